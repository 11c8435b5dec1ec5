"""Regenerate the README's `nanosft demo` output block from a real run of the demo.

Runs `python -m nanosft demo --device cpu` in a temporary folder (so the saved paths read
`nanosft-demo/...`), trims what it printed the way the README shows it (the banner, the progress
bar's last state, the final metrics, two rows of the held-out table, the result lines) and writes
it between the README's `<!-- demo output -->` and `<!-- /demo output -->` markers. Times depend on
the machine and its load. Run: `python scripts/readme_demo_output.py` (the demo's own run time), or
`--stdout FILE --stderr FILE` to build the block from a run captured before.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile

README = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "README.md")
START, END = "<!-- demo output -->", "<!-- /demo output -->"
TABLE_ROWS = 2  # held-out rows shown before "..."


def last_bar(stderr: str) -> str | None:
    """The progress bar's final state: tqdm rewrites its line after each \\r."""
    states = [s.strip() for s in re.split(r"[\r\n]", stderr) if s.strip().startswith("100%|")]
    return states[-1] if states else None


def trim(stdout: str, stderr: str) -> str:
    """The block the README shows: per-window log dicts and the memory lines left out."""
    lines, table_rows, in_table = [], 0, False
    for line in stdout.splitlines():
        line = line.rstrip()
        if line.startswith("{'loss'") or line.strip().startswith("Memory"):
            continue  # one dict a logging window; the ledger lines have their README section
        if line.startswith("{'train_runtime'"):
            bar = last_bar(stderr)
            lines += [bar] if bar else []
        if line.startswith("held-out prompt"):
            in_table = True
        elif in_table and line.startswith("What is"):
            table_rows += 1
            if table_rows == TABLE_ROWS + 1:
                lines.append("...")
            if table_rows > TABLE_ROWS:
                continue
        elif in_table and not line.startswith("-"):
            in_table = False
        if line.startswith("loss curve:"):
            continue
        lines.append(line)
    return "\n".join(lines).strip("\n")


def replace_block(readme: str, block: str) -> str:
    """README text with the code block between the markers replaced by `block`."""
    head, rest = readme.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n```\n{block}\n```\n{END}{tail}"


def run_demo() -> tuple:
    with tempfile.TemporaryDirectory() as folder:
        done = subprocess.run([sys.executable, "-m", "nanosft", "demo", "--device", "cpu"],
                              cwd=folder, capture_output=True, text=True, check=True)
    return done.stdout, done.stderr


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stdout", help="a captured run's stdout (default: run the demo)")
    parser.add_argument("--stderr", help="a captured run's stderr (the progress bar)")
    args = parser.parse_args()
    if args.stdout:
        with open(args.stdout, encoding="utf-8") as f:
            stdout = f.read()
        stderr = ""
        if args.stderr:
            with open(args.stderr, encoding="utf-8") as f:
                stderr = f.read()
    else:
        stdout, stderr = run_demo()
    with open(README, encoding="utf-8") as f:
        readme = f.read()
    with open(README, "w", encoding="utf-8") as f:
        f.write(replace_block(readme, trim(stdout, stderr)))
    print(f"wrote the demo block into {os.path.normpath(README)}")


if __name__ == "__main__":
    main()

"""README "Step through it": pdb, driven by the README's own commands over scripts/step_through.py,
stops at every breakpoint of the table, in the table's order, and reaches self.optimizer.step().

Compared: the table's rows (file: function, pdb breakpoint) against each other, and against the
`> file(line)function()` lines pdb prints after each `c`; then, after `r` and three `n`, the line
pdb shows (`-> self.optimizer.step()`). Hermetic: a subprocess, a tiny model built in it, CPU.
Run: python -m pytest -q tests/test_step_through.py
"""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_section():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return text.split("## Step through it\n", 1)[1].split("\n## ", 1)[0]


def table_rows(section):
    """[(file, function, breakpoint)] of the section's table."""
    rows = []
    for line in section.splitlines():
        found = re.match(r"\| .+ \| `(nanosft/[\w/]+\.py)`: `([\w.]+)` \| `tbreak ([\w.]+)` \|$",
                         line)
        if found:
            rows.append(found.groups())
    return rows


def commands(section):
    return section.split("```text\n", 1)[1].split("```", 1)[0].splitlines()


def test_readme_breakpoints_name_their_functions():
    rows = table_rows(readme_section())
    assert len(rows) >= 10
    for path, function, target in rows:
        assert target == path[:-3].replace("/", ".") + "." + function
    # the typed commands set exactly the table's breakpoints, in its order
    typed = [line.split()[1] for line in commands(readme_section()) if line.startswith("tbreak")]
    assert typed == [target for _, _, target in rows]


def test_pdb_walks_one_optimizer_step_through_every_breakpoint():
    section = readme_section()
    rows = table_rows(section)
    stdin = "\n".join(commands(section) + ["c"] * len(rows) + ["r", "n", "n", "n", "c", "q"])
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NANOSFT_REFERENCE": ""}
    result = subprocess.run([sys.executable, "-m", "pdb", "scripts/step_through.py"], cwd=ROOT,
                            input=stdin + "\n", capture_output=True, text=True, timeout=300,
                            env=env)
    out = result.stdout
    stops = re.findall(r"^> (\S+)\((\d+)\)(\w+)\(\)", out, re.MULTILINE)
    stops = [(os.path.relpath(path, ROOT), function) for path, _, function in stops
             if path.startswith(str(ROOT / "nanosft"))]
    expected = [(path, function.split(".")[-1]) for path, function, _ in rows]
    assert stops[:len(rows)] == expected, out[-3000:]
    # r: back in the loop's sync block; n x 3: the walkthrough's optimizer step is the next line
    shown = re.findall(r"^-> (.+)$", out, re.MULTILINE)
    assert "self.optimizer.step()" in [line.strip() for line in shown], out[-3000:]
    assert "Reference mode" in out and "{'loss'" in out  # the script ran to the end

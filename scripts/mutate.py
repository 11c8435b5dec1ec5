"""Break nanosft on purpose, in a temporary copy, and report which tests catch each break.

A test suite that still passes after a real bug is put in has a hole. Each mutation below is one
such bug (an ignored --adapter, a dropped chat history, wrong 8-bit optimizer settings, a multiplied
sampling temperature). For each, the repository is copied to a temporary folder, the one edit is
applied there, and the test files that should notice are run; the report lists the failing tests
("caught"; tests that fail on the unmutated copy too are left out) or says the mutation survived.
The working tree is never modified.

Run:  python scripts/mutate.py                 # every mutation, its own test files, from HEAD
      python scripts/mutate.py --only sampling_temperature_multiplied --worktree
      python scripts/mutate.py --tests tests    # the whole suite for each mutation (slow)
Exit status 1 when a mutation survives or no longer applies (the code it edits has changed).
"""

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Mutation:
    """One bug: inside `function` of `path`, replace `old` (exactly once each) with `new`."""

    name: str
    path: str
    function: str
    edits: tuple  # ((old, new), ...)
    tests: tuple  # test files that should fail


MUTATIONS = [
    Mutation("generate_ignores_adapter", "nanosft/cli/__init__.py", "run_generate",
             (("load_model(args.model, args.adapter", "load_model(args.model, None"),),
             ("tests/test_cli.py",)),
    Mutation("chat_ignores_adapter", "nanosft/cli/__init__.py", "run_chat",
             (("load_model(args.model, args.adapter", "load_model(args.model, None"),),
             ("tests/test_cli.py",)),
    Mutation("chat_drops_history", "nanosft/cli/__init__.py", "run_chat",
             (("stream_reply(model, tokenizer, messages, args)",
               "stream_reply(model, tokenizer, messages[-1:], args)"),),
             ("tests/test_cli.py",)),
    Mutation("bnb_8bit_wrong_hyperparameters", "nanosft/optim.py",
             "_bitsandbytes_cls_and_kwargs",
             (("betas = (args.adam_beta1, args.adam_beta2)", "betas = (0.5, 0.5)"),
              ("kwargs.update(betas=betas, eps=args.adam_epsilon)",
               "kwargs.update(betas=betas, eps=1e-2)")),
             ("tests/test_optim.py", "tests/parity/test_optim_parity.py")),
    Mutation("sampling_temperature_multiplied", "nanosft/generation.py", "sample_next_token",
             (("/ temperature", "* temperature"),),
             ("tests/test_model.py", "tests/parity/test_sampling_parity.py")),
]


def function_span(source: str, name: str) -> tuple[int, int]:
    """(start, end) character offsets of top-level or method `def name` up to the next def/class."""
    match = re.search(rf"^(\s*)def {re.escape(name)}\(", source, re.MULTILINE)
    if match is None:
        raise LookupError(f"def {name}( not found")
    indent = len(match.group(1))
    following = re.compile(rf"^[ \t]{{0,{indent}}}(?:def |class |@)\S", re.MULTILINE)
    nxt = following.search(source, match.end())
    return match.start(), nxt.start() if nxt else len(source)


def apply(mutation: Mutation, root: Path) -> None:
    """Edit the copy under `root`; raise LookupError when the code no longer holds the snippet."""
    path = root / mutation.path
    source = path.read_text()
    start, end = function_span(source, mutation.function)
    body = source[start:end]
    for old, new in mutation.edits:
        if body.count(old) != 1:
            raise LookupError(f"{mutation.path}:{mutation.function} holds {old!r} "
                              f"{body.count(old)} times, expected once: update this mutation")
        body = body.replace(old, new)
    path.write_text(source[:start] + body + source[end:])


def copy_repository(destination: Path, worktree: bool) -> None:
    """HEAD (git archive) or the working tree's tracked and unignored files, into `destination`."""
    if not worktree:
        archive = subprocess.run(["git", "archive", "HEAD"], cwd=ROOT, capture_output=True,
                                 check=True)
        subprocess.run(["tar", "-x", "-C", str(destination)], input=archive.stdout, check=True)
        return
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)


def run_tests(root: Path, tests) -> tuple[list[str], str]:
    """Run pytest in the copy; returns (failed test ids, the tail of the output)."""
    # cwd first on sys.path (python -m), so the copy's nanosft is imported, not the installed one
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfE", "--tb=no",
                             "-p", "no:cacheprovider", *tests], cwd=root, capture_output=True,
                            text=True, check=False)
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", result.stdout, re.MULTILINE)
    return failed, result.stdout[-1500:]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=[m.name for m in MUTATIONS])
    parser.add_argument("--tests", nargs="+", help="test paths to run instead of each one's own")
    parser.add_argument("--worktree", action="store_true",
                        help="copy the working tree (uncommitted edits included) instead of HEAD")
    parser.add_argument("--list", action="store_true", help="print the mutations and exit")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    if args.list:
        for m in chosen:
            print(f"{m.name:34s} {m.path}:{m.function}  {m.edits}")
        return 0
    survived = []
    # Tests that already fail unmutated prove nothing: run them once and leave them out of "caught".
    with tempfile.TemporaryDirectory(prefix="nanosft-baseline-") as folder:
        copy_repository(Path(folder), args.worktree)
        suites = args.tests or sorted({t for m in chosen for t in m.tests})
        broken, _ = run_tests(Path(folder), suites)
    if broken:
        print(f"already failing without a mutation (ignored below): {', '.join(broken)}")
    for mutation in chosen:
        with tempfile.TemporaryDirectory(prefix="nanosft-mutant-") as folder:
            root = Path(folder)
            copy_repository(root, args.worktree)
            try:
                apply(mutation, root)
            except LookupError as error:
                print(f"{mutation.name}: NOT APPLIED ({error})", flush=True)
                survived.append(mutation.name)
                continue
            failed, tail = run_tests(root, args.tests or mutation.tests)
            failed = [test for test in failed if test not in broken]
        if failed:
            print(f"{mutation.name}: caught by {len(failed)} test(s)", flush=True)
            for test in failed:
                print(f"    {test}")
        else:
            print(f"{mutation.name}: SURVIVED\n{tail}", flush=True)
            survived.append(mutation.name)
    print(f"\n{len(chosen) - len(survived)} of {len(chosen)} mutations caught"
          + (f"; not caught: {', '.join(survived)}" if survived else ""))
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())

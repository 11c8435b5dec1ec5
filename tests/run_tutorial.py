"""Runs a tutorial the way a reader does, `python tutorials/NN_topic.py`, for the
tests/test_tutorial_NN.py files.

Not a test module (pytest collects test_*.py only); imported as `from run_tutorial import
run_tutorial`, which works because tests/conftest.py puts tests/ on sys.path. A tutorial ends its
claims with `assert`, so exit code 0 is part of every check; the callers then assert on the printed
numbers.
"""

import subprocess
import sys
from pathlib import Path

from nanosft.reference import REFERENCE_BANNER

TUTORIALS = Path(__file__).resolve().parents[1] / "tutorials"
# the tutorials that follow walkthrough 1 and 2.1-2.7: they run in reference mode
READING_TUTORIALS = ("01", "02", "03", "04", "05", "06", "07", "08")


def run_tutorial(filename, timeout=300, nproc=None) -> str:
    """Run tutorials/<filename> in a fresh interpreter (under torchrun with `nproc` processes when
    given); assert exit 0; return what it printed."""
    launcher = [sys.executable]
    if nproc is not None:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    result = subprocess.run(
        [*launcher, str(TUTORIALS / filename)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    if filename[:2] in READING_TUTORIALS:  # they run the walkthrough's own lines, and say so first
        assert result.stdout.splitlines()[0] == REFERENCE_BANNER, result.stdout[:300]
    return result.stdout


def assert_reference_ran(out, *checks):
    """Each `reference check ran: <check>` line is in a tutorial's output and none says it skipped.

    The test extras install the reference libraries, so in CI every comparison must have run."""
    assert "reference check skipped" not in out, out[out.index("reference check skipped") :][:200]
    for check in checks:
        assert f"reference check ran: {check}" in out, f"the comparison with {check} did not run"

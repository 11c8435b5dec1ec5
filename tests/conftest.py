"""Shared pytest setup: tests run on CPU with fixed seeds and single-threaded BLAS-free noise.

Run everything: `python -m pytest -q` (what .ci/run calls). Parity tests live in tests/parity/ and
import the reference libraries directly; `pip install -e ".[test]"` installs the pinned versions.
A parity test that skips (or xfails) fails the session: a comparison that did not run is not a pass.
"""

import os
from pathlib import Path

import pytest
import torch

# Deterministic, and kind to a 2-core machine.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(min(2, torch.get_num_threads()))

PARITY_DIR = Path(__file__).resolve().parent / "parity"
_parity_not_run = []  # (nodeid, reason) of each parity test that skipped or xfailed


@pytest.fixture(autouse=True)
def _seed_everything():
    torch.manual_seed(0)
    yield


def _is_parity(report) -> bool:
    return PARITY_DIR in (Path(str(report.fspath)).resolve()).parents


def pytest_runtest_logreport(report):
    if (report.skipped or hasattr(report, "wasxfail")) and _is_parity(report):
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _parity_not_run.append((report.nodeid, getattr(report, "wasxfail", None) or reason))


def pytest_collectreport(report):
    if report.skipped and _is_parity(report):  # a module-level skip
        _parity_not_run.append((report.nodeid, str(report.longrepr)))


def pytest_sessionfinish(session, exitstatus):
    if _parity_not_run and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    if _parity_not_run:
        terminalreporter.section("parity tests that did not run (this fails the run)", red=True)
        for nodeid, reason in _parity_not_run:
            terminalreporter.line(f"{nodeid}: {reason}")
        terminalreporter.line(
            "install the reference libraries (pip install -e '.[test]') or fix "
            "the skip: a parity comparison must run"
        )

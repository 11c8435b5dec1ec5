"""Runs tutorials/10_collators.py as a user would and checks its claims reached the output.

Compared: exit code 0 (every assert in the script held) and the key lines: the banners, the
naive-rule EOS count, draft 3 == nanosft's collator, and TRL == nanosft when trl is installed.
Hermetic: the script builds its own toy ids; no network. Run: python -m pytest -q tests/test_tutorial_10.py
"""

from run_tutorial import run_tutorial


def test_tutorial_10_runs_and_prints_its_claims():
    out = run_tutorial("10_collators.py")
    for line in ("数据加载与批处理: draft 1, pad", "naive rule drops 3 real EOS",
                 "draft 3 == nanosft DataCollatorForLanguageModeling: True",
                 "padding-free: one row, positions restart per example", "MLM: 15% picked"):
        assert line in out
    assert out.count("TRL == nanosft: True") == 2  # the test extras install trl: it must run

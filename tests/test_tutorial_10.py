"""Runs tutorials/10_collators.py as a user would and checks its claims reached the output.

Compared: exit code 0 (every assert in the script held) and the key lines: the banners, the
naive-rule EOS count, draft 3 == nanosft's collator, the label shapes of the guide's task table
((B,) for classification, (B, T) padded with -100 for token classification), each non-LM collator
equal to transformers', and TRL == nanosft; every reference comparison ran.
Hermetic: the script builds its own toy ids; no network.
Run: python -m pytest -q tests/test_tutorial_10.py
"""

import re

from run_tutorial import assert_reference_ran, run_tutorial


def test_tutorial_10_runs_and_prints_its_claims():
    out = run_tutorial("10_collators.py")
    for line in (
        "数据加载与批处理: draft 1, pad",
        "naive rule drops 3 real EOS",
        "draft 3 == nanosft DataCollatorForLanguageModeling: True",
        "padding-free: one row, positions restart per example",
        "MLM: 15% picked",
    ):
        assert line in out
    assert out.count("TRL == nanosft: True") == 2  # the test extras install trl: it must run
    # the guide's non-LM tasks: one label per row (not padded), or one per token padded with -100
    shapes = {line.split()[1]: line for line in out.splitlines() if line.endswith("}")}
    assert "'labels': (3,)" in shapes["DataCollatorWithPadding"]
    assert "'labels': (3,)" in shapes["default_data_collator"]
    assert "'labels': (3, 5)" in shapes["DataCollatorForTokenClassification"]  # 5 = longest row
    assert "'labels': (3, 6)" in shapes["DataCollatorForLanguageModeling"]  # rows + EOS
    assert re.search(r"labels \[\[1, 0, 1, 0, 1\], \[0, 0, -100, -100, -100\]", out)
    for name in (
        "default_data_collator",
        "DataCollatorWithPadding",
        "DataCollatorForTokenClassification",
    ):
        assert f"transformers {name} == nanosft: True" in out
    assert_reference_ran(
        out,
        "transformers default_data_collator, DataCollatorWithPadding, "
        "DataCollatorForTokenClassification",
        "trl DataCollatorForLanguageModeling",
    )

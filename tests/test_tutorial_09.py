"""Runs tutorials/09_optimizers_schedulers.py as a script and checks what it prints (guide: optimizers, schedulers).

Compared: the decay split of the tiny Llama (2 layers x 7 linear weights + embedding + lm_head decayed, 5
norm weights not), the fused-AdamW-by-hand line, each schedule's first learning rates against the formulas
(warmup starts at 0, "constant" ignores warmup), the warmup ratio ceil(0.1 * 37) = 4, and the script's own
asserts (they fail the exit code). Hermetic: tiny model built in-process, no network.
Run: python -m pytest -q tests/test_tutorial_09.py
"""

import re

from run_tutorial import run_tutorial


def test_tutorial_09_runs_and_prints_groups_adamw_and_schedules():
    out = run_tutorial("09_optimizers_schedulers.py")
    assert "16 tensors get weight decay" in out  # embed + 2 * (4 attn + 3 mlp) + lm_head
    assert "5 tensors do not" in out  # 2 * (input, post_attention) layernorm + final norm
    assert "param groups: [(16, 0.1), (5, 0.0)]" in out
    assert re.search(r"max \|by hand - fused AdamW\| = \d\.\d\de-\d\d", out)
    assert re.search(r"^linear\s+\S+  0\.00 0\.33 0\.67 1\.00 0\.89", out, re.MULTILINE)  # W=3, T=12: (12-3)/9 ... 8/9
    assert re.search(r"^constant\s+\S+  1\.00 1\.00", out, re.MULTILINE)
    assert re.search(r"^constant_with_warmup\s+\S+  0\.00 0\.33 0\.67 1\.00 1\.00", out, re.MULTILINE)
    assert "warmup_steps=0.1   with 37 total steps -> 4" in out
    if "transformers max|diff|" in out:  # reference installed: every row compared
        assert out.count("transformers max|diff| 0e+00") == 10
    assert out.rstrip().endswith("OK: decay groups, one AdamW step and every schedule checked")

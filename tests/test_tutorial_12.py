"""Runs tutorials/12_mixed_precision.py as a user would and checks the bf16 and GradScaler claims it
prints.

Compared: exit code 0 (the script asserts the autocast dtypes, the skipped GradScaler step, the
halved scale and the scheduler not advancing after a skipped Trainer step) and the printed table:
step 2's grad_norm is inf, its weights unchanged, and step 3 trains with step 2's learning rate
while step 2's differs from step 1's. Hermetic: a tiny CausalLM and four hand-written rows, CPU only
(a CPU GradScaler stands in for CUDA fp16).
Run: python -m pytest -q tests/test_tutorial_12.py
"""

import re

from run_tutorial import assert_reference_ran, run_tutorial


def test_tutorial_12_bf16_and_grad_scaler_skip():
    out = run_tutorial("12_mixed_precision.py")
    assert (
        "q_proj output torch.bfloat16, q_proj.weight torch.float32, its grad torch.float32" in out
    )
    assert "logits returned as torch.float32" in out
    assert "weights changed: False; scale 65536 -> 32768" in out
    rows = re.findall(
        r"^\s+(\d)\s+\|\s+(\d+)\s+\|\s+(\S+) \| ([0-9.e+-]+)\s+\| (True|False)$", out, re.MULTILINE
    )
    assert [r[0] for r in rows] == ["1", "2", "3"]
    assert [r[1] for r in rows] == ["65536", "65536", "32768"]
    assert rows[1][2] == "inf" and [r[4] for r in rows] == ["True", "False", "True"]
    lrs = [float(r[3]) for r in rows]
    assert lrs[0] != lrs[1] and lrs[1] == lrs[2]  # the skipped step did not advance the schedule
    assert_reference_ran(out, "transformers LlamaForCausalLM under autocast")
    assert "OK: mixed precision checked" in out

"""Runs tutorials/16_fsdp.py under torchrun (2 gloo processes) and checks the FSDP claims it prints.

Compared: exit code 0 (the script asserts each rank's shard is its rows of the whole weight, the
whole weight inside forward, each gradient shard equal to the one-process rows with the negative
control of per-rank means, and QLoRA bytes per rank about half with logits equal to one process) and
the printed numbers behind them.
Hermetic: localhost gloo on CPU, tiny models and random rows from fixed seeds; no network.
Run: python -m pytest -q tests/test_tutorial_16.py
"""

import re

from run_tutorial import run_tutorial


def test_tutorial_16_fsdp_under_torchrun():
    out = run_tutorial("16_fsdp.py", timeout=300, nproc=2)
    assert (
        "[rank 0] q_proj.weight is a DTensor of global shape (64, 64); this rank holds rows 0-31"
        in out
    )
    assert (
        "[rank 1] q_proj.weight is a DTensor of global shape (64, 64); this rank holds rows 32-63"
        in out
    )
    assert out.count("inside forward: Parameter (64, 64) (all-gathered)") == 2
    grads = re.findall(
        r"one-process rows\| = ([0-9.e+-]+); with per-rank means instead: ([0-9.e+-]+)", out
    )
    assert len(grads) == 2 and all(float(a) < 1e-6 and float(b) > 1e-5 for a, b in grads)
    shares = re.findall(r"one process ([0-9,]+), this rank ([0-9,]+) \(", out)
    assert len(shares) == 2
    one = int(shares[0][0].replace(",", ""))
    assert sum(int(mine.replace(",", "")) for _, mine in shares) < 1.2 * one  # split, not copied
    assert "OK: FSDP checked" in out

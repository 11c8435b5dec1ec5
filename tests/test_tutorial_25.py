"""Runs tutorials/25_nd_parallel.py as a reader does (it spawns its 4 gloo processes) and checks
its claims.

Compared: exit code 0 (the script asserts each rank's data shard is its dp_shard coordinate, the
local shapes of q_proj / o_proj after the tp plan and after FSDP, logits equal to one process, the
load-balanced split giving each cp rank the same causal work, the merged attention and its q/k/v
gradients equal to the whole row's, and the training step's loss, grad norm and gradients equal
to one process with the token count summed over dp, halved when summed over all ranks) and the
printed numbers behind them.
Hermetic: localhost gloo on CPU, a tiny model and rows from fixed seeds; no network; ~30 s wall
on a shared 2-core machine (~4 s of CPU per process).
Run: python -m pytest -q tests/test_tutorial_25.py
"""

import re

from run_tutorial import run_tutorial


def test_tutorial_25_nd_parallel():
    out = run_tutorial("25_nd_parallel.py", timeout=300)
    shards = re.findall(r"dp_shard=(\d), cp=(\d); reads data shard (\d) of 2", out)
    assert sorted(shards) == [("0", "0", "0"), ("0", "1", "0"), ("1", "0", "1"), ("1", "1", "1")]
    assert out.count("whole ((32, 32), (32, 32)) -> tp ((16, 32), (32, 16)) -> tp + FSDP "
                     "((8, 32), (16, 16))") == 4
    logits = re.findall(r"max \|logits - one process\| = ([0-9.e+-]+)", out)
    assert len(logits) == 4 and all(float(d) < 1e-5 for d in logits)
    assert out.count("keeps tokens [0, 1, 2, 9, 10, 11] of 12 (39 causal pairs)") == 2
    assert out.count("keeps tokens [3, 4, 5, 6, 7, 8] of 12 (39 causal pairs)") == 2
    merged = re.findall(r"by hand ([0-9.e+-]+), online ([0-9.e+-]+), layout.attend "
                        r"([0-9.e+-]+); q/k/v grads ([0-9.e+-]+)", out)
    assert len(merged) == 4 and all(float(d) < 1e-5 for row in merged for d in row)
    tokens = re.findall(r"over dp (\d+) \(one process (\d+)\), over all 4 ranks (\d+)", out)
    assert len(tokens) == 4 and all(a == b and int(c) == 2 * int(a) for a, b, c in tokens)
    loss, one, halved = map(float, re.search(
        r"loss: mean over ranks ([0-9.]+), one process ([0-9.]+); with the count over all ranks "
        r"([0-9.]+)", out).groups())
    assert abs(loss - one) < 1e-5 and abs(halved - one / 2) < 1e-5
    norm, one_norm, grad = map(float, re.search(
        r"grad norm ([0-9.]+), one process ([0-9.]+); max \|grad - one process\| = "
        r"([0-9.e+-]+)", out).groups())
    assert abs(norm - one_norm) < 1e-5 and grad < 1e-5
    assert "OK: N-D parallel checked" in out

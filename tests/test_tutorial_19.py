"""Runs tutorials/19_performance.py as a user would and checks the deterministic figures it prints.

Compared: exit code 0 (the script asserts each claim below), then the printed lines: the profiler
counts 3 aten::mm per nn.Linear (forward, grad of input, grad of weight) over 15 linears; the
compiled model's losses equal eager's (aot_eager runs the same aten ops); a checkpointed layer
saves exactly its inputs for backward, h (B, T, C) plus cos and sin (T, head_dim) in fp32, while a
plain layer saves over 10x that; the two dataloaders give the same batches; bf16 stays within 2e-2
of fp32; the batch sizes auto_find_batch_size tried equal accelerate's find_executable_batch_size.
Timings are printed by the script but not checked here (a shared CPU is noisy).
Hermetic: tiny CausalLM, random rows from fixed seeds, CPU; no network.
Run: python -m pytest -q tests/test_tutorial_19.py
"""

import re

import torch
from accelerate.utils import find_executable_batch_size
from run_tutorial import run_tutorial


def test_tutorial_19_performance_figures():
    out = run_tutorial("19_performance.py")
    assert "aten::mm: 45 calls = 3 x 15 linears" in out  # 2 layers x 7 + lm_head
    share = re.search(r"matmul share of the step ([0-9.]+)%", out)
    assert 0 < float(share.group(1)) < 100
    diff = re.search(r"max \|loss difference\| over 6 steps ([0-9.e+-]+)", out)
    assert float(diff.group(1)) < 1e-6
    per_layer = re.search(r"per layer: ([0-9,]+) B plain, ([0-9,]+) B checkpointed", out)
    plain, checkpointed = (int(x.replace(",", "")) for x in per_layer.group(1, 2))
    B, T, C, head_dim = 8, 32, 64, 64 // 4
    assert checkpointed == (B * T * C + 2 * T * head_dim) * 4 and plain > 10 * checkpointed
    loaders = re.findall(r"dataloader_num_workers=[02]: first batch after .*, 8 batches", out)
    assert len(loaders) == 2
    bf16 = re.search(r"\|bf16 loss - fp32 loss\| at step 1: ([0-9.e+-]+)", out)
    assert float(bf16.group(1)) < 2e-2
    tried = re.search(r"batch sizes tried: \[([0-9, ]+)\]; trained with (\d+) rows", out)
    ours = [int(x) for x in tried.group(1).split(",")]
    theirs = []

    def attempt(batch_size):  # the tutorial's simulated device fits 5 rows
        theirs.append(batch_size)
        if batch_size > 5:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    find_executable_batch_size(attempt, starting_batch_size=16)()
    assert ours == theirs and int(tried.group(2)) == 5
    assert "OK: performance checked" in out

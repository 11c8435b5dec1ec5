"""Runs tutorials/08_linear4bit_forward.py as a script and checks what it prints (walkthrough 2.7).

Compared: the branch and line banners of 2.7, the scalings lora_alpha / r = 8 / 4 and
lora_alpha / sqrt(r) = 8 / 2 worked out here, the LoRA shapes (2, 3, 64) -> (2, 3, 4) -> (2, 3, 8),
bytes per weight 0.5 + 4/64 (+ the 16-entry code table) for the 1024x1024 layer, and the script's
own asserts (they fail the exit code), which check each replayed line against nanosft and peft.
CPU kernels: the (2, 96) NF4 example is decoded by formula and compared with bitsandbytes only as
one row of whole blocks (bnb's AVX-512 dequantize is wrong on rows that split a block); the eval
section runs one of two branches, chosen here as in the script by bnb's AVX512-BF16 check.
Hermetic: tiny layers built in-process on CPU, nothing written to disk.
Run: python -m pytest -q tests/test_tutorial_08.py
"""

import bitsandbytes.functional as bnbF
import pytest
from run_tutorial import run_tutorial


@pytest.fixture(scope="module")
def out():
    return run_tutorial("08_linear4bit_forward.py")


def test_tutorial_08_runs_and_prints_each_line_of_2_7(out):
    assert "==================== NF4 code values (QLoRA 3) ====================" in out
    assert "8 positive, 7 negative, 1 exact zero" in out  # NF4 by hand
    assert "bytes and absmax identical to bitsandbytes.functional.quantize_4bit: True" in out
    assert "weight.requires_grad=False, weight.grad=None" in out
    plain = 0.5 + 4 / 64 + 16 * 4 / 1024**2
    assert f"bytes per weight, 1024x1024: {plain:.4f} without" in out
    assert "elif self.merged: False | else: runs" in out
    assert (
        "in-place on the unclone result       -> RuntimeError: Output 0 of MatMul4Bit is a view"
        in out
    )
    assert "requires_conversion = not torch.is_autocast_enabled() -> True" in out
    assert f"(2, 3, 64) -> (2, 3, 4) -> (2, 3, 8), scaling = lora_alpha / r = {8 / 4}" in out
    assert f"rsLoRA scaling = lora_alpha / sqrt(r) = {8 / 4**0.5}" in out
    assert "DoRA output == m / ||W + sBA|| * (W + sBA) x + b: True" in out
    assert "float base: merged=True" in out and "unmerge() -> merged = False" in out
    # the peft comparisons ran (the test extras install peft)
    assert "peft bnb.Linear4bit beside ours: max |ours - peft|" in out
    assert "peft DoRA beside ours: max |ours - peft|" in out
    assert "peft's merged NF4 bytes identical to ours: True" in out
    assert out.rstrip().endswith("OK: walkthrough 2.7 replayed step by step")


def test_tutorial_08_decodes_the_2x96_weight_by_formula_and_bnb_only_on_whole_block_rows(out):
    # 96 = 64 + 32: rows split block 1, so bnb's CPU kernel is left out; 2 * 96 = 3 * 64 is not
    assert "dequantize_nf4 == code[index] * absmax: True" in out
    assert "not compared with bnb's CPU dequantize: rows of 96 split a 64-value block" in out
    assert f"cpu_kernels_decode(96) = {96 % 64 == 0}" in out
    assert (f"as one row of {2 * 96} values (cpu_kernels_decode({2 * 96}) = {2 * 96 % 64 == 0}): "
            "same bytes, bnb's dequantize == ours: True") in out


def test_tutorial_08_eval_takes_the_avx512_bf16_branch_only_on_a_cpu_with_it(out):
    """With AVX512-BF16, bnb repacks its weight in eval and peft's DoRA drifts (ours does not);
    without it, bnb keeps dequantize + matmul and peft's DoRA eval equals its train output."""
    avx512_bf16 = bool(bnbF.has_avx512bf16())
    assert (f"this CPU has AVX512-BF16: {avx512_bf16} -> bnb Linear4bit in eval repacked its "
            f"weight: {avx512_bf16}") in out
    assert "ours in eval == bnb in train: True" in out
    branches = ["with AVX512-BF16: peft DoRA on bnb", "without AVX512-BF16: peft DoRA on bnb"]
    ran, skipped = branches if avx512_bf16 else branches[::-1]
    assert ran in out and skipped not in out

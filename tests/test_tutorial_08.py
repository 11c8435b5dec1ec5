"""Runs tutorials/08_linear4bit_forward.py as a script and checks what it prints (walkthrough 2.7).

Compared: the branch and line banners of 2.7, the scalings lora_alpha / r = 8 / 4 and
lora_alpha / sqrt(r) = 8 / 2 worked out here, the LoRA shapes (2, 3, 64) -> (2, 3, 4) -> (2, 3, 8),
bytes per weight 0.5 + 4/64 (+ the 16-entry code table) for the 1024x1024 layer, and the script's
own asserts (they fail the exit code), which check each replayed line against nanosft and peft.
Hermetic: tiny layers built in-process on CPU, nothing written to disk.
Run: python -m pytest -q tests/test_tutorial_08.py
"""

from run_tutorial import run_tutorial


def test_tutorial_08_runs_and_prints_each_line_of_2_7():
    out = run_tutorial("08_linear4bit_forward.py")
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

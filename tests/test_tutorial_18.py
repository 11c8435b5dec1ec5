"""Runs tutorials/18_memory.py as a user would and checks the memory claims it prints.

Compared: exit code 0 (the script asserts the NF4 bytes equal bitsandbytes' tensors, every state row
of the ledger equals the live run's storages, the activations row is within 15% of the bytes saved
for backward, and quantizing while loading peaks lower than loading then quantizing) and the printed
figures: 0.5159 B/weight by hand, a QLoRA base under half of LoRA's fp32 base.
Hermetic: tiny CausalLMs built in-process and one temporary checkpoint, CPU only.
Run: timeout 900 python -m pytest -q tests/test_tutorial_18.py
"""

import re

from run_tutorial import run_tutorial


def test_tutorial_18_memory():
    out = run_tutorial("18_memory.py")
    assert "double_quant=True : by hand 0.5159" in out
    assert "double_quant=False: by hand 0.5625" in out
    for title in ("full fine-tuning", "LoRA r=8", "QLoRA (NF4 base)",
                  "QLoRA + gradient checkpointing"):
        assert f"=== {title}" in out
    stream, then = map(float, re.search(r"quantize while loading: \+([0-9.]+) MiB; load fp32 then "
                                        r"quantize: \+([0-9.]+) MiB", out).groups())
    assert stream < then
    assert "OK: memory ledger checked" in out

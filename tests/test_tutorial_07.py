"""Runs tutorials/07_peft_forward.py as a script and checks what it prints (walkthrough 2.6).

Compared: the printed shapes of the prompt-tuning forward (inputs_embeds, prompts, the
concatenation, the logits) against num_virtual_tokens + T worked out here, the prefix mask and -100
label rows, the extra target per row, P-tuning's prompts and prefix tuning's per-layer keys/values
and logits (shapes from the config, logits beside peft's), and the script's own asserts (they fail
the exit code).
Hermetic: the tiny models are built in-process; no network, temp folders only.
Run: python -m pytest -q tests/test_tutorial_07.py
"""

import re

import torch
from run_tutorial import run_tutorial

N_VIRTUAL, T, C, V = 4, 6, 64, 96
# the tutorial's batch (its `labels` and `attention_mask` lines): the expected prints are built from
# it
LABELS = torch.tensor([[5, 17, 42, 8, 9, 2], [-100, 33, 12, 2, -100, -100]])
ATTENTION_MASK = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])


def test_tutorial_07_runs_and_prints_each_line_of_2_6():
    out = run_tutorial("07_peft_forward.py")
    assert re.search(
        r"trainable params: [\d,]+ \|\| all params: [\d,]+ \|\| trainable%: \d+\.\d{4}", out
    )
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight" in out
    assert f"inputs_embeds shape: (2, {T}, {C})" in out
    assert f"prompts shape: (2, {N_VIRTUAL}, {C})" in out
    assert f"inputs_embeds after cat: (2, {N_VIRTUAL + T}, {C})" in out
    assert f"logits shape: (2, {N_VIRTUAL + T}, {V})" in out
    # prefix_labels / prefix_attention_mask prepended to the batch's own rows, as printed by torch
    prefix_labels = torch.full((2, N_VIRTUAL), -100)
    assert str(torch.cat((prefix_labels, LABELS), dim=1)) in out
    assert str(torch.cat((torch.ones(2, N_VIRTUAL), ATTENTION_MASK), dim=1)) in out
    # the peft comparisons ran (the test extras install peft and transformers)
    assert "peft's initial adapter weights are bit-identical to ours" in out
    assert re.search(r"max \|logits diff\| vs peft: \d", out)
    assert "trained targets: 8 without the prefix, 9 with it" in out
    assert "prompt tuning saves ['prompt_embeddings']" in out
    # P-tuning and prefix tuning: shapes worked out from the tiny config (2 layers, 2 KV heads of
    # 16 dims), each beside peft's logits
    assert f"P-tuning prompts shape: (2, {N_VIRTUAL}, {C})" in out
    assert f"prefix past_key_values: 2 layers x (2, 2, 2, {N_VIRTUAL}, 16)" in out
    assert f"prefix logits shape: (2, {T}, {V})" in out
    assert re.search(r"max \|logits diff\| vs peft \(P-tuning\): \d", out)
    assert re.search(r"max \|logits diff\| vs peft \(prefix tuning\): \d", out)
    assert f"prefix tuning saves prompt_embeddings ({N_VIRTUAL}, {2 * 2 * 32})" in out
    assert out.rstrip().endswith("OK: walkthrough 2.6 replayed step by step")

"""Runs tutorials/07_peft_forward.py as a script and checks what it prints (walkthrough 2.6).

Compared: the printed shapes of the prompt-tuning forward (inputs_embeds, prompts, the concatenation,
the logits) against num_virtual_tokens + T worked out here, the prefix mask and -100 label rows, the
extra target per row, and the script's own asserts (they fail the exit code). Hermetic: the tiny
models are built in-process; no network, temp folders only.
Run: python -m pytest -q tests/test_tutorial_07.py
"""

import re

N_VIRTUAL, T, C, V = 4, 6, 64, 96

from run_tutorial import run_tutorial


def test_tutorial_07_runs_and_prints_each_line_of_2_6():
    out = run_tutorial("07_peft_forward.py")
    assert re.search(r"trainable params: [\d,]+ \|\| all params: [\d,]+ \|\| trainable%: \d+\.\d{4}", out)
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight" in out
    assert f"inputs_embeds shape: (2, {T}, {C})" in out
    assert f"prompts shape: (2, {N_VIRTUAL}, {C})" in out
    assert f"inputs_embeds after cat: (2, {N_VIRTUAL + T}, {C})" in out
    assert f"logits shape: (2, {N_VIRTUAL + T}, {V})" in out
    assert "[-100, -100, -100, -100, -100,   33," in out  # 4 prefix labels, then row 1's own -100
    assert "[1., 1., 1., 1., 1., 1., 1., 1., 0., 0.]" in out  # prefix ones, then row 1's padding
    assert "trained targets: 8 without the prefix, 9 with it" in out
    assert "prompt tuning saves ['prompt_embeddings']" in out
    assert out.rstrip().endswith("OK: walkthrough 2.6 replayed step by step")

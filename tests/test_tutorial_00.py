"""Runs tutorials/00_model_and_tokenizer.py as a script and checks what it prints.

Compared: the printed banners, the ChatML rendering, the assistant-mask text and the loss line
against the facts the tutorial teaches (and its own asserts, which fail the exit code). Hermetic:
the script trains its tokenizer and builds its model in-process; no network, temp folders only.
Run: python -m pytest -q tests/test_tutorial_00.py
"""

import math
import re

from run_tutorial import assert_reference_ran, run_tutorial


def test_tutorial_00_runs_and_prints_each_stage():
    out = run_tutorial("00_model_and_tokenizer.py")
    for heading in (
        "processing_class (the tokenizer)",
        "apply_chat_template",
        "model (a tiny CausalLM)",
        'loss = outputs["loss"]',
    ):
        assert heading in out
    assert "<|im_start|>user\nWhat is two plus two?<|im_end|>\n<|im_start|>assistant\n" in out
    assert "tokens under the mask decode to: 'Two plus two is four.<|im_end|>\\n'" in out
    assert "model.layers.0.self_attn.k_proj.weight" in out and "lm_head.weight" in out
    vocab = int(re.search(r"vocab size: (\d+)", out).group(1))
    assert re.search(rf"logits shape: \(1, \d+, {vocab}\)", out)
    loss = float(re.search(r"loss: ([0-9.]+)", out).group(1))
    assert abs(loss - math.log(vocab)) < 0.1  # untrained model: near-uniform predictions
    assert_reference_ran(out, "transformers AutoTokenizer + LlamaForCausalLM")
    assert out.rstrip().endswith("OK: tokenizer and model agree on ids, shapes and loss")

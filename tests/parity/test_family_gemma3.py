"""Parity of nanosft.families.gemma3 with transformers 5.23 / peft 0.21.2 (Gemma3ForCausalLM).

On tiny random models built by transformers' Gemma3TextConfig (fp32; 3 layers: sliding, full,
sliding, window 5; head_dim 32 and query_pre_attn_scalar 24, so the attention scale differs from
head_dim ** -0.5; the global RoPE linearly scaled; norms randomized around Gemma's zeros): logits
within 1e-5 both ways (transformers save -> nanosft load, nanosft save -> transformers load), tied
and untied, on a plain, a left-padded, a right-padded and a packed batch (every sequence longer
than the window), in eval and in a training forward (nanosft's unpadded speed path); greedy
generation with the KV cache token for token; quantize-while-loading bitwise equal to
load-then-quantize and to transformers + bitsandbytes; "all-linear" naming peft's modules; a LoRA
adapter trained 3 steps by one library loading in the other with logits within 1e-5; the bf16
embedding scale and norms bitwise; transformers-4 rope spelling read as transformers reads it. A
negative control shows the per-layer-type RoPE matters. Hermetic: tmp folders, no downloads.
Helpers come from test_families.py (same folder).
Run: python -m pytest -q -s tests/parity/test_family_gemma3.py
"""

import peft
import pytest
import torch
import transformers
from test_families import assert_greedy_generation_matches
from test_families import (BASE, TOL, V, assert_adapters_move_both_ways,
                           assert_quantize_while_loading_matches, left_padded_batch,
                           models_both_ways, packed_row, save_random)
from tiny import one_thread  # noqa: F401 (an autouse fixture)

from nanosft.families.auto import AutoModelForCausalLM, config_from_dict
from nanosft.families.gemma3 import Gemma3Config
from nanosft.peft import LoraConfig, get_peft_model

WINDOW = 5
GEMMA3 = {**BASE, "num_hidden_layers": 3, "head_dim": 32, "query_pre_attn_scalar": 24,
          "sliding_window": WINDOW,
          "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
          "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                              "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                 "rope_theta": 1_000_000.0}}}
VARIANTS = {"gemma3": GEMMA3, "gemma3-untied": {**GEMMA3, "tie_word_embeddings": False},
            # sqrt(48) rounds in bf16 (sqrt(64) would not); 48 is no NF4 row width on CPU
            "gemma3-hidden48": {**GEMMA3, "hidden_size": 48}}


def hf_folder(tmp_path, name="gemma3"):
    """A random transformers Gemma3ForCausalLM, saved to tmp_path / "hf"."""
    return save_random(transformers.Gemma3TextConfig(**VARIANTS[name]), tmp_path)


def both_ways(tmp_path, name):
    return models_both_ways(*hf_folder(tmp_path, name), tmp_path)


@pytest.mark.parametrize("name", ["gemma3", "gemma3-untied"])
def test_logits_match_transformers_both_ways(name, tmp_path):
    x = torch.randint(3, V, (2, 16))
    padded, mask = left_padded_batch()
    packed, pos = packed_row()
    right = (torch.arange(16) < 11).long().expand(2, 16)
    worst = 0.0
    for hf, ours in both_ways(tmp_path, name):
        with torch.no_grad():
            pairs = [(hf(x).logits, ours(x).logits)]
            real = mask.bool()  # padded queries are never read
            pairs.append((hf(padded, attention_mask=mask).logits[real],
                          ours(padded, attention_mask=mask).logits[real]))
            # use_cache=False: transformers reads packed documents only without a cache
            want_packed = hf(packed, position_ids=pos, use_cache=False).logits
            pairs.append((want_packed, ours(packed, position_ids=pos).logits))
            want_right = hf(x, attention_mask=right).logits
        ours.train()  # a training forward: nanosft's unpadded speed path
        pairs.append((want_packed, ours(packed, position_ids=pos).logits.detach()))
        got_right = ours(x, attention_mask=right).logits.detach()
        pairs.append((want_right[right.bool()], got_right[right.bool()]))
        ours.eval()
        for want, got in pairs:
            torch.testing.assert_close(got, want, **TOL)
            worst = max(worst, (got - want).abs().max().item())
    print(f"\n[{name}] max |logit diff| = {worst:.3e}")


def test_negative_control_one_rope_for_all_layers_changes_the_logits(tmp_path):
    hf, folder = hf_folder(tmp_path)
    ours = AutoModelForCausalLM.from_pretrained(folder).eval()
    x = torch.randint(3, V, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(ours(x).logits, hf(x).logits, **TOL)
        rope = ours.config.rope_parameters  # the bug: the global RoPE in the sliding layers too
        rope["sliding_attention"] = rope["full_attention"]
        assert (ours(x).logits - hf(x).logits).abs().max() > 1e-3


def test_greedy_generation_is_token_identical(tmp_path):
    assert_greedy_generation_matches(*hf_folder(tmp_path))


def test_quantize_while_loading_is_bitwise_load_then_quantize_and_transformers(tmp_path):
    _, folder = hf_folder(tmp_path)
    assert_quantize_while_loading_matches(folder, torch.randint(3, V, (2, 9)))


def test_all_linear_targets_the_modules_peft_targets(tmp_path):
    hf, folder = hf_folder(tmp_path)
    config = {"r": 2, "lora_alpha": 4, "target_modules": "all-linear"}
    ref = peft.get_peft_model(hf, peft.LoraConfig(task_type="CAUSAL_LM", **config))
    got = get_peft_model(AutoModelForCausalLM.from_pretrained(folder), LoraConfig(**config))
    names = [n for n, _ in got.named_parameters() if "lora_" in n]
    assert names and names == [n for n, _ in ref.named_parameters() if "lora_" in n]


def test_trained_lora_adapters_move_both_ways(tmp_path):
    hf, folder = hf_folder(tmp_path)
    x = torch.randint(3, V, (2, 12))
    assert_adapters_move_both_ways(hf, folder, tmp_path, x, "all-linear", "gemma3")


def test_transformers4_rope_spelling_reads_as_transformers_reads_it():
    old = {"rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
           "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    want = transformers.Gemma3TextConfig(**BASE, **old).rope_parameters
    got = config_from_dict({"model_type": "gemma3_text", **BASE, **old}).rope_parameters
    assert got == want
    legacy = {**old, "rope_scaling": {"type": "linear", "factor": 8.0}}  # "type": older still
    assert config_from_dict({"model_type": "gemma3_text", **BASE, **legacy}).rope_parameters == want
    assert Gemma3Config().rope_parameters == transformers.Gemma3TextConfig().rope_parameters


def test_refused_model_type_names_gemma3_text():
    with pytest.raises(ValueError, match="gemma3_text"):
        config_from_dict({"model_type": "gpt2"})


def test_bf16_embedding_scale_and_norms_match_transformers_bitwise(tmp_path):
    _, folder = hf_folder(tmp_path, "gemma3-hidden48")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    ours = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    x = torch.randint(3, V, (2, 16))
    with torch.no_grad():  # sqrt(48) rounds in bf16: scaled in bf16, as transformers does
        h = hf.model.embed_tokens(x)
        torch.testing.assert_close(ours.model.embed_tokens(x), h, rtol=0, atol=0)
        torch.testing.assert_close(ours.model.norm(h), hf.model.norm(h), rtol=0, atol=0)

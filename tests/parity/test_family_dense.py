"""Parity of nanosft.families' olmo3, cohere2 and gpt_neox with transformers 5.23 / peft 0.21.2.

Tiny random models built by transformers' own config classes (fp32, 2 layers, hidden 64, norms and
biases randomized): OLMo 3 (post-norm, q/k norms over the whole projection, a 5-token sliding
layer then a full one), Cohere 2 (parallel block, bias-free LayerNorm, interleaved RoPE only in
the sliding layer, logit_scale 0.5, tied embeddings), GPT-NeoX with the parallel residual (Pythia)
and without it (partial rotary 0.5). Compared: logits within 1e-5 both load directions (plain,
left-padded, packed with position_ids, and nanosft's unpadded training forward; rows longer
than the window); greedy generation with the KV cache token for token; quantize-while-loading
bitwise equal to transformers + bitsandbytes (OLMo 3, Cohere 2, GPT-NeoX); a LoRA on GPT-NeoX's
fused query_key_value (peft's default target) trained by one library loading in the other, and an
all-linear LoRA on OLMo 3 and Cohere 2 the same way (peft's file keys, logits within 1e-6);
GPT-NeoX files keep transformers' `embed_out`; the older config.json spellings (Pythia's
rotary_pct, OLMo's flat rope_theta) read as transformers reads them. Negative control: Cohere 2
with RoPE in its full layer changes the logits.
Hermetic: tmp folders, no downloads; `-s` prints the largest differences.
Run: python -m pytest -q -s tests/parity/test_family_dense.py
"""

import pytest
import torch
import transformers
from safetensors import safe_open
from test_families import (BASE, PAD, TOL, V, assert_adapters_move_both_ways,
                           assert_quantize_while_loading_matches, left_padded_batch,
                           models_both_ways, packed_row, save_random)

from nanosft.families.auto import AutoModelForCausalLM, config_from_dict

WINDOWED = {"sliding_window": 5, "layer_types": ["sliding_attention", "full_attention"]}
NEOX = {k: v for k, v in BASE.items() if k != "num_key_value_heads"}  # no grouped-query heads
CONFIGS = {  # name: (transformers config class, arguments)
    "olmo3": (transformers.Olmo3Config, {**BASE, **WINDOWED}),
    "cohere2": (transformers.Cohere2Config, {**BASE, **WINDOWED, "logit_scale": 0.5}),
    "gpt_neox": (transformers.GPTNeoXConfig, NEOX),
    "gpt_neox-sequential": (transformers.GPTNeoXConfig,
                            {**NEOX, "use_parallel_residual": False,
                             "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                 "partial_rotary_factor": 0.5}}),
}


def hf_folder(name, tmp_path):
    config_class, kwargs = CONFIGS[name]
    return save_random(config_class(**kwargs), tmp_path)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_and_generation_match_transformers(name, tmp_path):
    x = torch.randint(3, V, (2, 16))
    padded, mask = left_padded_batch()
    packed, pos = packed_row()
    right = (torch.arange(16) < 11).long().expand(2, 16)
    hf, folder = hf_folder(name, tmp_path)
    worst = 0.0
    for theirs, ours in models_both_ways(hf, folder, tmp_path):
        with torch.no_grad():
            pairs = [(theirs(x).logits, ours(x).logits)]
            pairs.append((theirs(padded, attention_mask=mask).logits[mask.bool()],
                          ours(padded, attention_mask=mask).logits[mask.bool()]))
            pairs.append((theirs(packed, position_ids=pos, use_cache=False).logits,
                          ours(packed, position_ids=pos).logits))
            want_right = theirs(x, attention_mask=right).logits[right.bool()]
        ours.train()  # nanosft's unpadded speed path
        pairs.append((pairs[-1][0], ours(packed, position_ids=pos).logits.detach()))
        pairs.append((want_right, ours(x, attention_mask=right).logits[right.bool()].detach()))
        ours.eval()
        for want, got in pairs:
            torch.testing.assert_close(got, want, **TOL)
            worst = max(worst, (got - want).abs().max().item())
    if name != "gpt_neox-sequential":  # its decoding differs from gpt_neox's in the layer only
        ours = AutoModelForCausalLM.from_pretrained(folder).eval()
        want = hf.generate(padded, attention_mask=mask, do_sample=False, max_new_tokens=8,
                           pad_token_id=PAD)
        got = ours.generate(padded, attention_mask=mask, max_new_tokens=8)
        assert got.tolist() == want.tolist()
    print(f"\n[{name}] max |logit diff| = {worst:.3e}")


def test_negative_control_rope_in_cohere2_full_layers_changes_the_logits(tmp_path):
    hf, folder = hf_folder("cohere2", tmp_path)
    ours = AutoModelForCausalLM.from_pretrained(folder).eval()
    ours.model.layers[1].self_attn.sliding_window = 10**6  # the bug: RoPE in the full layer
    x = torch.randint(3, V, (1, 12))
    with torch.no_grad():
        assert (ours(x).logits - hf(x).logits).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["olmo3", "cohere2", "gpt_neox"])
def test_quantize_while_loading_is_bitwise_transformers(name, tmp_path):
    _, folder = hf_folder(name, tmp_path)
    assert_quantize_while_loading_matches(folder, torch.randint(3, V, (2, 9)))


def test_gpt_neox_lora_on_query_key_value_moves_both_ways(tmp_path):
    hf, folder = hf_folder("gpt_neox", tmp_path)
    x = torch.randint(3, V, (2, 12))
    assert_adapters_move_both_ways(hf, folder, tmp_path, x, ["query_key_value"], "gpt_neox")
    AutoModelForCausalLM.from_pretrained(folder).save_pretrained(tmp_path / "saved")
    with safe_open(str(tmp_path / "saved" / "model.safetensors"), "pt") as f:
        with safe_open(str(folder / "model.safetensors"), "pt") as g:
            assert sorted(f.keys()) == sorted(g.keys()) and "embed_out.weight" in f.keys()


def adapter_keys(folder):
    with safe_open(str(folder / "adapter_model.safetensors"), "pt") as f:
        return sorted(f.keys())


@pytest.mark.parametrize("name", ["olmo3", "cohere2"])
def test_all_linear_adapters_move_both_ways_with_peft_keys(name, tmp_path):
    """all-linear LoRA (q/k/v/o and gate/up/down_proj; OLMo 3's q/k norms and Cohere 2's
    LayerNorm carry none): the file nanosft writes holds peft's keys, and each library's trained
    adapter gives the other's fp32 logits within 1e-6."""
    hf, folder = hf_folder(name, tmp_path)
    x = torch.randint(3, V, (2, 12))
    diff = assert_adapters_move_both_ways(hf, folder, tmp_path, x, "all-linear", name)
    assert diff <= 1e-6
    keys = adapter_keys(tmp_path / "ours_adapter")
    assert keys == adapter_keys(tmp_path / "peft_adapter")
    assert len(keys) == 2 * 2 * 7  # 2 layers x 7 linears x (lora_A, lora_B)


def test_older_config_spellings_read_as_transformers_reads_them():
    """Pythia's rotary_pct / rotary_emb_base and OLMo's flat rope_theta (transformers-4 files)."""
    neox = {"model_type": "gpt_neox", **NEOX, "rotary_pct": 0.5, "rotary_emb_base": 1000}
    want = transformers.GPTNeoXConfig(**neox).rope_parameters
    got = config_from_dict(neox)
    assert (got.rope_theta, got.partial_rotary_factor) == (want["rope_theta"], 0.5)
    assert got.to_dict()["rope_parameters"] == {"rope_type": "default", **want}
    olmo = {"model_type": "olmo3", **BASE, "rope_theta": 1234.0}
    assert config_from_dict(olmo).rope_parameters == transformers.Olmo3Config(
        **olmo).rope_parameters


def test_nemotron_h_is_refused_by_name_naming_the_families_that_load():
    with pytest.raises(ValueError, match=r"nemotron_h.*Mamba.*'qwen3_moe'"):
        config_from_dict({"model_type": "nemotron_h", **BASE})

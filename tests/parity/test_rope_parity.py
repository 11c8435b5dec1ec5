"""Parity of every RoPE kind transformers 5.23 defines (nanosft.rope) with transformers' models.

Tiny random fp32 models built by transformers' own config classes, each with one rope_type:
default, linear, dynamic NTK, YaRN, LongRoPE and Llama 3.1's on Llama (max_position_embeddings
16, rows of 24 tokens so dynamic NTK grows its base and LongRoPE takes its long factors, then 8
tokens, back inside); OLMo 3 as TRL's tiny test model and the released checkpoints carry it (flat
`rope_scaling` YaRN with attention_factor, beta_fast/beta_slow: the full layers get YaRN, the
sliding ones plain RoPE), and written per layer type in transformers-5 spelling; Gemma 3 with YaRN
in its full layers; Cohere 2 (interleaved RoPE) with YaRN; GPT-NeoX (partial rotary) with YaRN and
dynamic NTK; Qwen3.5 (partial rotary, text positions through mrope) with YaRN; Gemma 4 with dynamic
NTK in its sliding layers and YaRN in its full ones (other head widths). Compared: logits
within 1e-5 loading transformers' files into nanosft and back (the config transformers reads back
keeps its rope_parameters). Negative control: YaRN's attention factor changes the logits
(dropped, the test would fail). Hermetic: tmp folders, no downloads.
Run: python -m pytest -q -s tests/parity/test_rope_parity.py
"""

import pytest
import torch
import transformers
from test_families import BASE, TOL, V, randomize_vectors, save_random

from nanosft.families.auto import AutoModelForCausalLM, config_from_dict, from_config
from nanosft.rope import ROPE_TYPES

SHORT = {**BASE, "max_position_embeddings": 16}  # rows of 24 tokens run past it
HALF = 8  # head_dim 16: eight rotated frequencies
LONGROPE = {"rope_type": "longrope", "original_max_position_embeddings": 8,
            "short_factor": [1.0 + 0.1 * i for i in range(HALF)],
            "long_factor": [1.0 + 0.7 * i for i in range(HALF)]}
YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4,
        "attention_factor": 1.2079441541679836, "beta_fast": 32.0, "beta_slow": 1.0}
LLAMA = {  # rope_type: rope_parameters (rope_theta added below)
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 8.0, "beta_slow": 2.0},
    "yarn-untruncated": {"rope_type": "yarn", "factor": 4.0, "truncate": False,
                         "mscale": 2.0, "mscale_all_dim": 1.0},
    "longrope": LONGROPE,
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8},
}
WINDOWED = {"sliding_window": 5, "num_hidden_layers": 4,
            "layer_types": ["sliding_attention", "full_attention"] * 2}
OTHERS = {  # name: (transformers config class, arguments)
    # TRL's tiny OLMo 3 (scripts/generate_tiny_models), OLMo-3-7B-Think's RoPE, 4 layers so that
    # full layers exist (TRL's 2 are both sliding)
    "olmo3-trl": (transformers.Olmo3Config,
                  {**BASE, "num_hidden_layers": 4, "max_position_embeddings": 65536,
                   "rope_theta": 500000,
                   "rope_scaling": {**YARN, "original_max_position_embeddings": 8192}}),
    "olmo3-per-type": (transformers.Olmo3Config,
                       {**BASE, **WINDOWED, "rope_parameters": {
                           "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                           # truncate is read from the outer dict by transformers: unread here
                           "full_attention": {**YARN, "rope_theta": 10000.0, "truncate": False}}}),
    "olmo3-dynamic": (transformers.Olmo3Config,
                      {**SHORT, **WINDOWED, "rope_parameters": {
                          "sliding_attention": {"rope_type": "linear", "factor": 2.0,
                                                "rope_theta": 10000.0},
                          "full_attention": {"rope_type": "dynamic", "factor": 4.0,
                                             "rope_theta": 10000.0}}}),
    "gemma3-yarn": (transformers.Gemma3TextConfig,
                    {**BASE, **WINDOWED, "head_dim": 16, "rope_parameters": {
                        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                        "full_attention": {**YARN, "rope_theta": 1e6}}}),
    "cohere2-yarn": (transformers.Cohere2Config,
                     {**BASE, "sliding_window": 5, "layer_types": ["sliding_attention"] * 2,
                      "rope_parameters": {**YARN, "rope_theta": 10000.0}}),
    "gpt_neox-yarn": (transformers.GPTNeoXConfig,
                      {**BASE, "rope_parameters": {**YARN, "rope_theta": 10000.0,
                                                   "partial_rotary_factor": 0.5}}),
    # Qwen3.5: partial rotary 0.25 of head_dim 32 (8 dims), mrope sections unused by text
    "qwen3_5-yarn": (transformers.Qwen3_5TextConfig,
                     {**BASE, "num_hidden_layers": 4, "head_dim": 32, "linear_key_head_dim": 16,
                      "linear_value_head_dim": 16, "linear_num_key_heads": 2,
                      "linear_num_value_heads": 4, "rope_parameters": {
                          **YARN, "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                          "mrope_section": [1, 1, 2], "mrope_interleaved": True}}),
    # Gemma 4: dynamic NTK in the sliding layers (head_dim 16), YaRN in the full ones
    # (global_head_dim 32), in place of its default / proportional
    "gemma4-dynamic-yarn": (transformers.Gemma4TextConfig, {
        **SHORT, "num_hidden_layers": 5, "head_dim": 16, "global_head_dim": 32,
        "sliding_window": 5, "vocab_size_per_layer_input": V, "hidden_size_per_layer_input": 64,
        "num_kv_shared_layers": 2, "layer_types": ["sliding_attention", "full_attention",
                                                   "sliding_attention", "sliding_attention",
                                                   "full_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0},
            "full_attention": {**YARN, "rope_theta": 1e6}}}),
    "gpt_neox-dynamic": (transformers.GPTNeoXConfig,
                         {**SHORT, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0,
                                                       "rope_theta": 10000.0,
                                                       "partial_rotary_factor": 0.5}}),
}


def config(name):
    if name in LLAMA:
        rope = {**LLAMA[name], "rope_theta": 10000.0}
        return transformers.LlamaConfig(**SHORT, rope_parameters=rope)
    config_class, kwargs = OTHERS[name]
    return config_class(**kwargs)


def models_both_ways(hf, folder, tmp_path):
    """[(transformers, nanosft)]: transformers' weights in nanosft, and nanosft's in transformers
    (the config it reads back keeps rope_parameters)."""
    ours = AutoModelForCausalLM.from_pretrained(folder).eval()
    theirs = randomize_vectors(from_config(config_from_dict(hf.config.to_dict()))).eval()
    theirs.save_pretrained(tmp_path / "ours")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert type(back) is type(hf)
    assert back.config.rope_parameters == hf.config.rope_parameters
    return [(hf, ours), (back, theirs)]


def assert_logits_match(hf, folder, tmp_path):
    """Rows of 24 then 8 tokens, both load directions; the largest difference."""
    worst = 0.0
    for theirs, ours in models_both_ways(hf, folder, tmp_path):
        for T in (24, 8):  # this order: transformers' dynamic NTK grows, then resets
            x = torch.randint(3, V, (2, T))
            with torch.no_grad():
                want, got = theirs(x).logits, ours(x).logits
            torch.testing.assert_close(got, want, **TOL)
            worst = max(worst, (got - want).abs().max().item())
    return worst


def test_every_transformers_rope_type_is_covered():
    kinds = {p["rope_type"] for p in LLAMA.values()}
    assert kinds == set(ROPE_TYPES)


@pytest.mark.parametrize("name", [*LLAMA, *OTHERS])
def test_logits_match_transformers(name, tmp_path):
    hf, folder = save_random(config(name), tmp_path)
    worst = assert_logits_match(hf, folder, tmp_path)
    print(f"\n[{name}] max |logit diff| = {worst:.3e}")


def test_olmo3_trl_config_gives_its_full_layers_yarn(tmp_path):
    hf, folder = save_random(config("olmo3-trl"), tmp_path)
    rope = AutoModelForCausalLM.from_pretrained(folder).config.rope_parameters
    assert rope["full_attention"]["rope_type"] == "yarn"
    assert rope["sliding_attention"]["rope_type"] == "default"
    assert rope == hf.config.rope_parameters


def test_negative_control_yarn_without_its_attention_factor_changes_the_logits(tmp_path):
    hf, folder = save_random(config("yarn"), tmp_path)
    ours = AutoModelForCausalLM.from_pretrained(folder).eval()
    ours.config.rope_scaling["attention_factor"] = 1.0  # the bug: cos and sin left unscaled
    x = torch.randint(3, V, (1, 24))
    with torch.no_grad():
        assert (ours(x).logits - hf(x).logits).abs().max() > 1e-3

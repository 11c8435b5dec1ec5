"""config.json keys a family's transformers config never reads load as transformers loads them.

TRL's tiny GPT-NeoX (scripts/generate_tiny_models: hidden 8, 4 heads, `num_key_value_heads=2`,
which GPTNeoXConfig keeps as an attribute nothing reads) loads with four full heads and the
logits of transformers' model within 1e-5 (fp32); likewise a Qwen3 file carrying Llama's
`mlp_bias: true` and a Gemma 3 file carrying `hidden_act: "gelu"` load without the bias or the
activation check, as transformers does. Negative control: Llama's own config reads mlp_bias.
Hermetic: tmp folders, no downloads.
Checkpoint keys transformers drops silently (rotary_emb.inv_freq of older files, Pythia's attention
bias buffers, GLM-4.5's MTP layer) load the same way.
Run: python -m pytest -q tests/parity/test_unread_config_keys.py
"""

import json

import pytest
import torch
import transformers
from test_families import BASE, TOL, V, save_random

from nanosft.families.auto import AutoModelForCausalLM

TRL_NEOX = {"vocab_size": V, "hidden_size": 8, "num_attention_heads": 4,
            "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 32}


def add_keys(folder, **keys):
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **keys}))


def assert_logits_match(hf, folder):
    ours = AutoModelForCausalLM.from_pretrained(folder).eval()
    x = torch.randint(3, V, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(ours(x).logits, hf(x).logits, **TOL)
    return ours


def test_trl_tiny_gpt_neox_with_num_key_value_heads_loads(tmp_path):
    hf, folder = save_random(transformers.GPTNeoXConfig(**TRL_NEOX), tmp_path)
    assert json.loads((folder / "config.json").read_text())["num_key_value_heads"] == 2
    ours = assert_logits_match(hf, folder)
    assert ours.config.num_key_value_heads == 4  # every head its own keys, as GPT-NeoX has


@pytest.mark.parametrize("config_class, keys", [
    (transformers.Qwen3Config, {"mlp_bias": True}),
    (transformers.Gemma3TextConfig, {"hidden_act": "gelu", "mlp_bias": True}),
    (transformers.MistralConfig, {"sliding_window": 5, "attention_bias": True}),
])
def test_llama_fields_a_family_never_reads_are_ignored(config_class, keys, tmp_path):
    hf, folder = save_random(config_class(**BASE), tmp_path)
    add_keys(folder, **keys)
    back = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    torch.testing.assert_close(dict(back.state_dict()), dict(hf.state_dict()), rtol=0, atol=0)
    assert_logits_match(back, folder)


def test_negative_control_llama_reads_mlp_bias(tmp_path):
    hf, folder = save_random(transformers.LlamaConfig(**BASE), tmp_path)
    add_keys(folder, mlp_bias=True)  # a Llama field: the model now wants biases the file lacks
    with pytest.raises(Exception, match="bias"):
        AutoModelForCausalLM.from_pretrained(folder)


def add_tensors(folder, **tensors):
    """Extra tensors written into the folder's model.safetensors beside its own."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    save_file({**load_file(path), **tensors}, path, metadata={"format": "pt"})


@pytest.mark.parametrize("name", ["llama-inv_freq", "pythia-buffers", "glm4_moe-mtp"])
def test_checkpoint_keys_transformers_ignores_are_ignored(name, tmp_path):
    """Old Llama files' per-layer rotary_emb.inv_freq, Pythia's attention.bias / masked_bias
    buffers, GLM-4.5's multi-token-prediction layer after the decoder's (nanosft's glm4_moe
    files already skipped it; kept here beside the others): transformers loads the folder without
    them (no warning needed), and so does nanosft, with transformers' logits."""
    if name == "llama-inv_freq":
        hf, folder = save_random(transformers.LlamaConfig(**BASE), tmp_path)
        extra = {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.rand(8)
                 for i in range(2)}
    elif name == "pythia-buffers":
        hf, folder = save_random(transformers.GPTNeoXConfig(**TRL_NEOX), tmp_path)
        extra = {}
        for i in range(2):
            extra[f"gpt_neox.layers.{i}.attention.bias"] = torch.ones(1, 1, 16, 16).tril().bool()
            extra[f"gpt_neox.layers.{i}.attention.masked_bias"] = torch.tensor(-1e9)
    else:
        config = transformers.Glm4MoeConfig(**BASE, moe_intermediate_size=32, n_routed_experts=4,
                                            num_experts_per_tok=2, first_k_dense_replace=1)
        hf, folder = save_random(config, tmp_path)
        from safetensors.torch import load_file

        saved = load_file(folder / "model.safetensors")  # the Hub's per-expert key names
        extra = {"model.layers.2." + k.removeprefix("model.layers.1."): v.clone()
                 for k, v in saved.items() if k.startswith("model.layers.1.")}
    add_tensors(folder, **extra)
    back = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    torch.testing.assert_close(dict(back.state_dict()), dict(hf.state_dict()), rtol=0, atol=0)
    assert_logits_match(back, folder)

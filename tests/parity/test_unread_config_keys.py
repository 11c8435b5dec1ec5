"""config.json keys a family's transformers config never reads load as transformers loads them.

TRL's tiny GPT-NeoX (scripts/generate_tiny_models: hidden 8, 4 heads, `num_key_value_heads=2`,
which GPTNeoXConfig keeps as an attribute nothing reads) loads with four full heads and the
logits of transformers' model within 1e-5 (fp32); likewise a Qwen3 file carrying Llama's
`mlp_bias: true` and a Gemma 3 file carrying `hidden_act: "gelu"` load without the bias or the
activation check, as transformers does. Negative control: Llama's own config reads mlp_bias.
Hermetic: tmp folders, no downloads.
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

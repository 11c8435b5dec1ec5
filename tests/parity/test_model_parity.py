"""Parity of nanosft.model.CausalLM with transformers' LlamaForCausalLM / Qwen2ForCausalLM.

The same weights go through both libraries, in both directions (saved by transformers and loaded by
nanosft; saved by nanosft and loaded by transformers' AutoModelForCausalLM), and we compare logits
(fp32, atol 1e-5), the loss with and without num_items_in_batch, a left-padded batch with its
attention_mask, and 20 greedy tokens (alone, left-padded, and stopping at eos). Hermetic: random
tiny configs built in-process, temp folders, no downloads. `pytest -s` prints the max |logit
difference|.
Run: python -m pytest -q -s tests/parity/test_model_parity.py
"""

import json

import pytest
import torch
import transformers

from nanosft.families.auto import AutoModelForCausalLM, config_from_dict, from_config
from nanosft.model import CausalLM

PAD = 0
# eos None: both libraries run all 20 new tokens (an eos case has its own test below).
BASE = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "max_position_embeddings": 256, "pad_token_id": PAD, "bos_token_id": 1,
        "eos_token_id": None}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32, "rope_theta": 10000.0}
LINEAR = {"rope_type": "linear", "factor": 4.0, "rope_theta": 500.0}
CASES = {  # name: (model family, config overrides)
    "llama-gqa-untied": ("llama", {"num_attention_heads": 4, "num_key_value_heads": 2}),
    "llama-mha-tied": ("llama", {"num_attention_heads": 4, "num_key_value_heads": 4,
                                 "tie_word_embeddings": True}),
    "llama-rope-llama3": ("llama", {"num_attention_heads": 4, "num_key_value_heads": 1,
                                    "rope_parameters": LLAMA3}),
    "llama-rope-linear": ("llama", {"num_attention_heads": 2, "num_key_value_heads": 2,
                                    "rope_parameters": LINEAR}),
    "qwen2-qkv-bias": ("qwen2", {"num_attention_heads": 4, "num_key_value_heads": 2}),
}


def randomize_biases(model):
    with torch.no_grad():  # both libraries init biases to zero, where a bias mix-up would hide
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    return model


def hf_model(kind, kw):
    config_cls = transformers.Qwen2Config if kind == "qwen2" else transformers.LlamaConfig
    model_cls = transformers.Qwen2ForCausalLM if kind == "qwen2" else transformers.LlamaForCausalLM
    return randomize_biases(model_cls(config_cls(**BASE, **kw)).eval())


def from_hf(name, tmp_path):
    """A transformers model and nanosft's load of its saved folder."""
    hf = hf_model(*CASES[name])
    hf.save_pretrained(tmp_path / "from_hf")
    return hf, AutoModelForCausalLM.from_pretrained(tmp_path / "from_hf").eval()


def both_ways(name, tmp_path):
    """(transformers model, nanosft model) pairs: transformers -> nanosft and back."""
    hf, ours = from_hf(name, tmp_path)
    theirs = randomize_biases(from_config(config_from_dict(hf.config.to_dict())).eval())
    theirs.save_pretrained(tmp_path / "from_nanosft")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "from_nanosft").eval()
    assert type(back) is type(hf)
    return [(hf, ours), (back, theirs)]


def left_padded_batch():
    x = torch.randint(3, 128, (3, 9))
    mask = torch.ones_like(x)
    mask[1, :3], mask[2, :6] = 0, 0
    return x.masked_fill(mask == 0, PAD), mask


@pytest.mark.parametrize("name", list(CASES))
def test_logits_loss_and_padded_batch_match(name, tmp_path):
    x = torch.randint(3, 128, (2, 16))
    labels = x.masked_fill(torch.rand(x.shape) < 0.3, -100)
    padded, mask = left_padded_batch()
    for direction, (hf, ours) in zip(("hf->nanosft", "nanosft->hf"), both_ways(name, tmp_path)):
        with torch.no_grad():
            want, got = hf(x), ours(x)
            diff = (want.logits - got.logits).abs().max().item()
            print(f"\n[{name} {direction}] max |logit diff| = {diff:.3e}")
            torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=1e-5)
            for n in (None, torch.tensor(37.0)):
                torch.testing.assert_close(ours(x, labels=labels, num_items_in_batch=n).loss,
                                           hf(x, labels=labels, num_items_in_batch=n).loss,
                                           rtol=1e-6, atol=1e-6)
            real = mask.bool()  # padded queries are never used, so only real positions are compared
            want_p = hf(padded, attention_mask=mask).logits
            got_p = ours(padded, attention_mask=mask).logits
            torch.testing.assert_close(got_p[real], want_p[real], rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["llama-gqa-untied", "llama-mha-tied", "llama-rope-llama3",
                                  "qwen2-qkv-bias"])
def test_greedy_generation_is_token_identical(name, tmp_path):
    # One direction suffices: the weights were shown equal both ways above; this checks decoding.
    hf, ours = from_hf(name, tmp_path)
    prompt = torch.randint(3, 128, (1, 6))
    want = hf.generate(prompt, do_sample=False, max_new_tokens=20, pad_token_id=PAD)
    got = ours.generate(prompt, max_new_tokens=20)
    assert want.shape[1] == 26 and got.tolist() == want.tolist()
    padded, mask = left_padded_batch()
    want = hf.generate(padded, attention_mask=mask, do_sample=False, max_new_tokens=20,
                       pad_token_id=PAD)
    assert ours.generate(padded, attention_mask=mask, max_new_tokens=20).tolist() == want.tolist()


def test_generation_stops_at_eos_like_transformers(tmp_path):
    padded, mask = left_padded_batch()
    hf, ours = from_hf("llama-gqa-untied", tmp_path)
    free = ours.generate(padded, attention_mask=mask, max_new_tokens=20)
    eos = int(free[1, 9 + 4])  # a token row 1 generates at step 5 stops it there
    want = hf.generate(padded, attention_mask=mask, do_sample=False, max_new_tokens=20,
                       eos_token_id=eos, pad_token_id=PAD)
    got = ours.generate(padded, attention_mask=mask, max_new_tokens=20, eos_token_id=eos,
                        pad_token_id=PAD)
    assert got.tolist() == want.tolist() and (got[1, 9:] == PAD).any()


def test_old_spelling_config_loads_like_transformers(tmp_path):
    hf = hf_model(*CASES["llama-gqa-untied"])
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["rope_parameters"], config["dtype"]  # the transformers-4 spelling
    config.update(rope_theta=1234.0, torch_dtype="float32",
                  rope_scaling={"type": "linear", "factor": 2.0})
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    ours = CausalLM.from_pretrained(tmp_path).eval()
    assert ours.config.rope_theta == 1234.0
    assert ours.config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    x = torch.randint(3, 128, (2, 16))
    with torch.no_grad():
        want, got = hf(x).logits, ours(x).logits
    print(f"\n[old-spelling config] max |logit diff| = {(want - got).abs().max().item():.3e}")
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_sharded_folders_move_both_ways(tmp_path):
    hf = hf_model(*CASES["llama-gqa-untied"])
    hf.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    ours = CausalLM.from_pretrained(tmp_path / "hf").eval()
    ours.save_pretrained(tmp_path / "ours", max_shard_size="40KB")
    assert (tmp_path / "ours" / "model.safetensors.index.json").exists()
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "ours").eval()
    x = torch.randint(3, 128, (2, 16))
    with torch.no_grad():
        want = hf(x).logits
        torch.testing.assert_close(ours(x).logits, want, rtol=0, atol=1e-5)
        torch.testing.assert_close(back(x).logits, want, rtol=0, atol=1e-5)

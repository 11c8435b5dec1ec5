"""Behaviour of nanosft.model (and the nanosft.io.hub files it writes): masks, positions, KV cache,
loss, RoPE scaling, checkpoints and errors.

Every expected value is computed in the test itself (a second forward pass, a formula written out
here, a greedy loop without cache), never copied from earlier output. Hermetic: tiny random models
built in-process on CPU, temp folders only, no network.
Run: python -m pytest -q tests/test_model.py
"""

import json
import math
import os

import pytest
import torch
import torch.nn.functional as F

from nanosft.model import (
    CausalLM,
    ModelConfig,
    build_attention_mask,
    causal_lm_loss,
    rope_dict,
)
from nanosft.rope import rope_frequencies
from nanosft.fast.unpad import varlen_layout

PAD, EOS = 0, 2


def tiny_config(**overrides):
    kw = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
          "pad_token_id": PAD, "eos_token_id": EOS}
    return ModelConfig(**{**kw, **overrides})


@pytest.fixture
def model():
    return CausalLM(tiny_config()).eval()


def ids(*rows):
    return torch.tensor(rows)


def test_changing_a_future_token_never_changes_earlier_logits(model):
    x = torch.randint(3, 96, (2, 10))
    y = x.clone()
    y[:, 6] = (y[:, 6] + 1) % 96
    a, b = model(x).logits, model(y).logits
    torch.testing.assert_close(a[:, :6], b[:, :6], rtol=0, atol=0)
    # the changed token itself is seen from position 6 on
    assert not torch.allclose(a[:, 6:], b[:, 6:])


def test_left_padded_row_with_its_position_ids_gives_the_unpadded_logits(model):
    real = ids([5, 17, 33, 8, 41])
    padded = ids([PAD, PAD, 5, 17, 33, 8, 41])
    mask = ids([0, 0, 1, 1, 1, 1, 1])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    alone = model(real).logits
    got = model(padded, attention_mask=mask, position_ids=pos).logits
    assert torch.isfinite(got).all()  # pad queries see no key at all: no NaN may leak out
    torch.testing.assert_close(got[:, 2:], alone, rtol=1e-5, atol=1e-5)
    # Negative control: without the padding mask the real tokens attend to the pads.
    leaky = model(padded, attention_mask=torch.ones_like(mask), position_ids=pos).logits
    assert not torch.allclose(leaky[:, 2:], alone, atol=1e-3)


def test_packed_row_with_restarting_position_ids_equals_each_example_alone(model):
    a, b, c = [7, 8, 9, 10], [11, 12, 13], [14, 15]
    packed = ids(a + b + c)
    pos = ids([0, 1, 2, 3, 0, 1, 2, 0, 1])
    got = model(packed, position_ids=pos).logits[0]
    want = torch.cat([model(ids(s)).logits[0] for s in (a, b, c)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # Negative control: with a plain causal mask, b and c attend to the documents before them.
    leaky = model(packed, position_ids=pos, attention_mask=torch.ones_like(packed)).logits[0]
    assert not torch.allclose(leaky[4:], want[4:], atol=1e-3)


def test_varlen_layout_packs_only_what_it_can_run_exactly():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0]])
    # packed: one SDPA per document
    assert varlen_layout(None, pos, 1, 6, 0, unpad=False) == (None, [3, 2, 1])
    # one document a row
    assert varlen_layout(None, torch.arange(6)[None], 2, 6, 0, unpad=True) is None
    right = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    # eval keeps the padded path
    assert varlen_layout(right, torch.arange(4)[None], 2, 4, 0, unpad=False) is None
    index, lengths = varlen_layout(right, torch.arange(4)[None], 2, 4, 0, unpad=True)
    assert index.tolist() == [0, 1, 2, 4, 5] and lengths == [3, 2]
    holes = torch.tensor([[1, 0, 1, 1]])  # real tokens not in one run: only the dense mask is exact
    assert varlen_layout(holes, torch.arange(4)[None], 1, 4, 0, unpad=True) is None
    # left padding: the last pad predicts the first real token, so its logits matter; keep the
    # dense mask
    left = torch.tensor([[0, 1, 1, 1]])
    assert varlen_layout(left, torch.arange(4)[None], 1, 4, 0, unpad=True) is None
    # with a cache
    assert varlen_layout(right, torch.arange(2, 6)[None], 2, 4, 2, unpad=True) is None


def test_training_forward_unpads_and_equals_the_masked_path(model):
    """In training a padded batch runs as one packed row; its loss, real-token logits and
    gradients equal the dense-mask path (eval mode, same weights: the model has no dropout), and
    pad positions never reach a layer."""
    x = torch.randint(3, 96, (3, 7))
    # right padding, as the SFT collator pads
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3, [1] * 2 + [0] * 5])
    labels = x.masked_fill(mask == 0, -100)
    runs = {}
    for training in (True, False):
        model.train(training)
        model.zero_grad()
        out = model(x, attention_mask=mask, labels=labels, num_items_in_batch=torch.tensor(12.0))
        out.loss.backward()
        runs[training] = (out, {n: p.grad.clone() for n, p in model.named_parameters()})
    (packed, packed_grads), (dense, dense_grads) = runs[True], runs[False]
    real = mask.bool()
    torch.testing.assert_close(packed.logits[real], dense.logits[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed.loss, dense.loss, rtol=1e-6, atol=1e-6)
    for name, grad in dense_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    # the packed path ran
    assert (packed.logits[~real] == 0).all() and not (dense.logits[~real] == 0).all()


def test_sdpa_fast_path_only_when_nothing_is_masked():
    pos = torch.arange(6)[None]
    assert build_attention_mask(None, pos, 6, 0) is None  # is_causal=True
    assert build_attention_mask(torch.ones(2, 6), pos, 6, 0) is None
    # one new token sees the whole cache
    assert build_attention_mask(None, pos[:, -1:], 1, 5) is None
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    # With a cache and several new tokens, is_causal would align the wrong corner: an explicit mask.
    torch.testing.assert_close(build_attention_mask(None, pos[:, 3:], 3, 3)[0, 0], causal[3:])
    padded = build_attention_mask(torch.tensor([[0, 0, 1, 1, 1, 1]]), pos, 6, 0)[0, 0]
    torch.testing.assert_close(padded[2:], causal[2:] & torch.tensor([0, 0, 1, 1, 1, 1]).bool())
    # pad queries with nothing to see attend everywhere instead of giving NaN
    assert padded[:2].all()


def test_loss_is_token_sum_over_num_items_in_batch_and_mean_without_it(model):
    x = torch.randint(3, 96, (2, 6))
    labels = x.clone()
    labels[0, :3] = -100
    out = model(x, labels=labels, num_items_in_batch=torch.tensor(20.0))
    logp = out.logits.float().log_softmax(-1)
    # Formula: position t predicts labels[t+1]; -100 targets (and the last position) add nothing.
    total, count = 0.0, 0
    for b in range(2):
        for t in range(5):
            if labels[b, t + 1] != -100:
                total, count = total - logp[b, t, labels[b, t + 1]], count + 1
    torch.testing.assert_close(out["loss"], total / 20.0, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(model(x, labels=labels).loss, total / count, rtol=1e-6, atol=1e-6)
    # negative control: the two reductions differ here
    assert not torch.allclose(out.loss, total / count)


def test_loss_ignores_the_last_position_and_upcasts():
    logits = torch.randn(1, 3, 5, dtype=torch.bfloat16)
    labels = ids([1, 2, 3])
    want = F.cross_entropy(logits[0, :2].float(), labels[0, 1:])
    got = causal_lm_loss(logits, labels)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def greedy_without_cache(model, x, n):
    for _ in range(n):
        x = torch.cat((x, model(x).logits[:, -1].argmax(-1, keepdim=True)), dim=1)
    return x


def test_kv_cache_generation_equals_full_recomputation(model):
    x = ids([5, 17, 33, 8])
    got = model.generate(x, max_new_tokens=12, eos_token_id=-1)  # -1: never stop early
    torch.testing.assert_close(got, greedy_without_cache(model, x, 12), rtol=0, atol=0)


def test_batched_left_padded_generation_equals_each_prompt_alone(model):
    p1, p2 = [5, 17, 33, 8, 41], [9, 12]
    batch = ids(p1, [PAD, PAD, PAD] + p2)
    mask = ids([1] * 5, [0, 0, 0, 1, 1])
    out = model.generate(batch, attention_mask=mask, max_new_tokens=10, eos_token_id=-1)
    alone = [model.generate(ids(p), max_new_tokens=10, eos_token_id=-1)[0] for p in (p1, p2)]
    torch.testing.assert_close(out[0], alone[0])
    torch.testing.assert_close(out[1, 3:], alone[1])


def test_generation_stops_at_eos_and_pads_finished_rows(model):
    x = ids([5, 17, 33, 8], [9, 12, 40, 3])
    free = model.generate(x, max_new_tokens=8, eos_token_id=-1)
    eos = int(free[0, 6])  # the row-0 token of step 3 plays eos
    streamed = []
    out = model.generate(x, max_new_tokens=8, eos_token_id=eos, pad_token_id=PAD,
                         streamer=streamed.append)
    for row in range(2):
        new = free[row, 4:].tolist()
        stop = new.index(eos) + 1 if eos in new else len(new)
        want = new[:stop] + [PAD] * (out.shape[1] - 4 - stop)
        assert out[row, 4:].tolist() == want
    assert torch.stack(streamed, dim=1).tolist() == out[:, 4:].tolist()


def test_sampling_with_top_k_1_or_tiny_top_p_is_greedy(model):
    x = ids([5, 17, 33, 8])
    greedy = model.generate(x, max_new_tokens=6, eos_token_id=-1)
    for kw in ({"top_k": 1}, {"top_p": 1e-6}):
        got = model.generate(x, max_new_tokens=6, temperature=0.7, eos_token_id=-1, **kw)
        torch.testing.assert_close(got, greedy)
    sampled = [model.generate(x, max_new_tokens=6, temperature=5.0, eos_token_id=-1)
               for _ in range(3)]
    assert any(not torch.equal(s, greedy) for s in sampled)  # control: sampling really samples


def rope_inv_freq(config):
    inv_freq, scale = rope_frequencies(rope_dict(config), config.head_dim,
                                       config.max_position_embeddings)
    assert scale == 1.0  # linear and llama3 leave cos and sin unscaled
    return inv_freq


def test_rope_linear_and_llama3_scaling_follow_the_formula():
    base = rope_inv_freq(tiny_config())
    hd = 16
    torch.testing.assert_close(base, torch.tensor([10000.0 ** (-i / hd) for i in range(0, hd, 2)]))
    linear = rope_inv_freq(tiny_config(rope_scaling={"type": "linear", "factor": 4.0}))
    torch.testing.assert_close(linear, base / 4.0, rtol=0, atol=0)
    s = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 64}
    llama3 = rope_inv_freq(tiny_config(rope_scaling=s))
    for got, f in zip(llama3.tolist(), base.tolist()):
        wavelen = 2 * math.pi / f
        if wavelen < 64 / 4.0:
            want = f  # high frequency: kept
        elif wavelen > 64 / 1.0:
            want = f / 8.0  # low frequency: interpolated by the factor
        else:
            smooth = (64 / wavelen - 1.0) / (4.0 - 1.0)
            want = (1 - smooth) * f / 8.0 + smooth * f
        assert got == pytest.approx(want, rel=1e-6)
    assert (llama3 == base).any() and (llama3 == base / 8).any() and (llama3 != base).any()


def test_init_follows_initializer_range_and_zeroes_the_padding_row():
    from nanosft.families.auto import config_from_dict, from_config

    config = tiny_config(vocab_size=256, initializer_range=0.05).to_dict()
    m = from_config(config_from_dict({**config, "model_type": "qwen2"}))
    emb = m.model.embed_tokens.weight
    assert torch.all(emb[PAD] == 0) and emb[1:].std().item() == pytest.approx(0.05, rel=0.05)
    attn = m.model.layers[0].self_attn
    # qwen2: q/k/v bias, none on o_proj
    assert torch.all(attn.q_proj.bias == 0) and attn.o_proj.bias is None
    assert torch.all(m.model.layers[1].post_attention_layernorm.weight == 1)


def test_save_load_round_trip_is_exact(tmp_path, model):
    model.save_pretrained(tmp_path)
    loaded = CausalLM.from_pretrained(tmp_path).eval()
    assert sorted(os.listdir(tmp_path)) == ["config.json", "generation_config.json",
                                            "model.safetensors"]
    for k, v in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[k], v, rtol=0, atol=0)
    # trainable
    assert all(isinstance(p, torch.nn.Parameter) and p.requires_grad for p in loaded.parameters())
    x = torch.randint(3, 96, (1, 8))
    torch.testing.assert_close(loaded(x).logits, model(x).logits, rtol=0, atol=0)


def test_sharded_save_writes_an_index_and_loads_back(tmp_path, model):
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and set(index["weight_map"]) == set(model.state_dict())
    assert not (tmp_path / "model.safetensors").exists()
    loaded = CausalLM.from_pretrained(tmp_path)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[k], v, rtol=0, atol=0)
    model.save_pretrained(tmp_path)  # back to one file: stale shards must not remain beside it
    assert sorted(os.listdir(tmp_path)) == ["config.json", "generation_config.json",
                                            "model.safetensors"]


def test_tied_embeddings_save_without_lm_head_and_stay_tied(tmp_path):
    from safetensors.torch import load_file

    m = CausalLM(tiny_config(tie_word_embeddings=True))
    assert m.lm_head.weight is m.model.embed_tokens.weight
    m.save_pretrained(tmp_path)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    loaded = CausalLM.from_pretrained(tmp_path)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    torch.testing.assert_close(loaded.lm_head.weight, m.model.embed_tokens.weight, rtol=0, atol=0)


def test_dtype_choice_and_config_spellings(tmp_path, model):
    model.to(torch.bfloat16).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["architectures"] == ["LlamaForCausalLM"]
    assert config["rope_parameters"] == {"rope_theta": 10000.0, "rope_type": "default"}
    # None -> float32
    assert CausalLM.from_pretrained(tmp_path).lm_head.weight.dtype == torch.float32
    assert CausalLM.from_pretrained(tmp_path, dtype="auto").lm_head.weight.dtype == torch.bfloat16
    del config["dtype"], config["rope_parameters"]
    old = ModelConfig.from_dict({**config, "rope_theta": 5e5, "torch_dtype": "float16",
                                 "rope_scaling": {"type": "linear", "factor": 2.0}})
    linear = {"rope_type": "linear", "factor": 2.0}
    assert (old.rope_theta, old.dtype, old.rope_scaling) == (5e5, "float16", linear)
    assert ModelConfig.from_dict(old.to_dict()) == old


def test_gradient_checkpointing_gives_the_same_gradients(model):
    x = torch.randint(3, 96, (2, 8))
    model.train()
    model(x, labels=x).loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.gradient_checkpointing_enable()
    assert model.is_gradient_checkpointing
    model(x, labels=x).loss.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-5, atol=1e-7)


def test_enable_input_require_grads_lets_a_frozen_embedding_feed_a_graph(model):
    model.requires_grad_(False)
    assert not model.get_input_embeddings()(ids([1, 2])).requires_grad
    model.enable_input_require_grads()
    assert model.get_input_embeddings()(ids([1, 2])).requires_grad
    assert model.num_parameters(only_trainable=True) == 0 and model.num_parameters() > 0


# ----- errors: the message must name the culprit -------------------------------------------------


def test_missing_files_are_named(tmp_path, model):
    with pytest.raises(FileNotFoundError, match="config.json"):
        CausalLM.from_pretrained(tmp_path)
    model.save_pretrained(tmp_path)
    os.remove(tmp_path / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        CausalLM.from_pretrained(tmp_path)


@pytest.mark.parametrize("field, value, culprit", [
    ("model_type", "gpt2", "model_type"),
    ("sliding_window", 4096, "sliding_window"),  # loads as nanosft.families.mistral's
    ("rope_parameters", {"rope_type": "ntk_by_parts", "factor": 2.0, "rope_theta": 1e4},
     "ntk_by_parts"),  # no such rope_type in transformers 5.23
    ("rope_parameters", {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4},
     "low_freq_factor"),
    ("hidden_act", "gelu", "hidden_act"),
    ("num_key_value_heads", 3, "num_key_value_heads"),
])
def test_unsupported_config_values_are_refused(field, value, culprit):
    base = tiny_config(model_type="mistral").to_dict()
    with pytest.raises(ValueError, match=culprit):
        ModelConfig.from_dict({**base, field: value})


def test_key_and_shape_mismatches_are_listed(tmp_path, model):
    from safetensors.torch import save_file

    model.save_pretrained(tmp_path)
    sd = model.state_dict()
    sd["model.layers.0.mlp.extra.weight"] = sd.pop("model.layers.1.mlp.up_proj.weight")
    save_file(sd, tmp_path / "model.safetensors")
    missing_then_unexpected = r"layers\.1\.mlp\.up_proj\.weight.*model\.layers\.0\.mlp\.extra"
    with pytest.raises(ValueError, match=missing_then_unexpected):
        CausalLM.from_pretrained(tmp_path)
    sd = model.state_dict()
    sd["model.norm.weight"] = torch.ones(32)
    save_file(sd, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*\(32,\).*\(64,\)"):
        CausalLM.from_pretrained(tmp_path)


def test_corrupt_safetensors_header_and_bad_shard_size(tmp_path, model):
    model.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\":")
    with pytest.raises(ValueError, match="model.safetensors.*cannot read"):
        CausalLM.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="max_shard_size"):
        model.save_pretrained(tmp_path, max_shard_size="lots")


def _bf16_ulp(t):
    # the spacing of bf16 values at |t|: 2^(exponent - 7), as tests/test_lora.py
    return torch.ldexp(torch.ones_like(t, dtype=torch.float32),
                       torch.frexp(t.float().abs().clamp(min=1e-30)).exponent - 8)


def _float64_sdpa(self, q, k, v, mask=None, is_causal=False):
    # softmax(q k^T) v in float64, rounded once to q's dtype: row for row the same numbers whether
    # a row sits in a padded batch or in one packed row (a kernel's blocking depends on T)
    with torch.autocast("cpu", enabled=False):
        rep = q.shape[1] // k.shape[1]
        q64, k64, v64 = q.double(), k.double().repeat_interleave(rep, 1), v.double()
        scores = (q64 @ k64.transpose(-1, -2)) * self.scaling
        T, S = scores.shape[-2:]
        if is_causal:
            mask = torch.ones(T, S, dtype=torch.bool).tril()
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return (scores.softmax(-1) @ v64.repeat_interleave(rep, 1)).to(q.dtype)


def _bf16_qlora_model():
    """TRL's bf16 QLoRA recipe on the tiny model: bf16 weights, NF4 computing in bf16, bf16
    adapters (B random, so every adapter gradient is nonzero)."""
    from nanosft.nf4 import quantize_model
    from nanosft.peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = quantize_model(CausalLM(tiny_config()).to(torch.bfloat16),
                           compute_dtype=torch.bfloat16)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    for name, p in model.named_parameters():
        if p.requires_grad:
            p.data = p.data.to(torch.bfloat16)
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.05)
    return model.train()


def test_training_under_cpu_bf16_autocast_unpads_and_equals_reference_mode(monkeypatch):
    """Under CPU bf16 autocast a right-padded training batch runs unpadded too (1.6x a bf16 QLoRA
    step at SmolLM2-135M's widths, CPU time). With one attention arithmetic for both layouts
    (float64, rounded once), the logits at real positions and the loss equal reference mode's
    (the padded batch with its mask) bit for bit: every other op works row by row. The adapter
    gradients are within 1 bf16 ulp of each value, the bound tests/test_lora.py holds torch's own
    bf16 GEMMs to: their sums over tokens see the real rows with and without pad rows between."""
    from nanosft.model import Attention
    from nanosft.reference import reference_mode

    monkeypatch.setattr(Attention, "sdpa", _float64_sdpa)
    model = _bf16_qlora_model()
    x = torch.randint(3, 96, (3, 9))
    mask = torch.tensor([[1] * 9, [1] * 5 + [0] * 4, [1] * 2 + [0] * 7])
    labels = x.masked_fill(mask == 0, -100)
    runs = {}
    for reference in (True, False):
        model.zero_grad()
        with reference_mode(reference), torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x, attention_mask=mask, labels=labels)
        out.loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        runs[reference] = out, grads
    (fast, fast_grads), (ref, ref_grads) = runs[False], runs[True]
    real = mask.bool()
    assert (fast.logits[~real] == 0).all() and not (ref.logits[~real] == 0).all()  # unpadded
    torch.testing.assert_close(fast.logits[real], ref.logits[real], rtol=0, atol=0)
    torch.testing.assert_close(fast.loss, ref.loss, rtol=0, atol=0)
    assert fast_grads.keys() == ref_grads.keys() and len(ref_grads) == 2 * 7 * 2
    for name, g in ref_grads.items():
        assert g.dtype == torch.bfloat16 and g.abs().max() > 0, name
        assert ((fast_grads[name].float() - g.float()).abs() <= _bf16_ulp(g)).all(), name


def test_bf16_attention_per_document_is_the_masked_attention_to_one_ulp():
    """The one kernel whose numbers the unpadded layout changes: torch's bf16 SDPA over each
    document (is_causal) against the padded batch under its dense mask, real positions within
    1 bf16 ulp of each value (the kernel blocks by T); in fp32 within 1e-6."""
    from nanosft.masking import build_attention_mask
    from nanosft.model import Attention

    attn = Attention(tiny_config())
    lengths = [37, 20, 9]
    pad = torch.tensor([[1] * n + [0] * (37 - n) for n in lengths])
    dense_mask = build_attention_mask(pad, torch.arange(37)[None], 37, 0)
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        q, k, v = (torch.randn(3, h, 37, 16, generator=g).to(dtype) for h in (4, 2, 2))
        dense = attn.sdpa(q, k, v, dense_mask)
        for i, n in enumerate(lengths):
            doc = attn.sdpa(q[i:i + 1, :, :n], k[i:i + 1, :, :n], v[i:i + 1, :, :n],
                            is_causal=True)
            want = dense[i:i + 1, :, :n]
            if dtype == torch.bfloat16:
                assert ((doc.float() - want.float()).abs() <= _bf16_ulp(want)).all()
            else:
                torch.testing.assert_close(doc, want, rtol=1e-6, atol=1e-6)

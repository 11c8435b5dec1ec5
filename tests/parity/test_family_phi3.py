"""Parity of nanosft.families.phi3 with transformers 5.23 / peft 0.21.2: Phi-3 / Phi-4-mini.

Two tiny random models built by transformers' Phi3Config (fp32, norms randomized): "partial" has
partial_rotary_factor 0.5, default RoPE and a 5-token sliding window; "longrope" has Phi-4-mini's
0.75 with LongRoPE short/long factors and original_max_position_embeddings 12, so the 16-token
batches take the long factors and the 12-token ones (and the packed row, positions < 7) the short.
Compared: logits within 1e-5 both load directions (plain, left-padded, packed with position_ids);
greedy generation with the KV cache token for token, and each step's logits within 1e-5 where the
longrope run crosses 12 and transformers re-encodes the cache (a transformers streamer gets the
same puts and one end across it); quantize-while-loading bitwise equal
to load-then-quantize and to transformers + bitsandbytes;
target_modules="all-linear" naming peft's modules (qkv_proj, o_proj, gate_up_proj, down_proj); a
LoRA on the fused qkv_proj / gate_up_proj trained 3 steps by one library loading in the other.
Negative controls: short factors past 12, and a cache kept past 12, change the logits.
Hermetic: tmp folders, no downloads; `-s` prints the largest differences.
Run: python -m pytest -q -s tests/parity/test_family_phi3.py
"""

import peft
import pytest
import torch
import transformers
from test_families import (BASE, PAD, TOL, V, assert_adapters_move_both_ways,
                           assert_quantize_while_loading_matches, left_padded_batch,
                           models_both_ways, packed_row, save_random)
from test_generate_parity import Recorder

from nanosft import generation
from nanosft.families.auto import AutoModelForCausalLM
from nanosft.peft import LoraConfig, get_peft_model

OLD_LEN = 12  # original_max_position_embeddings of the longrope model


def longrope(n):
    g = torch.Generator().manual_seed(2)
    return {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "short_factor": (1 + torch.rand(n, generator=g)).tolist(),
            "long_factor": (1 + 4 * torch.rand(n, generator=g)).tolist()}


CONFIGS = {  # head_dim 16: "partial" turns 8 dims of each head, "longrope" 12 (6 frequencies)
    "partial": {"partial_rotary_factor": 0.5, "sliding_window": 5},
    "longrope": {"max_position_embeddings": 64, "original_max_position_embeddings": OLD_LEN,
                 "rope_parameters": longrope(6)},
}


def hf_folder(name, tmp_path):
    """A random transformers Phi-3 model, saved to tmp_path / "hf"."""
    return save_random(transformers.Phi3Config(**{**BASE, **CONFIGS[name]}), tmp_path)


def both_ways(name, tmp_path):
    return models_both_ways(*hf_folder(name, tmp_path), tmp_path)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers_both_ways(name, tmp_path):
    x = torch.randint(3, V, (2, 16))  # 16 > OLD_LEN: longrope's long factors
    padded, mask = left_padded_batch()  # 12 == OLD_LEN: short factors
    packed, pos = packed_row()
    worst = 0.0
    for hf, ours in both_ways(name, tmp_path):
        with torch.no_grad():
            pairs = [(hf(x).logits, ours(x).logits), (hf(x[:, :9]).logits, ours(x[:, :9]).logits)]
            real = mask.bool()  # padded queries are never read
            pairs.append((hf(padded, attention_mask=mask).logits[real],
                          ours(padded, attention_mask=mask).logits[real]))
            pairs.append((hf(packed, position_ids=pos, use_cache=False).logits,
                          ours(packed, position_ids=pos).logits))
        ours.train()  # nanosft's unpadded speed path
        pairs.append((pairs[-1][0], ours(packed, position_ids=pos).logits.detach()))
        ours.eval()
        for want, got in pairs:
            torch.testing.assert_close(got, want, **TOL)
            worst = max(worst, (got - want).abs().max().item())
    print(f"\n[phi3-{name}] max |logit diff| = {worst:.3e}")


def test_negative_control_long_factors_change_the_logits(tmp_path):
    hf, folder = hf_folder("longrope", tmp_path)
    ours = AutoModelForCausalLM.from_pretrained(folder).eval()
    x = torch.randint(3, V, (1, 16))
    rope = ours.config.rope_scaling
    with torch.no_grad():
        want = hf(x).logits
        rope["long_factor"] = rope["short_factor"]  # the bug: short factors past OLD_LEN
        diff = (ours(x).logits - want).abs().max().item()
    assert diff > 1e-3


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_generation_is_token_identical(name, tmp_path):
    hf, folder = hf_folder(name, tmp_path)
    ours = AutoModelForCausalLM.from_pretrained(folder).eval()
    prompt = torch.randint(3, V, (1, 8))  # 8 + 20 crosses OLD_LEN
    want = hf.generate(prompt, do_sample=False, max_new_tokens=20, pad_token_id=PAD)
    assert ours.generate(prompt, max_new_tokens=20).tolist() == want.tolist()
    streams = [Recorder(), Recorder()]  # a transformers streamer across the re-encoding
    hf.generate(prompt, do_sample=False, max_new_tokens=20, pad_token_id=PAD,
                streamer=streams[0])
    ours.generate(prompt, do_sample=False, max_new_tokens=20, streamer=streams[1])
    assert (streams[1].puts, streams[1].ended) == (streams[0].puts, streams[0].ended)
    padded, mask = left_padded_batch()
    want = hf.generate(padded, attention_mask=mask, do_sample=False, max_new_tokens=10,
                       pad_token_id=PAD)
    assert ours.generate(padded, attention_mask=mask, max_new_tokens=10).tolist() == want.tolist()


def step_logits(model, run):
    """run()'s ids and the last-position logits of each of its forwards, (B, steps, V)."""
    seen = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: seen.append(out[:, -1]))
    ids = run()
    hook.remove()
    return ids, torch.stack(seen, 1)


def test_longrope_generation_re_encodes_the_cache_past_the_original_length(tmp_path):
    hf, folder = hf_folder("longrope", tmp_path)
    ours = AutoModelForCausalLM.from_pretrained(folder).eval()
    prompt = torch.randint(3, V, (1, 8))
    out = hf.generate(prompt, do_sample=False, max_new_tokens=10, pad_token_id=PAD,
                      output_logits=True, return_dict_in_generate=True)
    want = torch.stack(out.logits, 1)
    ids, got = step_logits(ours, lambda: ours.generate(prompt, max_new_tokens=10))
    assert ids.tolist() == out.sequences.tolist()
    torch.testing.assert_close(got, want, **TOL)
    # negative control: keeping the short-factor cache past OLD_LEN (no re-encoding)
    _, kept = step_logits(ours, lambda: generation.generate(ours, prompt, max_new_tokens=10))
    crossing = OLD_LEN + 1 - prompt.shape[1]  # the step that sees OLD_LEN + 1 ids
    assert (kept - want)[:, :crossing].abs().max() < 1e-5
    assert (kept - want)[:, crossing:].abs().max() > 1e-4
    print(f"\n[phi3] generation step-logit max diff = {(got - want).abs().max().item():.3e}")


def test_quantize_while_loading_is_bitwise_load_then_quantize_and_transformers(tmp_path):
    _, folder = hf_folder("longrope", tmp_path)
    ours = assert_quantize_while_loading_matches(folder, torch.randint(3, V, (2, 16)))
    assert any("qkv_proj.weight.absmax" in k for k in ours)  # the fused linears are 4-bit too


def test_all_linear_targets_the_modules_peft_targets(tmp_path):
    hf, folder = hf_folder("partial", tmp_path)
    config = {"r": 2, "lora_alpha": 4, "target_modules": "all-linear"}
    ref = peft.get_peft_model(hf, peft.LoraConfig(task_type="CAUSAL_LM", **config))
    got = get_peft_model(AutoModelForCausalLM.from_pretrained(folder), LoraConfig(**config))
    names = [n for n, _ in got.named_parameters() if "lora_" in n]
    assert names == [n for n, _ in ref.named_parameters() if "lora_" in n]
    assert {n.split(".")[-4] for n in names} == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}


def test_trained_lora_adapters_on_fused_projections_move_both_ways(tmp_path):
    hf, folder = hf_folder("longrope", tmp_path)
    x = torch.randint(3, V, (2, 16))
    assert_adapters_move_both_ways(hf, folder, tmp_path, x, ["qkv_proj", "gate_up_proj"], "phi3")

"""Parity of nanosft.families.moe and qwen3_moe with transformers 5.23: Qwen3-MoE.

Tiny random models built by transformers' Qwen3MoeConfig (fp32, 2 layers, hidden 64, 4 experts,
top 2; norms randomized): "topk-norm" renormalises the top-k weights, every layer sparse; "window"
keeps the raw softmax weights, a 5-token window on every layer and layer 0 dense
(decoder_sparse_step 2). Compared: logits within 1e-5 both load directions (plain, left-padded,
packed with position_ids, and the unpadded training forward); the auxiliary load-balancing loss
(over the left-padded batch's real tokens and over the unpadded rows) and the loss with it added,
within 1e-6, and the router weights' gradient through it; greedy generation token for token;
the checkpoint files: nanosft writes transformers' per-expert keys, and reads them into the 3-D
parameters; quantize-while-loading bitwise equal to transformers + bitsandbytes (experts and router
stay full precision in both). Negative control: dropping the renormalisation changes the logits.
Hermetic: tmp folders, no downloads; `-s` prints the largest differences.
Run: python -m pytest -q -s tests/parity/test_family_moe.py
"""

import pytest
import torch
import transformers
from safetensors import safe_open
from test_families import (BASE, PAD, TOL, V, assert_quantize_while_loading_matches,
                           left_padded_batch, models_both_ways, packed_row, save_random)

from nanosft.families.moe import load_balancing_loss
from nanosft.model import CausalLM

MOE = {"head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
CONFIGS = {
    "topk-norm": {**MOE, "norm_topk_prob": True},
    "window": {**MOE, "use_sliding_window": True, "sliding_window": 5, "decoder_sparse_step": 2},
}


def hf_folder(name, tmp_path):
    """A random transformers Qwen3-MoE model, saved to tmp_path / "hf"."""
    return save_random(transformers.Qwen3MoeConfig(**{**BASE, **CONFIGS[name]}), tmp_path)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_and_aux_loss_match_transformers_both_ways(name, tmp_path):
    x = torch.randint(3, V, (2, 16))
    padded, mask = left_padded_batch()
    packed, pos = packed_row()
    right = (torch.arange(16) < 11).long().expand(2, 16)
    labels = x.masked_fill(right == 0, -100)  # the unpadded path scores real tokens only
    worst = aux_worst = 0.0
    for hf, ours in models_both_ways(*hf_folder(name, tmp_path), tmp_path):
        with torch.no_grad():
            pairs = [(hf(x).logits, ours(x).logits)]
            real = mask.bool()
            pairs.append((hf(padded, attention_mask=mask).logits[real],
                          ours(padded, attention_mask=mask).logits[real]))
            pairs.append((hf(packed, position_ids=pos, use_cache=False).logits,
                          ours(packed, position_ids=pos).logits))
            labelled = padded.masked_fill(mask == 0, -100)
            labelled[:, 1:][mask[:, :-1] == 0] = -100  # a padded query's prediction: not read
            want = hf(padded, attention_mask=mask, labels=labelled, output_router_logits=True)
            got = ours(padded, attention_mask=mask, labels=labelled, output_router_logits=True)
            aux = [(want.aux_loss, got.aux_loss), (want.loss, got.loss)]
            want_right = hf(x, attention_mask=right, labels=labels, output_router_logits=True)
        ours.train()  # nanosft's unpadded speed path: the routers see the real tokens only
        got_right = ours(x, attention_mask=right, labels=labels, output_router_logits=True)
        pairs.append((want_right.logits[right.bool()], got_right.logits[right.bool()].detach()))
        aux += [(want_right.aux_loss, got_right.aux_loss.detach()),
                (want_right.loss, got_right.loss.detach())]
        ours.eval()
        for want, got in pairs:
            torch.testing.assert_close(got, want, **TOL)
            worst = max(worst, (got - want).abs().max().item())
        for want, got in aux:
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
            aux_worst = max(aux_worst, (got - want).abs().item())
    print(f"\n[qwen3_moe-{name}] max |logit diff| = {worst:.3e}, aux loss {aux_worst:.3e}")


def test_aux_loss_gradient_reaches_the_router_as_in_transformers(tmp_path):
    hf, folder = hf_folder("topk-norm", tmp_path)
    ours = CausalLM.from_pretrained(folder)
    padded, mask = left_padded_batch()
    for model in (hf, ours):
        model.zero_grad()
        model(padded, attention_mask=mask, output_router_logits=True).aux_loss.backward()
    for i in range(2):
        want = hf.model.layers[i].mlp.gate.weight.grad
        torch.testing.assert_close(ours.model.layers[i].mlp.gate.weight.grad, want, rtol=0,
                                   atol=1e-7)
        assert want.abs().max() > 1e-4


def test_load_balancing_loss_equals_the_formula():
    """E * sum_e f_e P_e by hand on two layers of 3 tokens: the real tokens only."""
    g = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(3, 4, generator=g) for _ in range(2))
    mask = torch.tensor([[1, 1, 0]])
    f = torch.zeros(4)
    P = torch.zeros(4)
    for layer in logits:
        p = layer[:2].softmax(-1)
        f += torch.nn.functional.one_hot(p.topk(2).indices, 4).sum((0, 1))
        P += p.sum(0)
    want = 4 * ((f / 4) * (P / 4)).sum()
    torch.testing.assert_close(load_balancing_loss(logits, 4, 2, mask), want)


def test_greedy_generation_is_token_identical(tmp_path):
    hf, folder = hf_folder("window", tmp_path)  # a dense and a sparse layer, the cache > window
    ours = CausalLM.from_pretrained(folder).eval()
    prompt = torch.randint(3, V, (1, 8))
    want = hf.generate(prompt, do_sample=False, max_new_tokens=12, pad_token_id=PAD)
    assert ours.generate(prompt, max_new_tokens=12).tolist() == want.tolist()
    padded, mask = left_padded_batch()
    want = hf.generate(padded, attention_mask=mask, do_sample=False, max_new_tokens=12,
                       pad_token_id=PAD)
    assert ours.generate(padded, attention_mask=mask, max_new_tokens=12).tolist() == want.tolist()


def test_negative_control_unnormalised_top_k_changes_the_logits(tmp_path):
    hf, folder = hf_folder("topk-norm", tmp_path)
    ours = CausalLM.from_pretrained(folder).eval()
    x = torch.randint(3, V, (1, 12))
    for layer in ours.model.layers:
        layer.mlp.gate.norm_topk_prob = False  # the bug: the k weights do not sum to 1
    with torch.no_grad():
        assert (ours(x).logits - hf(x).logits).abs().max() > 1e-3


def test_checkpoint_files_hold_transformers_per_expert_keys(tmp_path):
    hf, folder = hf_folder("window", tmp_path)
    ours = CausalLM.from_pretrained(folder)
    assert ours.model.layers[1].mlp.experts.gate_up_proj.shape == (4, 64, 64)  # (E, 2 I, C)
    ours.save_pretrained(tmp_path / "ours")
    files = []
    for folder_ in (folder, tmp_path / "ours"):
        with safe_open(str(folder_ / "model.safetensors"), "pt") as f:
            files.append({k: f.get_tensor(k) for k in f.keys()})
    assert sorted(files[0]) == sorted(files[1])
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in files[1]
    for key, tensor in files[0].items():
        assert torch.equal(files[1][key], tensor), key


def test_quantize_while_loading_is_bitwise_transformers(tmp_path):
    _, folder = hf_folder("topk-norm", tmp_path)
    ours = assert_quantize_while_loading_matches(folder, torch.randint(3, V, (2, 9)))
    assert ours["model.layers.0.mlp.experts.gate_up_proj"].dtype == torch.float32
    assert any("q_proj.weight.absmax" in k for k in ours)

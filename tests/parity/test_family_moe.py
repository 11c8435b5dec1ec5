"""Parity of nanosft.families.moe, qwen3_moe, glm4_moe, gpt_oss and expert_lora with transformers
5.23 and peft 0.21.2: Qwen3-MoE, GLM-4-MoE and gpt-oss.

Tiny random models built by transformers' Qwen3MoeConfig (fp32, 2 layers, hidden 64, 4 experts,
top 2; norms randomized): "topk-norm" renormalises the top-k weights, every layer sparse; "window"
keeps the raw softmax weights, a 5-token window on every layer and layer 0 dense
(decoder_sparse_step 2). Compared: logits within 1e-5 both load directions (plain, left-padded,
packed with position_ids, and the unpadded training forward); the auxiliary load-balancing loss
(over the left-padded batch's real tokens and over the unpadded rows) and the loss with it added,
within 1e-6, and the router weights' gradient through it; greedy generation token for token;
the checkpoint files: nanosft writes transformers' per-expert keys, and reads them into the 3-D
parameters; quantize-while-loading bitwise equal to transformers + bitsandbytes (experts and router
stay full precision in both). LoRA on the experts (peft 0.21's target_parameters, which peft turns
"all-linear" into for this model type): the same parameter names, shapes, saved config (rank and
alpha doubled on the fused gate_up_proj), logits and gradients as peft; adapters trained by one
library load in the other, merge_and_unload keeps the logits; rank_pattern / alpha_pattern on
modules as peft. Negative controls: dropping the renormalisation, and disabling the expert
adapters, change the logits. GLM-4-MoE (sigmoid router whose correction bias picks the experts
within the best of 2 groups, routed_scaling_factor 2.5, shared experts, a dense first layer,
partial RoPE, q/k norms): logits both ways, generation, NF4 load bitwise, all-linear LoRA as peft;
loaded in bf16 or fp16, the correction bias stays fp32 with transformers' bits and the bf16 logits
equal transformers' (eager experts) bit for bit; negative control: the bias read through bf16
flips a token's expert group.
gpt-oss (attention sinks, sliding and full layers, YaRN, biased router, transposed interleaved
experts with the clamped SwiGLU): logits both ways, aux loss, generation, LoRA on the transposed
experts as peft, NF4 load bitwise; negative controls: without sinks, without the clamp.
Hermetic: tmp folders, no downloads; `-s` prints the largest differences.
Run: python -m pytest -q -s tests/parity/test_family_moe.py
"""

import json

import peft
import pytest
import torch
import transformers
from safetensors import safe_open
from test_families import (BASE, PAD, TOL, V, assert_adapters_move_both_ways,
                           assert_quantize_while_loading_matches, left_padded_batch,
                           models_both_ways, packed_row, save_random)

from nanosft.families.auto import AutoModelForCausalLM
from nanosft.families.glm4_moe import Glm4MoeForCausalLM
from nanosft.families.moe import load_balancing_loss
from nanosft.peft import LoraConfig, PeftModelForCausalLM, get_peft_model

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
    """The aux loss's gradient on each router weight, also with gradient checkpointing."""
    hf, folder = hf_folder("topk-norm", tmp_path)
    ours = AutoModelForCausalLM.from_pretrained(folder)
    padded, mask = left_padded_batch()
    for model in (hf, ours):
        model.zero_grad()
        model(padded, attention_mask=mask, output_router_logits=True).aux_loss.backward()
    for i in range(2):
        want = hf.model.layers[i].mlp.gate.weight.grad
        torch.testing.assert_close(ours.model.layers[i].mlp.gate.weight.grad, want, rtol=0,
                                   atol=1e-7)
        assert want.abs().max() > 1e-4
    # checkpointed layers: the same gradient, and the recompute in backward keeps no logits
    want = [layer.mlp.gate.weight.grad.clone() for layer in ours.model.layers]
    ours.zero_grad()
    ours.gradient_checkpointing_enable()
    ours.train()(padded, attention_mask=mask, output_router_logits=True).aux_loss.backward()
    for layer, w in zip(ours.model.layers, want):
        torch.testing.assert_close(layer.mlp.gate.weight.grad, w, rtol=0, atol=1e-7)
        assert layer.mlp.router_logits is None


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
    ours = AutoModelForCausalLM.from_pretrained(folder).eval()
    padded, mask = left_padded_batch()
    want = hf.generate(padded, attention_mask=mask, do_sample=False, max_new_tokens=8,
                       pad_token_id=PAD)
    assert ours.generate(padded, attention_mask=mask, max_new_tokens=8).tolist() == want.tolist()


def test_negative_control_unnormalised_top_k_changes_the_logits(tmp_path):
    hf, folder = hf_folder("topk-norm", tmp_path)
    ours = AutoModelForCausalLM.from_pretrained(folder).eval()
    x = torch.randint(3, V, (1, 12))
    for layer in ours.model.layers:
        layer.mlp.gate.norm_topk_prob = False  # the bug: the k weights do not sum to 1
    with torch.no_grad():
        assert (ours(x).logits - hf(x).logits).abs().max() > 1e-3


def test_checkpoint_files_hold_transformers_per_expert_keys(tmp_path):
    hf, folder = hf_folder("window", tmp_path)
    ours = AutoModelForCausalLM.from_pretrained(folder)
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


def random_adapters(ref, ours):
    """The same random LoRA weights (B non-zero) in peft's model and nanosft's."""
    g = torch.Generator().manual_seed(0)
    theirs = dict(ref.named_parameters())
    with torch.no_grad():
        for n, p in ours.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
                theirs[n].copy_(p)


def assert_lora_matches_peft(ref, ours, label):
    """With the same random adapters in peft's model `ref` and nanosft's `ours`: logits within
    TOL and every LoRA gradient of the loss within 1e-7. Returns the logit and gradient maxima."""
    random_adapters(ref, ours)
    x = torch.randint(3, V, (2, 12))
    a, b = ref(x, labels=x), ours(x, labels=x)
    torch.testing.assert_close(b.logits, a.logits, **TOL)
    a.loss.backward()
    b.loss.backward()
    theirs = dict(ref.named_parameters())
    worst = 0.0
    for n, p in ours.named_parameters():
        if "lora_" in n:
            torch.testing.assert_close(p.grad, theirs[n].grad, rtol=0, atol=1e-7, msg=n)
            worst = max(worst, (p.grad - theirs[n].grad).abs().max().item())
    logits = (b.logits - a.logits).abs().max().item()
    print(f"\n[{label}] LoRA logits {logits:.2e}, gradients {worst:.2e}")
    return logits, worst


def test_all_linear_lora_on_experts_and_router_equals_peft(tmp_path):
    """peft 0.21 turns "all-linear" on Qwen3-MoE into LoRA on the attention linears plus
    target_parameters on gate_up_proj (rank and alpha doubled: gate and up fused), down_proj and
    the router's gate.weight (nested ParamWrappers): the same names, shapes, saved config, logits
    and every LoRA gradient."""
    hf, folder = hf_folder("topk-norm", tmp_path)
    config = {"r": 2, "lora_alpha": 4, "target_modules": "all-linear"}
    ref = peft.get_peft_model(hf, peft.LoraConfig(task_type="CAUSAL_LM", **config))
    ours = get_peft_model(AutoModelForCausalLM.from_pretrained(folder), LoraConfig(**config))
    shapes = [[(n, p.shape) for n, p in m.named_parameters() if "lora_" in n] for m in (ref, ours)]
    assert shapes[0] == shapes[1]
    assert ("base_model.model.model.layers.1.mlp.experts.base_layer.lora_A.default.weight",
            (4 * 4, 64)) in shapes[1]  # gate_up_proj: rank 2 r per expert, 4 experts, in C
    want, got = ref.peft_config["default"], ours.active_peft_config
    assert sorted(want.target_parameters) == got.target_parameters == [
        "down_proj", "gate.weight", "gate_up_proj"]
    assert sorted(want.target_modules) == got.target_modules
    assert (want.rank_pattern, want.alpha_pattern) == (got.rank_pattern, got.alpha_pattern)
    assert_lora_matches_peft(ref, ours, "qwen3_moe experts")


def test_expert_adapters_move_both_ways_and_merge(tmp_path):
    hf, folder = hf_folder("topk-norm", tmp_path)
    x = torch.randint(3, V, (2, 12))
    assert_adapters_move_both_ways(hf, folder, tmp_path, x, "all-linear", "qwen3_moe experts")
    ours = PeftModelForCausalLM.from_pretrained(AutoModelForCausalLM.from_pretrained(folder),
                                                tmp_path / "peft_adapter")
    with torch.no_grad():
        want = ours(x).logits
        with ours.disable_adapter():  # negative control: the expert adapters change the logits
            assert (ours(x).logits - want).abs().max() > 1e-4
        merged = ours.merge_and_unload()
        assert type(merged.model.layers[0].mlp.experts).__name__ == "Experts"
        torch.testing.assert_close(merged(x).logits, want, **TOL)


def test_rank_and_alpha_patterns_apply_to_modules_as_in_peft(tmp_path):
    hf, folder = hf_folder("window", tmp_path)
    config = {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"],
              "rank_pattern": {"q_proj": 4}, "alpha_pattern": {r"layers\.1\.self_attn\.v_proj": 16}}
    ref = peft.get_peft_model(hf, peft.LoraConfig(task_type="CAUSAL_LM", **config))
    ours = get_peft_model(AutoModelForCausalLM.from_pretrained(folder), LoraConfig(**config))
    shapes = [[(n, p.shape) for n, p in m.named_parameters() if "lora_" in n] for m in (ref, ours)]
    assert shapes[0] == shapes[1]
    scalings = [{n: m.scaling["default"] for n, m in model.named_modules() if hasattr(m, "lora_A")}
                for model in (ref, ours)]
    assert scalings[0] == scalings[1] and 8.0 in scalings[1].values()


GLM = {**BASE, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
       "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5, "use_qk_norm": True,
       "attention_bias": True}  # layer 0 dense (first_k_dense_replace 1), layer 1 MoE


def glm_folder(tmp_path):
    """A random GLM-4-MoE with a non-zero correction bias (it decides the choice)."""
    hf, folder = save_random(transformers.Glm4MoeConfig(**GLM), tmp_path)
    with torch.no_grad():
        hf.model.layers[1].mlp.gate.e_score_correction_bias.copy_(torch.tensor([.5, -.5, 0, .2]))
    hf.save_pretrained(folder)
    return hf, folder


def test_glm4_moe_logits_generation_and_quantized_load_match_transformers(tmp_path):
    """Sigmoid router with correction bias inside 1 of 2 groups, routed_scaling_factor 2.5,
    shared experts, a dense first layer, partial RoPE, q/k norms: logits both ways (plain,
    left-padded, packed, unpadded training forward), greedy generation, NF4 load bitwise."""
    hf, folder = glm_folder(tmp_path)
    x = torch.randint(3, V, (2, 16))
    padded, mask = left_padded_batch()
    packed, pos = packed_row()
    worst = 0.0
    for theirs, ours in models_both_ways(hf, folder, tmp_path):
        with torch.no_grad():
            pairs = [(theirs(x).logits, ours(x).logits),
                     (theirs(padded, attention_mask=mask).logits[mask.bool()],
                      ours(padded, attention_mask=mask).logits[mask.bool()]),
                     (theirs(packed, position_ids=pos, use_cache=False).logits,
                      ours(packed, position_ids=pos).logits)]
        pairs.append((pairs[-1][0], ours.train()(packed, position_ids=pos).logits.detach()))
        for want, got in pairs:
            torch.testing.assert_close(got, want, **TOL)
            worst = max(worst, (got - want).abs().max().item())
    ours = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert any(n.endswith("e_score_correction_bias") for n, _ in ours.named_buffers())
    want = hf.generate(padded, attention_mask=mask, do_sample=False, max_new_tokens=8,
                       pad_token_id=PAD)
    assert ours.generate(padded, attention_mask=mask, max_new_tokens=8).tolist() == want.tolist()
    assert_quantize_while_loading_matches(folder, torch.randint(3, V, (2, 9)))
    print(f"\n[glm4_moe] max |logit diff| = {worst:.3e}")


def test_glm4_moe_all_linear_lora_equals_peft(tmp_path):
    """peft's rewrite for glm4_moe: experts and router by target_parameters; the shared experts'
    and the dense layer's gate/up/down_proj then carry no LoRA (their names moved), as in peft."""
    hf, folder = glm_folder(tmp_path)
    config = {"r": 2, "lora_alpha": 4, "target_modules": "all-linear"}
    ref = peft.get_peft_model(hf, peft.LoraConfig(task_type="CAUSAL_LM", **config))
    ours = get_peft_model(AutoModelForCausalLM.from_pretrained(folder), LoraConfig(**config))
    names = [[n for n, _ in m.named_parameters() if "lora_" in n] for m in (ref, ours)]
    assert names[0] == names[1] and not any("shared_experts" in n for n in names[1])
    random_adapters(ref, ours)
    x = torch.randint(3, V, (2, 12))
    torch.testing.assert_close(ours(x).logits, ref(x).logits, **TOL)


def fp32_bias_flipped_by_bf16(folder, x):
    """A correction bias whose last fp32 bits decide token 0's expert group: the router's sigmoid
    scores of x under bf16 loading give the gap between group 1 (experts 2, 3) and group 0; expert
    0's bias lands just across that gap from its nearest bfloat16 value, so the fp32 bias picks
    one group and its bf16 copy the other (each by > 1e-5, far above fp32 rounding)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    seen = []
    hf.model.layers[1].mlp.gate.register_forward_hook(lambda m, i, out: seen.append(out[0]))
    with torch.no_grad():
        hf(x)
    s = seen[0][0].sigmoid()  # token 0's scores (E,), fp32
    gap = float(s[2] + s[3] - s[0] - s[1])  # group 0 wins iff its bias > gap
    for step in range(1, 2000):
        for b in (gap + step * 1e-5, gap - step * 1e-5):
            rounded = float(torch.tensor(b).bfloat16())
            if (b - gap) * (rounded - gap) < 0 and abs(rounded - gap) > 1e-5:
                return torch.tensor([b, 0.0, 0.0, 0.0])
    raise AssertionError("no bias flips the choice")


def test_glm4_moe_correction_bias_stays_fp32_under_bf16_loading(tmp_path, monkeypatch):
    """transformers keeps e_score_correction_bias in fp32 under dtype=bfloat16 or float16
    (Glm4MoePreTrainedModel._keep_in_fp32_modules_strict): so does nanosft, read from the file in
    fp32, every bit equal; bf16 logits bit for bit against transformers' eager experts (the
    per-expert loop nanosft writes; its default grouped_mm rounds bf16 differently: printed).
    Negative control: the bias read through bf16 flips token 0's group and moves its logits."""
    hf, folder = save_random(transformers.Glm4MoeConfig(**GLM), tmp_path)
    x = torch.randint(3, V, (2, 40))
    with torch.no_grad():
        hf.model.layers[1].mlp.gate.e_score_correction_bias.copy_(fp32_bias_flipped_by_bf16(
            folder, x))
    hf.save_pretrained(folder)
    key = "model.layers.1.mlp.gate.e_score_correction_bias"
    for dtype in (torch.float16, torch.bfloat16):
        ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
        ours = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
        want, got = ref.state_dict()[key], ours.state_dict()[key]
        assert want.dtype == got.dtype == torch.float32
        assert torch.equal(got, want) and torch.equal(got, hf.state_dict()[key])
        assert ours.state_dict()["model.layers.1.mlp.gate.weight"].dtype == dtype
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.bfloat16, experts_implementation="eager").eval()
    grouped = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    with torch.no_grad():
        want, got = ref(x).logits, ours.eval()(x).logits
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        grouped_diff = (grouped.eval()(x).logits - got).abs().max().item()
        monkeypatch.setattr(Glm4MoeForCausalLM, "_keep_in_fp32_modules_strict", [])
        rounded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
        assert not torch.equal(rounded.state_dict()[key], want_bias := hf.state_dict()[key])
        assert rounded.state_dict()[key].dtype == want_bias.dtype  # a buffer keeps its dtype
        assert (rounded(x).logits[0, 0] - want[0, 0]).abs().max() > 1e-2
    print(f"\n[glm4_moe] bf16 logits: {(got - want).abs().max():.1e} vs eager experts, "
          f"{grouped_diff:.2e} vs grouped_mm")


OSS = {**BASE, "head_dim": 16, "intermediate_size": 32, "num_local_experts": 4,
       "num_experts_per_tok": 2, "sliding_window": 5, "swiglu_limit": 0.05,  # the clamp bites
       "max_position_embeddings": 512,
       "rope_parameters": {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                           "truncate": False, "original_max_position_embeddings": 64,
                           "rope_theta": 150000.0}}  # layer 0 sliding, layer 1 full


def test_gpt_oss_logits_aux_loss_and_generation_match_transformers(tmp_path):
    """Attention sinks (eager), a 5-token sliding layer then a full one, YaRN RoPE, biases,
    router with a bias (softmax over the top 2 logits), transposed interleaved experts with the
    clamped SwiGLU: logits both ways (plain, left-padded, the unpadded training forward with its
    aux loss), greedy generation. A packed row is compared with transformers run on each document
    alone: transformers' gpt_oss builds its mask without position_ids, so its eager attention lets
    packed documents see each other (its flash-attention path separates them, as nanosft does)."""
    hf, folder = save_random(transformers.GptOssConfig(**OSS), tmp_path)
    x = torch.randint(3, V, (2, 16))
    padded, mask = left_padded_batch()
    packed, pos = packed_row()
    right = (torch.arange(16) < 11).long().expand(2, 16)
    labels = x.masked_fill(right == 0, -100)
    worst = aux_worst = 0.0
    for theirs, ours in models_both_ways(hf, folder, tmp_path):
        with torch.no_grad():
            alone = torch.cat([theirs(packed[:, s:e]).logits
                               for s, e in ((0, 7), (7, 13), (13, 16))], 1)
            pairs = [(theirs(x).logits, ours(x).logits),
                     (theirs(padded, attention_mask=mask).logits[mask.bool()],
                      ours(padded, attention_mask=mask).logits[mask.bool()]),
                     (alone, ours(packed, position_ids=pos).logits)]
            want = theirs(x, attention_mask=right, labels=labels, output_router_logits=True)
        got = ours.train()(x, attention_mask=right, labels=labels, output_router_logits=True)
        ours.eval()
        pairs.append((want.logits[right.bool()], got.logits[right.bool()].detach()))
        for w, g in pairs:
            torch.testing.assert_close(g, w, **TOL)
            worst = max(worst, (g - w).abs().max().item())
        for w, g in ((want.aux_loss, got.aux_loss), (want.loss, got.loss)):
            torch.testing.assert_close(g.detach(), w, rtol=0, atol=1e-6)
            aux_worst = max(aux_worst, (g - w).abs().item())
    ours = AutoModelForCausalLM.from_pretrained(folder).eval()
    want = hf.generate(padded, attention_mask=mask, do_sample=False, max_new_tokens=8,
                       pad_token_id=PAD)
    assert ours.generate(padded, attention_mask=mask, max_new_tokens=8).tolist() == want.tolist()
    with torch.no_grad():  # negative controls: no sinks, no clamp
        want = hf(x).logits
        sinks = [layer.self_attn.sinks.data.clone() for layer in ours.model.layers]
        for layer in ours.model.layers:
            layer.self_attn.sinks.fill_(-1e4)  # a sink nobody attends to: plain softmax
        assert (ours(x).logits - want).abs().max() > 1e-3
        for layer, s in zip(ours.model.layers, sinks):
            layer.self_attn.sinks.copy_(s)
            layer.mlp.experts.limit = 1e9
        assert (ours(x).logits - want).abs().max() > 1e-3
    print(f"\n[gpt_oss] max |logit diff| = {worst:.3e}, aux loss {aux_worst:.3e}")


def test_gpt_oss_lora_on_transposed_experts_equals_peft(tmp_path):
    """target_parameters on gpt-oss's (E, in, out) experts: peft does not swap in and out there;
    the same names, shapes, logits and gradients; NF4 load bitwise with transformers."""
    hf, folder = save_random(transformers.GptOssConfig(**OSS), tmp_path)
    config = {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"],
              "target_parameters": ["gate_up_proj", "down_proj"]}
    ref = peft.get_peft_model(hf, peft.LoraConfig(task_type="CAUSAL_LM", **config))
    ours = get_peft_model(AutoModelForCausalLM.from_pretrained(folder), LoraConfig(**config))
    shapes = [[(n, p.shape) for n, p in m.named_parameters() if "lora_" in n] for m in (ref, ours)]
    assert shapes[0] == shapes[1]
    assert ("base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.default.weight",
            (2 * 4, 64)) in shapes[1]  # gate_up_proj (E, C, 2 I): in = C
    assert_lora_matches_peft(ref, ours, "gpt_oss experts")
    assert_quantize_while_loading_matches(folder, torch.randint(3, V, (2, 9)))


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe"])
def test_target_parameters_alone_train_the_experts_as_peft_does(family, tmp_path):
    """LoraConfig(target_parameters=[...]) with no target_modules (TRL's gpt-oss test): peft finds
    no default target_modules for these model types, so it wraps the expert parameters alone and
    saves target_modules None; the same trainable names, shapes, logits and gradients."""
    if family == "gpt_oss":
        hf, folder = save_random(transformers.GptOssConfig(**OSS), tmp_path)
    else:
        hf, folder = hf_folder("topk-norm", tmp_path)
    config = {"r": 2, "lora_alpha": 4,
              "target_parameters": ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]}
    ref = peft.get_peft_model(hf, peft.LoraConfig(task_type="CAUSAL_LM", **config))
    ours = get_peft_model(AutoModelForCausalLM.from_pretrained(folder), LoraConfig(**config))
    trainable = [[(n, p.shape) for n, p in m.named_parameters() if p.requires_grad]
                 for m in (ref, ours)]
    assert trainable[0] == trainable[1] and trainable[1]
    assert all(".experts." in n for n, _ in trainable[1])  # no linear wrapped
    assert_lora_matches_peft(ref, ours, f"{family} target_parameters alone")
    saved = []
    for model, where in ((ref, "peft"), (ours, "ours")):
        model.save_pretrained(tmp_path / where)
        saved.append(json.loads((tmp_path / where / "adapter_config.json").read_text()))
    # gpt_oss: None kept; qwen3_moe: peft's MoE rewrite leaves an empty list
    assert saved[1]["target_modules"] == saved[0]["target_modules"]
    assert saved[1]["target_modules"] == (None if family == "gpt_oss" else [])
    back = PeftModelForCausalLM.from_pretrained(AutoModelForCausalLM.from_pretrained(folder),
                                                tmp_path / "peft")
    x = torch.randint(3, V, (1, 8))  # peft's file, read back: peft's random adapters
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, ref.eval()(x).logits, **TOL)

"""Parity of Gemma 4's MoE block (nanosft.families.gemma4_moe) with transformers 5.23, peft 0.21.2
and TRL 1.16: gemma4_text with enable_moe_block, the layout of Gemma 4 26B-A4B.

Two tiny random models built by transformers' Gemma4TextConfig (fp32; 4 experts of width 32, top
2, beside every layer's dense MLP; norms, router scale and per_expert_scale randomized): "moe",
3 layers (sliding, full, then a full layer reading layer 1's keys and values) with per-layer inputs
of 64; "moe-plain", 2 layers without per-layer inputs, values from k_proj in the full layer,
logits soft-capped at 3. Compared: logits within 1e-5 both ways on a plain, a left-padded and a
packed batch, in eval and in the unpadded training forward; the checkpoint file nanosft writes
holds transformers' keys and tensors (3-D experts, router.proj / scale / per_expert_scale, the three
extra norms); greedy generation token for token; quantize-while-loading bitwise equal to
transformers + bitsandbytes (router.proj in NF4, the 3-D experts float in both); LoRA as peft:
"all-linear" (router.proj among the linears) plus target_parameters on the 3-D experts, the same
names and shapes, logits and every LoRA gradient, and adapters trained by one library loading in
the other; QLoRA SFT per-step losses and fp32 LoRA gradients against TRL + peft + bitsandbytes
(test_family_sft's harness, with the experts' target_parameters); no auxiliary loss (transformers
computes none for Gemma 4: TRL's aux_loss_enabled is False in both); NF4 experts (quantize_experts)
against bitsandbytes' round trip of each expert's slice; a multimodal gemma4 folder (how 26B-A4B
ships) loading its MoE text model; bf16 logits bit for bit against transformers' eager experts;
gradient checkpointing giving the plain backward's gradients; config errors naming the field.
Negative controls: the router reading the MLP's normed input instead of the residual, and
per_expert_scale dropped, each move the logits. Hermetic: tmp folders, no downloads; `-s` prints
the largest differences.
Run: python -m pytest -q -s tests/parity/test_family_gemma4_moe.py
"""

import peft
import pytest
import test_family_sft
import torch
import transformers
from safetensors.torch import load_file
from test_family_moe import assert_lora_matches_peft
from test_nf4_experts import round_trip, same_lora
from test_families import (BASE, TOL, V, assert_checkpointing_keeps_gradients,
                           assert_greedy_generation_matches,
                           assert_quantize_while_loading_matches, left_padded_batch,
                           assert_adapters_move_both_ways, models_both_ways, packed_row,
                           save_random)
from tiny import one_thread  # noqa: F401 (an autouse fixture)

from nanosft.families.auto import AutoModelForCausalLM, config_from_dict
from nanosft.families.gemma4_moe import Gemma4Experts
from nanosft.families.nf4_experts import NF4Experts, dequantize_experts, quantize_experts
from nanosft.peft import LoraConfig, PeftModelForCausalLM, get_peft_model

EXPERTS = {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2,
           "moe_intermediate_size": 32}
MOE = {**BASE, **EXPERTS, "num_hidden_layers": 3, "head_dim": 16, "global_head_dim": 32,
       "sliding_window": 5, "vocab_size_per_layer_input": V, "hidden_size_per_layer_input": 64,
       "num_kv_shared_layers": 1,
       "layer_types": ["sliding_attention", "full_attention", "full_attention"]}
VARIANTS = {"moe": MOE,
            "moe-plain": {**MOE, "num_hidden_layers": 2, "hidden_size_per_layer_input": 0,
                          "num_kv_shared_layers": 0, "attention_k_eq_v": True,
                          "num_global_key_value_heads": 1, "final_logit_softcapping": 3.0,
                          "layer_types": ["sliding_attention", "full_attention"]}}
# peft leaves Gemma 4's experts out of "all-linear" (3-D parameters): named by target_parameters
LORA = {"r": 2, "lora_alpha": 4, "target_modules": "all-linear",
        "target_parameters": ["experts.gate_up_proj", "experts.down_proj"]}


def hf_folder(tmp_path, name="moe"):
    """A random transformers Gemma4ForCausalLM with the MoE block, saved to tmp_path / "hf"."""
    return save_random(transformers.Gemma4TextConfig(**VARIANTS[name]), tmp_path)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_match_transformers_both_ways(name, tmp_path):
    x = torch.randint(3, V, (2, 16))
    padded, mask = left_padded_batch()
    packed, pos = packed_row()
    right = (torch.arange(16) < 11).long().expand(2, 16)
    worst = 0.0
    for hf, ours in models_both_ways(*hf_folder(tmp_path, name), tmp_path):
        with torch.no_grad():
            pairs = [(hf(x).logits, ours(x).logits)]
            real = mask.bool()  # padded queries are never read
            pairs.append((hf(padded, attention_mask=mask).logits[real],
                          ours(padded, attention_mask=mask).logits[real]))
            want_packed = hf(packed, position_ids=pos, use_cache=False).logits
            pairs.append((want_packed, ours(packed, position_ids=pos).logits))
            want_right = hf(x, attention_mask=right).logits
        ours.train()  # a training forward: nanosft's unpadded speed path (real tokens routed)
        pairs.append((want_packed, ours(packed, position_ids=pos).logits.detach()))
        got_right = ours(x, attention_mask=right).logits.detach()
        pairs.append((want_right[right.bool()], got_right[right.bool()]))
        ours.eval()
        for want, got in pairs:
            torch.testing.assert_close(got, want, **TOL)
            worst = max(worst, (got - want).abs().max().item())
    print(f"\n[gemma4 {name}] max |logit diff| = {worst:.3e}")


def test_checkpoint_file_holds_transformers_keys_and_tensors(tmp_path):
    hf, folder = hf_folder(tmp_path)
    ours = AutoModelForCausalLM.from_pretrained(folder)
    assert ours.model.layers[0].experts.gate_up_proj.shape == (4, 64, 64)  # (E, 2 I, C)
    ours.save_pretrained(tmp_path / "ours")
    want, got = (load_file(str(f / "model.safetensors")) for f in (folder, tmp_path / "ours"))
    assert sorted(got) == sorted(want)
    assert {"model.layers.2.router.per_expert_scale", "model.layers.2.experts.down_proj",
            "model.layers.2.pre_feedforward_layernorm_2.weight"} <= set(got)
    for key, tensor in want.items():
        assert torch.equal(got[key], tensor), key


def test_negative_controls_router_input_and_per_expert_scale(tmp_path):
    """The router reads the residual before the MLP; read the MLP's normed input instead, or drop
    per_expert_scale, and the logits move."""
    hf, folder = hf_folder(tmp_path)
    x = torch.randint(3, V, (2, 16))
    with torch.no_grad():
        want = hf(x).logits
        ours = AutoModelForCausalLM.from_pretrained(folder).eval()
        torch.testing.assert_close(ours(x).logits, want, **TOL)
        for layer in ours.model.layers:  # the bug: the router sees pre_feedforward_layernorm(h)
            layer.router.forward = lambda h, f=layer.router.forward, n=(
                layer.pre_feedforward_layernorm): f(n(h))
        assert (ours(x).logits - want).abs().max() > 1e-3
        ours = AutoModelForCausalLM.from_pretrained(folder).eval()
        for layer in ours.model.layers:
            layer.router.per_expert_scale.fill_(1.0)
        assert (ours(x).logits - want).abs().max() > 1e-3


def test_greedy_generation_is_token_identical(tmp_path):
    assert_greedy_generation_matches(*hf_folder(tmp_path))


def test_quantize_while_loading_is_bitwise_transformers(tmp_path):
    _, folder = hf_folder(tmp_path)
    ours = assert_quantize_while_loading_matches(folder, torch.randint(3, V, (2, 9)))
    assert ours["model.layers.0.experts.gate_up_proj"].dtype == torch.float32
    assert "model.layers.0.router.proj.weight.absmax" in ours


def test_lora_on_router_and_experts_equals_peft(tmp_path):
    """all-linear (router.proj included) and target_parameters on the 3-D experts (nested
    ParamWrappers): the same names, shapes, logits and every LoRA gradient as peft."""
    hf, folder = hf_folder(tmp_path)
    ref = peft.get_peft_model(hf, peft.LoraConfig(task_type="CAUSAL_LM", **LORA))
    ours = get_peft_model(AutoModelForCausalLM.from_pretrained(folder), LoraConfig(**LORA))
    shapes = [[(n, p.shape) for n, p in m.named_parameters() if "lora_" in n] for m in (ref, ours)]
    assert shapes[0] == shapes[1]
    names = [n for n, _ in shapes[1]]
    assert "base_model.model.model.layers.0.router.proj.lora_A.default.weight" in names
    assert ("base_model.model.model.layers.0.experts.base_layer.lora_A.default.weight",
            (2 * 4, 64)) in shapes[1]  # gate_up_proj: rank 2 per expert, 4 experts, in C
    assert_lora_matches_peft(ref, ours, "gemma4 moe")


def test_trained_expert_adapters_move_both_ways(tmp_path):
    """An adapter (attention, MLP, router, 3-D experts) trained 3 steps by one library loads in
    the other: logits within 1e-5; merge_and_unload keeps them."""
    hf, folder = hf_folder(tmp_path)
    x = torch.randint(3, V, (2, 12))
    lora = {k: v for k, v in LORA.items() if k not in ("r", "lora_alpha")}
    assert_adapters_move_both_ways(hf, folder, tmp_path, x, label="gemma4 moe", **lora)
    ours_loads_peft = PeftModelForCausalLM.from_pretrained(
        AutoModelForCausalLM.from_pretrained(folder), tmp_path / "peft_adapter").eval()
    with torch.no_grad():
        want = ours_loads_peft(x).logits
        torch.testing.assert_close(ours_loads_peft.merge_and_unload()(x).logits, want, **TOL)


def test_qlora_sft_losses_and_lora_gradients_match_trl(tmp_path, monkeypatch):
    """test_family_sft's two checks on a Gemma 4 MoE model (a sliding layer, a full layer, a full
    layer reading its keys; per-layer inputs; 4 experts, top 2) with its all-linear LoRA plus the
    experts' target_parameters: 3 steps' loss, grad_norm and learning_rate, and every fp32 LoRA
    gradient of the first step, at the dense Gemma 4's loss and gradient tolerances (same reason).
    Weights drawn at std 0.2 (transformers' default 0.02 gives router probabilities within ~1e-2
    of each other and expert outputs ~1e-3 that the post-norms scale up ~1000x: one bf16 ulp
    apart after step 2, 3 tokens pick another expert and step 3 moves 5.6e-4; at 0.2, measured
    over seeds 11-14: at most 1.5e-5). With the same upstream gradient every layer's
    activation gradients equal transformers' bit for bit; they part only where the loss path
    does (1e-10)."""
    overrides = {**test_family_sft.FAMILIES["gemma4_text"][1], **EXPERTS,
                 "initializer_range": 0.2}
    monkeypatch.setitem(test_family_sft.FAMILIES, "gemma4_moe",
                        (transformers.Gemma4TextConfig, overrides))
    monkeypatch.setattr(test_family_sft, "LORA", {**test_family_sft.LORA,
                                                  "target_parameters": LORA["target_parameters"]})
    for table in ("LOSS_ATOL_AFTER_STEP_1", "FAMILY_GRAD_ATOL"):
        tolerances = getattr(test_family_sft, table)
        monkeypatch.setitem(tolerances, "gemma4_moe", tolerances["gemma4_text"])
    test_family_sft.test_qlora_sft_losses_match_trl("gemma4_moe", tmp_path / "sft")
    test_family_sft.test_lora_gradients_match_peft("gemma4_moe", tmp_path / "grads")


def test_nf4_experts_equal_the_bitsandbytes_round_trip(tmp_path):
    """quantize_experts stores Gemma 4's experts as NF4, each expert's slice on its own (its GeGLU
    kept): logits, loss and every LoRA gradient (q_proj and target_parameters on the experts)
    equal the model whose every slice is bitsandbytes' quantize_4bit / dequantize_4bit round trip
    (logits 1e-6; gradients 5e-6, the dense Gemma 4's: NF4Experts sums x Q^T + x D^T where the
    reference has x (Q + D)^T, and the post-norms of small branch outputs scale that last bit up:
    1.2e-6 measured on gradients up to 0.27), not the float model's; dequantize_experts gives
    Gemma4Experts back."""
    _, folder = hf_folder(tmp_path)
    model = quantize_experts(AutoModelForCausalLM.from_pretrained(folder))
    ref = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        for m in ref.modules():
            if isinstance(m, Gemma4Experts):
                for W in (m.gate_up_proj, m.down_proj):
                    for e in range(len(W)):
                        W[e] = round_trip(W[e].flatten()).view_as(W[e])  # as stored: 1-D
    assert [m.expert_class for m in model.modules() if isinstance(m, NF4Experts)] == \
        [Gemma4Experts] * 3
    x = torch.randint(3, V, (2, 12))
    with torch.no_grad():  # negative control: the float experts compute otherwise
        floats = AutoModelForCausalLM.from_pretrained(folder)
        assert (floats(x).logits - model(x).logits).abs().max() > 1e-4
    model, ref = same_lora(model, ref)
    got, want = model(x, labels=x), ref(x, labels=x)
    torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=1e-6)
    got.loss.backward()
    want.loss.backward()
    grads = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
    assert any(".experts." in n for n in grads)
    for n, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, grads[n], rtol=0, atol=5e-6, msg=n)
    dequantize_experts(model)
    assert not any(isinstance(m, NF4Experts) for m in model.modules())
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, want.logits.detach(), rtol=0, atol=1e-6)


def test_multimodal_gemma4_folder_loads_its_moe_language_model(tmp_path):
    """model_type gemma4 (how 26B-A4B ships: vision tower beside the language model, keys
    model.language_model.*, experts among them): nanosft loads the text model, with the logits of
    transformers' AutoModelForCausalLM on text."""
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16,
              "position_embedding_size": 64}
    config = transformers.Gemma4Config(text_config=VARIANTS["moe-plain"], vision_config=vision,
                                       audio_config=None)
    torch.manual_seed(0)
    transformers.Gemma4ForConditionalGeneration(config).save_pretrained(tmp_path / "vlm")
    want = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "vlm").eval()
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "vlm").eval()
    assert ours.config.enable_moe_block and ours.config.num_experts == 4
    x = torch.randint(3, V, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(ours(x).logits, want(input_ids=x).logits, **TOL)


@pytest.mark.parametrize("fields,message", [
    ({"num_experts": None}, "enable_moe_block=true needs num_experts"),
    ({"moe_intermediate_size": 0}, "needs moe_intermediate_size"),
    ({"top_k_experts": 5}, "top_k_experts=5 must be at most num_experts=4")])
def test_moe_config_errors_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        config_from_dict({"model_type": "gemma4_text", **MOE, **fields})


def test_bf16_logits_equal_transformers_eager_experts_bitwise(tmp_path):
    """Loaded in bfloat16: the same casts in the same places (fp32 router softmax and top-k
    weights, bf16 experts, the weighted rows cast back before the combine), so the logits equal
    transformers' eager experts (the per-expert loop nanosft writes) bit for bit; its default
    grouped_mm rounds bf16 otherwise (printed)."""
    _, folder = hf_folder(tmp_path)
    x = torch.randint(3, V, (2, 80))
    ours = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    eager = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.bfloat16, experts_implementation="eager").eval()
    grouped = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    with torch.no_grad():
        got = ours(x).logits
        torch.testing.assert_close(got, eager(x).logits, rtol=0, atol=0)
        diff = (grouped.eval()(x).logits - got).abs().max().item()
    print(f"\n[gemma4 moe] bf16 logits: 0 vs eager experts, {diff:.2e} vs grouped_mm")


def test_gradient_checkpointing_gives_the_same_gradients(tmp_path):
    """Checkpointed layers (router and experts recomputed in backward) give the plain backward's
    gradients, on a right-padded batch."""
    assert_checkpointing_keeps_gradients(hf_folder(tmp_path)[1])

"""NF4 expert weights (nanosft.families.nf4_experts), opt-in and beyond the peers.

Compared: each expert's stored bytes and dequantized weight against bitsandbytes' own
quantize_4bit / dequantize_4bit round trip of that expert's slice alone (bit for bit; an `in`
that is not a multiple of 64 against nanosft.nf4's NF4 written out by hand); a tiny Qwen3-MoE with
NF4 experts against the same model whose expert weights were replaced by that round trip: logits
and loss (fp32, 1e-6), and, with LoRA on the experts (ParamWrapper) and attention, every LoRA
gradient and the input gradient; only the experts the router chose are dequantized; the stored
bytes, measured, against the formula from shapes, and that formula on a Qwen3-30B-A3B layer
against QLoRA's 4.127 bits a weight; GLM-4-MoE's logits the same way; backward keeps no float
expert weight (against plain F.linear, which does). A short QLoRA SFT run with NF4 experts
lowers the loss. gpt-oss (transposed (E, in, out) experts with biases): each slice stored as
bitsandbytes' round trip of its transpose, logits / loss / aux loss / bias and embedding gradients
against the round-trip model (1e-6), LoRA on its transposed experts (target_parameters) with
every gradient, the merge, save / reload in its own layout, and a gpt-oss-20b layer's bytes.
Hermetic: tiny models built in-process, CPU, fixed seeds; `-s` prints the byte counts.
Run: python -m pytest -q -s tests/test_nf4_experts.py
"""

import copy

import pytest
import torch
from tiny import one_thread  # noqa: F401 (an autouse fixture)

from nanosft.args import SFTConfig
from nanosft.families.auto import AutoModelForCausalLM
from nanosft.expert_lora import ParamWrapper
from nanosft.families.glm4_moe import Glm4MoeConfig, Glm4MoeForCausalLM
from nanosft.families.gpt_oss import GptOssConfig, GptOssExperts, GptOssForCausalLM
from nanosft.families.moe import Experts, SparseMoeBlock
from nanosft.families.nf4_experts import (NF4Experts, NF4ExpertWeight, dequantize_experts,
                                          experts_nbytes, nf4_nbytes, quantize_experts)
from nanosft.families.qwen3_moe import Qwen3MoeConfig, Qwen3MoeForCausalLM
from nanosft.nf4 import dequantize_nf4, quantize_model, quantize_nf4
from nanosft.peft import LoraConfig, get_peft_model
from nanosft.sft import SFTTrainer

bnbF = pytest.importorskip("bitsandbytes.functional")

V = 128
TINY = {"vocab_size": V, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "max_position_embeddings": 64, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 64, "norm_topk_prob": True, "pad_token_id": 0, "eos_token_id": 1}
TOL = {"rtol": 0, "atol": 1e-6}


def tiny_moe(seed=0, **overrides):
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**TINY, **overrides}))


def round_trip(W):
    """bitsandbytes' NF4 round trip (blocksize 64, double quantization) of one 2-D slice."""
    packed, state = bnbF.quantize_4bit(W.contiguous(), blocksize=64, compress_statistics=True,
                                       quant_type="nf4")
    return bnbF.dequantize_4bit(packed, state)


def round_trip_model(model):
    """A copy of `model` whose every expert slice is replaced by its NF4 round trip (float);
    gpt-oss's (in, out) slices round-trip as their (out, in) transpose."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for m in ref.modules():
            if type(m) is Experts:
                for W in (m.gate_up_proj, m.down_proj):
                    for e in range(len(W)):
                        W[e] = round_trip(W[e])
            elif type(m) is GptOssExperts:
                for W in (m.gate_up_proj, m.down_proj):
                    for e in range(len(W)):
                        W[e] = round_trip(W[e].T).T
    return ref


def nf4_pair(seed=0):
    """(NF4-expert model, round-trip reference), same weights."""
    model = tiny_moe(seed)
    ref = round_trip_model(model)
    return quantize_experts(model), ref


def test_each_expert_holds_bitsandbytes_bytes_of_its_own_slice():
    torch.manual_seed(0)
    W = torch.randn(3, 128, 64) * torch.tensor([0.01, 1.0, 100.0])[:, None, None]  # own scales
    stored = NF4ExpertWeight(W)
    for e in range(3):
        packed, state = bnbF.quantize_4bit(W[e].contiguous(), blocksize=64,
                                           compress_statistics=True, quant_type="nf4")
        assert torch.equal(stored.packed[e], packed.reshape(-1))
        assert torch.equal(stored.absmax[e], state.absmax)
        assert torch.equal(stored.absmax2[e], state.state2.absmax)
        assert torch.equal(stored.offset[e], state.offset)
        assert torch.equal(stored.dequantize(e), bnbF.dequantize_4bit(packed, state))
    # negative control: the 3-D tensor quantized as one shares its double quantization across
    # experts (one offset), so expert 0's small weights decode otherwise
    packed, state = bnbF.quantize_4bit(W, blocksize=64, compress_statistics=True,
                                       quant_type="nf4")
    assert not torch.equal(bnbF.dequantize_4bit(packed, state)[0], stored.dequantize(0))


def test_rows_shorter_than_a_block_decode_as_nf4_by_hand():
    # in = 32: a 64-value block spans two rows. Stored flat, each expert decodes as nanosft.nf4's
    # hand-written NF4 (bitsandbytes' CPU kernel decodes the 2-D (out, 32) shape wrongly)
    torch.manual_seed(1)
    W = torch.randn(2, 64, 32)
    stored = NF4ExpertWeight(W, compress_statistics=False)
    for e in range(2):
        packed, absmax = quantize_nf4(W[e])
        assert torch.equal(stored.dequantize(e), dequantize_nf4(packed, absmax, (64, 32)))


def test_model_dequantized_experts_equal_the_round_trip_of_each_slice():
    model = tiny_moe()
    ref = round_trip_model(model)
    quantize_experts(model)
    pairs = [(m, r) for m, r in zip(model.modules(), ref.modules()) if isinstance(m, NF4Experts)]
    assert len(pairs) == 2 and not any(type(m) is Experts for m in model.modules())
    for m, r in pairs:
        for name in ("gate_up_proj", "down_proj"):
            for e in range(4):
                assert torch.equal(m.nf4[name].dequantize(e), getattr(r, name)[e])


def test_logits_and_loss_equal_the_round_trip_model():
    model, ref = nf4_pair()
    x = torch.randint(2, V, (2, 12))
    mask = torch.ones_like(x)
    mask[0, :4] = 0
    with torch.no_grad():
        got = model(x, attention_mask=mask, labels=x, output_router_logits=True)
        want = ref(x, attention_mask=mask, labels=x, output_router_logits=True)
    torch.testing.assert_close(got.logits, want.logits, **TOL)
    torch.testing.assert_close(got.loss, want.loss, **TOL)
    torch.testing.assert_close(got.aux_loss, want.aux_loss, **TOL)
    # negative control: the float (unquantized) model is not what the NF4 model computes
    float_model = tiny_moe()
    with torch.no_grad():
        assert (float_model(x).logits - model(x).logits).abs().max() > 1e-3


def test_glm4_moe_logits_equal_the_round_trip_model():
    # GLM-4-MoE: sigmoid router with groups, shared experts (linears, left alone), dense layer 0
    torch.manual_seed(0)
    model = Glm4MoeForCausalLM(Glm4MoeConfig(
        vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=64, n_group=2, topk_group=1,
        routed_scaling_factor=2.5))
    ref = round_trip_model(model)
    quantize_experts(model)
    assert sum(isinstance(m, NF4Experts) for m in model.modules()) == 1
    x = torch.randint(2, V, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, ref(x).logits, **TOL)


def test_only_the_chosen_experts_are_dequantized():
    model = quantize_experts(tiny_moe())
    calls = []
    for layer, m in enumerate(m for m in model.modules() if isinstance(m, NF4Experts)):
        for name, weight in m.nf4.items():
            def counting(e, weight=weight, key=(layer, name)):
                calls.append((*key, e))
                return NF4ExpertWeight.dequantize(weight, e)
            weight.dequantize = counting
    x = torch.randint(2, V, (1, 1))  # one token: top 2 of 4 experts per layer
    with torch.no_grad():
        out = model(x, output_router_logits=True)
    for layer, logits in enumerate(out.router_logits):
        chosen = set(logits.topk(2, dim=-1).indices.flatten().tolist())
        for name in ("gate_up_proj", "down_proj"):
            assert sorted(e for l_, n, e in calls if (l_, n) == (layer, name)) == sorted(chosen)


def test_backward_keeps_no_float_expert_weight():
    # bitsandbytes' MatMul4Bit habit: dequantize again in backward rather than keep the float
    # weight (out, in) of every chosen expert alive until then; the input still gets its gradient
    model = quantize_experts(tiny_moe(moe_intermediate_size=192))  # shapes no other weight has
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    h = model.get_input_embeddings()(torch.randint(2, V, (2, 12))).detach().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(inputs_embeds=h).logits.sum().backward()
    weights = {(384, 64), (64, 384), (64, 192), (192, 64)}  # (2 I, C), (C, I), transposed too
    assert saved and not weights & set(saved)
    assert h.grad is not None and h.grad.abs().sum() > 0
    # negative control: the same forward through plain F.linear keeps them
    saved.clear()
    ref = round_trip_model(tiny_moe(moe_intermediate_size=192))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ref(inputs_embeds=h).logits.sum().backward()
    assert weights & set(saved) == {(64, 384), (192, 64)}  # mm saves W^T


def lora_pair():
    """(NF4-expert, round-trip reference) models under the same LoRA on experts (gate_up_proj,
    down_proj, ParamWrapper) and q_proj, B drawn non-zero so the deltas count."""
    return same_lora(*nf4_pair())


def same_lora(model, ref):
    """`model` and `ref` under the same LoRA on experts and q_proj, with equal random weights."""
    config = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"],
              "target_parameters": ["gate_up_proj", "down_proj"]}
    model = get_peft_model(model, LoraConfig(**config))
    ref = get_peft_model(ref, LoraConfig(**config))
    with torch.no_grad():
        torch.manual_seed(3)
        for (n, p), (n_ref, p_ref) in zip(model.named_parameters(), ref.named_parameters()):
            assert n == n_ref
            if p.requires_grad:
                p.copy_(torch.randn_like(p) * 0.1)
                p_ref.copy_(p)
    return model, ref


def test_lora_on_nf4_experts_gradients_equal_the_round_trip_model():
    model, ref = lora_pair()
    assert sum(isinstance(m, ParamWrapper) for m in model.modules()) == 4  # 2 layers x 2
    x = torch.randint(2, V, (2, 12))
    embeds = {}
    for m in (model, ref):
        h = m.get_input_embeddings()(x).detach().requires_grad_()
        out = m(inputs_embeds=h, labels=x)
        out.loss.backward()
        embeds[m] = (out.logits.detach(), h.grad)
    torch.testing.assert_close(embeds[model][0], embeds[ref][0], **TOL)
    torch.testing.assert_close(embeds[model][1], embeds[ref][1], **TOL)  # to the inputs
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
    assert sorted(grads) == sorted(ref_grads) and any(".experts." in n for n in grads)
    for n in grads:
        torch.testing.assert_close(grads[n], ref_grads[n], **TOL, msg=n)
    for m in model.modules():  # the frozen NF4 storage: integer codes, placeholders without grad
        if isinstance(m, NF4Experts):
            assert m.gate_up_proj.grad is None and m.down_proj.grad is None
            assert all(w.packed.dtype == torch.uint8 for w in m.nf4.values())


def test_dequantize_experts_then_merge_keeps_the_logits():
    model, ref = lora_pair()
    x = torch.randint(2, V, (2, 9))
    with torch.no_grad():
        want = ref(x).logits
        merged = dequantize_experts(model).merge_and_unload()
        assert not any(isinstance(m, NF4Experts) for m in merged.modules())
        torch.testing.assert_close(merged(x).logits, want, rtol=0, atol=1e-5)
        # merged straight onto the NF4 experts: the delta becomes the placeholder's own tensor,
        # which the forward adds to the dequantized weights
        merged = lora_pair()[0].merge_and_unload()
        assert any(isinstance(m, NF4Experts) for m in merged.modules())
        torch.testing.assert_close(merged(x).logits, want, rtol=0, atol=1e-5)
        # a deepcopy materializes the placeholders: a merge then lands there and is read
        merged = copy.deepcopy(lora_pair()[0]).merge_and_unload()
        assert any(isinstance(m, NF4Experts) for m in merged.modules())
        torch.testing.assert_close(merged(x).logits, want, rtol=0, atol=1e-5)


def test_storage_moves_with_to_and_saves_dequantized_float_weights(tmp_path):
    model = quantize_experts(tiny_moe())
    model.to(torch.float64)  # placeholders follow the dtype, still one value each
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.dtype == torch.float64
    assert experts.gate_up_proj.untyped_storage().nbytes() == 8
    assert experts.nf4["gate_up_proj"].offset.dtype == torch.float32  # statistics stay fp32
    model.to(torch.float32)
    # saved under the float model's names, as the dequantized weights (not zero placeholders)
    state = model.state_dict()
    assert not any("nf4" in k for k in state)
    want = torch.stack([experts.nf4["down_proj"].dequantize(e) for e in range(4)])
    assert torch.equal(state["model.layers.0.mlp.experts.down_proj"], want)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    x = torch.randint(0, V, (2, 9))
    torch.testing.assert_close(loaded(x).logits, model(x).logits, rtol=0, atol=1e-6)


def test_refusals_name_the_fix():
    with pytest.raises(ValueError, match="before get_peft_model"):
        quantize_experts(get_peft_model(tiny_moe(), LoraConfig(
            r=2, target_modules=["q_proj"], target_parameters=["down_proj"])))
    with pytest.raises(ValueError, match="no MoE experts"):
        quantize_experts(tiny_moe(mlp_only_layers=[0, 1]))


def test_bytes_measured_against_the_formula_and_qlora_bits_per_weight():
    model = tiny_moe()
    before = experts_nbytes(model)
    quantize_experts(model)
    after = experts_nbytes(model)
    E, C, I = 4, 64, 64
    assert before == 2 * 4 * E * (2 * I * C + C * I)  # 2 layers, fp32
    placeholders = 2 * 4  # one fp32 value per placeholder
    assert after == 2 * (nf4_nbytes((E, 2 * I, C)) + nf4_nbytes((E, C, I)) + placeholders)
    # the formula against real storage at Qwen3-30B-A3B's expert shapes (2 of its 128 experts)
    C, I = 2048, 768
    real = NF4ExpertWeight(torch.randn(2, 2 * I, C))
    assert real.nbytes() == nf4_nbytes((2, 2 * I, C))
    # one Qwen3-30B-A3B MoE layer (128 experts, hidden 2048, 768 each), built on the meta device
    config = Qwen3MoeConfig(hidden_size=C, moe_intermediate_size=I, num_experts=128,
                            num_experts_per_tok=8)
    with torch.device("meta"):
        block = SparseMoeBlock(config).to(torch.bfloat16)
    bf16 = experts_nbytes(block)
    nf4 = sum(nf4_nbytes(p.shape) for p in block.experts.parameters())
    weights = sum(p.numel() for p in block.experts.parameters())
    assert weights == 128 * 3 * I * C
    # QLoRA 2305.14314, section 3: 4 bits + 8 / 64 (absmax codes) + 32 / (64 * 256) per weight
    assert abs(8 * nf4 / weights - (4 + 8 / 64 + 32 / (64 * 256))) < 1e-4
    print(f"\ntiny (2 layers, 4 experts, fp32): {before} -> {after} bytes "
          f"({after / before:.3f}); Qwen3-30B-A3B layer, bf16 {bf16 / 2**20:.0f} MiB -> NF4 "
          f"{nf4 / 2**20:.1f} MiB ({nf4 / bf16:.3f}, {8 * nf4 / weights:.4f} bits a weight); "
          f"x48 layers: {48 * (bf16 - nf4) / 2**30:.1f} GiB saved")


def test_qlora_sft_with_nf4_experts_lowers_the_loss(tmp_path):
    from tokenizers import Tokenizer as BackendTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    from nanosft.tokenizer import Tokenizer

    vocab = {"<pad>": 0, "</s>": 1, **{f"t{i}": i for i in range(2, V)}}
    backend = BackendTokenizer(WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = WhitespaceSplit()
    tokenizer = Tokenizer(backend, pad_token="<pad>", eos_token="</s>")
    g = torch.Generator().manual_seed(2)
    rows = [{"input_ids": torch.randint(2, 12, (10,), generator=g).tolist()} for _ in range(4)]
    model = quantize_experts(quantize_model(tiny_moe()))
    args = SFTConfig(str(tmp_path), per_device_train_batch_size=4, max_steps=6, learning_rate=2e-2,
                     logging_steps=1, save_strategy="no", use_cpu=True, bf16=False,
                     optim="adamw_torch", report_to="none", disable_tqdm=True,
                     gradient_checkpointing=False, max_length=None, seed=0)
    trainer = SFTTrainer(model, args, train_dataset=rows, processing_class=tokenizer,
                         peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    wrapped = [m for m in trainer.model.modules() if isinstance(m, ParamWrapper)]
    assert {w.parameter_name for w in wrapped} == {"gate_up_proj", "down_proj", "weight"}
    assert any(isinstance(w.get_base_layer(), NF4Experts) for w in wrapped)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    print(f"\nQLoRA SFT with NF4 experts, losses: {[round(v, 4) for v in losses]}")
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.1


# gpt-oss: experts held transposed, W[e] (in, out) read as x @ W[e], with float biases and the
# clamped SwiGLU; each slice is quantized as W[e]^T (Linear4bit's (out, in) orientation)


def tiny_gpt_oss(seed=0):
    torch.manual_seed(seed)
    return GptOssForCausalLM(GptOssConfig(
        vocab_size=V, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=64, pad_token_id=0, eos_token_id=1))


def test_gpt_oss_logits_loss_aux_and_bias_grads_equal_the_round_trip_model():
    model = tiny_gpt_oss()
    ref = round_trip_model(model)
    quantize_experts(model)
    experts = [m for m in model.modules() if isinstance(m, NF4Experts)]
    assert len(experts) == 2 and not any(type(m) is GptOssExperts for m in model.modules())
    refs = [m for m in ref.modules() if type(m) is GptOssExperts]
    float_experts = [m for m in tiny_gpt_oss().modules() if type(m) is GptOssExperts]
    for m, r, f in zip(experts, refs, float_experts):
        # gate_up_proj (E, C, 2 I) = (4, 64, 128) is stored as four (2 I, C) = (128, 64) slices
        assert m.nf4["gate_up_proj"].shape == (4, 128, 64) and m.is_transposed
        assert m.gate_up_proj.shape == (4, 64, 128)  # the placeholder keeps the float layout
        for e in range(4):
            W = f.gate_up_proj[e].detach()
            assert torch.equal(m.nf4["gate_up_proj"].dequantize(e), round_trip(W.T))
            assert torch.equal(m.nf4["down_proj"].dequantize(e), r.down_proj[e].T)
            # negative control: the stored (in, out) orientation quantizes other blocks (each of
            # 32 gate and 32 up columns of one input row), so it decodes to other weights
            assert not torch.equal(round_trip(W), round_trip(W.T).T)
        for name in ("gate_up_proj_bias", "down_proj_bias"):  # float, trainable, unchanged
            b = getattr(m, name)
            assert b.dtype == torch.float32 and b.requires_grad
            assert torch.equal(b, getattr(r, name))
    x = torch.randint(2, V, (2, 12))
    mask = torch.ones_like(x)
    mask[0, :4] = 0
    got = model(x, attention_mask=mask, labels=x, output_router_logits=True)
    want = ref(x, attention_mask=mask, labels=x, output_router_logits=True)
    torch.testing.assert_close(got.logits, want.logits, **TOL)
    torch.testing.assert_close(got.loss, want.loss, **TOL)
    torch.testing.assert_close(got.aux_loss, want.aux_loss, **TOL)
    got.loss.backward()
    want.loss.backward()
    for m, r in zip(experts, refs):
        torch.testing.assert_close(m.gate_up_proj_bias.grad, r.gate_up_proj_bias.grad, **TOL)
        torch.testing.assert_close(m.down_proj_bias.grad, r.down_proj_bias.grad, **TOL)
        assert m.down_proj_bias.grad.abs().sum() > 0 and m.gate_up_proj.grad is None
    torch.testing.assert_close(model.get_input_embeddings().weight.grad,
                               ref.get_input_embeddings().weight.grad, **TOL)
    # negative control: the float model is not what the NF4 model computes
    with torch.no_grad():
        assert (tiny_gpt_oss()(x).logits - got.logits).abs().max() > 1e-3


def test_gpt_oss_lora_on_transposed_experts_equals_the_round_trip_model():
    model, ref = same_lora(quantize_experts(tiny_gpt_oss()), round_trip_model(tiny_gpt_oss()))
    wrappers = [m for m in model.modules() if isinstance(m, ParamWrapper)]
    assert len(wrappers) == 4 and all(w.is_transposed for w in wrappers)
    assert {(w.parameter_name, w.in_features, w.out_features) for w in wrappers} == {
        ("gate_up_proj", 64, 128), ("down_proj", 64, 64)}  # (in, out) read from (E, in, out)
    x = torch.randint(2, V, (2, 12))
    outs = {}
    for m in (model, ref):
        h = m.get_input_embeddings()(x).detach().requires_grad_()
        out = m(inputs_embeds=h, labels=x)
        out.loss.backward()
        outs[m] = (out.logits.detach(), h.grad)
    torch.testing.assert_close(outs[model][0], outs[ref][0], **TOL)
    torch.testing.assert_close(outs[model][1], outs[ref][1], **TOL)
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
    assert sorted(grads) == sorted(ref_grads)
    assert sum(".mlp.experts." in n for n in grads) == 8  # A, B x 2 parameters x 2 layers
    for n in grads:
        torch.testing.assert_close(grads[n], ref_grads[n], **TOL, msg=n)
    # merged straight onto the NF4 experts: the (E, in, out) delta is read as x @ D[e]
    with torch.no_grad():
        want = ref(x).logits
        merged = model.merge_and_unload()
        assert any(isinstance(m, NF4Experts) for m in merged.modules())
        torch.testing.assert_close(merged(x).logits, want, rtol=0, atol=1e-5)


def test_gpt_oss_saves_float_weights_in_its_layout_and_reloads(tmp_path):
    model = quantize_experts(tiny_gpt_oss())
    ref = round_trip_model(tiny_gpt_oss())
    model.to(torch.float64)  # placeholders stay one value; the biases follow as any parameter
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.untyped_storage().nbytes() == 8
    assert experts.gate_up_proj_bias.dtype == torch.float64
    model.to(torch.float32)
    state, want = model.state_dict(), ref.state_dict()
    assert list(state) == list(want)  # the float model's keys, in its order
    for key in want:
        if ".experts." in key:
            assert state[key].shape == want[key].shape  # (E, in, out) again
            assert torch.equal(state[key], want[key]), key
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is GptOssForCausalLM
    x = torch.randint(0, V, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, model(x).logits, **TOL)
        torch.testing.assert_close(loaded(x).logits, ref(x).logits, **TOL)
        # dequantize_experts gives GptOssExperts back, the same weights
        dequantize_experts(model)
        assert sum(type(m) is GptOssExperts for m in model.modules()) == 2
        torch.testing.assert_close(model(x).logits, ref(x).logits, **TOL)


def test_gpt_oss_bytes_measured_and_for_a_20b_layer():
    model = tiny_gpt_oss()
    before = experts_nbytes(model)
    quantize_experts(model)
    E, C, I = 4, 64, 64
    assert before == 2 * 4 * E * (C * 2 * I + I * C)  # 2 layers, fp32
    assert experts_nbytes(model) == 2 * (nf4_nbytes((E, 2 * I, C)) + nf4_nbytes((E, C, I)) + 8)
    # gpt-oss-20b's MoE layer: 32 experts, hidden 2880, 2880 each, built on the meta device
    config = GptOssConfig(num_local_experts=32, hidden_size=2880, intermediate_size=2880)
    with torch.device("meta"):
        experts = GptOssExperts(config).to(torch.bfloat16)
    bf16 = experts_nbytes(experts)
    weights = 32 * 3 * 2880 * 2880
    assert bf16 == 2 * weights
    nf4 = sum(nf4_nbytes(getattr(experts, n).transpose(1, 2).shape)
              for n in ("gate_up_proj", "down_proj"))
    # 2880 * 2880 and 2880 * 5760 are whole blocks of 64 and 16,384: QLoRA's bits a weight
    assert abs(8 * nf4 / weights - (4 + 8 / 64 + 32 / (64 * 256))) < 1e-4
    biases = 2 * 32 * (2 * 2880 + 2880)  # bf16, kept in float either way
    print(f"\ngpt-oss tiny (2 layers, 4 experts, fp32): {before} -> {experts_nbytes(model)} "
          f"bytes; gpt-oss-20b layer (32 x 2880 x 2880), bf16 {bf16 / 2**20:.1f} MiB -> NF4 "
          f"{nf4 / 2**20:.1f} MiB ({nf4 / bf16:.3f}, {8 * nf4 / weights:.4f} bits a weight), "
          f"{(bf16 - nf4) / 2**20:.1f} MiB saved (biases {biases / 2**20:.2f} MiB stay bf16); "
          f"x24 layers: {24 * (bf16 - nf4) / 2**30:.2f} GiB saved")


def test_qwen3_5_moe_experts_quantize_beside_the_shared_expert():
    """Qwen3.5-MoE (Gated DeltaNet and gated attention layers, experts plus the gated shared
    expert, a linear left alone): quantize_experts takes its 3-D experts; logits, loss, aux loss
    and, with LoRA on the NF4 experts and q_proj, every LoRA gradient equal the round-trip model's
    (1e-6); the experts' bytes shrink to nf4_nbytes."""
    from nanosft.families.qwen3_5_moe import Qwen3_5MoeConfig, Qwen3_5MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3_5MoeForCausalLM(Qwen3_5MoeConfig(
        vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=64, shared_expert_intermediate_size=64,
        layer_types=["linear_attention", "full_attention"]))
    ref = round_trip_model(model)
    float_bytes = experts_nbytes(model)
    quantize_experts(model)
    assert sum(isinstance(m, NF4Experts) for m in model.modules()) == 2
    assert type(model.model.layers[0].mlp.shared_expert.gate_proj) is torch.nn.Linear
    assert experts_nbytes(model) == 2 * (nf4_nbytes((4, 128, 64)) + nf4_nbytes((4, 64, 64)) + 8)
    assert experts_nbytes(model) < float_bytes / 7
    lora = {"r": 2, "target_modules": ["q_proj"], "target_parameters": ["gate_up_proj",
                                                                        "down_proj"]}
    model, ref = (get_peft_model(m, LoraConfig(**lora)) for m in (model, ref))
    for m in (model, ref):  # the same non-zero adapters
        torch.manual_seed(1)
        for n, p in m.named_parameters():
            if "lora_" in n:
                p.data = torch.randn(p.shape) * 0.1
    x = torch.randint(2, V, (2, 12))
    outs = [m(x, labels=x, output_router_logits=True) for m in (model, ref)]
    for key in ("logits", "loss", "aux_loss"):
        torch.testing.assert_close(getattr(outs[0], key), getattr(outs[1], key), **TOL)
    for out in outs:
        out.loss.backward()
    grads = [{n: p.grad for n, p in m.named_parameters() if p.requires_grad} for m in (model, ref)]
    assert sorted(grads[0]) == sorted(grads[1]) and any(".experts." in n for n in grads[0])
    for n, grad in grads[1].items():
        torch.testing.assert_close(grads[0][n], grad, **TOL, msg=n)

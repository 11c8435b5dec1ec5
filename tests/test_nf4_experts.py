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
lowers the loss.
Hermetic: tiny models built in-process, CPU, fixed seeds; `-s` prints the byte counts.
Run: python -m pytest -q -s tests/test_nf4_experts.py
"""

import copy

import pytest
import torch
from tiny import one_thread  # noqa: F401 (an autouse fixture)

from nanosft.args import SFTConfig
from nanosft.io.auto import AutoModelForCausalLM
from nanosft.families.expert_lora import ParamWrapper
from nanosft.families.glm4_moe import Glm4MoeConfig, Glm4MoeForCausalLM
from nanosft.families.gpt_oss import GptOssConfig, GptOssForCausalLM
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
    """A copy of `model` whose every expert slice is replaced by its NF4 round trip (float)."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for m in ref.modules():
            if type(m) is Experts:
                for W in (m.gate_up_proj, m.down_proj):
                    for e in range(len(W)):
                        W[e] = round_trip(W[e])
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
    model, ref = nf4_pair()
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
    torch.manual_seed(0)
    gpt_oss = GptOssForCausalLM(GptOssConfig(
        vocab_size=V, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2))
    with pytest.raises(ValueError, match="GptOssExperts.*do not call quantize_experts"):
        quantize_experts(gpt_oss)
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

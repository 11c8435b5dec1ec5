"""The memory ledger, layer by layer, against a real step when LoRA wraps some projections only.

Compared, for Llama, OLMo 3, Cohere 2, GPT-NeoX, Qwen3-MoE, GLM-4-MoE and gpt-oss, fp32 and under
bf16 autocast: each decoder layer's predicted saves against the bytes autograd kept in that layer
(nanosft.memory.count_saved_tensors), with LoRA on one projection (o_proj / dense alone, v_proj
alone, one MLP linear) or on the router or one 3-D expert parameter alone (target_parameters).
The first layer's input needs no grad, nor does a later layer's while no layer before it holds
LoRA, so what autograd keeps follows the branches LoRA makes need grad: o_proj's own input with
nothing before it trained, no RoPE tables in a layer whose q and k need no grad (they then go to
the first layer that rotates a q or k needing grad), lora_A's weight copy under autocast only
where its input needs grad, the router's and the experts' saves by which of them train. The
state rows are exact; each layer within 0.1%. QLoRA under bf16 autocast (OLMo 3, Gemma 3, Phi-3,
Qwen3-MoE): a 4-bit linear returns its input's dtype, which the norms after o_proj and Phi-3's
fused v read. DoRA on Llama and Qwen2 (the weight norm's scale kept, B A through the identity
not), fp32 and bf16. LFM2's short convolution under bf16 autocast (the conv weight's copy; its
output cast back over a 4-bit in_proj). Qwen3.5-MoE with the router or one expert parameter alone.
Tiny models (hidden 64, 2-3 layers), CPU, seeded.
Run: python -m pytest -q tests/test_memory_partial_targets.py
"""

import pytest
from test_memory import SIZES, _family_model
from test_memory import _model as _llama_model
from test_memory_hybrid import _assert_each_layer_matches
from test_memory_hybrid import _model as _hybrid_model
from test_memory_moe import _model
from test_memory_qwen3_5_moe import _model as _qwen3_5_moe_model
from tiny import one_thread, tiny_model  # noqa: F401  (one_thread: autouse fixture)

from nanosft import nf4
from nanosft.peft import LoraConfig, get_peft_model
from nanosft.sft import _cast_trainable_to_bf16

ROUTER = {"qwen3_moe": "gate.weight", "glm4_moe": "gate.weight", "gpt_oss": "router.weight"}
CASES = [  # (family, target_modules or target_parameters)
    ("llama", ["o_proj"]),  # o_proj's LoRA input, the MLP after it; RoPE tables in layer 1
    ("llama", ["v_proj"]),  # SDPA keeps q, k, v; no RoPE tables in layer 0
    ("llama", ["down_proj"]),  # the MLP's product, nothing of attention in layer 0
    ("llama", ["gate_proj"]),
    ("olmo3", ["o_proj"]),
    ("olmo3", ["v_proj"]),
    ("olmo3", ["down_proj"]),
    ("cohere2", ["o_proj"]),
    ("cohere2", ["v_proj"]),
    ("cohere2", ["up_proj"]),
    ("gpt_neox", ["dense"]),
    ("gpt_neox", ["dense_4h_to_h"]),
    ("qwen3_moe", ["o_proj"]),
    ("qwen3_moe", ["v_proj"]),
    ("glm4_moe", ["o_proj"]),  # (a dense first layer, then an MoE layer with shared experts)
    ("glm4_moe", ["down_proj"]),  # peft moves it to the experts: the dense layer stays frozen
    ("gpt_oss", ["q_proj"]),  # eager attention with sinks: what q alone keeps
    ("gpt_oss", ["v_proj"]),  # ... v alone: the probabilities
    ("gpt_oss", ["o_proj"]),
] + [(name, ["experts." + p]) for name in ROUTER for p in ("gate_up_proj", "down_proj")] + [
    (name, [router]) for name, router in ROUTER.items()]


def _lora_model(name, targets):
    lora = ({"target_modules": [], "target_parameters": targets} if "." in targets[0] else
            {"target_modules": targets})
    if name != "llama":
        return _model(name, "lora", **lora)
    return get_peft_model(tiny_model(**SIZES), LoraConfig(r=4, **lora)).train()


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name,targets", CASES, ids=[f"{n}-{','.join(t)}" for n, t in CASES])
def test_partial_targets_each_layer(name, targets, bf16):
    """Each layer's predicted saves equal what that layer kept in a real step (within 0.1%); the
    old walks read 0 for o_proj alone in the first layer, put the RoPE tables in layer 0 when it
    rotated nothing needing grad, and counted the whole MoE block for a router alone."""
    _assert_each_layer_matches(_lora_model(name, targets), bf16=bf16, rel=0.001)


def _qlora_model(name, targets):
    if name in ("olmo3", "qwen3_moe"):
        return _model(name, "qlora", target_modules=targets)
    model = _family_model(name)
    nf4.quantize_model(model)
    model = get_peft_model(model, LoraConfig(r=4, target_modules=targets)).train()
    _cast_trainable_to_bf16(model)  # what SFTTrainer does to adapters on a 4-bit base
    return model


QLORA_CASES = [("olmo3", ["o_proj"]), ("olmo3", "all-linear"), ("Gemma3TextConfig", ["o_proj"]),
               ("Phi3Config", "all-linear"), ("qwen3_moe", ["o_proj"])]


@pytest.mark.parametrize("name,targets", QLORA_CASES, ids=[
    f"{n}-{t if isinstance(t, str) else ','.join(t)}" for n, t in QLORA_CASES])
def test_qlora_under_bf16_autocast_each_layer(name, targets):
    """A 4-bit linear returns its input's dtype: o_proj's output is SDPA's bf16 under autocast
    (OLMo 3's and Gemma 3's norms after it read it so), and Phi-3's fused qkv output is float32,
    so SDPA gets a bf16 copy of v, not a view keeping the whole output. Each layer within 0.1%
    (the old walks read OLMo 3's and Gemma 3's layers 8 KiB over, Phi-3's 12 KiB)."""
    _assert_each_layer_matches(_qlora_model(name, targets), bf16=True, rel=0.001)


DORA_CASES = [("dora", ["o_proj"], False), ("dora", ["o_proj"], True), ("dora", "all-linear", True),
              ("qdora", "all-linear", False), ("qdora", ["down_proj"], True),
              ("Qwen2Config", ["v_proj"], True)]  # a biased v_proj


def _dora_model(method, targets):
    if method in ("dora", "qdora"):
        return _llama_model(method, targets).train()
    model = get_peft_model(_family_model(method), LoraConfig(r=4, target_modules=targets,
                                                             use_dora=True))
    return model.train()


@pytest.mark.parametrize("method,targets,bf16", DORA_CASES, ids=[
    f"{m}-{t if isinstance(t, str) else ','.join(t)}-{'bf16' if b else 'fp32'}"
    for m, t, b in DORA_CASES])
def test_dora_each_layer(method, targets, bf16):
    """DoRA (Llama, and Qwen2's biased v_proj): B A through the identity feeds only the detached
    weight norm, so autograd drops it; the norm, m / norm and, where the input needs grad,
    m / norm - 1 are kept, with W x less its bias (a bf16 output less an fp32 bias: fp32). peft
    casts x to the adapters' dtype unless CUDA's autocast is on, so under CPU autocast lora_A
    reads a copy of x. Each layer within 0.1% (the old walk read 8 KiB over per DoRA linear of
    64 inputs, and 8 KiB short for fp32 adapters under autocast)."""
    _assert_each_layer_matches(_dora_model(method, targets), bf16=bf16, rel=0.001)


@pytest.mark.parametrize("method,targets", [("lora", ["out_proj"]), ("qlora", "all-linear")],
                         ids=["lora-out_proj", "qlora-all-linear"])
def test_lfm2_short_conv_under_bf16_autocast_each_layer(method, targets):
    """LFM2's short convolution under bf16 autocast: conv1d keeps its (C, 1, K) weight's bf16
    copy where its input needs grad; over a 4-bit in_proj (float32 gates) its output is cast
    back to float32, and c * y keeps that (B, C, T) copy instead of the padded bf16 output.
    Each layer within 0.1% (the old walk read the conv layers 384 B and 7,680 B short)."""
    _assert_each_layer_matches(_hybrid_model("lfm2", method, targets), bf16=True, rel=0.001)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("parameter", ["mlp.gate.weight", "experts.down_proj"])
def test_qwen3_5_moe_router_or_experts_alone_each_layer(parameter, bf16):
    """Qwen3.5-MoE with LoRA on the router or the experts' down_proj alone: the MoE block keeps
    what that part asks for, beside a frozen shared expert (each layer within 0.1%)."""
    model = _qwen3_5_moe_model("lora", target_modules=[], target_parameters=[parameter])
    _assert_each_layer_matches(model, bf16=bf16, rel=0.001)

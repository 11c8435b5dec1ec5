"""The memory ledger (nanosft/memory) on Gemma 4's MoE layers, against the tensors of a real step.

Gemma 4 with enable_moe_block (each layer's dense GeGLU MLP plus routed experts: the router's
scale-free fp32 norm, its softmax, top-k and per_expert_scale; the experts' GeGLU over the
N * top_k dispatched rows; the three extra norms), for full fine-tuning, LoRA (all-linear, so
router.proj, plus target_parameters on the 3-D experts) and QLoRA: the parameter list equals the
model's names and shapes; the weights, adapters, gradients and AdamW rows equal the distinct
storage bytes after one step; the activations row equals the bytes autograd saves
(saved_tensors_hooks) within 1% (full) and 5% (LoRA / QLoRA), and under bf16 autocast; the same
with the experts stored as NF4 by quantize_experts (codes and statistics in the weights row).
Negative control: the same config without its MoE rows (read as the dense Gemma 4) is short by
more than 5%. Tiny models (hidden 64, 2 layers, 4 experts, top 2), CPU, seeded.
Run: python -m pytest -q tests/test_memory_gemma4_moe.py
"""

import dataclasses

import pytest
import torch
import transformers
from test_memory import measured_state_rows
from test_memory_moe import TINY, _activations, _plan, _step, assert_ledger_rows_equal_a_real_step
from tiny import one_thread  # noqa: F401  (autouse fixture)

from nanosft import memory, nf4
from nanosft.families.nf4_experts import NF4Experts, quantize_experts
from nanosft.memory.plan import lora_targets, parameter_targets
from nanosft.families.auto import config_from_dict, from_config
from nanosft.peft import LoraConfig, get_peft_model
from nanosft.sft import _cast_trainable_to_bf16

# a sliding then a full layer (head_dim 32, one kv head, v = k); per-layer inputs of 8; 4 experts
# of width 32, top 2
GEMMA4_MOE = {**TINY, "head_dim": 16, "global_head_dim": 32, "sliding_window": 5,
              "layer_types": ["sliding_attention", "full_attention"],
              "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 128,
              "attention_k_eq_v": True, "num_global_key_value_heads": 1,
              "enable_moe_block": True, "num_experts": 4, "top_k_experts": 2,
              "moe_intermediate_size": 32}
LORA = {"r": 4, "target_modules": "all-linear",
        "target_parameters": ["experts.gate_up_proj", "experts.down_proj"]}


def _model(method, nf4_experts=False):
    torch.manual_seed(0)
    config = transformers.Gemma4TextConfig(**GEMMA4_MOE)
    model = from_config(config_from_dict(config.to_dict()))
    if method == "qlora":
        nf4.quantize_model(model)
    if nf4_experts:
        quantize_experts(model)
    if method != "full":
        model = get_peft_model(model, LoraConfig(**LORA))
    if method == "qlora":
        _cast_trainable_to_bf16(model)  # what SFTTrainer does to adapters on a 4-bit base
    return model.train()


@pytest.mark.parametrize("method", ["full", "lora", "qlora"])
def test_ledger_rows_equal_a_real_step(method):
    model = _model(method)
    plan = assert_ledger_rows_equal_a_real_step(model, method)
    if method != "full":  # the 3-D experts' pairs beside router.proj's LoRA
        config = model.get_base_model().config
        assert parameter_targets(config, plan) == {"gate_up_proj": 4, "down_proj": 4}
        assert "proj" in lora_targets(config, plan)


def test_activations_under_bf16_autocast():
    model = _model("full")
    measured, _ = _step(model, bf16=True)
    predicted = _activations(model.config, _plan(model, bf16=True))
    assert abs(predicted - measured) <= 0.01 * measured


def test_negative_control_without_the_moe_rows():
    model = _model("full")
    measured, _ = _step(model)
    dense = dataclasses.replace(model.config, enable_moe_block=False)
    predicted = _activations(dense, _plan(model))
    print(f"read as dense Gemma 4: {predicted / measured:.4f}")
    assert predicted < 0.95 * measured


@pytest.mark.parametrize("method", ["full", "qlora"])
def test_nf4_experts_rows_equal_a_real_step(method):
    """Experts stored by quantize_experts (frozen NF4 codes, dequantized again in backward): the
    weights, adapters, gradients and AdamW rows exactly, the activations row within 5%."""
    model = _model(method, nf4_experts=True)
    base = model if method == "full" else model.get_base_model()
    measured_saved, optimizer = _step(model)
    nf4_tensors = [t for m in base.modules() if isinstance(m, NF4Experts)
                   for w in m.nf4.values() for t in w.tensors()]
    measured = measured_state_rows(model, optimizer, nf4_tensors)
    plan = _plan(model)
    assert plan.nf4_experts
    ledger = memory.estimate_memory(base.config, plan)
    assert {row: ledger.rows[row] for row in measured} == measured
    predicted = _activations(base.config, plan)
    assert abs(predicted - measured_saved) <= 0.05 * measured_saved

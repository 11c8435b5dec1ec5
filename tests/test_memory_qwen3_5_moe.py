"""The memory ledger (nanosft/memory) on Qwen3.5-MoE (qwen3_5_moe_text), against a real step.

Compared, for full fine-tuning, LoRA (all-linear: attention, Gated DeltaNet, the shared expert and
its gate; peft rewrites no expert names for this model type), LoRA with target_parameters on the
3-D experts and the router, and QLoRA: the parameter list equals the model's names and shapes
(router, 3-D experts, shared expert, its (1, C) gate); the weights, adapters, gradients and AdamW
rows equal the distinct storage bytes after one step (the plan read off the model); the
activations row equals the bytes autograd saves (saved_tensors_hooks) within 1% for full
fine-tuning (also under bf16 autocast) and 5% for LoRA / QLoRA. Negative controls: the layers read
as dense Qwen3.5 (the shared expert as the MLP, no routed experts), and a ledger routing each
token to one expert, miss the 1%. With the experts stored as NF4 (quantize_experts) under LoRA
on them: the weights row holds their NF4 bytes exactly, the activations within 5%. Tiny model
(hidden 64, a Gated DeltaNet and a gated attention layer, 4 experts, top 2), CPU, seeded.
Run: python -m pytest -q tests/test_memory_qwen3_5_moe.py
"""

import dataclasses

import pytest
import torch
import transformers
from test_memory import measured_state_rows
from test_memory_moe import TINY, _activations, _plan, _step, assert_ledger_rows_equal_a_real_step
from tiny import one_thread  # noqa: F401  (autouse fixture)

from nanosft import memory, nf4
from nanosft.families.auto import config_from_dict, from_config
from nanosft.peft import LoraConfig, get_peft_model
from nanosft.sft import _cast_trainable_to_bf16

QWEN3_5_MOE = {**TINY, "layer_types": ["linear_attention", "full_attention"], "head_dim": 16,
               "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
               "linear_value_head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2,
               "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64}
EXPERTS = {"target_modules": "all-linear",
           "target_parameters": ["experts.gate_up_proj", "experts.down_proj", "mlp.gate.weight"]}


def _model(method, nf4_experts=False, **lora):
    from nanosft.families.nf4_experts import quantize_experts

    torch.manual_seed(0)
    config = transformers.Qwen3_5MoeTextConfig(**QWEN3_5_MOE)
    model = from_config(config_from_dict(config.to_dict()))
    if nf4_experts:
        quantize_experts(model)
    if method == "qlora":
        nf4.quantize_model(model)
    if method != "full":
        model = get_peft_model(model, LoraConfig(r=4, **(lora or {"target_modules": "all-linear"})))
    if method == "qlora":
        _cast_trainable_to_bf16(model)  # what SFTTrainer does to adapters on a 4-bit base
    return model.train()


@pytest.mark.parametrize("method", ["full", "lora", "qlora"])
def test_ledger_rows_equal_a_real_step(method):
    plan = assert_ledger_rows_equal_a_real_step(_model(method), method)
    assert not plan.target_parameters  # all-linear: no rewrite to the experts for this type


def test_lora_on_the_experts_and_router():
    """target_parameters on gate_up_proj, down_proj and the router beside all-linear: peft's
    ParamWrapper pairs, their gradients and AdamW states exactly; the W + B A each forward keeps,
    within 5%."""
    plan = assert_ledger_rows_equal_a_real_step(_model("lora", **EXPERTS), "lora")
    assert plan.target_parameters == {"experts.gate_up_proj": 4, "experts.down_proj": 4,
                                      "mlp.gate.weight": 4}


def test_activations_under_bf16_autocast():
    model = _model("full")
    measured, _ = _step(model, bf16=True)
    predicted = _activations(model.config, _plan(model, bf16=True))
    assert abs(predicted - measured) <= 0.01 * measured


def test_negative_controls_dense_reading_and_top_1_routing():
    """Read as dense Qwen3.5 with the shared expert as its MLP, or with each token sent to one
    expert, the activations row misses the 1% full fine-tuning is held to."""
    model = _model("full")
    measured, _ = _step(model)
    plan = _plan(model)
    assert abs(_activations(model.config, plan) - measured) <= 0.01 * measured
    dense = config_from_dict({**model.config.to_dict(), "model_type": "qwen3_5_text",
                              "intermediate_size": QWEN3_5_MOE["shared_expert_intermediate_size"]})
    top1 = dataclasses.replace(model.config, num_experts_per_tok=1)
    for wrong in (dense, top1):
        assert abs(_activations(wrong, plan) - measured) > 0.01 * measured
    print(f"\ndense reading {_activations(dense, plan) / measured:.3f}, top-1 "
          f"{_activations(top1, plan) / measured:.3f} of the measured bytes")
    memory.estimate_memory(model.config, memory.MemoryPlan(full=True))  # modelled: no refusal


def test_nf4_experts_rows_equal_a_real_step():
    """quantize_experts on this family, then LoRA on the NF4 experts and all-linear: the weights,
    adapter, gradient and AdamW rows exactly (the experts at nf4_nbytes plus each placeholder's
    one value), the activations within 5%; the ledger reading the experts as float misses."""
    from nanosft.families.nf4_experts import NF4Experts

    model = _model("lora", nf4_experts=True, **EXPERTS)
    stored = [t for m in model.modules() if isinstance(m, NF4Experts) for w in m.nf4.values()
              for t in w.tensors()]
    assert stored
    measured_saved, optimizer = _step(model)
    measured = measured_state_rows(model, optimizer, stored)
    plan = _plan(model)
    assert plan.nf4_experts
    config = model.get_base_model().config
    ledger = memory.estimate_memory(config, plan)
    assert {row: ledger.rows[row] for row in measured} == measured
    assert abs(_activations(config, plan) - measured_saved) <= 0.05 * measured_saved
    as_float = memory.estimate_memory(config, dataclasses.replace(plan, nf4_experts=False))
    assert as_float.rows["base weights (frozen)"] > measured["base weights (frozen)"] + 10_000

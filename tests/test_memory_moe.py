"""The memory ledger (nanosft/memory) on OLMo 3, Cohere 2, GPT-NeoX and the mixture-of-experts
families (Qwen3-MoE, GLM-4-MoE, gpt-oss), against the tensors of a real step.

Compared, per family and for full fine-tuning, LoRA (all-linear) and QLoRA: the parameter list
equals the model's names and shapes (3-D experts, routers, sinks, GLM's shared experts and dense
first layer, NeoX's LayerNorm biases); the weights, adapters (peft's ParamWrapper pairs on the
experts and the router, gate_up_proj at twice the rank), gradients and AdamW rows equal the
distinct storage bytes after one step, the plan read off the peft-wrapped model by
plan_from_model; the activations row equals the bytes autograd saves (saved_tensors_hooks)
within 1% for full fine-tuning and 5% for LoRA / QLoRA (those count the first layer's input,
which the ledger leaves out for a frozen embedding, as for Llama). The MoE block's rows are the
N * top_k tokens dispatched to the experts; under bf16 autocast each expert's weight slice is cast
anew and kept. Negative controls: a ledger routing each token to one expert (10% short), the
parallel and post-norm layers read as Llama's (off by more than 1%), and the autocast copies left
out (5% short), each miss the tolerance. Families still not modelled are refused by name, and the
trainer's prediction steps aside for NF4 experts (quantize_experts). Tiny models (hidden 64, 2
layers, 4 experts, top 2), CPU, seeded.
Run: python -m pytest -q tests/test_memory_moe.py
"""

import dataclasses
from types import SimpleNamespace

import pytest
import torch
import transformers
from test_memory import _storages, measured_state_rows
from tiny import one_thread  # noqa: F401  (autouse fixture)

from nanosft import memory, nf4
from nanosft.configuration import ModelConfig
from nanosft.families.auto import AutoConfig, config_from_dict, from_config
from nanosft.peft import LoraConfig, get_peft_model
from nanosft.sft import _cast_trainable_to_bf16

TINY = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
        "pad_token_id": 0, "bos_token_id": None, "eos_token_id": None}
MOE = {"num_experts_per_tok": 2}
FAMILIES = {  # model_type: (transformers config class, overrides of TINY)
    "qwen3_moe": ("Qwen3MoeConfig", {**MOE, "head_dim": 32, "num_experts": 4,
                                     "moe_intermediate_size": 32, "norm_topk_prob": True}),
    # layer 0 dense, layer 1 routed (sigmoid, 2 groups) plus shared experts; q/k norms
    "glm4_moe": ("Glm4MoeConfig", {**MOE, "n_routed_experts": 4, "moe_intermediate_size": 64,
                                   "n_group": 2, "topk_group": 1, "use_qk_norm": True,
                                   "attention_bias": True}),
    # layer 0 sliding (5-token window), layer 1 full; sinks, biased router and experts
    "gpt_oss": ("GptOssConfig", {**MOE, "head_dim": 32, "num_local_experts": 4,
                                 "sliding_window": 5, "rope_parameters": {
                                     "rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4,
                                     "original_max_position_embeddings": 32}}),
    "olmo3": ("Olmo3Config", {"sliding_window": 5}),
    "cohere2": ("Cohere2Config", {"sliding_window": 5}),
    # intermediate 4 x hidden, as GPT-NeoX's checkpoints (at 2 x, its gelu MLP's one fewer
    # (N, I) tensor and its fused v's two more (N, C) cancel, and the Llama reading agrees)
    "gpt_neox": ("GPTNeoXConfig", {"num_key_value_heads": None, "intermediate_size": 256}),
}
B, T, V = 2, 32, 128


def _model(name, method, **lora):
    cls, overrides = FAMILIES[name]
    fields = {**TINY, **overrides}
    if fields["num_key_value_heads"] is None:  # GPT-NeoX has no grouped-query heads
        del fields["num_key_value_heads"]
    torch.manual_seed(0)
    model = from_config(config_from_dict(getattr(transformers, cls)(**fields).to_dict()))
    if method == "qlora":
        nf4.quantize_model(model)
    if method != "full":
        model = get_peft_model(model, LoraConfig(r=4, **(lora or {"target_modules": "all-linear"})))
    if method == "qlora":
        _cast_trainable_to_bf16(model)  # what SFTTrainer does to adapters on a 4-bit base
    return model.train()


def _step(model, bf16=False):
    """One AdamW step; the bytes autograd saved for its backward (less the model's own state)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-3)
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(0))
    with memory.count_saved_tensors(model) as saved:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    return saved.total, optimizer


def _plan(model, bf16=False):
    args = SimpleNamespace(per_device_train_batch_size=B, optim="adamw_torch", optim_args=None,
                           gradient_checkpointing=False, bf16=bf16)
    return memory.plan_from_model(model, args, T)


def _activations(config, plan):  # the loss's fp32 log-probs are the logits row's share
    return memory.estimate_memory(config, plan).rows["activations (saved for backward)"] + \
        B * T * V * 4


def assert_ledger_rows_equal_a_real_step(model, method):
    """Parameter shapes (full), the four state rows exactly and the activations row within 1%
    (full) / 5% (LoRA, QLoRA) of one real step of `model`; returns the plan read off it."""
    base = model if method == "full" else model.get_base_model()
    if method == "full":
        real = {n: tuple(p.shape) for n, p in model.named_parameters()}
        assert dict(memory.parameter_shapes(base.config)) == real
    measured_saved, optimizer = _step(model)
    measured = measured_state_rows(model, optimizer)
    plan = _plan(model)
    ledger = memory.estimate_memory(base.config, plan)
    assert {row: ledger.rows[row] for row in measured} == measured
    predicted = _activations(base.config, plan)
    assert abs(predicted - measured_saved) <= (0.01 if method == "full" else 0.05) * measured_saved
    return plan


@pytest.mark.parametrize("method", ["full", "lora", "qlora"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_ledger_rows_equal_a_real_step(name, method):
    plan = assert_ledger_rows_equal_a_real_step(_model(name, method), method)
    if method != "full" and name in ("qwen3_moe", "glm4_moe"):  # peft's rewrite of all-linear
        assert plan.target_parameters == {"gate_up_proj": 8, "down_proj": 4, "gate.weight": 4}


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_lora_on_gpt_oss_transposed_experts(method):
    """target_parameters on gpt-oss's (E, in, out) experts: the pairs, their gradients and AdamW
    states, and the (E, in, out) W + B A (plus, on a 4-bit base, the bf16 factors cast to the
    experts' fp32) each forward keeps."""
    model = _model("gpt_oss", method, target_modules=["q_proj"],
                   target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    measured_saved, optimizer = _step(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    plan = _plan(model)
    ledger = memory.estimate_memory(model.get_base_model().config, plan)
    assert ledger.rows["trainable parameters"] == _storages(trainable)
    assert ledger.rows["optimizer states"] == _storages(
        [v for s in optimizer.state.values() for v in s.values()])
    predicted = _activations(model.get_base_model().config, plan)
    assert abs(predicted - measured_saved) <= 0.05 * measured_saved
    per_layer = ledger.per_layer[1]
    E, C, I = 4, 64, 128
    assert per_layer["experts.gate_up_proj_plus_delta"] == E * C * 2 * I * 4


def test_moe_rows_are_the_top_k_dispatched_tokens_and_autocast_copies():
    """Qwen3-MoE: the experts' saves scale with N * top_k rows (a ledger routing each token to
    one expert is short); under bf16 autocast over fp32 weights each expert's slice is cast anew
    and kept (within 1%; without those copies the ledger is short by more than 5%)."""
    model = _model("qwen3_moe", "full")
    measured, _ = _step(model)
    plan = _plan(model)
    assert abs(_activations(model.config, plan) - measured) <= 0.01 * measured
    top1 = dataclasses.replace(model.config, num_experts_per_tok=1)
    assert _activations(top1, plan) < 0.9 * measured
    model = _model("qwen3_moe", "full")
    measured, _ = _step(model, bf16=True)
    plan = _plan(model, bf16=True)
    predicted = _activations(model.config, plan)
    assert abs(predicted - measured) <= 0.01 * measured
    casts = sum(d.get(f"experts.{p}_cast", 0) for p in ("gate_up_proj", "down_proj")
                for d in memory.estimate_memory(model.config, plan).per_layer)
    assert casts == 2 * 4 * 3 * 32 * 64 * 2  # 2 layers, 4 experts, (2 I + I) x C bf16 weights
    assert predicted - casts < 0.95 * measured


@pytest.mark.parametrize("name", ["olmo3", "cohere2", "gpt_neox"])
def test_negative_control_the_layers_read_as_llama(name):
    """Post-norm (OLMo 3), parallel blocks under one LayerNorm (Cohere 2), parallel residual
    with LayerNorms and a fused query_key_value (GPT-NeoX): read as Llama's, the activations
    row misses the 1% that full fine-tuning is held to (Cohere 2 by 1.5%: its LayerNorm keeps
    two (N, C) copies where Llama's two RMSNorms keep one input each)."""
    model = _model(name, "full")
    measured, _ = _step(model)
    fields = {**model.config.to_dict(), "model_type": "llama", "rope_parameters": None,
              "hidden_act": "silu",  # GPT-NeoX's gelu and partial RoPE: Llama's names
              "tie_word_embeddings": model.config.tie_word_embeddings}
    as_llama = ModelConfig.from_dict(fields)
    assert abs(_activations(as_llama, _plan(model)) - measured) > 0.01 * measured


def test_moe_families_are_not_refused():
    moe = config_from_dict(transformers.Qwen3MoeConfig(**TINY, num_experts=4,
                                                       num_experts_per_tok=2).to_dict())
    memory.estimate_memory(moe, memory.MemoryPlan(full=True))  # modelled now: no refusal


def _nf4_experts_model(name, method, **lora):
    """_model with the experts stored as NF4 (quantize_experts) before LoRA wraps them."""
    from nanosft.families.nf4_experts import quantize_experts

    cls, overrides = FAMILIES[name]
    torch.manual_seed(0)
    model = from_config(config_from_dict(getattr(transformers, cls)(**{**TINY, **overrides})
                                         .to_dict()))
    if method == "qlora":
        nf4.quantize_model(model)
    quantize_experts(model)
    if method != "full":
        model = get_peft_model(model, LoraConfig(r=4, **(lora or {"target_modules": "all-linear"})))
    if method == "qlora":
        _cast_trainable_to_bf16(model)
    return model.train()


def _nf4_expert_weights(model):
    from nanosft.families.nf4_experts import NF4Experts

    return [w for m in model.modules() if isinstance(m, NF4Experts) for w in m.nf4.values()]


@pytest.mark.parametrize("name,method,bf16", [("qwen3_moe", "full", True),
                                              ("qwen3_moe", "lora", False),
                                              ("glm4_moe", "qlora", True),
                                              ("gpt_oss", "lora", False)])
def test_nf4_experts_rows_equal_a_real_step(name, method, bf16):
    """Experts stored by quantize_experts: the weights row holds nf4_nbytes per 3-D weight (codes,
    double-quantized statistics) plus each placeholder's one value, exactly (gpt-oss's biases
    stay float); the experts neither
    train nor keep a float weight for backward (dequantized again there), so the activations row
    (LoRA's delta D[e] and its input rows where target_parameters reach the experts) is within 5%.
    Negative control: the same step predicted with the experts in float misses the weights row by
    more than their float bytes less the NF4 bytes."""
    model = _nf4_experts_model(name, method)
    base = model if method == "full" else model.get_base_model()
    measured_saved, optimizer = _step(model, bf16=bf16)
    measured = measured_state_rows(
        model, optimizer, [t for w in _nf4_expert_weights(model) for t in w.tensors()])
    plan = _plan(model, bf16=bf16)
    assert plan.nf4_experts
    ledger = memory.estimate_memory(base.config, plan)
    assert {row: ledger.rows[row] for row in measured} == measured
    predicted = _activations(base.config, plan)
    assert abs(predicted - measured_saved) <= 0.05 * measured_saved
    as_float = memory.estimate_memory(base.config, dataclasses.replace(plan, nf4_experts=False))
    assert as_float.rows["base weights (frozen)"] + as_float.rows["trainable parameters"] > \
        measured["base weights (frozen)"] + measured["trainable parameters"] + 10_000


@pytest.mark.parametrize("bf16", [False, True])
def test_nf4_experts_keep_no_float_expert_weight_for_backward(bf16):
    """No tensor autograd saves equals an expert's dequantized (out, in) slice (nor its bf16 copy
    under autocast, which float experts keep per expert): NF4Experts dequantize again in backward.
    Controls: float experts holding the same values do save them; the ledger lists the autocast
    copies for float experts only."""
    from nanosft.families.nf4_experts import dequantize_experts

    model = _nf4_experts_model("qwen3_moe", "lora", target_modules=["q_proj"])
    slices = [w.dequantize(e) for w in _nf4_expert_weights(model)
              for e in range(w.shape[0])]
    slices += [s.t() for s in slices]  # F.linear saves W[e]^T for mm
    found = []

    def pack(t):
        if t.dim() == 2 and t.is_floating_point():
            found.extend(1 for s in slices if s.shape == t.shape and torch.equal(s.to(t.dtype), t))
        return t

    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(0))

    def run():
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = model(input_ids=ids, labels=ids).loss
        loss.backward()

    run()
    assert not found
    config, plan = model.get_base_model().config, _plan(model, bf16=bf16)
    dequantize_experts(model)  # control: float experts holding the same values keep W[e]
    run()
    assert found
    rows = memory.estimate_memory(config, plan).per_layer[1]
    assert not any(k.startswith("experts.") and k.endswith("_cast") for k in rows)
    float_rows = memory.estimate_memory(config, dataclasses.replace(plan, nf4_experts=False))
    assert any(k.endswith("_proj_cast") for k in float_rows.per_layer[1]) == bf16


def test_trainer_prediction_counts_nf4_experts(tmp_path):
    """The trainer's prediction line reads NF4 experts off the model (it stepped aside before):
    its weights row is the float one less the experts' float bytes plus their NF4 bytes."""
    from nanosft.args import TrainingArguments
    from nanosft.families.nf4_experts import experts_nbytes

    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=B,
                             optim="adamw_torch")
    model = _model("qwen3_moe", "lora")
    before = memory.predict_for_trainer(model, args)
    nf4_model = _nf4_experts_model("qwen3_moe", "lora")
    after = memory.predict_for_trainer(nf4_model, args)
    assert after is not None and after.plan.nf4_experts and not before.plan.nf4_experts
    assert after.rows["base weights (frozen)"] == before.rows["base weights (frozen)"] - \
        experts_nbytes(model.get_base_model()) + experts_nbytes(nf4_model.get_base_model())
    assert after.rows["trainable parameters"] == before.rows["trainable parameters"]


def test_cli_memory_prints_an_moe_ledger(tmp_path, capsys):
    from nanosft import cli

    cls, overrides = FAMILIES["glm4_moe"]
    getattr(transformers, cls)(**{**TINY, **overrides}).save_pretrained(tmp_path)
    assert cli.main(["memory", "--model", str(tmp_path), "--lora", "--target_modules",
                     "all-linear", "--max_length", "64", "--gradient_checkpointing",
                     "false"]) == 0
    out = capsys.readouterr().out
    plan = memory.MemoryPlan(max_length=64, bf16=True, target_modules="all-linear",
                             fused_lm_head=True)  # as nanosft train
    ledger = memory.estimate_memory(AutoConfig.from_pretrained(str(tmp_path)), plan)
    assert ledger.plan.target_modules == "all-linear" and ledger.rows["trainable parameters"]
    for name, value in ledger.rows.items():
        assert f"{name:<34}{value / memory.MiB:>10.3f} MiB" in out

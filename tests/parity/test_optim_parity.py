"""Parity of nanosft.optim with transformers: schedule curves, decay grouping, one AdamW step.

Compared: the learning rate after every scheduler.step() over 30 steps for every schedule name
(nanosft.optim.get_scheduler vs transformers.get_scheduler, same optimizer settings and kwargs), the
weight-decay names of a tiny transformers Llama (Trainer.get_decay_parameter_names vs ours), and the
parameters after one step of the optimizer each side builds (AdamW: bit-equal; bitsandbytes 8-bit
AdamW and its paged variant: also the class, lr, betas, eps, optim bits, paging, min_8bit_size and
which tensors get 8-bit state). Hermetic: the Llama is built in-process from a 2-layer config,
nothing is downloaded. Run: python -m pytest -q tests/parity/test_optim_parity.py
"""

import types

import bitsandbytes as bnb
import pytest
import torch
import transformers

from nanosft.args import TrainingArguments
from nanosft.optim import create_optimizer, get_decay_parameter_names, get_scheduler

STEPS, WARMUP, LR = 30, 4, 1e-3

# (schedule name, scheduler_specific_kwargs); each with warmup and a non-default knob where it has
# one.
CASES = [
    ("linear", None),
    ("cosine", None),
    ("cosine", {"num_cycles": 1.5}),
    ("cosine_with_restarts", {"num_cycles": 3}),
    ("polynomial", {"lr_end": 1e-5, "power": 2.0}),
    ("constant", None),
    ("constant_with_warmup", None),
    ("inverse_sqrt", None),
    ("inverse_sqrt", {"timescale": 7}),
    ("cosine_with_min_lr", {"min_lr": 1e-4}),
    ("cosine_with_min_lr", {"min_lr_rate": 0.2, "num_cycles": 0.25}),
    ("cosine_warmup_with_min_lr", {"min_lr_rate": 0.1}),
    ("cosine_warmup_with_min_lr", {"min_lr": 1e-4, "warmup_lr_rate": 0.3}),
    ("warmup_stable_decay", {"num_decay_steps": 10}),
    (
        "warmup_stable_decay",
        {
            "num_decay_steps": 8,
            "warmup_type": "cosine",
            "decay_type": "1-sqrt",
            "min_lr_ratio": 0.1,
        },
    ),
    (
        "warmup_stable_decay",
        {
            "num_decay_steps": 6,
            "num_stable_steps": 5,
            "warmup_type": "1-sqrt",
            "decay_type": "linear",
        },
    ),
]


def _lr_curve(make_scheduler, name, kwargs):
    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([param], lr=LR)
    sched = make_scheduler(
        name,
        opt,
        num_warmup_steps=WARMUP,
        num_training_steps=STEPS,
        scheduler_specific_kwargs=kwargs,
    )
    curve = []
    for _ in range(STEPS + 3):  # a few steps past the end: schedules must keep their floor
        curve.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return curve


@pytest.mark.parametrize("name,kwargs", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_schedule_curve_equals_transformers(name, kwargs):
    ours = _lr_curve(get_scheduler, name, kwargs)
    theirs = _lr_curve(transformers.get_scheduler, name, kwargs)
    # Same float operations in the same order: equal to the last bit (1e-12 leaves room for nothing
    # else).
    torch.testing.assert_close(
        torch.tensor(ours, dtype=torch.float64),
        torch.tensor(theirs, dtype=torch.float64),
        rtol=0,
        atol=1e-12,
    )
    starts_above_zero = name in ("constant", "cosine_warmup_with_min_lr") or "min_lr_ratio" in (
        kwargs or {}
    )
    if not starts_above_zero:
        assert (
            ours[0] == 0.0
        )  # warmup starts at lr 0 (transformers' warmup), negative control for an off-by-one


def test_plateau_scheduler_reduces_like_transformers():
    curves = []
    for make in (get_scheduler, transformers.get_scheduler):
        param = torch.nn.Parameter(torch.zeros(2))
        opt = torch.optim.SGD([param], lr=LR)
        sched = make(
            "reduce_lr_on_plateau", opt, scheduler_specific_kwargs={"patience": 1, "factor": 0.5}
        )
        lrs = []
        for metric in (1.0, 0.9, 0.95, 0.97, 0.99, 0.5):
            sched.step(metric)
            lrs.append(opt.param_groups[0]["lr"])
        curves.append(lrs)
    assert curves[0] == curves[1]
    assert curves[0][-1] < LR  # it did reduce


def _tiny_llama(hidden_size=32, intermediate_size=64):
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def test_decay_names_equal_trainer_rule_on_llama():
    model = _tiny_llama()
    trainer_self = types.SimpleNamespace()  # the method reads nothing from self
    theirs = transformers.Trainer.get_decay_parameter_names(trainer_self, model)
    ours = get_decay_parameter_names(model)
    assert ours == theirs
    assert "model.norm.weight" not in ours and "model.layers.0.input_layernorm.weight" not in ours
    assert "model.layers.0.self_attn.q_proj.weight" in ours


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused"])
def test_one_adamw_step_equals_transformers_trainer_optimizer(optim, tmp_path):
    kw = {
        "learning_rate": 1e-2,
        "weight_decay": 0.1,
        "adam_beta1": 0.8,
        "adam_beta2": 0.99,
        "adam_epsilon": 1e-6,
        "optim": optim,
    }
    hf_args = transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", **kw
    )
    ours_model, theirs_model = _tiny_llama(), _tiny_llama()
    theirs_trainer = transformers.Trainer(model=theirs_model, args=hf_args)
    theirs_opt = theirs_trainer.create_optimizer()
    ours_opt = create_optimizer(ours_model, TrainingArguments(output_dir=str(tmp_path), **kw))
    assert [g["weight_decay"] for g in ours_opt.param_groups] == [
        g["weight_decay"] for g in theirs_opt.param_groups
    ]
    assert ours_opt.defaults.get("fused") == theirs_opt.defaults.get("fused")
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    for model, opt in ((ours_model, ours_opt), (theirs_model, theirs_opt)):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    for (name, p_ours), p_theirs in zip(ours_model.named_parameters(), theirs_model.parameters()):
        # Same optimizer class, same kernel, same groups, same grads: bit-equal.
        torch.testing.assert_close(p_ours, p_theirs, rtol=0, atol=0, msg=name)


@pytest.fixture
def fresh_bnb_manager():
    """bitsandbytes keeps per-parameter overrides in a process-wide GlobalOptimManager, keyed by
    (group, index); one optimizer's entries would leak into the next, so each test starts clean."""
    bnb.optim.GlobalOptimManager.get_instance().initialize()
    yield
    bnb.optim.GlobalOptimManager.get_instance().initialize()


def _bnb_settings(opt):
    groups = [
        (g["lr"], g["betas"], g["eps"], g["weight_decay"], len(g["params"]))
        for g in opt.param_groups
    ]
    return type(opt), groups, vars(opt.args), opt.is_paged


@pytest.mark.filterwarnings(
    "ignore::UserWarning"
)  # bnb on CPU: "paged optimizers are not supported"
@pytest.mark.parametrize("optim", ["adamw_bnb_8bit", "paged_adamw_8bit"])
def test_one_8bit_adamw_step_equals_transformers_trainer_optimizer(
    optim, tmp_path, fresh_bnb_manager
):
    # Non-default lr, betas and eps, so a builder that ignores any of them is caught.
    kw = {
        "learning_rate": 1e-2,
        "weight_decay": 0.1,
        "adam_beta1": 0.8,
        "adam_beta2": 0.99,
        "adam_epsilon": 1e-6,
        "optim": optim,
    }
    hf_args = transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", **kw
    )
    # hidden 64: embed_tokens, lm_head (128 x 64) and the MLP (128 x 64) reach bnb's min_8bit_size
    # 4096
    ours_model, theirs_model = _tiny_llama(64, 128), _tiny_llama(64, 128)
    theirs_opt = transformers.Trainer(model=theirs_model, args=hf_args).create_optimizer()
    ours_opt = create_optimizer(ours_model, TrainingArguments(output_dir=str(tmp_path), **kw))
    assert _bnb_settings(ours_opt) == _bnb_settings(theirs_opt)
    assert isinstance(ours_opt, bnb.optim.AdamW) and ours_opt.args.optim_bits == 8
    assert ours_opt.is_paged == (optim == "paged_adamw_8bit")
    assert (
        ours_opt.param_groups[0]["betas"] == (0.8, 0.99) and ours_opt.param_groups[0]["eps"] == 1e-6
    )
    assert [g["weight_decay"] for g in ours_opt.param_groups] == [0.1, 0.0]
    ours_names = {id(p): n for n, p in ours_model.named_parameters()}
    theirs_names = {id(p): n for n, p in theirs_model.named_parameters()}
    assert [[ours_names[id(p)] for p in g["params"]] for g in ours_opt.param_groups] == [
        [theirs_names[id(p)] for p in g["params"]] for g in theirs_opt.param_groups
    ]
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    for model, opt in ((ours_model, ours_opt), (theirs_model, theirs_opt)):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    state_dtypes = [
        {n: opt.state[p]["state1"].dtype for n, p in model.named_parameters()}
        for model, opt in ((ours_model, ours_opt), (theirs_model, theirs_opt))
    ]
    # transformers keeps nn.Embedding in 32-bit state; big linears are 8-bit, small ones 32-bit.
    assert state_dtypes[0] == state_dtypes[1]
    assert state_dtypes[0]["model.embed_tokens.weight"] == torch.float32
    assert state_dtypes[0]["model.layers.0.mlp.up_proj.weight"] == torch.uint8
    for (name, p_ours), p_theirs in zip(ours_model.named_parameters(), theirs_model.parameters()):
        # Same class, same blockwise kernels, same state bits, same grads: bit-equal.
        torch.testing.assert_close(p_ours, p_theirs, rtol=0, atol=0, msg=name)

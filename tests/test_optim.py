"""Behaviour of nanosft.optim: decay groups, every optimizer steps, schedule formulas written out,
errors.

Compared: which parameters get weight decay (biases and norm weights never, frozen ones are in no
group), one AdamW step against the decoupled-decay formula computed by hand in the test, each
optimizer name building and changing the weights, learning rates against the formulas of
transformers' get_scheduler (including the 0, 5e-4, 1e-3, 6.67e-4, 3.33e-4 warmup/linear sequence).
Hermetic: tiny nn.Modules on CPU.
Run: python -m pytest -q tests/test_optim.py
"""

import math
import warnings

import pytest
import torch
from torch import nn

from nanosft.args import TrainingArguments
from nanosft.optim import (
    create_optimizer,
    create_scheduler,
    get_decay_parameter_names,
    get_parameter_groups,
    get_scheduler,
    parse_optim_args,
)


class MyRMSNorm(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Tiny(nn.Module):
    """Norms behind names the regex rule misses (ln_f, scale): only the class rule catches them."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.fc = nn.Linear(8, 8)
        self.ln_f = nn.LayerNorm(8)
        self.scale = MyRMSNorm(8)
        self.post_attention_layernorm = nn.Module()
        self.post_attention_layernorm.weight = nn.Parameter(torch.ones(8))
        self.head = nn.Linear(8, 10, bias=False)

    def forward(self, ids):
        return self.head(
            self.scale(self.ln_f(self.fc(self.embed(ids)) * self.post_attention_layernorm.weight))
        )


def test_decay_names_exclude_biases_and_norms_by_name_and_by_class():
    names = get_decay_parameter_names(Tiny())
    assert names == ["embed.weight", "fc.weight", "head.weight"]


def test_decay_names_on_nanosft_llama():
    model_mod = pytest.importorskip("nanosft.model")
    config = model_mod.ModelConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=32,
    )
    model = model_mod.CausalLM(config)
    names = get_decay_parameter_names(model)
    all_names = [n for n, _ in model.named_parameters()]
    expected = [
        n for n in all_names if "norm" not in n
    ]  # the only non-decayed params of a bias-free Llama
    assert names == expected


def test_groups_hold_only_trainable_parameters_and_keep_empty_groups():
    model = Tiny()
    for p in model.parameters():
        p.requires_grad_(False)
    model.fc.bias.requires_grad_(True)
    groups = get_parameter_groups(model, weight_decay=0.1)
    assert [len(g["params"]) for g in groups] == [0, 1]
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert groups[1]["params"][0] is model.fc.bias


def test_no_trainable_parameter_is_a_clear_error():
    model = Tiny().requires_grad_(False)
    with pytest.raises(ValueError, match="Tiny has no parameter with requires_grad=True"):
        create_optimizer(model, TrainingArguments())


@pytest.mark.parametrize("optim", ["adamw_torch_fused", "adamw_torch"])
def test_adamw_step_matches_decoupled_decay_formula(optim):
    torch.manual_seed(0)
    model = Tiny()
    lr, wd, b1, b2, eps = 1e-2, 0.1, 0.9, 0.999, 1e-8
    args = TrainingArguments(
        optim=optim,
        learning_rate=lr,
        weight_decay=wd,
        adam_beta1=b1,
        adam_beta2=b2,
        adam_epsilon=eps,
    )
    opt = create_optimizer(model, args)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    decayed = set(get_decay_parameter_names(model))
    for n, p in model.named_parameters():
        g, w = grads[n], before[n]
        w = w * (1 - lr * (wd if n in decayed else 0.0))  # decoupled decay first
        m, v = (1 - b1) * g, (1 - b2) * g * g
        expected = w - (lr / (1 - b1)) * m / ((v.sqrt() / math.sqrt(1 - b2)) + eps)
        torch.testing.assert_close(
            p.detach(), expected, rtol=1e-6, atol=1e-7, msg=n
        )  # fused vs eager: ~1 ulp


@pytest.mark.parametrize(
    "optim,cls_name",
    [
        ("adamw_torch_fused", "AdamW"),
        ("adamw_torch", "AdamW"),
        ("adamw_bnb_8bit", "AdamW"),
        ("paged_adamw_8bit", "AdamW"),
        ("sgd", "SGD"),
    ],
)
def test_each_optimizer_builds_and_steps(optim, cls_name):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 128), nn.LayerNorm(128), nn.Linear(128, 4)
    )  # 8192 weights: 8-bit state
    args = TrainingArguments(
        optim=optim,
        learning_rate=1e-2,
        weight_decay=0.01,
        optim_args="momentum=0.9" if optim == "sgd" else None,
    )
    opt = create_optimizer(model, args)
    assert type(opt).__name__ == cls_name
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(3, 64)).pow(2).mean().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bitsandbytes: "Paged optimizers are not supported on CPU"
        opt.step()
    assert all(not torch.equal(a, b.detach()) for a, b in zip(before, model.parameters()))
    if "8bit" in optim:
        assert opt.state[model[0].weight]["state1"].dtype == torch.uint8  # really 8-bit moments
    if optim == "sgd":
        assert opt.param_groups[0]["momentum"] == 0.9


def test_optim_args_parsing():
    assert parse_optim_args("momentum=0.9, nesterov=True") == {
        "momentum": "0.9",
        "nesterov": "True",
    }
    assert parse_optim_args(None) == {}
    with pytest.raises(ValueError, match="'momentum' is not key=value"):
        parse_optim_args("momentum")


def _lrs(name, warmup, total, lr=1e-3, steps=None, **kwargs):
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=lr)
    sched = get_scheduler(
        name,
        opt,
        num_warmup_steps=warmup,
        num_training_steps=total,
        scheduler_specific_kwargs=kwargs or None,
    )
    out = []
    for _ in range(steps or total):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_linear_warmup_first_step_runs_at_zero():
    # transformers get_linear_schedule_with_warmup: warmup 2, lr 1e-3, 5 steps -> 0, 5e-4, 1e-3,
    # 6.67e-4, 3.33e-4.
    expected = [0.0, 5e-4, 1e-3, 1e-3 * 2 / 3, 1e-3 / 3]
    torch.testing.assert_close(
        torch.tensor(_lrs("linear", 2, 5)), torch.tensor(expected), rtol=1e-12, atol=0
    )


def test_cosine_formula():
    W, T = 3, 12
    expected = [
        s / W if s < W else 0.5 * (1 + math.cos(math.pi * (s - W) / (T - W))) for s in range(T)
    ]
    torch.testing.assert_close(
        torch.tensor(_lrs("cosine", W, T, lr=1.0)), torch.tensor(expected), rtol=0, atol=1e-12
    )


def test_constant_ignores_warmup_but_constant_with_warmup_does_not():
    assert _lrs("constant", 3, 6, lr=1.0) == [1.0] * 6
    assert _lrs("constant_with_warmup", 3, 6, lr=1.0) == [0.0, 1 / 3, 2 / 3, 1.0, 1.0, 1.0]


def test_inverse_sqrt_and_polynomial_formulas():
    got = _lrs("inverse_sqrt", 4, 10, lr=1.0)
    expected = [s / 4 if s < 4 else 1 / math.sqrt(s / 4) for s in range(10)]  # timescale = warmup
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=0, atol=1e-12)
    got = _lrs("polynomial", 0, 4, lr=1.0, steps=6, lr_end=0.1, power=2.0)
    expected = [(1 - 0.1) * (1 - s / 4) ** 2 + 0.1 for s in range(5)] + [
        0.1
    ]  # past the end: lr_end
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=0, atol=1e-12)


def test_warmup_stable_decay_phases():
    got = _lrs("warmup_stable_decay", 2, 8, lr=1.0, steps=9, num_decay_steps=4, decay_type="linear")
    assert got == [0.0, 0.5, 1.0, 1.0, 1.0, 0.75, 0.5, 0.25, 0]


def test_create_scheduler_uses_warmup_ratio_and_kwargs():
    args = TrainingArguments(
        lr_scheduler_type="cosine_with_restarts",
        warmup_steps=0.25,
        lr_scheduler_kwargs={"num_cycles": 2},
        learning_rate=1.0,
    )
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = create_scheduler(args, opt, num_training_steps=10)
    assert sched.lr_lambdas[0].keywords == {
        "num_warmup_steps": 3,
        "num_training_steps": 10,
        "num_cycles": 2,
    }


def test_scheduler_state_round_trips():
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = get_scheduler("linear", opt, num_warmup_steps=2, num_training_steps=10)
    for _ in range(4):
        opt.step()
        sched.step()
    state = sched.state_dict()
    opt2 = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    sched2 = get_scheduler("linear", opt2, num_warmup_steps=2, num_training_steps=10)
    sched2.load_state_dict(state)
    opt2.step()
    sched2.step()
    opt.step()
    sched.step()
    assert sched2.get_last_lr() == sched.get_last_lr()


@pytest.mark.parametrize(
    "name,kwargs,match",
    [
        ("cosinus", {}, "lr_scheduler_type='cosinus' is unknown"),
        (
            "linear",
            {"num_cycles": 2},
            r"keys \['num_cycles'\] do not apply to lr_scheduler_type='linear'",
        ),
        ("polynomial", {"lr_end": 1.0}, "lr_end .* must be smaller"),
        ("cosine_with_min_lr", {}, "needs lr_scheduler_kwargs"),
        ("cosine_with_min_lr", {"min_lr": 1e-5, "min_lr_rate": 0.1}, "both min_lr and min_lr_rate"),
        ("warmup_stable_decay", {}, "num_decay_steps"),
        (
            "warmup_stable_decay",
            {"num_decay_steps": 2, "decay_type": "cubic"},
            "decay_type='cubic'",
        ),
    ],
)
def test_scheduler_errors(name, kwargs, match):
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.5)
    with pytest.raises(ValueError, match=match):
        get_scheduler(
            name, opt, num_warmup_steps=1, num_training_steps=5, scheduler_specific_kwargs=kwargs
        )


def test_an_earlier_models_embedding_override_does_not_reach_the_next_optimizer():
    """bitsandbytes keeps 32-bit overrides in one process-wide manager, keyed by parameter
    position: the embedding of a model trained earlier must not make the next model's first
    weight (same position) keep 32-bit state."""
    first = nn.Sequential(nn.Embedding(64, 128), nn.Linear(128, 64))
    opt = create_optimizer(first, TrainingArguments(optim="adamw_bnb_8bit"))
    first(torch.tensor([[1, 2, 3]])).sum().backward()
    opt.step()
    assert opt.state[first[0].weight]["state1"].dtype == torch.float32  # the override acted
    second = nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 4))  # a weight at position 0
    opt = create_optimizer(second, TrainingArguments(optim="adamw_bnb_8bit"))
    second(torch.randn(3, 64)).pow(2).mean().backward()
    opt.step()
    assert opt.state[second[0].weight]["state1"].dtype == torch.uint8

"""Optimizer and learning-rate schedule: weight-decay groups, AdamW / 8-bit AdamW / SGD, every
HF schedule.

Guide: optimizers and schedulers. 优化器配置与管理 -> AdamW优化器实现 (two parameter groups,
decoupled weight decay, Loshchilov & Hutter 1711.05101) and 学习率调度器类型 (linear, cosine,
constant, warmup, plateau). Each schedule is a named multiplier function
`lr_lambda(step) -> factor` wrapped in torch's LambdaLR, so optimizer step s (1-based) runs at
base_lr * lr_lambda(s - 1), exactly as transformers.get_scheduler.
"""

import math
import re
from functools import partial

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR, ReduceLROnPlateau

# Lower-cased dotted names that never get weight decay
# (transformers Trainer.get_decay_parameter_names).
NO_DECAY_PATTERNS = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]


# ----------------------------------------------------------------------------- decay groups
def _is_norm_module(module: nn.Module) -> bool:
    # nn.LayerNorm by type (as transformers); any *LayerNorm / *RMSNorm class
    # (nanosft's, torch's) by name.
    name = type(module).__name__
    return isinstance(module, nn.LayerNorm) or name.endswith(("LayerNorm", "RMSNorm"))


def get_decay_parameter_names(model: nn.Module) -> list[str]:
    """Names of the parameters that get weight decay: all but biases and norm weights, in
    model order.
    Guide: optimizers and schedulers | Mirrors: transformers Trainer.get_decay_parameter_names
    Differs: RMSNorm modules are excluded by class too, not only by their attribute name."""
    patterns = [re.compile(p) for p in NO_DECAY_PATTERNS]
    norm_prefixes = [prefix + "." for prefix, m in model.named_modules()
                     if prefix and _is_norm_module(m)]
    names = []
    for name, _ in model.named_parameters():
        if any(p.search(name.lower()) for p in patterns):
            continue
        if any(name.startswith(prefix) for prefix in norm_prefixes):
            continue
        names.append(name)
    return names


def get_parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two optimizer groups of trainable parameters: [decayed, weight_decay=0.0]; empty groups
    are kept.
    Guide: optimizers and schedulers (分组参数权重衰减)
    Mirrors: transformers Trainer.create_optimizer (optimizer_grouped_parameters)"""
    decay = set(get_decay_parameter_names(model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError(f"{type(model).__name__} has no parameter with requires_grad=True, so "
                         "there is nothing to optimise. Unfreeze some parameters "
                         "(for LoRA: wrap it with get_peft_model first).")
    return [
        {"params": [p for n, p in named if n in decay], "weight_decay": weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]


# ----------------------------------------------------------------------------- optimizers
def parse_optim_args(optim_args: str | None) -> dict[str, str]:
    """Parse `optim_args` "momentum=0.9,nesterov=True" into {"momentum": "0.9", "nesterov": "True"}.
    Mirrors: transformers trainer_optimizer._parse_optim_args"""
    if not optim_args:
        return {}
    parsed = {}
    for item in optim_args.replace(" ", "").split(","):
        if item.count("=") != 1:
            raise ValueError(f"optim_args={optim_args!r}: item {item!r} is not key=value; "
                             "write it as 'momentum=0.9,nesterov=True'")
        key, value = item.split("=")
        parsed[key] = value
    return parsed


# transformers 5.23's bitsandbytes optim names (OptimizerNames): AdamW, Lion, RMSprop and
# AdEMAMix, 8- or 32-bit state, paged or not. Paged state lives in CUDA unified memory; on a CPU
# bitsandbytes warns and runs the same update unpaged.
BITSANDBYTES_OPTIMIZERS = (
    "adamw_bnb_8bit", "adamw_8bit", "paged_adamw_32bit", "paged_adamw_8bit",
    "ademamix", "ademamix_8bit", "paged_ademamix_32bit", "paged_ademamix_8bit",
    "lion_8bit", "lion_32bit", "paged_lion_32bit", "paged_lion_8bit",
    "rmsprop_bnb", "rmsprop_bnb_8bit", "rmsprop_bnb_32bit",
)


def _bitsandbytes_cls_and_kwargs(bnb, args):
    """(optimizer class, kwargs) for a bitsandbytes optim name: the family from the name, 8-bit
    state where it says 8bit, paging where it says paged.
    Mirrors: transformers trainer_optimizer._get_bitsandbytes_optimizer"""
    name, optim_args = args.optim, parse_optim_args(args.optim_args)
    kwargs = {"lr": args.learning_rate}
    betas = (args.adam_beta1, args.adam_beta2)
    if "adam" in name:
        cls = bnb.optim.AdamW
        kwargs.update(betas=betas, eps=args.adam_epsilon)
    elif "lion" in name:
        cls = bnb.optim.Lion
        kwargs.update(betas=betas)
    elif "rmsprop" in name:
        cls = bnb.optim.RMSprop
        kwargs.update(optim_args)  # as transformers: optim_args passed through as given
    else:  # ademamix
        cls = bnb.optim.AdEMAMix
        kwargs.update(betas=(float(optim_args.get("beta1", args.adam_beta1)),
                             float(optim_args.get("beta2", args.adam_beta2)),
                             float(optim_args.get("beta3", 0.9999))),
                      alpha=float(optim_args.get("alpha", 5.0)),
                      eps=float(optim_args.get("eps", args.adam_epsilon)))
        kwargs.update({k: int(optim_args[k]) for k in ("t_alpha", "t_beta3") if k in optim_args})
    kwargs["optim_bits"] = 8 if "8bit" in name else 32
    if "rmsprop" not in name:
        kwargs["is_paged"] = "paged" in name
    return cls, kwargs


def _bitsandbytes_optimizer(groups, args, model: nn.Module):
    try:
        import bitsandbytes as bnb
    except ImportError as e:
        raise ImportError(
            f"optim={args.optim!r} needs bitsandbytes: pip install bitsandbytes") from e
    # 8-bit blockwise state for tensors with >= 4096 elements; smaller ones stay 32-bit
    # (bnb min_8bit_size).
    cls, kwargs = _bitsandbytes_cls_and_kwargs(bnb, args)
    optimizer = cls(groups, **kwargs)
    if kwargs["optim_bits"] != 8:
        return optimizer
    # Embeddings keep 32-bit state, as transformers Trainer.create_optimizer registers them
    # (bnb's GlobalOptimManager is process-wide; the override is read at the first step).
    # Differs: transformers registers on top of what earlier optimizers left there. The manager
    # keys overrides by (group, position), so a dead model's embedding override would land on
    # whatever parameter now sits at its position (a linear weight kept in 32 bits): start clean.
    manager = bnb.optim.GlobalOptimManager.get_instance()
    manager.initialize()
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            manager.register_module_override(module, "weight", {"optim_bits": 32})
    return optimizer


def _sgd(groups, args):
    kwargs = {"lr": args.learning_rate}
    extra = parse_optim_args(args.optim_args)
    for key in ("momentum", "dampening", "weight_decay"):
        if key in extra:
            kwargs[key] = float(extra[key])
    if "nesterov" in extra:
        kwargs["nesterov"] = extra["nesterov"].lower() in ("true", "1", "yes")
    return torch.optim.SGD(groups, **kwargs)


def is_optimizer_factory(optimizer_cls_or_factory) -> bool:
    """True unless it is a torch.optim.Optimizer class: optimizer_cls_and_kwargs may give a
    factory (Muon / Dion style), instantiated and then called with (model, **kwargs).
    Mirrors: transformers trainer_optimizer.is_optimizer_factory"""
    return not (isinstance(optimizer_cls_or_factory, type)
                and issubclass(optimizer_cls_or_factory, torch.optim.Optimizer))


def create_optimizer(model: nn.Module, args) -> torch.optim.Optimizer:
    """Build args.optim over the two weight-decay groups of `model`'s trainable parameters.
    Guide: optimizers and schedulers | Mirrors: transformers Trainer.create_optimizer,
    get_optimizer_cls_and_kwargs.
    adamw_torch_fused -> torch AdamW(fused=True) (runs on CPU too in torch >= 2.4);
    adamw_torch -> foreach."""
    groups = get_parameter_groups(model, args.weight_decay)
    if args.optim in ("adamw_torch", "adamw_torch_fused"):
        fused = {"fused": True} if args.optim == "adamw_torch_fused" else {}
        return torch.optim.AdamW(groups, lr=args.learning_rate,
                                 betas=(args.adam_beta1, args.adam_beta2),
                                 eps=args.adam_epsilon, **fused)
    if args.optim in BITSANDBYTES_OPTIMIZERS:
        return _bitsandbytes_optimizer(groups, args, model=model)
    if args.optim == "sgd":
        return _sgd(groups, args)
    raise ValueError(f"optim={args.optim!r} is not one nanosft builds; choose adamw_torch_fused, "
                     "adamw_torch, sgd or a bitsandbytes one "
                     f"({', '.join(BITSANDBYTES_OPTIMIZERS)})")


# ----------------------------------------------------------------------------- schedule multipliers
# Each returns the factor for `step` = number of scheduler.step() calls so far (0 at construction).
def _warmup(step, num_warmup_steps):
    return float(step) / float(max(1, num_warmup_steps))


def constant_lambda(step):
    """Factor 1 at every step.
    Mirrors: transformers optimization._get_constant_lambda"""
    return 1


def constant_with_warmup_lambda(step, *, num_warmup_steps):
    """Linear warmup 0 -> 1 over num_warmup_steps, then 1.
    Mirrors: transformers optimization._get_constant_schedule_with_warmup_lr_lambda"""
    if step < num_warmup_steps:
        return _warmup(step, num_warmup_steps)
    return 1.0


def linear_lambda(step, *, num_warmup_steps, num_training_steps):
    """Linear warmup, then a straight line down to 0 at num_training_steps.
    Mirrors: transformers optimization._get_linear_schedule_with_warmup_lr_lambda"""
    if step < num_warmup_steps:
        return _warmup(step, num_warmup_steps)
    remaining = float(num_training_steps - step)
    return max(0.0, remaining / float(max(1, num_training_steps - num_warmup_steps)))


def _progress(step, num_warmup_steps, num_training_steps):
    # Fraction of the post-warmup phase done, 0 -> 1.
    return float(step - num_warmup_steps) / float(max(1, num_training_steps - num_warmup_steps))


def cosine_lambda(step, *, num_warmup_steps, num_training_steps, num_cycles=0.5, min_lr_rate=0.0):
    """Linear warmup, then num_cycles cosine waves (half a wave: 1 -> 0), floored at min_lr_rate.
    Mirrors: transformers optimization._get_cosine_schedule_with_warmup_lr_lambda
    (both of that name)"""
    if step < num_warmup_steps:
        return _warmup(step, num_warmup_steps)
    progress = _progress(step, num_warmup_steps, num_training_steps)
    factor = 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * progress))
    if min_lr_rate:  # cosine_with_min_lr: the curve ends at min_lr instead of 0
        factor = factor * (1 - min_lr_rate) + min_lr_rate
    return max(0.0, factor)


def cosine_with_restarts_lambda(step, *, num_warmup_steps, num_training_steps, num_cycles=1):
    """Linear warmup, then num_cycles cosine decays 1 -> 0, each restarting at 1.
    Mirrors: optimization._get_cosine_with_hard_restarts_schedule_with_warmup_lr_lambda"""
    if step < num_warmup_steps:
        return _warmup(step, num_warmup_steps)
    progress = _progress(step, num_warmup_steps, num_training_steps)
    if progress >= 1.0:
        return 0.0
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * ((float(num_cycles) * progress) % 1.0))))


def polynomial_lambda(step, *, num_warmup_steps, num_training_steps, lr_end, power, lr_init):
    """Linear warmup, then (lr_init - lr_end) * remaining**power + lr_end, as a factor of lr_init.
    Mirrors: transformers optimization._get_polynomial_decay_schedule_with_warmup_lr_lambda"""
    if step < num_warmup_steps:
        return _warmup(step, num_warmup_steps)
    if step > num_training_steps:
        return lr_end / lr_init  # LambdaLR multiplies by lr_init again
    fraction_left = 1 - (step - num_warmup_steps) / (num_training_steps - num_warmup_steps)
    return ((lr_init - lr_end) * fraction_left**power + lr_end) / lr_init


def inverse_sqrt_lambda(step, *, num_warmup_steps, timescale):
    """Linear warmup, then 1 / sqrt((step + timescale - warmup) / timescale).
    Mirrors: transformers optimization._get_inverse_sqrt_schedule_lr_lambda"""
    if step < num_warmup_steps:
        return _warmup(step, num_warmup_steps)
    return 1.0 / math.sqrt((step + timescale - num_warmup_steps) / timescale)


def cosine_warmup_with_min_lr_lambda(step, *, num_warmup_steps, num_training_steps, num_cycles,
                                     min_lr_rate, warmup_lr_rate=None):
    """Warmup that starts above 0, then cosine down to min_lr_rate.
    Mirrors: optimization._get_cosine_with_min_lr_schedule_with_warmup_lr_rate_lambda"""
    step = float(step)
    num_warmup_steps = float(num_warmup_steps)
    num_training_steps = float(num_training_steps)
    if step < num_warmup_steps:
        # This variant starts warmup one step ahead, so the first step is not at lr 0.
        if warmup_lr_rate is None:
            return (step + 1.0) / max(1.0, num_warmup_steps)
        warmup_lr_rate = float(warmup_lr_rate)
        return warmup_lr_rate + (1.0 - warmup_lr_rate) * step / max(1, num_warmup_steps - 1)
    progress = (step - num_warmup_steps + 1.0) / max(1.0, num_training_steps - num_warmup_steps)
    factor = 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * progress))
    return max(0, factor * (1 - min_lr_rate) + min_lr_rate)


def _wsd_warmup(kind, progress):
    # Rises 0 -> 1 over the warmup phase.
    if kind == "linear":
        return progress
    if kind == "cosine":
        return 0.5 * (1.0 - math.cos(math.pi * progress))
    return 1.0 - math.sqrt(1.0 - progress)  # "1-sqrt"


def _wsd_decay(kind, progress, num_cycles):
    # Falls 1 -> 0 over the decay phase.
    if kind == "linear":
        return 1.0 - progress
    if kind == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * progress))
    return 1.0 - math.sqrt(progress)  # "1-sqrt"


def warmup_stable_decay_lambda(step, *, num_warmup_steps, num_stable_steps, num_decay_steps,
                               warmup_type, decay_type, min_lr_ratio, num_cycles):
    """Three phases: warmup (linear/cosine/1-sqrt), flat at 1, decay to min_lr_ratio;
    then min_lr_ratio.
    Mirrors: transformers optimization._get_wsd_scheduler_lambda"""
    if step < num_warmup_steps:
        factor = _wsd_warmup(warmup_type, float(step) / float(max(1, num_warmup_steps)))
        return max(0.0, factor * (1.0 - min_lr_ratio) + min_lr_ratio)
    if step < num_warmup_steps + num_stable_steps:
        return 1.0
    if step < num_warmup_steps + num_stable_steps + num_decay_steps:
        progress = (float(step - num_warmup_steps - num_stable_steps)
                    / float(max(1, num_decay_steps)))
        factor = _wsd_decay(decay_type, progress, num_cycles)
        return max(0.0, factor * (1.0 - min_lr_ratio) + min_lr_ratio)
    return min_lr_ratio


# ----------------------------------------------------------------------------- get_scheduler
# The lr_scheduler_kwargs each schedule takes (transformers raises TypeError on any other key).
SCHEDULER_KWARGS = {
    "linear": (), "constant": (), "constant_with_warmup": (),
    "cosine": ("num_cycles",), "cosine_with_restarts": ("num_cycles",),
    "polynomial": ("lr_end", "power"), "inverse_sqrt": ("timescale",),
    "cosine_with_min_lr": ("num_cycles", "min_lr", "min_lr_rate"),
    "cosine_warmup_with_min_lr": ("num_cycles", "min_lr", "min_lr_rate", "warmup_lr_rate"),
    "warmup_stable_decay": ("num_decay_steps", "num_stable_steps", "warmup_type", "decay_type",
                            "min_lr_ratio", "num_cycles"),
    "reduce_lr_on_plateau": None,  # anything torch's ReduceLROnPlateau takes
}


def _min_lr_rate(optimizer, min_lr, min_lr_rate):
    if min_lr is not None and min_lr_rate is not None:
        raise ValueError("lr_scheduler_kwargs sets both min_lr and min_lr_rate; keep one")
    if min_lr is not None:
        return min_lr / optimizer.defaults["lr"]
    if min_lr_rate is None:
        raise ValueError('cosine_with_min_lr needs lr_scheduler_kwargs={"min_lr": ...} '
                         'or {"min_lr_rate": ...}')
    return min_lr_rate


def _schedule_lambda(name, optimizer, W, T, kw):
    """The multiplier function for a LambdaLR schedule `name` (W warmup steps, T total steps)."""
    if name == "constant_with_warmup":
        return partial(constant_with_warmup_lambda, num_warmup_steps=W)
    if name == "inverse_sqrt":
        timescale = kw.get("timescale") or W or 10_000
        return partial(inverse_sqrt_lambda, num_warmup_steps=W, timescale=timescale)
    if name == "warmup_stable_decay":
        return _wsd_lambda(W, T, **kw)
    if T is None:
        raise ValueError(f"{name} needs num_training_steps (the total number of optimizer steps)")
    if name == "linear":
        return partial(linear_lambda, num_warmup_steps=W, num_training_steps=T)
    if name == "cosine":
        return partial(cosine_lambda, num_warmup_steps=W, num_training_steps=T,
                       num_cycles=kw.get("num_cycles", 0.5))
    if name == "cosine_with_restarts":
        return partial(cosine_with_restarts_lambda, num_warmup_steps=W, num_training_steps=T,
                       num_cycles=kw.get("num_cycles", 1))
    if name == "polynomial":
        lr_init, lr_end = optimizer.defaults["lr"], kw.get("lr_end", 1e-7)
        if not lr_init > lr_end:
            raise ValueError(f"polynomial: lr_end ({lr_end}) must be smaller than the learning "
                             f"rate ({lr_init})")
        return partial(polynomial_lambda, num_warmup_steps=W, num_training_steps=T, lr_end=lr_end,
                       power=kw.get("power", 1.0), lr_init=lr_init)
    rate = _min_lr_rate(optimizer, kw.get("min_lr"), kw.get("min_lr_rate"))
    if name == "cosine_with_min_lr":
        return partial(cosine_lambda, num_warmup_steps=W, num_training_steps=T,
                       num_cycles=kw.get("num_cycles", 0.5), min_lr_rate=rate)
    return partial(cosine_warmup_with_min_lr_lambda, num_warmup_steps=W, num_training_steps=T,
                   num_cycles=kw.get("num_cycles", 0.5), min_lr_rate=rate,
                   warmup_lr_rate=kw.get("warmup_lr_rate"))


def _wsd_lambda(W, T, num_decay_steps=None, num_stable_steps=None, warmup_type="linear",
                decay_type="cosine", min_lr_ratio=0, num_cycles=0.5):
    if num_decay_steps is None:
        raise ValueError('warmup_stable_decay needs lr_scheduler_kwargs={"num_decay_steps": N}')
    if T is None and num_stable_steps is None:
        raise ValueError("warmup_stable_decay needs num_training_steps or "
                         "lr_scheduler_kwargs['num_stable_steps']")
    for label, kind in (("warmup_type", warmup_type), ("decay_type", decay_type)):
        if kind not in ("linear", "cosine", "1-sqrt"):
            raise ValueError(f"warmup_stable_decay: {label}={kind!r}; "
                             "choose 'linear', 'cosine' or '1-sqrt'")
    if num_stable_steps is None:
        num_stable_steps = T - W - num_decay_steps
    return partial(warmup_stable_decay_lambda, num_warmup_steps=W,
                   num_stable_steps=num_stable_steps, num_decay_steps=num_decay_steps,
                   warmup_type=warmup_type, decay_type=decay_type,
                   min_lr_ratio=min_lr_ratio, num_cycles=num_cycles)


def get_scheduler(name, optimizer, num_warmup_steps=None, num_training_steps=None,
                  scheduler_specific_kwargs=None, **kwargs):
    """Learning-rate scheduler `name` over `optimizer`; extra settings come in
    scheduler_specific_kwargs.
    Guide: optimizers and schedulers (学习率调度器类型)
    Mirrors: transformers.optimization.get_scheduler
    "constant" ignores warmup; "reduce_lr_on_plateau" is torch's ReduceLROnPlateau, stepped with
    an eval metric."""
    kw = {**(scheduler_specific_kwargs or {}), **kwargs}
    if name not in SCHEDULER_KWARGS:
        raise ValueError(f"lr_scheduler_type={name!r} is unknown; "
                         f"choose one of {', '.join(SCHEDULER_KWARGS)}")
    allowed = SCHEDULER_KWARGS[name]
    unknown = [] if allowed is None else [k for k in kw if k not in allowed]
    if unknown and name != "constant":
        raise ValueError(f"lr_scheduler_kwargs keys {unknown} do not apply to "
                         f"lr_scheduler_type={name!r}; it takes {list(allowed) or 'none'}")
    if name == "constant":
        return LambdaLR(optimizer, constant_lambda)
    if name == "reduce_lr_on_plateau":
        return ReduceLROnPlateau(optimizer, **kw)
    if num_warmup_steps is None:
        raise ValueError(f"{name} needs num_warmup_steps (0 for no warmup)")
    lr_lambda = _schedule_lambda(name, optimizer, num_warmup_steps, num_training_steps, kw)
    return LambdaLR(optimizer, lr_lambda)


def create_scheduler(args, optimizer, num_training_steps: int):
    """The scheduler args.lr_scheduler_type with args.get_warmup_steps(num_training_steps)
    warmup steps.
    Guide: optimizers and schedulers | Mirrors: transformers Trainer.create_scheduler"""
    return get_scheduler(args.lr_scheduler_type, optimizer,
                         num_warmup_steps=args.get_warmup_steps(num_training_steps),
                         num_training_steps=num_training_steps,
                         scheduler_specific_kwargs=args.lr_scheduler_kwargs)


# transformers.optimization's named schedule functions: get_scheduler under their names
def get_constant_schedule(optimizer):
    """A constant learning rate. Mirrors: transformers get_constant_schedule"""
    return get_scheduler("constant", optimizer)


def get_constant_schedule_with_warmup(optimizer, num_warmup_steps):
    """Linear warmup, then constant. Mirrors: transformers get_constant_schedule_with_warmup"""
    return get_scheduler("constant_with_warmup", optimizer, num_warmup_steps=num_warmup_steps)


def get_linear_schedule_with_warmup(optimizer, num_warmup_steps, num_training_steps):
    """Linear warmup, then linear decay to 0. Mirrors: transformers
    get_linear_schedule_with_warmup"""
    return get_scheduler("linear", optimizer, num_warmup_steps, num_training_steps)


def get_cosine_schedule_with_warmup(optimizer, num_warmup_steps, num_training_steps,
                                    num_cycles=0.5):
    """Linear warmup, then cosine decay. Mirrors: transformers get_cosine_schedule_with_warmup"""
    return get_scheduler("cosine", optimizer, num_warmup_steps, num_training_steps,
                         num_cycles=num_cycles)


def get_polynomial_decay_schedule_with_warmup(optimizer, num_warmup_steps, num_training_steps,
                                              lr_end=1e-7, power=1.0):
    """Linear warmup, then polynomial decay to lr_end. Mirrors: transformers
    get_polynomial_decay_schedule_with_warmup"""
    return get_scheduler("polynomial", optimizer, num_warmup_steps, num_training_steps,
                         lr_end=lr_end, power=power)

"""FSDP2: transformers' fsdp / fsdp_config arguments, fully_shard per decoder layer, gathered state.

The guide's FSDP part. `normalize_fsdp_config` reads `fsdp` and `fsdp_config` as transformers 5.23
does; `apply_fsdp` runs torch's fully_shard on every decoder layer and then the root, with the
4-bit bytes of a QLoRA model and their absmax statistics sharded alike (the FSDP-QLoRA idea);
the state-dict helpers gather shards into the one-process Hugging Face files and cut them back
(no_sync, in trainer_utils, skips the reduce-scatter). Built on distributed.py; imports nothing
else of nanosft (4-bit layers are recognised by their attributes).
"""

import copy
import json

import torch
from torch import nn

from nanosft.distributed import get_world_size, is_dtensor, require_process_group, to_full
from nanosft.optim import BITSANDBYTES_OPTIMIZERS

# ----------------------------------------------------------------------------- FSDP arguments
# The fsdp_config keys nanosft acts on, with transformers' defaults
# (TrainingArguments._process_fsdp_args).
FSDP_CONFIG_DEFAULTS = {
    "version": 2,
    "reshard_after_forward": True,  # free the gathered weights after each layer's forward (ZeRO-3)
    "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",  # fully_shard per decoder layer, then the root
    "transformer_layer_cls_to_wrap": None,  # None -> the decoder layer class
    "activation_checkpointing": False,  # recompute each decoder layer in backward
    "state_dict_type": "FULL_STATE_DICT",  # checkpoints gathered on rank 0 into the usual HF files
    # transformers adds these when it normalises a config; inert at these values, refused otherwise
    "min_num_params": 0,
    "xla": False,
    "xla_fsdp_v2": False,
    "xla_fsdp_grad_ckpt": False,
}
# keys whose value is fixed here: FSDP2, per decoder layer, gathered Hugging Face files
_FIXED = ("version", "auto_wrap_policy", "state_dict_type", "min_num_params", "xla",
          "xla_fsdp_v2", "xla_fsdp_grad_ckpt")
_BOOLEANS = ("reshard_after_forward", "activation_checkpointing", "xla", "xla_fsdp_v2",
             "xla_fsdp_grad_ckpt")
# transformers' class names for the one decoder layer class nanosft has
DECODER_LAYER_NAMES = {
    "DecoderLayer",
    "LlamaDecoderLayer",
    "MistralDecoderLayer",
    "Phi3DecoderLayer",
    "Qwen2DecoderLayer",
    "Qwen3DecoderLayer",  # nanosft.families' subclasses
    "SmolLM3DecoderLayer",
}
_RESHARD_BY_STRATEGY = {"full_shard": True, "shard_grad_op": False}  # the legacy `fsdp="..."` words


def _as_bool(key, value):
    text = str(value).lower()  # transformers passes every flag through str_to_bool
    if text not in ("true", "false", "1", "0"):
        raise ValueError(f"fsdp_config[{key!r}]={value!r} is invalid: use true or false")
    return text in ("true", "1")


def _read_fsdp_config(fsdp_config):
    if fsdp_config is None:
        return {}
    if isinstance(fsdp_config, str):  # a JSON file, as transformers accepts
        try:
            with open(fsdp_config, encoding="utf-8") as f:
                fsdp_config = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(
                f"fsdp_config={fsdp_config!r} could not be read ({e}); pass a dict or the path "
                "of a JSON file holding one"
            ) from e
    if not isinstance(fsdp_config, dict):
        raise ValueError(
            f"fsdp_config={fsdp_config!r} is invalid: pass a dict or the path of a JSON file"
        )
    # "fsdp_version" and "version" mean the same key (accelerate's config files use the prefix)
    return {k.removeprefix("fsdp_"): v for k, v in fsdp_config.items()}


def normalize_fsdp_config(fsdp, fsdp_config) -> dict | None:
    """`fsdp` and `fsdp_config` -> the full config dict (None when FSDP is off); bad keys raise.
    Mirrors: transformers TrainingArguments._process_fsdp_args
    Differs: FSDP2 only, and only the keys nanosft acts on; any other key is refused by name."""
    if fsdp in (None, False, "", []):
        return None
    config = _read_fsdp_config(fsdp_config)
    for word in fsdp.split() if isinstance(fsdp, str) else ([] if fsdp is True else list(fsdp)):
        if word not in (*_RESHARD_BY_STRATEGY, "auto_wrap"):
            raise ValueError(
                f'fsdp={fsdp!r}: {word!r} is not supported; use fsdp=True (or "full_shard", '
                '"shard_grad_op", "auto_wrap"); CPU offload and hybrid sharding are not implemented'
            )
        config.setdefault("reshard_after_forward", _RESHARD_BY_STRATEGY.get(word, True))
    unknown = sorted(set(config) - set(FSDP_CONFIG_DEFAULTS))
    if unknown:
        raise ValueError(
            f"fsdp_config has keys nanosft does not act on: {', '.join(unknown)}. Remove them; "
            f"the supported keys are {', '.join(FSDP_CONFIG_DEFAULTS)}."
        )
    config = {**FSDP_CONFIG_DEFAULTS, **config}
    for key in _BOOLEANS:
        config[key] = _as_bool(key, config[key])
    for key in _FIXED:
        only = FSDP_CONFIG_DEFAULTS[key]
        if str(config[key]) != str(only):
            raise ValueError(
                f"fsdp_config[{key!r}]={config[key]!r} is not supported: nanosft runs FSDP2 "
                f"(fully_shard) per decoder layer and saves gathered Hugging Face files; "
                f"use {only!r} or remove the key"
            )
    config["version"] = 2
    layers = config["transformer_layer_cls_to_wrap"]
    config["transformer_layer_cls_to_wrap"] = [layers] if isinstance(layers, str) else layers
    return config


def check_fsdp_options(args, feature="fsdp") -> None:
    """Refuse TrainingArguments that FSDP here cannot honour, naming the option and the fix.
    Mirrors: accelerate FullyShardedDataParallelPlugin checks"""
    clashes = {
        "fp16": (args.fp16, "the fp16 GradScaler is not shard-aware here; use bf16=True"),
        "optim": (
            args.optim in BITSANDBYTES_OPTIMIZERS,
            'bitsandbytes\' 8-bit states do not shard; use optim="adamw_torch"',
        ),
        "torch_compile": (
            args.torch_compile,
            "compiling a sharded model is not supported here; drop it",
        ),
    }
    for name, (bad, fix) in clashes.items():
        if bad:
            raise ValueError(f"{feature} with {name}={getattr(args, name)!r} is not supported: "
                             f"{fix}.")


# ----------------------------------------------------------------------------- 4-bit statistics
def _is_linear4bit(module) -> bool:
    # duck-typed so this module imports nothing of nanosft's layers
    return (
        hasattr(module, "quant_state")
        and getattr(module, "weight", None) is not None
        and module.weight.dtype == torch.uint8
    )


def _drop_exposed(module, state_dict, prefix, local_metadata):
    # the checkpoint keeps bitsandbytes' keys ("weight.absmax"); the parameter aliases are plumbing
    for name in ("weight_absmax", "weight_nested_absmax"):
        state_dict.pop(prefix + name, None)


def expose_quant_statistics(linear4bit) -> None:
    """Register a Linear4bit's absmax tensors as frozen parameters, so fully_shard shards them too.
    Mirrors: the idea of bitsandbytes bnb_4bit_quant_storage
    Differs: the 16- and 256-entry code tables and the offset stay whole on every rank."""
    qs = linear4bit.quant_state
    # (blocks,) uint8 codes when double-quantized, else fp32
    linear4bit.weight_absmax = nn.Parameter(qs.absmax, requires_grad=False)
    if qs.nested:
        linear4bit.weight_nested_absmax = nn.Parameter(qs.state2.absmax, requires_grad=False)
    linear4bit._register_state_dict_hook(_drop_exposed)


def _quant_state_from_parameters(linear4bit):
    # a shallow copy pointing at the parameters as they are now (gathered in forward, else sharded)
    qs = copy.copy(linear4bit.quant_state)
    qs.absmax = linear4bit.weight_absmax
    if qs.nested:
        qs.state2 = copy.copy(qs.state2)
        qs.state2.absmax = linear4bit.weight_nested_absmax
    return qs


def _hook_quant_states(owner, linears) -> None:
    # While `owner` runs forward, its Linear4bits read the gathered statistics; the copy made for
    # each forward stays with bitsandbytes' autograd context, whose backward sees them gathered
    # again (FSDP's pre-backward).
    sharded = {}

    def gathered(module, args):
        for lin in linears:
            sharded[lin] = lin.quant_state
            lin.quant_state = _quant_state_from_parameters(lin)

    def restore(module, args, output):
        for lin in linears:
            lin.quant_state = sharded.pop(lin, lin.quant_state)

    owner.register_forward_pre_hook(gathered)  # runs after fully_shard's, which is prepended
    owner.register_forward_hook(restore)


# ----------------------------------------------------------------------------- FSDP2: shard,
# accumulate, gather
def _decoder_layers(model, names):
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        found = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(
            f"fsdp_config['transformer_layer_cls_to_wrap']={sorted(names)} matches no module of "
            f"this model (its classes: {', '.join(found[:12])}); name the decoder layer class"
        )
    return layers


def apply_fsdp(model, fsdp_config: dict, device, mesh=None) -> nn.Module:
    """fully_shard every decoder layer, then the root, over all ranks or the 1-D `mesh` (a
    parallelism config's "dp_shard" dim); returns `model` (in place).
    Mirrors: accelerate fsdp2_prepare_model (transformer-layer auto-wrap)
    4-bit layers get their absmax registered first: packed bytes and statistics shard alike."""
    require_process_group("fsdp")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    names = set(fsdp_config["transformer_layer_cls_to_wrap"] or ["DecoderLayer"])
    names |= DECODER_LAYER_NAMES if names & DECODER_LAYER_NAMES else set()
    layers = _decoder_layers(model, names)
    if fsdp_config["activation_checkpointing"]:
        model.gradient_checkpointing_enable()  # torch.utils.checkpoint around each (sharded) layer
    linears = [m for m in model.modules() if _is_linear4bit(m)]
    for lin in linears:
        expose_quant_statistics(lin)
    if mesh is None:
        mesh = init_device_mesh(torch.device(device).type, (get_world_size(),))
    reshard = fsdp_config["reshard_after_forward"]
    owned = set()
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
        inside = [m for m in layer.modules() if m in set(linears)]
        owned.update(inside)
        if inside:
            _hook_quant_states(layer, inside)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    rest = [m for m in linears if m not in owned]
    if rest:  # 4-bit layers outside every decoder layer: the root's forward gathers them
        _hook_quant_states(model, rest)
    for lin in linears:  # outside forward, quant_state points at the sharded (DTensor) statistics
        lin.quant_state = _quant_state_from_parameters(lin)
    return model


def is_fsdp(model) -> bool:
    """True when fully_shard was applied to `model`. Mirrors: accelerate is_fsdp2
    checks"""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def full_state_dict(model, only=None) -> dict:
    """model.state_dict() (or its keys in `only`) with every sharded tensor gathered whole onto the
    CPU; a collective, so every rank calls it. Tied weights stay one tensor under both names.
    Mirrors: torch get_model_state_dict(full_state_dict=True)"""
    gathered, out = {}, {}
    for k, v in model.state_dict().items():
        if only is None or k in only:  # the same keys, in the same order, on every rank
            if id(v) not in gathered:
                gathered[id(v)] = to_full(v).detach().cpu()
            out[k] = gathered[id(v)]
    return out


def whole_tensors_into_shards():
    """Context in which copying a whole tensor into a sharded parameter keeps this rank's part of
    it (load_state_dict of a one-process file into an FSDP model).
    Mirrors: torch implicit_replication"""
    from torch.distributed.tensor.experimental import implicit_replication

    return implicit_replication()


def full_optimizer_state_dict(optimizer) -> dict:
    """optimizer.state_dict() in its one-process form, per-parameter states gathered whole (every
    rank calls it).
    Mirrors: torch get_optimizer_state_dict(full_state_dict=True)
    Differs: keeps torch's integer parameter ids, so the file equals a one-process optimizer.pt."""
    state = optimizer.state_dict()
    state["state"] = {
        i: {k: to_full(v).cpu() if torch.is_tensor(v) else v for k, v in s.items()}
        for i, s in state["state"].items()
    }
    return state


def shard_optimizer_state_dict(state: dict, optimizer) -> dict:
    """A whole (one-process) optimizer state dict cut to this rank's shards, for load_state_dict.
    Mirrors: torch set_optimizer_state_dict(full_state_dict=True)"""
    from torch.distributed.tensor import distribute_tensor

    params = [p for group in optimizer.param_groups for p in group["params"]]
    out = {**state, "state": {}}
    for i, s in state["state"].items():
        p = params[int(i)]
        out["state"][i] = {
            k: distribute_tensor(v.to(p.device), p.device_mesh, p.placements, src_data_rank=None)
            if is_dtensor(p) and torch.is_tensor(v) and v.dim() > 0
            else v
            for k, v in s.items()
        }
    return out


def held_bytes(model) -> int:
    """Parameter bytes this rank holds: local shards of sharded parameters, whole tensors
    otherwise, plus 4-bit quantization tensors that are not parameters (code tables, offset).
    Mirrors: the per-rank memory FSDP-QLoRA is about"""
    seen, total = set(), 0
    tensors = list(model.parameters())
    for m in model.modules():
        if _is_linear4bit(m):
            qs = m.quant_state
            tensors += [qs.absmax, qs.code] + (
                [qs.state2.absmax, qs.state2.code, qs.offset] if qs.nested else []
            )
    for t in tensors:
        local = t.to_local() if is_dtensor(t) else t
        key = (local.untyped_storage().data_ptr(), local.storage_offset(), local.numel())
        if key not in seen:  # tied weights and the absmax parameter/quant_state aliases count once
            seen.add(key)
            total += local.numel() * local.element_size()
    return total

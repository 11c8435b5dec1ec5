"""torchrun environment -> process group; data parallel (DDP), FSDP2 and tensor parallel plumbing.

The guide's "distributed training" part. `torchrun --nproc_per_node N` sets RANK / WORLD_SIZE /
LOCAL_RANK / MASTER_ADDR / MASTER_PORT; `init_distributed` turns them into a process group (gloo on
CPU, nccl on CUDA). `shard_batches` gives each rank its share of the seeded epoch order
(accelerate's BatchSamplerShard). FSDP: fsdp / fsdp_config as transformers reads them, torch's
fully_shard per decoder layer (4-bit bytes and their statistics sharded too), no-sync accumulation,
gathered state dicts. Tensor parallel: transformers' Llama plan through torch's parallelize_module.
Imports nothing of nanosft, so model.py can use it for tp_plan.
"""

import argparse
import contextlib
import copy
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn


def _is_dtensor(value) -> bool:
    # a DTensor exists only once torch.distributed.tensor is imported, an import that costs seconds
    # (sympy); so `import nanosft.sft` does not pay it, and the check never triggers the import
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def init_distributed(args) -> bool:
    """Create the default process group from the torchrun environment; True when one exists.
    Guide: distributed training | Mirrors: accelerate PartialState.__init__ (MULTI_CPU /
    MULTI_GPU)"""
    if dist.is_available() and dist.is_initialized():
        return True
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    on_cuda = torch.device(args.device).type == "cuda"
    if on_cuda:
        # one GPU per process: LOCAL_RANK picks it before NCCL builds its communicator
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(
        backend="nccl" if on_cuda else "gloo", timeout=timedelta(seconds=args.ddp_timeout)
    )
    return True


def is_initialized() -> bool:
    """True inside a process group. Guide: distributed training | Mirrors:
    torch.distributed.is_initialized"""
    return dist.is_available() and dist.is_initialized()


def get_world_size() -> int:
    """Number of processes (1 without a process group). Guide: distributed training | Mirrors:
    accelerate num_processes"""
    return dist.get_world_size() if is_initialized() else 1


def get_rank() -> int:
    """This process's global rank (0 without a process group). Guide: distributed training |
    Mirrors: accelerate process_index"""
    return dist.get_rank() if is_initialized() else 0


def is_main_process() -> bool:
    """True on rank 0, the process that logs and writes files. Guide: distributed training |
    Mirrors: accelerate is_main_process"""
    return get_rank() == 0


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over all ranks in place and return it (a no-op for one process).
    Guide: distributed training | Mirrors: transformers Trainer._get_num_items_in_batch
    (accelerator.gather(...).sum())"""
    if is_initialized() and get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def barrier() -> None:
    """Wait until every rank gets here (a no-op for one process). Guide: distributed training |
    Mirrors: accelerate wait_for_everyone"""
    if is_initialized() and get_world_size() > 1:
        dist.barrier()


def cleanup() -> None:
    """Destroy the process group if there is one. Guide: distributed training | Mirrors:
    torch.distributed.destroy_process_group"""
    if is_initialized():
        dist.destroy_process_group()


def shard_batches(
    batches: list, num_replicas: int, rank: int, batch_size: int, drop_last: bool = False
) -> list:
    """Rank `rank`'s batches: global batches rank, rank+W, ... with the tail evened out.
    Guide: distributed training | Mirrors: accelerate BatchSamplerShard._iter_with_no_split
    Every rank gets the same number of full batches: the short last batch is topped up and missing
    ones are made from the epoch's first indices again (drop_last drops incomplete rounds)."""
    if num_replicas == 1:
        return batches
    batches = [list(b) for b in batches]
    if drop_last:
        usable = len(batches) // num_replicas * num_replicas
        return batches[rank:usable:num_replicas]
    if not batches:
        return []
    # indices to recycle: those of the first W batches, repeated for datasets smaller than W *
    # batch_size
    recycled = [i for b in batches[:num_replicas] for i in b]
    while len(recycled) < num_replicas * batch_size:
        recycled += recycled
    cursor = 0
    if len(batches[-1]) < batch_size:  # top up the short last batch
        cursor = batch_size - len(batches[-1])
        batches[-1] += recycled[:cursor]
    while len(batches) % num_replicas:  # add whole batches until every rank has one more
        batches.append(recycled[cursor : cursor + batch_size])
        cursor += batch_size
    return batches[rank::num_replicas]


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
# transformers' class names for the one decoder layer class nanosft has
DECODER_LAYER_NAMES = {
    "DecoderLayer",
    "LlamaDecoderLayer",
    "MistralDecoderLayer",
    "Qwen2DecoderLayer",
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
    Guide: FSDP | Mirrors: transformers TrainingArguments._process_fsdp_args
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
    for key in (
        "reshard_after_forward",
        "activation_checkpointing",
        "xla",
        "xla_fsdp_v2",
        "xla_fsdp_grad_ckpt",
    ):
        config[key] = _as_bool(key, config[key])
    fixed = {
        "version": 2,
        "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "state_dict_type": "FULL_STATE_DICT",
        "min_num_params": 0,
        "xla": False,
        "xla_fsdp_v2": False,
        "xla_fsdp_grad_ckpt": False,
    }
    for key, only in fixed.items():
        if str(config[key]) != str(only):
            raise ValueError(
                f"fsdp_config[{key!r}]={config[key]!r} is not supported: nanosft runs FSDP2 "
                f"(fully_shard) per decoder layer and saves gathered Hugging Face files; "
                f"use {only!r} "
                "or remove the key"
            )
    config["version"] = 2
    layers = config["transformer_layer_cls_to_wrap"]
    config["transformer_layer_cls_to_wrap"] = [layers] if isinstance(layers, str) else layers
    return config


def check_fsdp_options(args) -> None:
    """Refuse TrainingArguments that FSDP here cannot honour, naming the option and the fix.
    Guide: FSDP | Mirrors: accelerate FullyShardedDataParallelPlugin checks"""
    clashes = {
        "fp16": (args.fp16, "the fp16 GradScaler is not shard-aware here; use bf16=True"),
        "optim": (
            args.optim in ("adamw_bnb_8bit", "paged_adamw_8bit"),
            'bitsandbytes\' 8-bit states do not shard; use optim="adamw_torch"',
        ),
        "torch_compile": (
            args.torch_compile,
            "compiling a sharded model is not supported here; drop it",
        ),
    }
    for name, (bad, fix) in clashes.items():
        if bad:
            raise ValueError(f"fsdp with {name}={getattr(args, name)!r} is not supported: {fix}.")


# ----------------------------------------------------------------------------- FSDP2: shard,
# accumulate, gather
def require_process_group(feature: str) -> None:
    """Raise, naming the fix, when there is no multi-process group (a plain `python script.py`
    launch).
    Guide: FSDP, tensor parallel | Mirrors: accelerate PartialState (distributed_type checks)"""
    if get_world_size() > 1:
        return
    env = {k: os.environ.get(k) for k in ("WORLD_SIZE", "RANK", "MASTER_ADDR")}
    raise RuntimeError(
        f"{feature} needs several processes, but this one runs alone (torchrun environment: "
        f"{env}). Launch with `torchrun --nproc_per_node 2 your_script.py`; for one process, "
        f"drop {feature}."
    )


def _is_linear4bit(module) -> bool:
    # duck-typed so this module imports nothing of nanosft (model.py imports it for tp_plan)
    return (
        hasattr(module, "quant_state")
        and getattr(module, "weight", None) is not None
        and module.weight.dtype == torch.uint8
    )


def _drop_exposed(module, state_dict, prefix, local_metadata):
    # the checkpoint keeps bitsandbytes' keys ("weight.absmax"); the parameter aliases are FSDP
    # plumbing
    for name in ("weight_absmax", "weight_nested_absmax"):
        state_dict.pop(prefix + name, None)


def expose_quant_statistics(linear4bit) -> None:
    """Register a Linear4bit's absmax tensors as frozen parameters, so fully_shard shards them too.
    Guide: FSDP (QLoRA) | Mirrors: the idea of bitsandbytes bnb_4bit_quant_storage
    Differs: the 16- and 256-entry code tables and the offset stay whole on every rank."""
    qs = linear4bit.quant_state
    linear4bit.weight_absmax = nn.Parameter(
        qs.absmax, requires_grad=False
    )  # (blocks,) uint8 or fp32
    if qs.nested:
        linear4bit.weight_nested_absmax = nn.Parameter(
            qs.state2.absmax, requires_grad=False
        )  # fp32
    linear4bit._register_state_dict_hook(_drop_exposed)


def _quant_state_from_parameters(linear4bit):
    # a shallow copy pointing at the parameters as they are now (gathered inside forward, sharded
    # outside)
    qs = copy.copy(linear4bit.quant_state)
    qs.absmax = linear4bit.weight_absmax
    if qs.nested:
        qs.state2 = copy.copy(qs.state2)
        qs.state2.absmax = linear4bit.weight_nested_absmax
    return qs


def _hook_quant_states(owner, linears) -> None:
    """While `owner` runs forward, its Linear4bits read the gathered statistics; the copy made for
    each forward
    stays with bitsandbytes' autograd context, whose backward sees them gathered again (FSDP's
    pre-backward)."""
    sharded = {}

    def gathered(module, args):
        for lin in linears:
            sharded[lin] = lin.quant_state
            lin.quant_state = _quant_state_from_parameters(lin)

    def restore(module, args, output):
        for lin in linears:
            lin.quant_state = sharded.pop(lin, lin.quant_state)

    owner.register_forward_pre_hook(
        gathered
    )  # after fully_shard's own pre-hook, which is prepended
    owner.register_forward_hook(restore)


def _decoder_layers(model, names):
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        found = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(
            f"fsdp_config['transformer_layer_cls_to_wrap']={sorted(names)} matches no module of "
            "this "
            f"model (its classes: {', '.join(found[:12])}); name the decoder layer class"
        )
    return layers


def apply_fsdp(model, fsdp_config: dict, device) -> nn.Module:
    """fully_shard every decoder layer, then the root, over all ranks; returns `model` (in place).
    Guide: FSDP | Mirrors: accelerate fsdp2_prepare_model (transformer-layer auto-wrap)
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
    mesh = init_device_mesh(torch.device(device).type, (get_world_size(),))
    reshard = fsdp_config["reshard_after_forward"]
    owned = set()
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
        inside = [m for m in layer.modules() if m in set(linears)]
        owned.update(inside)
        _hook_quant_states(layer, inside) if inside else None
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    rest = [m for m in linears if m not in owned]
    _hook_quant_states(model, rest) if rest else None
    for lin in linears:  # outside forward, quant_state points at the sharded (DTensor) statistics
        lin.quant_state = _quant_state_from_parameters(lin)
    return model


def is_fsdp(model) -> bool:
    """True when fully_shard was applied to `model`. Guide: FSDP | Mirrors: accelerate is_fsdp2
    checks"""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def fsdp_no_sync(model):
    """Accumulate full gradients locally, with no reduce-scatter, for the micro-batches before the
    sync step.
    Guide: gradient accumulation (FSDP) | Mirrors: FSDPModule.set_requires_gradient_sync, DDP
    no_sync"""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def to_full(tensor):
    """The whole tensor behind a DTensor (a collective: every rank calls it), any other value
    unchanged.
    Guide: FSDP, tensor parallel | Mirrors: torch DTensor.full_tensor"""
    return tensor.full_tensor() if _is_dtensor(tensor) else tensor


def full_state_dict(model, only=None) -> dict:
    """model.state_dict() (or its keys in `only`) with every sharded tensor gathered whole onto the
    CPU; a collective, so every rank calls it. Tied weights stay one tensor under both names.
    Guide: FSDP checkpoints | Mirrors: torch get_model_state_dict(full_state_dict=True)"""
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
    Guide: FSDP checkpoints | Mirrors: torch implicit_replication"""
    from torch.distributed.tensor.experimental import implicit_replication

    return implicit_replication()


def full_optimizer_state_dict(optimizer) -> dict:
    """optimizer.state_dict() in its one-process form: per-parameter states gathered whole (every
    rank calls it).
    Guide: FSDP checkpoints | Mirrors: torch get_optimizer_state_dict(full_state_dict=True)
    Differs: keeps torch's integer parameter ids, so the file equals a one-process optimizer.pt."""
    state = optimizer.state_dict()
    state["state"] = {
        i: {k: to_full(v).cpu() if torch.is_tensor(v) else v for k, v in s.items()}
        for i, s in state["state"].items()
    }
    return state


def shard_optimizer_state_dict(state: dict, optimizer) -> dict:
    """A whole (one-process) optimizer state dict cut to this rank's shards of each parameter, for
    load_state_dict.
    Guide: FSDP checkpoints | Mirrors: torch set_optimizer_state_dict(full_state_dict=True)"""
    from torch.distributed.tensor import distribute_tensor

    params = [p for group in optimizer.param_groups for p in group["params"]]
    out = {**state, "state": {}}
    for i, s in state["state"].items():
        p = params[int(i)]
        out["state"][i] = {
            k: distribute_tensor(v.to(p.device), p.device_mesh, p.placements, src_data_rank=None)
            if _is_dtensor(p) and torch.is_tensor(v) and v.dim() > 0
            else v
            for k, v in s.items()
        }
    return out


def held_bytes(model) -> int:
    """Parameter bytes this rank holds: local shards of sharded parameters, whole tensors
    otherwise, plus 4-bit quantization tensors that are not parameters (code tables, offset).
    Guide: FSDP (memory) | Mirrors: the per-rank memory FSDP-QLoRA is about"""
    seen, total = set(), 0
    tensors = list(model.parameters())
    for m in model.modules():
        if _is_linear4bit(m):
            qs = m.quant_state
            tensors += [qs.absmax, qs.code] + (
                [qs.state2.absmax, qs.state2.code, qs.offset] if qs.nested else []
            )
    for t in tensors:
        local = t.to_local() if _is_dtensor(t) else t
        key = (local.untyped_storage().data_ptr(), local.storage_offset(), local.numel())
        if key not in seen:  # tied weights and the absmax parameter/quant_state aliases count once
            seen.add(key)
            total += local.numel() * local.element_size()
    return total


# ----------------------------------------------------------------------------- tensor parallelism
# transformers' LlamaConfig.base_model_tp_plan (Mistral and Qwen2 write the same): the Megatron
# layout.
# Column-parallel q/k/v/gate/up give each rank whole heads and a slice of the MLP's hidden units;
# the
# row-parallel o/down multiply those slices and sum over ranks: one all-reduce per attention, one
# per MLP.
LLAMA_TP_PLAN = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}


def check_tp_sizes(config, tp_size: int) -> None:
    """Refuse a model whose heads, KV heads or MLP width do not split evenly over `tp_size` ranks,
    naming them.
    Guide: tensor parallel | Mirrors: transformers distributed checks of tp_size against the
    config"""
    sizes = {
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "intermediate_size": config.intermediate_size,
    }
    bad = {k: v for k, v in sizes.items() if v % tp_size}
    if bad:
        listed = ", ".join(f"{k}={v}" for k, v in bad.items())
        raise ValueError(
            f"tensor parallel over {tp_size} ranks needs every split size divisible by "
            f"{tp_size}, but {listed} is not; launch a number of processes (torchrun "
            f"--nproc_per_node) that divides {', '.join(map(str, sizes.values()))}, "
            "or use FSDP instead"
        )


def apply_tensor_parallel(model, tp_plan="auto") -> nn.Module:
    """Shard a CausalLM's decoder layers over all ranks (DTensor colwise / rowwise), in place.
    Guide: tensor parallel | Mirrors: transformers from_pretrained(tp_plan="auto")
    Differs: embeddings, norms and lm_head stay whole on each rank (transformers splits lm_head)."""
    if (
        not is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1
    ):  # as transformers, from torchrun's env
        init_distributed(
            argparse.Namespace(
                device="cuda" if torch.cuda.is_available() else "cpu", ddp_timeout=1800
            )
        )
    require_process_group("tp_plan")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = LLAMA_TP_PLAN if tp_plan == "auto" else tp_plan
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    if not isinstance(plan, dict) or any(v not in styles for v in plan.values()):
        raise ValueError(
            f'tp_plan={tp_plan!r} is invalid: pass "auto" or a dict of module patterns to '
            '"colwise" / "rowwise"'
        )
    check_tp_sizes(model.config, get_world_size())
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    if device_type == "cuda":
        model.to(torch.device("cuda", torch.cuda.current_device()))
    mesh = init_device_mesh(device_type, (get_world_size(),))
    parallelize_module(model.model, mesh, {k: styles[v]() for k, v in plan.items()})
    return model


def clip_grad_norm_(parameters, max_norm: float) -> torch.Tensor:
    """Clip gradients that are partly sharded (DTensor) and partly whole; returns the whole-model
    2-norm.
    Guide: tensor parallel | Mirrors: torch.nn.utils.clip_grad_norm_
    Differs: whole gradients (norms, embeddings under TP) count as replicated, once."""
    from torch.distributed.tensor.experimental import implicit_replication

    with implicit_replication():
        return to_full(torch.nn.utils.clip_grad_norm_(parameters, max_norm))


def refuse_tensor_parallel(model) -> None:
    """Raise, naming the fix, for a tensor-parallel model handed to the data-parallel Trainer: its
    ranks hold different shards and must see the same batches, which DDP's data sharding breaks.
    Guide: tensor parallel | Mirrors: nothing (transformers' Trainer mixes TP with data sharding)"""
    if any(_is_dtensor(p) for p in model.parameters()):
        raise ValueError("this model was loaded with tp_plan (its weights are split over the "
                         "ranks); the Trainer shards data over ranks and cannot train it. Train it "
                         "with a loop like tutorials/15_custom_loop.py, every rank on the same "
                         "batches, or load it without tp_plan and use fsdp=True.")

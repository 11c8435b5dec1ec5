"""Apply a ParallelismConfig's plan to a plain model, and clip gradients spread over its meshes.

As torchtitan's parallelize step and the guide's 3D_parallel.py: tensor parallel first (the Llama
tp_plan over the mesh's "tp" dim: each decoder layer's projections become DTensors), then FSDP2
over "dp_shard" (fully_shard per decoder layer and the root; a tensor-parallel weight becomes a
2-D DTensor, sharded along dp_shard and tp), or DDP over "dp_replicate" alone. Context parallel
(cp_size > 1): FSDP2 over dp_shard x cp, and context_parallel.ContextParallel hands each cp rank
its part of every row. The model never sees the ranks. Built on distributed.py, mesh.py,
fsdp.py, tensor_parallel.py and context_parallel.py.
"""

import fnmatch
import math

import torch

from nanosft.distributed import all_reduce_sum, get_world_size, is_dtensor
from nanosft.parallel.fsdp import apply_fsdp, normalize_fsdp_config
from nanosft.parallel.mesh import check_parallelism
from nanosft.parallel.tensor_parallel import (AUTO_PLAN_MODEL_TYPES, LLAMA_TP_PLAN,
                                              apply_tensor_parallel)


def _is_lora_linear(module) -> bool:
    return hasattr(module, "base_layer") and hasattr(module, "lora_A")


def adapter_tp_plan(model) -> dict:
    """The Llama tp plan for `model` (a CausalLM), with each LoRA layer's adapters following its
    base layer: column-parallel base -> A whole, B split along its output rows (each rank adds
    its slice of B A x to its slice of W x); row-parallel base -> A split along its input columns
    (A x summed over ranks), B whole. Mirrors: peft's layers under a transformers tp_plan
    Differs: DoRA, 4-bit bases and dropout > 0 are refused (not implemented yet)."""
    plan = {}
    for pattern, style in LLAMA_TP_PLAN.items():
        layers = [m for n, m in model.model.named_modules()
                  if fnmatch.fnmatchcase(n, pattern)]
        if not any(_is_lora_linear(m) for m in layers):
            plan[pattern] = style
            continue
        for m in layers:
            if (any(m.use_dora.values()) or not isinstance(m.base_layer, torch.nn.Linear)
                    or any(not isinstance(d, torch.nn.Identity) for d in m.lora_dropout.values())):
                raise ValueError("tensor parallel with DoRA, a 4-bit base or lora_dropout > 0 is "
                                 "not implemented yet; use plain LoRA with lora_dropout=0, or "
                                 "dp_shard_size (FSDP) alone")
        plan[f"{pattern}.base_layer"] = style
        plan[f"{pattern}.{'lora_B' if style == 'colwise' else 'lora_A'}.*"] = style
    return plan


def _local_features(model, tp_size) -> None:
    """A LoRA layer under tensor parallel sees its rank's piece: a row-parallel one reads
    in_features / tp_size inputs, a column-parallel one writes out_features / tp_size outputs
    (LoraLinear checks the input's width against in_features)."""
    for pattern, style in LLAMA_TP_PLAN.items():
        for name, m in model.model.named_modules():
            if fnmatch.fnmatchcase(name, pattern) and _is_lora_linear(m):
                if style == "rowwise":
                    m.in_features //= tp_size
                else:
                    m.out_features //= tp_size


def parallelize(model, args):
    """Lay `model` over args.parallelism_config's mesh, in place; returns the model to call (DDP's
    wrapper when dp_replicate_size > 1, context_parallel.ContextParallel's when cp_size > 1, else
    `model`). Mirrors: accelerate prepare_nd_parallel
    Differs: a model loaded with tp_plan is refused (not yet)."""
    config = args.parallelism_config
    check_parallelism(config, get_world_size(), model)
    if config.total_size == 1:  # one process: nothing to lay out
        return model
    if any(is_dtensor(p) for p in model.parameters()):
        raise ValueError("this model is already split over ranks (loaded with tp_plan); with "
                         "parallelism_config, load it plain and the Trainer applies the plan")
    mesh = config.get_device_mesh(torch.device(args.device).type)
    if config.tp_size > 1:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        model_type = getattr(base.config, "model_type", "llama")
        plan = adapter_tp_plan(base) if model_type in AUTO_PLAN_MODEL_TYPES else "auto"
        apply_tensor_parallel(base, tp_plan=plan, mesh=mesh["tp"])  # "auto" refuses the type
        _local_features(base, config.tp_size)
    if config.cp_size > 1:  # context parallel: FSDP2 over dp_shard x cp, each rank its part
        from nanosft.parallel import context_parallel

        context_parallel.check_context_parallel(model, args)
        fsdp_config = args.fsdp_config if args.fsdp else normalize_fsdp_config(True, None)
        apply_fsdp(model, fsdp_config, args.device, mesh=config.dp_shard_cp_mesh)
        return context_parallel.ContextParallel(model, mesh["cp"])
    if config.dp_shard_size > 1:
        fsdp_config = args.fsdp_config if args.fsdp else normalize_fsdp_config(True, None)
        apply_fsdp(model, fsdp_config, args.device, mesh=mesh["dp_shard"])
    elif config.dp_replicate_size > 1:  # mesh.py refuses replicas beside any other dim
        device_ids = [args.local_process_index] if args.device.type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    return model


def _holders(grad) -> int:
    """How many ranks hold each value of `grad`: all of them for a whole tensor; for a DTensor,
    the ranks outside its mesh times the sizes of the mesh dims it is replicated along."""
    world = get_world_size()
    if not is_dtensor(grad):
        return world
    mesh = grad.device_mesh
    replicated = [mesh.size(i) for i, p in enumerate(grad.placements) if p.is_replicate()]
    return world // mesh.size() * math.prod(replicated)


def clip_grad_norm_(parameters, max_norm: float) -> torch.Tensor:
    """Clip gradients that are whole tensors or DTensors on any sub-mesh; returns the 2-norm of
    the whole model's gradient (one all-reduce). Each rank adds the squares of the values it
    holds divided by how many ranks hold them, so the sum over all ranks counts every value once.
    Mirrors: torch.nn.utils.clip_grad_norm_ (and 3D_parallel.py's clip over DTensors)"""
    grads = [p.grad for p in parameters if p.grad is not None]
    if any(is_dtensor(g) and any(p.is_partial() for p in g.placements) for g in grads):
        raise ValueError("a gradient is still a partial sum (Partial placement): reduce it first")
    squares = torch.zeros((), dtype=torch.float64, device=grads[0].device if grads else "cpu")
    for g in grads:
        local = g.to_local() if is_dtensor(g) else g
        squares += local.detach().double().pow(2).sum() / _holders(g)
    total_norm = all_reduce_sum(squares).sqrt().float()
    clip_coef = float(max_norm) / (total_norm.item() + 1e-6)  # torch's epsilon
    if clip_coef < 1.0:
        for g in grads:
            g.detach().mul_(clip_coef)
    return total_norm

"""Apply a ParallelismConfig's plan to a plain model, and clip gradients spread over its meshes.

As torchtitan's parallelize step and the guide's 3D_parallel.py: tensor parallel first (the Llama
tp_plan over the mesh's "tp" dim: each decoder layer's float projections become DTensors; 4-bit
bases, DoRA magnitudes and row-parallel dropout of LoRA layers follow in tensor_parallel_peft.py),
then FSDP2 over "dp_shard" (fully_shard per decoder layer and the root; a tensor-parallel weight
becomes a 2-D DTensor, sharded along dp_shard and tp), or over "dp_replicate" x "dp_shard" when
replicas stand beside another dim (HSDP), or DDP over "dp_replicate" alone. Context parallel
(cp_size > 1): FSDP2 over dp_shard x cp, and context_parallel.ContextParallel hands each cp rank
its part of every row. The model never sees the ranks. Built on distributed.py, mesh.py, fsdp.py,
tensor_parallel.py, tensor_parallel_peft.py and context_parallel.py.
"""

import math

import torch

from nanosft.distributed import all_reduce_sum, get_rank, get_world_size, is_dtensor
from nanosft.parallel.fsdp import apply_fsdp, normalize_fsdp_config
from nanosft.parallel.mesh import check_parallelism
from nanosft.parallel.tensor_parallel import (AUTO_PLAN_MODEL_TYPES, LLAMA_TP_PLAN,
                                              apply_tensor_parallel)
from nanosft.parallel.tensor_parallel_peft import (_is_lora_linear, check_4bit_blocks,
                                                   parallelize_peft_layers, planned_layers)


def adapter_tp_plan(model) -> dict:
    """The Llama tp plan for `model` (a CausalLM) over its float layers, with each LoRA layer's
    adapters following its base layer: column-parallel base -> A whole, B split along its output
    rows (each rank adds its slice of B A x to its slice of W x); row-parallel base -> A split
    along its input columns (A x summed over ranks), B whole. 4-bit layers, DoRA magnitudes and
    row-parallel dropout are left to tensor_parallel_peft.parallelize_peft_layers.
    Mirrors: peft's layers under a transformers tp_plan"""
    plan = {}
    for name, m, style in planned_layers(model, LLAMA_TP_PLAN):
        base = m.base_layer if _is_lora_linear(m) else m
        if isinstance(base, torch.nn.Linear):
            plan[f"{name}.base_layer" if base is not m else name] = style
        if base is not m:
            plan[f"{name}.{'lora_B' if style == 'colwise' else 'lora_A'}.*"] = style
    return plan


def _local_features(model, tp_size) -> None:
    """A LoRA layer under tensor parallel sees its rank's piece: a row-parallel one reads
    in_features / tp_size inputs, a column-parallel one writes out_features / tp_size outputs
    (LoraLinear checks the input's width against in_features)."""
    for _, m, style in planned_layers(model, LLAMA_TP_PLAN):
        if _is_lora_linear(m):
            if style == "rowwise":
                m.in_features //= tp_size
            else:
                m.out_features //= tp_size


def _loaded_tp_mesh(model, config, device_type):
    """The config's mesh for a model from_pretrained(tp_plan=..., device_mesh=...) already split:
    its tp mesh must be this rank's tp group of the config's layout and, when another dim is
    split too, a dim of the config's mesh (FSDP composes with DTensors of the same root mesh)."""
    tp_mesh = next(p.device_mesh for p in model.parameters() if is_dtensor(p))
    first = get_rank() - get_rank() % config.tp_size
    expected, held = list(range(first, first + config.tp_size)), tp_mesh.mesh.flatten().tolist()
    fix = ("load it with device_mesh=parallelism_config.get_device_mesh()[\"tp\"], or load it "
           "plain and the Trainer applies the tp plan")
    if tp_mesh.ndim != 1 or held != expected:
        raise ValueError(f"this model was loaded with tp_plan over ranks {held}, but "
                         f"parallelism_config (tp_size={config.tp_size}) puts rank {get_rank()}'s "
                         f"tensor-parallel group on ranks {expected}; {fix}")
    mesh = config.get_device_mesh(device_type)
    if config.total_size > config.tp_size and tp_mesh._get_root_mesh() != mesh:
        raise ValueError("this model was loaded with tp_plan over a mesh of its own; FSDP over "
                         "the other dims needs the tp dim of parallelism_config's mesh: " + fix)
    return mesh


def _split_adapters(base, tp_mesh, tp_size) -> None:
    """LoRA layers injected after the base was split (get_peft_model on a model loaded with
    tp_plan): their adapters follow the base layer's plan, laid out as adapter_tp_plan does."""
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {k: styles[v]() for k, v in adapter_tp_plan(base).items() if k.endswith(".*")}
    if plan:
        parallelize_module(base.model, tp_mesh, plan)
        parallelize_peft_layers(base, LLAMA_TP_PLAN, tp_mesh)
        _local_features(base, tp_size)


def parallelize(model, args):
    """Lay `model` over args.parallelism_config's mesh, in place; returns the model to call (DDP's
    wrapper when dp_replicate_size alone is > 1, context_parallel.ContextParallel's when cp_size
    > 1, else `model`). FSDP2 runs over "dp_shard", or over ("dp_replicate", "dp_shard") when
    there are replicas beside another dim (HSDP: sharded within a replica, gradients all-reduced
    across replicas; with dp_shard_size 1 each replica holds the whole tensor-parallel piece), or
    over dp_shard x cp under context parallel. A model loaded with from_pretrained(tp_plan="auto",
    device_mesh=config.get_device_mesh()["tp"]) keeps its split (LoRA adapters injected after it
    are split to follow it); the rest of the plan is applied. Mirrors: accelerate
    prepare_nd_parallel (a model with tp_size checked against the config's)"""
    config = args.parallelism_config
    check_parallelism(config, get_world_size(), model)
    if config.total_size == 1:  # one process: nothing to lay out
        return model
    device_type = torch.device(args.device).type
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    loaded_split = any(is_dtensor(p) for p in model.parameters())
    if loaded_split and config.tp_size == 1:
        raise ValueError("this model was loaded with tp_plan (split over ranks), but "
                         "parallelism_config has tp_size=1; set tp_size to the size of its "
                         "device_mesh, or load it without tp_plan")
    if loaded_split:
        _split_adapters(base, _loaded_tp_mesh(model, config, device_type)["tp"], config.tp_size)
    elif config.tp_size > 1:
        check_4bit_blocks(base, LLAMA_TP_PLAN, config.tp_size)
    mesh = config.get_device_mesh(device_type)
    if config.tp_size > 1 and not loaded_split:
        model_type = getattr(base.config, "model_type", "llama")
        plan = adapter_tp_plan(base) if model_type in AUTO_PLAN_MODEL_TYPES else "auto"
        apply_tensor_parallel(base, tp_plan=plan, mesh=mesh["tp"])  # "auto" refuses the type
        parallelize_peft_layers(base, LLAMA_TP_PLAN, mesh["tp"])
        _local_features(base, config.tp_size)
    if config.cp_size > 1:  # context parallel: FSDP2 over dp_shard x cp, each rank its part
        from nanosft.parallel import context_parallel

        context_parallel.check_context_parallel(model, args)
        fsdp_config = args.fsdp_config if args.fsdp else normalize_fsdp_config(True, None)
        apply_fsdp(model, fsdp_config, args.device, mesh=config.dp_shard_cp_mesh)
        return context_parallel.ContextParallel(model, mesh["cp"])
    replicas = config.dp_replicate_size > 1
    if config.dp_shard_size > 1 or (replicas and config.tp_size > 1):
        fsdp_config = args.fsdp_config if args.fsdp else normalize_fsdp_config(True, None)
        dp_mesh = mesh["dp_replicate", "dp_shard"] if replicas else mesh["dp_shard"]
        apply_fsdp(model, fsdp_config, args.device, mesh=dp_mesh)
    elif replicas:  # replicas of a whole model: DDP
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

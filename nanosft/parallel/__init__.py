"""Model wrapping for several processes and for speed: FSDP2 sharding, DDP, torch.compile, and
tensor parallelism (tp_plan loading). `wrap_model` is the Trainer's one entry point.
"""

import torch


def clip_grad_norm_(parameters, max_norm: float) -> torch.Tensor:
    """The global-norm clip over DTensors of several meshes (parallelize.clip_grad_norm_)."""
    from nanosft.parallel.parallelize import clip_grad_norm_ as clip

    return clip(parameters, max_norm)


def wrap_model(model, args):
    """Lay `model` over args.parallelism_config's mesh (tensor parallel, FSDP2, DDP), else shard it
    in place with FSDP2 (args.fsdp), else wrap it in DDP under torchrun; then torch.compile as args
    say. Returns the model to call; `model` itself stays what checkpoints save.
    Mirrors: accelerate Accelerator.prepare_model"""
    if args.parallelism_config is not None:
        from nanosft.parallel.parallelize import parallelize

        model = parallelize(model, args)
    elif args.fsdp:  # fully_shard swaps in sharded parameters: before the optimizer is built
        from nanosft.parallel.fsdp import apply_fsdp

        apply_fsdp(model, args.fsdp_config, args.device)
    elif args.world_size > 1:
        from nanosft.parallel.tensor_parallel import refuse_tensor_parallel

        refuse_tensor_parallel(model)  # DDP would all-reduce its shards' grads
        device_ids = [args.local_process_index] if args.device.type == "cuda" else None
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    if args.torch_compile:
        model = torch.compile(model)  # shares its parameters with the model it wraps
    return model

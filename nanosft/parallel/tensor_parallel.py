"""Tensor parallelism: transformers' Llama tp_plan applied with torch's parallelize_module.

The guide's tensor-parallel part. `AutoModelForCausalLM.from_pretrained(dir, tp_plan="auto")`
applies `apply_tensor_parallel` to the loaded model (model.py never sees the ranks): it splits
each decoder layer's projections over the ranks as DTensors (the Megatron layout);
`clip_grad_norm_` clips gradients that are partly sharded; the Trainer, which shards data, refuses
such a model (`refuse_tensor_parallel`). Built on distributed.py; imports nothing else of nanosft.
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn

from nanosft.distributed import (
    get_world_size,
    init_distributed,
    is_dtensor,
    is_initialized,
    require_process_group,
    to_full,
)

# transformers' LlamaConfig.base_model_tp_plan (Mistral and Qwen2 write the same): the Megatron
# layout. Column-parallel q/k/v/gate/up give each rank whole heads and a slice of the MLP's hidden
# units; the row-parallel o/down multiply those slices and sum over ranks: one all-reduce per
# attention, one per MLP.
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
    naming them. Mirrors: transformers distributed checks of tp_size
    against the config"""
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


# the model types whose decoder layers LLAMA_TP_PLAN shards correctly
AUTO_PLAN_MODEL_TYPES = ("llama", "mistral", "qwen2")


def apply_tensor_parallel(model, tp_plan="auto", mesh=None) -> nn.Module:
    """Shard a CausalLM's decoder layers over all ranks, or over the 1-D `mesh` (a parallelism
    config's "tp" dim), as DTensors (colwise / rowwise), in place.
    Mirrors: transformers from_pretrained(tp_plan="auto")
    Differs: embeddings, norms and lm_head stay whole on each rank (transformers splits lm_head)."""
    model_type = getattr(model.config, "model_type", "llama")
    if tp_plan == "auto" and model_type not in AUTO_PLAN_MODEL_TYPES:
        # q/k norms, fused qkv_proj / gate_up_proj or per-type RoPE: the Llama plan would shard
        # them wrongly and train on silently wrong numbers
        llama_shaped = ", ".join(AUTO_PLAN_MODEL_TYPES)
        raise ValueError(
            f'tp_plan="auto" holds the plan of Llama-shaped layers ({llama_shaped}); a '
            f"{model_type} model has layers it does not fit. Train it without tp_plan (DDP or "
            "FSDP shard it correctly), or pass a dict tp_plan written for its modules")
    if not is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # as transformers does, the process group comes from torchrun's environment
        device = "cuda" if torch.cuda.is_available() else "cpu"
        init_distributed(argparse.Namespace(device=device, ddp_timeout=1800))
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
    check_tp_sizes(model.config, get_world_size() if mesh is None else mesh.size())
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    if device_type == "cuda":
        model.to(torch.device("cuda", torch.cuda.current_device()))
    if mesh is None:
        mesh = init_device_mesh(device_type, (get_world_size(),))
    parallelize_module(model.model, mesh, {k: styles[v]() for k, v in plan.items()})
    return model


def clip_grad_norm_(parameters, max_norm: float) -> torch.Tensor:
    """Clip gradients that are partly sharded (DTensor) and partly whole; returns the whole-model
    2-norm. Mirrors: torch.nn.utils.clip_grad_norm_
    Differs: whole gradients (norms, embeddings under TP) count as replicated, once."""
    from torch.distributed.tensor.experimental import implicit_replication

    with implicit_replication():
        return to_full(torch.nn.utils.clip_grad_norm_(parameters, max_norm))


def refuse_tensor_parallel(model) -> None:
    """Raise, naming the fix, for a tensor-parallel model handed to the data-parallel Trainer: its
    ranks hold different shards and must see the same batches, which DDP's data sharding breaks.
    Mirrors: nothing (transformers' Trainer mixes TP with data sharding)"""
    if any(is_dtensor(p) for p in model.parameters()):
        raise ValueError(
            "this model was loaded with tp_plan (its weights are split over the ranks); the "
            "Trainer shards data over ranks and cannot train it. Train it with a loop like "
            "tutorials/15_custom_loop.py, every rank on the same batches, or load it without "
            "tp_plan and use fsdp=True."
        )

"""torchrun environment -> process group, rank queries, all-reduce of counts, batch sharding.

The guide's "distributed training" part: data parallelism (DDP) only. `torchrun --nproc_per_node N`
sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT; `init_distributed` turns them into a
process group (gloo on CPU, nccl on CUDA). `shard_batches` gives each rank its share of the seeded
epoch order the way accelerate's BatchSamplerShard does, so n ranks see the batches one process would.
"""

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def init_distributed(args) -> bool:
    """Create the default process group from the torchrun environment; True when one exists.
    Guide: distributed training | Mirrors: accelerate PartialState.__init__ (MULTI_CPU / MULTI_GPU)"""
    if dist.is_available() and dist.is_initialized():
        return True
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    on_cuda = torch.device(args.device).type == "cuda"
    if on_cuda:
        # one GPU per process: LOCAL_RANK picks it before NCCL builds its communicator
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend="nccl" if on_cuda else "gloo", timeout=timedelta(seconds=args.ddp_timeout))
    return True


def is_initialized() -> bool:
    """True inside a process group. Guide: distributed training | Mirrors: torch.distributed.is_initialized"""
    return dist.is_available() and dist.is_initialized()


def get_world_size() -> int:
    """Number of processes (1 without a process group). Guide: distributed training | Mirrors: accelerate num_processes"""
    return dist.get_world_size() if is_initialized() else 1


def get_rank() -> int:
    """This process's global rank (0 without a process group). Guide: distributed training | Mirrors: accelerate process_index"""
    return dist.get_rank() if is_initialized() else 0


def is_main_process() -> bool:
    """True on rank 0, the process that logs and writes files. Guide: distributed training | Mirrors: accelerate is_main_process"""
    return get_rank() == 0


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over all ranks in place and return it (a no-op for one process).
    Guide: distributed training | Mirrors: transformers Trainer._get_num_items_in_batch (accelerator.gather(...).sum())"""
    if is_initialized() and get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def barrier() -> None:
    """Wait until every rank gets here (a no-op for one process). Guide: distributed training | Mirrors: accelerate wait_for_everyone"""
    if is_initialized() and get_world_size() > 1:
        dist.barrier()


def cleanup() -> None:
    """Destroy the process group if there is one. Guide: distributed training | Mirrors: torch.distributed.destroy_process_group"""
    if is_initialized():
        dist.destroy_process_group()


def shard_batches(batches: list, num_replicas: int, rank: int, batch_size: int, drop_last: bool = False) -> list:
    """Rank `rank`'s batches: the global batches rank, rank+W, rank+2W, ... with the tail evened out.
    Guide: distributed training | Mirrors: accelerate BatchSamplerShard._iter_with_no_split (even_batches=True)
    Every rank must get the same number of full batches, so the last short batch is topped up and missing batches are
    made from the first indices of the epoch again (with drop_last, incomplete rounds are simply dropped)."""
    if num_replicas == 1:
        return batches
    batches = [list(b) for b in batches]
    if drop_last:
        usable = len(batches) // num_replicas * num_replicas
        return batches[rank:usable:num_replicas]
    if not batches:
        return []
    # indices to recycle: those of the first W batches, repeated for datasets smaller than W * batch_size
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

"""torchrun environment -> process group; rank helpers, collectives and DDP's data sharding.

The guide's "distributed training" part. `torchrun --nproc_per_node N` sets RANK / WORLD_SIZE /
LOCAL_RANK / MASTER_ADDR / MASTER_PORT; `init_distributed` turns them into a process group (gloo on
CPU, nccl on CUDA). `shard_batches` gives each rank its share of the seeded epoch order
(accelerate's BatchSamplerShard). FSDP2 lives in parallel/fsdp.py and tensor parallelism in
parallel/tensor_parallel.py, both built on this module. `check_ranks_agree` stops every rank,
naming the odd ones, when they hold different data or step plans (they would wait in a
collective until ddp_timeout otherwise), and `explain_timeout` turns that wait into a message.
Imports nothing of nanosft, so every layer above can use it.
"""

import array
import contextlib
import gc
import hashlib
import os
import sys
from collections.abc import Mapping
from datetime import timedelta

import torch
import torch.distributed as dist


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


def all_reduce_sum(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum `tensor` over all ranks (or the ranks of `group`) in place and return it (a no-op for
    one process).
    Guide: distributed training | Mirrors: transformers Trainer._get_num_items_in_batch
    (accelerator.gather(...).sum())"""
    if is_initialized() and get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def data_parallel(args) -> tuple:
    """(size, rank, group) of the ranks that read different rows: every rank (group None), or the
    data-parallel dims of args.parallelism_config, whose tensor-parallel ranks share their rows
    (group None when there is one data shard: nothing to sum). Mirrors: transformers
    Trainer dp_world_size (world_size // tp_size // cp_size) and accelerate's dp mesh"""
    config = getattr(args, "parallelism_config", None)
    if config is None:
        return get_world_size(), get_rank(), None
    return config.data_parallel_group(torch.device(args.device).type)


def all_reduce_data_parallel(tensor: torch.Tensor, args) -> torch.Tensor:
    """Sum `tensor` in place over the ranks that read different rows (data_parallel(args)): every
    rank, or parallelism_config's data-parallel ones, whose tensor-parallel ranks hold the same
    counts and must add them once; a no-op for one data shard. Mirrors: accelerate's gather over
    the dp mesh (transformers Trainer dp_world_size)"""
    size, _, group = data_parallel(args)
    return all_reduce_sum(tensor, group) if size > 1 else tensor


def barrier() -> None:
    """Wait until every rank gets here (a no-op for one process). Guide: distributed training |
    Mirrors: accelerate wait_for_everyone"""
    if is_initialized() and get_world_size() > 1:
        dist.barrier()


def cleanup(barrier: bool = True) -> None:
    """Destroy the process group if there is one, after a barrier: a rank that tears gloo down
    while a peer is still inside a collective or writing can abort that peer at exit (SIGABRT,
    "terminate called without an active exception"). barrier=False on error paths, where a peer
    may never come. A DDP wrapper left in a reference cycle (a trainer and a hook closing over it)
    keeps its reducer, and through it the group, alive until interpreter finalization, where
    freeing it can abort the process the same way: collect such cycles before destroying.
    Guide: distributed training | Mirrors: torch.distributed.destroy_process_group"""
    if is_initialized():
        if barrier:
            dist.barrier()
        gc.collect()
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
    # indices to recycle: the first W batches', repeated for datasets smaller than W * batch_size
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


def shard_stream(rows, batch_size: int, num_replicas: int, rank: int, drop_last: bool = False):
    """Rank `rank`'s rows of a stream that every rank reads whole: of each round of
    num_replicas x batch_size rows, the rank-th batch_size; a short last round is filled from
    the first round's rows again (dropped with drop_last).
    Guide: distributed training | Mirrors: accelerate IterableDatasetShard (split_batches=False)"""
    total = batch_size * num_replicas
    mine = slice(rank * batch_size, (rank + 1) * batch_size)
    first_round, current = None, []
    for row in rows:
        current.append(row)
        if len(current) == total:
            yield from current[mine]
            first_round = current if first_round is None else first_round
            current = []
    if current and not drop_last:
        first_round = current.copy() if first_round is None else first_round
        while len(current) < total:
            current += first_round
        yield from current[:total][mine]


def require_process_group(feature: str) -> None:
    """Raise, naming the fix, when there is no multi-process group (a plain `python script.py`).
    Guide: distributed training | Mirrors: accelerate PartialState (distributed_type checks)"""
    if get_world_size() > 1:
        return
    env = {k: os.environ.get(k) for k in ("WORLD_SIZE", "RANK", "MASTER_ADDR")}
    raise RuntimeError(
        f"{feature} needs several processes, but this one runs alone (torchrun environment: "
        f"{env}). Launch with `torchrun --nproc_per_node 2 your_script.py`; for one process, "
        f"drop {feature}."
    )


# ----------------------------------------------------------------------------- DTensor helpers
def is_dtensor(value) -> bool:
    """True for a DTensor (a parameter sharded by FSDP2 or tensor parallel).
    Guide: distributed training | Mirrors: isinstance(value, torch.distributed.tensor.DTensor)
    Differs: never imports torch.distributed.tensor (seconds of sympy), so `import nanosft.sft`
    does not pay for it: no DTensor can exist before that import."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def to_full(tensor):
    """The whole tensor behind a DTensor (a collective: every rank calls it), any other value
    unchanged. Guide: distributed training | Mirrors: torch DTensor.full_tensor"""
    return tensor.full_tensor() if is_dtensor(tensor) else tensor


# ----------------------------------------------------------------------------- ranks agree
FINGERPRINT_KEYS = ("input_ids", "labels", "completion_mask", "assistant_masks", "seq_lengths")


def _int64_bytes(value) -> bytes:
    """A token list or tensor as int64 bytes: what the fingerprint hashes."""
    if torch.is_tensor(value):
        return value.detach().to("cpu", torch.int64).contiguous().numpy().tobytes()
    try:
        return array.array("q", value).tobytes()  # a flat list of ints (or bools)
    except TypeError:  # nested lists
        return torch.as_tensor(value).to(torch.int64).numpy().tobytes()


def fingerprint_examples(dataset, keys=FINGERPRINT_KEYS) -> str:
    """16 hex digits of BLAKE2b over each example's `keys` (token ids, labels, masks), in order:
    two ranks get the same string only when they hold the same tokenized examples."""
    digest = hashlib.blake2b(digest_size=8)
    try:
        length = len(dataset)
    except (TypeError, NotImplementedError):  # a stream: never read ahead to compare
        return "stream"
    for i in range(length):
        example = dataset[i]
        if not isinstance(example, Mapping):
            continue
        for key in keys:
            if example.get(key) is not None:
                digest.update(key.encode())
                digest.update(_int64_bytes(example[key]))
    return digest.hexdigest()


def _ranks(ranks: list) -> str:
    """[1] -> 'rank 1'; [0, 2, 3] -> 'ranks 0, 2 and 3'."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return f"ranks {', '.join(map(str, ranks[:-1]))} and {ranks[-1]}"


def ranks_disagree_message(per_rank: list) -> str | None:
    """The error for `per_rank` (one dict of named values per rank, in rank order) when the ranks
    hold different values, naming the ranks that differ from rank 0 and each value's ranks; None
    when all agree."""
    differ = [name for name in per_rank[0] if len({repr(v.get(name)) for v in per_rank}) > 1]
    if not differ:
        return None
    odd = [rank for rank, values in enumerate(per_rank) if values != per_rank[0]]
    parts = []
    for name in differ:
        holders = {}  # value -> the ranks holding it, in rank order
        for rank, values in enumerate(per_rank):
            holders.setdefault(repr(values.get(name)), []).append(rank)
        listed = ", ".join(f"{value} on {_ranks(ranks)}" for value, ranks in holders.items())
        parts.append(f"{name}: {listed}")
    return (f"{_ranks(odd)} {'does' if len(odd) == 1 else 'do'} not hold the same training data "
            f"and step plan as rank 0 ({'; '.join(parts)}). The ranks would wait for each other "
            "in a collective until ddp_timeout, or train on different data, so every rank stops. "
            "Every rank must read the same training file with the same arguments: with a "
            "multi-node run, copy the same file to each node.")


def check_ranks_agree(named_values: dict) -> None:
    """Raise ValueError on every rank, naming the ranks that differ, unless all ranks hold the same
    `named_values` (e.g. num_examples, a data fingerprint, max_steps); a no-op for one process.
    Differs: transformers and accelerate trust the ranks to agree."""
    if get_world_size() <= 1:
        return
    per_rank = [None] * get_world_size()
    dist.all_gather_object(per_rank, named_values)  # every rank sees every rank's values
    message = ranks_disagree_message(per_rank)
    if message is not None:
        raise ValueError(message)


@contextlib.contextmanager
def explain_timeout(ddp_timeout):
    """Turn a collective that waited longer than ddp_timeout seconds (gloo raises a RuntimeError)
    into a TimeoutError that names the setting; closes the process group first (a gloo group
    left open after a timeout aborts the process at exit). NCCL's watchdog ends its process
    itself."""
    try:
        yield
    except RuntimeError as error:
        if not (is_initialized() and "timed out" in str(error).lower()):
            raise
        rank = get_rank()
        cleanup(barrier=False)  # the peers may never come
        raise TimeoutError(
            f"rank {rank} waited longer than ddp_timeout={ddp_timeout} s for the other ranks in "
            f"a collective ({error}). Another rank is stuck, stopped or far slower (its own log "
            "says why: a dead node, an error on that rank, a long save); for slow steps raise "
            "--ddp_timeout.") from error

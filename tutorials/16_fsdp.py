"""Tutorial 16: fully sharded data parallel (FSDP2) on two CPU processes (guide: 分布式训练 / FSDP).

DDP keeps a whole replica on every rank; FSDP keeps 1/world_size of every parameter, gradient and
optimizer state. Before a layer runs, its shards are all-gathered into whole weights; after its
forward they are freed again (reshard_after_forward); in backward the whole gradients are
reduce-scattered, so each rank keeps the averaged gradient of its own shard. nanosft uses torch's
engine: `fully_shard` on every decoder layer, then on the root (what `Trainer` does with
`fsdp=True`). For QLoRA the packed NF4 bytes and their absmax statistics are sharded the same way:
each rank holds about half of the 4-bit model (the idea of FSDP-QLoRA).
Run:      torchrun --standalone --nproc_per_node=2 tutorials/16_fsdp.py
          (or python tutorials/16_fsdp.py, which starts the 2 gloo processes itself)
Runtime:  about 10 s of CPU over the two processes (starting them is most of it).
You should see:
  - rank 0 holding rows 0-31 and rank 1 rows 32-63 of q_proj.weight, and the whole (64, 64) inside
    forward;
  - each rank's gradient shard = its rows of the one-process gradient (~1e-10), per-rank means off
    by ~2e-4;
  - QLoRA bytes: each rank about half of the one-process bytes plus the small NF4 code tables every
    rank keeps,
    and logits equal to one process;
  - "OK: FSDP checked".
"""

# %%
import os
import socket

import torch
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from nanosft import distributed
from nanosft.parallel import fsdp
from nanosft.model import CausalLM, ModelConfig
from nanosft.nf4 import quantize_model
from nanosft.peft import LoraConfig, get_peft_model

TINY = {
    "vocab_size": 64,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
WORLD = 2
FSDP_CONFIG = fsdp.normalize_fsdp_config(
    True, None
)  # what TrainingArguments(fsdp=True) holds


def banner(title):
    if distributed.is_main_process():
        print(f"\n{'=' * 20} {title} {'=' * 20}", flush=True)


def tiny_model():
    torch.manual_seed(0)
    return CausalLM(ModelConfig(**TINY))


def global_batch():
    """4 rows with different numbers of trained tokens; rank r trains on rows 2r and 2r+1."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 64, (4, 12), generator=g)
    labels = ids.clone()
    labels[:, :4] = -100
    labels[1, 4:9] = -100  # row 1 trains on fewer tokens: the ranks' counts differ
    return ids, labels


def rank_print(rank, text):
    # the two processes print in turn, so the lines do not interleave
    for r in range(WORLD):
        if r == rank:
            print(f"[rank {rank}] {text}", flush=True)
        distributed.barrier()


# %% [markdown]
# ## 1. What each rank holds: a shard before forward, the whole weight inside it
def holds(rank):
    banner("1. shards and the all-gather")
    full_q = tiny_model().model.layers[0].self_attn.q_proj.weight.detach().clone()  # (64, 64)
    model = fsdp.apply_fsdp(tiny_model(), FSDP_CONFIG, "cpu")
    q_proj = model.model.layers[0].self_attn.q_proj
    shard = q_proj.weight.to_local()
    rows = shard.shape[0]
    rank_print(
        rank,
        f"q_proj.weight is a {type(q_proj.weight).__name__} of global shape "
        f"{tuple(q_proj.weight.shape)}; this rank holds rows {rank * rows}-"
        f"{(rank + 1) * rows - 1}: "
        f"{tuple(shard.shape)}, placements {q_proj.weight.placements}",
    )
    assert torch.equal(
        shard, full_q[rank * rows : (rank + 1) * rows]
    )  # plain row slices, no copies elsewhere
    seen = {}
    q_proj.register_forward_pre_hook(
        lambda m, a: seen.update(kind=type(m.weight).__name__, shape=tuple(m.weight.shape))
    )
    model(torch.ones(1, 4, dtype=torch.long))
    rank_print(
        rank,
        f"inside forward: {seen['kind']} {seen['shape']} (all-gathered); after it: "
        f"{type(q_proj.weight).__name__} of local shape {tuple(q_proj.weight.to_local().shape)}",
    )
    assert seen == {"kind": "Parameter", "shape": (64, 64)} and isinstance(q_proj.weight, DTensor)


# %% [markdown]
# ## 2. The reduce-scatter of gradients, and the result of one process
def gradients(rank):
    banner("2. reduce-scatter of gradients")
    ids, labels = global_batch()
    reference = tiny_model()  # one process, all 4 rows: mean over every trained token
    reference(ids, labels=labels).loss.backward()
    want = reference.model.layers[0].self_attn.q_proj.weight.grad
    mine = slice(2 * rank, 2 * rank + 2)
    tokens = (labels[:, 1:] != -100).sum().float()  # all ranks' tokens
    runs = {}
    for name, count in (("global count", tokens), ("per-rank mean", None)):
        model = fsdp.apply_fsdp(tiny_model(), FSDP_CONFIG, "cpu")
        if count is None:  # the mistake: each rank divides by its own tokens
            loss = model(ids[mine], labels=labels[mine]).loss
        else:  # FSDP averages over ranks (divides by 2): the loss is multiplied back, as Trainer
            loss = model(ids[mine], labels=labels[mine], num_items_in_batch=count).loss * WORLD
        loss.backward()
        grad = model.model.layers[0].self_attn.q_proj.weight.grad  # DTensor: this rank's rows only
        rows = grad.to_local().shape[0]
        runs[name] = (grad.to_local() - want[rank * rows : (rank + 1) * rows]).abs().max().item()
    rank_print(
        rank,
        f"grad shard {tuple(runs and grad.to_local().shape)}; max |shard - one-process rows| = "
        f"{runs['global count']:.2e}; with per-rank means instead: {runs['per-rank mean']:.2e}",
    )
    assert runs["global count"] < 1e-6 and runs["per-rank mean"] > 1e-5


# %% [markdown]
# ## 3. QLoRA: the 4-bit bytes and their statistics are sharded too
def qlora(rank):
    banner("3. QLoRA bytes per rank")

    def build():
        model = quantize_model(tiny_model())
        return get_peft_model(
            model,
            LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights="gaussian"),
        )

    ids, _ = global_batch()
    one = build()
    one_bytes = fsdp.held_bytes(one)
    # every rank keeps each 4-bit layer's code tables and offset whole: 16 + 256 + 1 fp32 constants
    tables = sum(
        t.numel() * t.element_size()
        for m in one.modules()
        if hasattr(m, "quant_state")
        for t in (m.quant_state.code, m.quant_state.state2.code, m.quant_state.offset)
    )
    with torch.no_grad():
        want = one(ids).logits
    model = fsdp.apply_fsdp(build(), FSDP_CONFIG, "cpu")
    base = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer
    mine = fsdp.held_bytes(model)
    with torch.no_grad():
        diff = (model(ids).logits - want).abs().max().item()
    rank_print(
        rank,
        f"q_proj packed NF4: {tuple(base.weight.shape)} uint8 global, "
        f"{tuple(base.weight.to_local().shape)} here; absmax "
        f"{tuple(base.weight_absmax.to_local().shape)} of {tuple(base.weight_absmax.shape)}",
    )
    rank_print(
        rank,
        f"parameter bytes: one process {one_bytes:,}, this rank {mine:,} ({mine / one_bytes:.2f}, "
        f"{tables:,} of them code tables kept whole); max |logits - one process| = {diff:.2e}",
    )
    assert abs(mine - (one_bytes + tables) / 2) < 0.01 * one_bytes and diff < 1e-5


def main():
    rank = distributed.get_rank()
    holds(rank)
    gradients(rank)
    qlora(rank)
    if rank == 0:
        print("\nOK: FSDP checked", flush=True)
    distributed.cleanup()


def _spawned(rank, port):
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    start()


def start():
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo")
    main()


if __name__ == "__main__":
    if "RANK" in os.environ:  # started by torchrun
        start()
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        print(
            f"not started by torchrun: spawning {WORLD} gloo processes on this machine", flush=True
        )
        mp.spawn(_spawned, args=(port,), nprocs=WORLD, join=True)

"""Tutorial 25: N-D parallel on four CPU processes: the guide's 3D_parallel.py steps (guide:
分布式训练 / N-D 并行).

Four ranks laid on one named grid: data parallel (FSDP2, "dp_shard") beside tensor parallel
("tp": each weight split) or context parallel ("cp": each row's tokens split). The steps of the
guide's 3D_parallel.py, each checked against one process: (1) the mesh and which rows each rank
reads; (2) a decoder layer split by the tp plan, then by FSDP (the local shapes); (3) attention
whose tokens are spread over the cp ranks: K/V all-gathered, the blocks merged by an online
softmax; (4) one training step of dp_shard x cp: the token count summed over the data-parallel
ranks only, the loss summed over every rank's share, the gradient norm over DTensor shards.
nanosft's Trainer does all of it from
`TrainingArguments(parallelism_config=ParallelismConfig(...))`.
Run:      python tutorials/25_nd_parallel.py   (spawns its 4 gloo processes)
          (or torchrun --standalone --nproc_per_node=4 tutorials/25_nd_parallel.py)
Runtime:  a few seconds of CPU per process; starting the 4 processes is most of it.
You should see:
  - each rank's coordinates (dp_shard, cp); the two cp ranks of a data shard read the same rows;
  - q_proj (32, 32) -> (16, 32) on each tp rank -> (8, 32) after FSDP; logits equal to one process;
  - rank 0 keeps tokens [0, 1, 2, 9, 10, 11] of a 12-token row, rank 1 [3 .. 8]: equal causal work;
    the merged attention and its q/k/v gradients equal the whole row's (~1e-7);
  - the token count over dp (the loss equal to one process) beside the count over all 4 ranks
    (the loss halved); the grad norm and every gradient equal to one process; "OK: N-D parallel
    checked".
"""

# %%
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from nanosft import ParallelismConfig, distributed
from nanosft.collator import DataCollatorForLanguageModeling
from nanosft.model import CausalLM, ModelConfig
from nanosft.parallel.context_parallel import (ContextParallel, build_layout,
                                               load_balanced_index, online_softmax_attention,
                                               padded_length)
from nanosft.parallel.fsdp import apply_fsdp, normalize_fsdp_config
from nanosft.parallel.parallelize import clip_grad_norm_
from nanosft.parallel.tensor_parallel import LLAMA_TP_PLAN, apply_tensor_parallel
from nanosft.trainer_utils import count_num_items_in_batch

TINY = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
WORLD = 4


def banner(title):
    if distributed.is_main_process():
        print(f"\n{'=' * 20} {title} {'=' * 20}", flush=True)


def rank_print(rank, text):
    for r in range(WORLD):  # in turn, so the lines of the processes do not interleave
        if r == rank:
            print(f"[rank {rank}] {text}", flush=True)
        distributed.barrier()


def tiny_model():
    torch.manual_seed(0)  # the same weights on every rank and in the one-process reference
    return CausalLM(ModelConfig(**TINY))


def all_rows():
    """4 ragged rows: 2 per data shard; the second half of each row is supervised."""
    g = torch.Generator().manual_seed(3)
    rows = []
    for length in (9, 13, 6, 11):
        ids = torch.randint(1, 64, (length,), generator=g).tolist()
        rows.append({"input_ids": ids,
                     "labels": [t if j >= length // 2 else -100 for j, t in enumerate(ids)]})
    return rows


collate = DataCollatorForLanguageModeling(pad_token_id=0)


# %% [markdown]
# ## 1. The mesh: one named grid over the ranks
def the_mesh(rank):
    banner("1. init_device_mesh: dp_replicate x dp_shard x cp x tp")
    config = ParallelismConfig(dp_shard_size=2, cp_size=2)
    mesh = config.get_device_mesh("cpu")
    _, dp_shard, cp, _ = mesh.get_coordinate()
    shard = config.data_parallel_rank(rank)  # which rows this rank reads (the sampler's rank)
    rank_print(rank, f"mesh {dict(zip(mesh.mesh_dim_names, mesh.shape))}: dp_shard={dp_shard}, "
                     f"cp={cp}; reads data shard {shard} of {config.data_parallel_size}")
    assert shard == dp_shard  # the cp ranks of one data shard read the same rows
    return config


# %% [markdown]
# ## 2. Tensor parallel, then FSDP: a weight split twice
def tensor_parallel(rank):
    banner("2. parallelize_module(tp plan), then fully_shard over dp_shard")
    config = ParallelismConfig(dp_shard_size=2, tp_size=2)
    mesh = config.get_device_mesh("cpu")
    model = tiny_model()
    attn = model.model.layers[0].self_attn
    whole = (tuple(attn.q_proj.weight.shape), tuple(attn.o_proj.weight.shape))
    apply_tensor_parallel(model, tp_plan=LLAMA_TP_PLAN, mesh=mesh["tp"])
    after_tp = (tuple(attn.q_proj.weight.to_local().shape),
                tuple(attn.o_proj.weight.to_local().shape))
    apply_fsdp(model, normalize_fsdp_config(True, None), "cpu", mesh=mesh["dp_shard"])
    after_fsdp = (tuple(attn.q_proj.weight.to_local().shape),
                  tuple(attn.o_proj.weight.to_local().shape))
    rank_print(rank, f"q_proj, o_proj: whole {whole} -> tp {after_tp} -> tp + FSDP {after_fsdp} "
                     f"({attn.q_proj.weight.placements})")
    assert after_tp == ((16, 32), (32, 16)) and after_fsdp == ((8, 32), (16, 16))
    ids = torch.randint(1, 64, (2, 10), generator=torch.Generator().manual_seed(5))
    diff = (model(ids).logits - tiny_model()(ids).logits).abs().max().item()
    rank_print(rank, f"max |logits - one process| = {diff:.1e}")
    assert diff < 1e-5


# %% [markdown]
# ## 3. Context parallel: each rank's queries over every rank's keys
def merge_by_hand(q, key_blocks, value_blocks, masks, scale):
    """Each block's own softmax statistics, then one merge: the blocks' partial outputs are
    rescaled to the common max and added; the sums of exp likewise."""
    partial = []
    for k, v, mask in zip(key_blocks, value_blocks, masks):
        k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)  # 4 heads, 2 KV heads
        s = (q @ k.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
        m = s.amax(-1, keepdim=True)  # this block's max (-inf where no key is visible)
        p = torch.exp(s - m.nan_to_num(neginf=0.0))
        partial.append((m, p.sum(-1, keepdim=True), p @ v))
    m_all = torch.stack([m for m, _, _ in partial]).amax(0)  # the max over all the keys
    l_all = sum(l * torch.exp(m - m_all) for m, l, _ in partial)
    o_all = sum(o * torch.exp(m - m_all) for m, _, o in partial)
    return o_all / l_all


def context_parallel_attention(rank, config):
    banner("3. attention over cp ranks: all-gather K/V, online softmax")
    cp_mesh = config.get_device_mesh("cpu")["cp"]
    cp_rank, group = cp_mesh.get_local_rank(), cp_mesh.get_group()
    T = 11  # odd: padded to 12 = 2 chunks per rank
    padded = padded_length(T, 2)
    mine = load_balanced_index(padded, 2, cp_rank)
    pairs = int((mine + 1).sum())  # causal (query, key) pairs this rank scores
    rank_print(rank, f"cp rank {cp_rank} keeps tokens {mine.tolist()} of {padded} "
                     f"({pairs} causal pairs)")
    assert pairs == int((torch.arange(padded) + 1).sum()) // 2
    g = torch.Generator().manual_seed(7)  # the same whole row on every rank
    q, k, v = (torch.randn(1, n, padded, 8, generator=g) for n in (4, 2, 2))
    layout = build_layout(None, torch.arange(T)[None], T, 2, cp_rank, group)
    q_mine, k_mine, v_mine = (x[:, :, mine].clone().requires_grad_() for x in (q, k, v))
    # by hand: gather every rank's K/V block, merge
    keys, values = [torch.empty_like(k_mine) for _ in range(2)], [torch.empty_like(v_mine)
                                                                 for _ in range(2)]
    dist.all_gather(keys, k_mine.detach(), group=group)
    dist.all_gather(values, v_mine.detach(), group=group)
    masks = [layout.block_mask(j) for j in range(2)]
    by_hand = merge_by_hand(q_mine.detach(), keys, values, masks, 8**-0.5)
    streamed = online_softmax_attention(q_mine.detach(), keys, values, masks, 8**-0.5)
    y = layout.attend(q_mine, k_mine, v_mine, 8**-0.5)  # what the model's attention layers call
    # one process: the whole (unpadded) row, causal
    q_all, k_all, v_all = (x[:, :, :T].clone().requires_grad_() for x in (q, k, v))
    whole = F.scaled_dot_product_attention(q_all, k_all, v_all, is_causal=True, enable_gqa=True)
    real = mine < T
    diffs = [(a[:, :, real] - whole[:, :, mine[real]]).abs().max().item()
             for a in (by_hand, streamed, y)]
    weights = torch.randn(whole.shape, generator=torch.Generator().manual_seed(8))
    (whole * weights).sum().backward()
    (y[:, :, real] * weights[:, :, mine[real]]).sum().backward()  # k, v grads come from both ranks
    grad = max((a.grad[:, :, real] - b.grad[:, :, mine[real]]).abs().max().item()
               for a, b in ((q_mine, q_all), (k_mine, k_all), (v_mine, v_all)))
    rank_print(rank, f"max |merged - whole row|: by hand {diffs[0]:.1e}, online {diffs[1]:.1e}, "
                     f"layout.attend {diffs[2]:.1e}; q/k/v grads {grad:.1e}")
    assert max(diffs) < 1e-6 and grad < 1e-5


# %% [markdown]
# ## 4. One training step of dp_shard x cp: which sum runs over which ranks
def training_step(rank, config):
    banner("4. the reductions: token count over dp, loss over every share, grad norm")
    rows = all_rows()
    reference = tiny_model()  # one process, the global batch of 4 rows
    batch = collate(rows)
    n_all = count_num_items_in_batch([batch])
    ref_out = reference(**batch, num_items_in_batch=n_all)
    ref_out.loss.backward()
    ref_loss = ref_out.loss.item()
    ref_norm = torch.cat([p.grad.flatten() for p in reference.parameters()]).norm().item()

    model = tiny_model()
    apply_fsdp(model, normalize_fsdp_config(True, None), "cpu", mesh=config.dp_shard_cp_mesh)
    cp_model = ContextParallel(model, config.get_device_mesh("cpu")["cp"])
    shard = config.data_parallel_rank(rank)
    mine = collate(rows[2 * shard: 2 * shard + 2])  # this data shard's rows (both cp ranks)
    local = count_num_items_in_batch([mine])
    over_dp = distributed.all_reduce_sum(local.clone(), config.dp_mesh.get_group())
    over_world = distributed.all_reduce_sum(local.clone())  # wrong: cp ranks count rows twice
    out = cp_model(**mine, num_items_in_batch=over_dp)  # cp_size x this rank's share
    loss = out.loss * config.data_parallel_size  # the Trainer's: FSDP averages over dp too
    loss.backward()
    logged = distributed.all_reduce_sum(loss.detach().clone()).item() / WORLD
    with torch.no_grad():
        halved = cp_model(**mine, num_items_in_batch=over_world).loss * config.data_parallel_size
    halved = distributed.all_reduce_sum(halved).item() / WORLD
    rank_print(rank, f"tokens: this shard's rows {int(local)}, over dp {int(over_dp)} "
                     f"(one process {int(n_all)}), over all 4 ranks {int(over_world)}; "
                     f"logits {tuple(out.logits.shape)} (this rank's tokens)")
    norm = clip_grad_norm_(model.parameters(), float("inf")).item()
    grad = max((distributed.to_full(p.grad) - q.grad).abs().max().item()
               for p, q in zip(model.parameters(), reference.parameters()))
    if rank == 0:
        print(f"loss: mean over ranks {logged:.6f}, one process {ref_loss:.6f}; with the count "
              f"over all ranks {halved:.6f}\ngrad norm {norm:.6f}, one process {ref_norm:.6f}; "
              f"max |grad - one process| = {grad:.1e}", flush=True)
    assert int(over_dp) == int(n_all) and int(over_world) == 2 * int(n_all)
    assert abs(logged - ref_loss) < 1e-5 and abs(halved - ref_loss / 2) < 1e-5
    assert abs(norm - ref_norm) < 1e-5 and grad < 1e-5


def main():
    rank = distributed.get_rank()
    config = the_mesh(rank)
    tensor_parallel(rank)
    context_parallel_attention(rank, config)
    training_step(rank, config)
    if rank == 0:
        print("\nOK: N-D parallel checked", flush=True)
    distributed.cleanup()


def start():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    main()


def _spawned(rank, port):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    start()


if __name__ == "__main__":
    if "RANK" in os.environ:  # started by torchrun
        start()
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        print(f"not started by torchrun: spawning {WORLD} gloo processes on this machine",
              flush=True)
        mp.spawn(_spawned, args=(port,), nprocs=WORLD, join=True)

"""Tutorial 17: tensor parallelism on two CPU processes (guide: 分布式训练 / 张量并行).

Tensor parallelism splits each weight matrix itself across ranks (Megatron-LM's layout). A
column-parallel linear gives each rank some output features (some attention heads, some MLP hidden
units) from the whole input; the following row-parallel linear takes exactly those features and
produces a partial sum of the whole output; one all-reduce adds the partial sums. So column- then
row-parallel costs one all-reduce per attention block and one per MLP, with nothing gathered in
between. nanosft loads a model this way with
`AutoModelForCausalLM.from_pretrained(folder, tp_plan="auto")`: transformers' Llama
base_model_tp_plan applied to the loaded model through torch's parallelize_module (q/k/v/gate/up
colwise, o/down rowwise).
Run:      torchrun --standalone --nproc_per_node=2 tutorials/17_tensor_parallel.py
          (or python tutorials/17_tensor_parallel.py, which starts the 2 gloo processes itself)
Runtime:  about 8 s of CPU over the two processes (starting them is most of it).
You should see:
  - the MLP by hand: each rank's partial output far from the whole one, their all-reduced sum equal
    (~1e-7);
  - per rank 2 of 4 query heads and 1 of 2 KV heads; 4 all-reduces in a 2-layer forward (2 per
    layer);
  - logits and every gradient equal to one process (~1e-7);
  - the refusal of 3 KV heads over 2 ranks; "OK: tensor parallel checked".
"""

# %%
import os
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.tensor.debug import CommDebugMode

from nanosft import distributed
from nanosft.parallel import tensor_parallel
from nanosft.families.auto import AutoModelForCausalLM
from nanosft.model import MLP, CausalLM, ModelConfig

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


def banner(title):
    if distributed.is_main_process():
        print(f"\n{'=' * 20} {title} {'=' * 20}", flush=True)


def rank_print(rank, text):
    for r in range(WORLD):  # in turn, so the lines of the two processes do not interleave
        if r == rank:
            print(f"[rank {rank}] {text}", flush=True)
        distributed.barrier()


# %% [markdown]
# ## 1. Column- then row-parallel, by hand, on the SwiGLU MLP
def mlp_by_hand(rank):
    banner("1. column-parallel gate/up, row-parallel down, one all-reduce")
    torch.manual_seed(0)
    mlp = MLP(ModelConfig(**TINY))  # gate/up: (128, 64), down: (64, 128)
    x = torch.randn(2, 3, 64)
    want = mlp(x)
    hidden = slice(rank * 64, (rank + 1) * 64)  # this rank's 64 of the 128 hidden units
    gate, up = mlp.gate_proj.weight[hidden], mlp.up_proj.weight[hidden]  # rows: column-parallel
    down = mlp.down_proj.weight[:, hidden]  # columns: row-parallel
    partial = F.linear(
        F.silu(F.linear(x, gate)) * F.linear(x, up), down
    )  # (2, 3, 64), a partial sum
    before = (partial - want).abs().max().item()
    total = partial.clone()
    dist.all_reduce(total)  # the one communication of the block
    after = (total - want).abs().max().item()
    rank_print(
        rank,
        f"hidden units {hidden.start}-{hidden.stop - 1}: max |partial - whole| = {before:.3f}; "
        f"after the all-reduce: {after:.1e}",
    )
    assert before > 1e-2 and after < 1e-6
    return want


# %% [markdown]
# ## 2. The whole model: AutoModelForCausalLM.from_pretrained(folder, tp_plan="auto")
def whole_model(rank, folder):
    banner('2. from_pretrained(tp_plan="auto"): heads split, 2 all-reduces per layer')
    model = AutoModelForCausalLM.from_pretrained(folder, tp_plan="auto")
    attn = model.model.layers[0].self_attn
    heads = attn.q_proj.weight.to_local().shape[0] // attn.head_dim
    kv_heads = attn.k_proj.weight.to_local().shape[0] // attn.head_dim
    rank_print(
        rank,
        f"q_proj {tuple(attn.q_proj.weight.to_local().shape)} of "
        f"{tuple(attn.q_proj.weight.shape)}: "
        f"{heads} of {attn.num_heads} query heads, {kv_heads} of {attn.num_kv_heads} KV heads; "
        f"o_proj {tuple(attn.o_proj.weight.to_local().shape)} (its input columns)",
    )
    assert heads == attn.num_heads // WORLD and kv_heads == attn.num_kv_heads // WORLD
    ids = torch.randint(1, 64, (2, 10), generator=torch.Generator().manual_seed(5))
    with CommDebugMode() as comm:
        out = model(ids, labels=ids)
    counts = {str(k).split(".")[-1]: v for k, v in comm.get_comm_counts().items()}
    rank_print(rank, f"collectives in one forward: {counts}")
    assert counts == {
        "all_reduce": 2 * TINY["num_hidden_layers"]
    }  # o_proj and down_proj, nothing else
    out.loss.backward()

    banner("3. equal to one process")
    reference = CausalLM.from_pretrained(folder)
    want = reference(ids, labels=ids)
    want.loss.backward()
    logits_diff = (out.logits - want.logits).abs().max().item()
    grad_diff = max(
        (distributed.to_full(p.grad) - q.grad).abs().max().item()
        for p, q in zip(model.parameters(), reference.parameters())
    )
    rank_print(
        rank,
        f"max |logits - one process| = {logits_diff:.1e}; "
        f"max |grad - one process| = {grad_diff:.1e}",
    )
    assert logits_diff < 1e-5 and grad_diff < 1e-5


# %% [markdown]
# ## 3. Sizes that do not split are refused
def refused(rank):
    banner("4. sizes that do not divide")
    try:
        tensor_parallel.check_tp_sizes(
            ModelConfig(
                **{**TINY, "num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 48}
            ),
            WORLD,
        )
    except ValueError as e:
        if rank == 0:
            print(e, flush=True)
        assert "num_key_value_heads=3" in str(e)
    else:
        raise AssertionError("3 KV heads over 2 ranks was accepted")


def main(folder):
    rank = distributed.get_rank()
    mlp_by_hand(rank)
    whole_model(rank, folder)
    refused(rank)
    if rank == 0:
        print("\nOK: tensor parallel checked", flush=True)
    distributed.cleanup()


def start(folder):
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    if distributed.is_main_process():
        torch.manual_seed(0)
        CausalLM(ModelConfig(**TINY)).save_pretrained(folder)  # a model folder both ranks load
    distributed.barrier()
    main(folder)


def _spawned(rank, port, folder):
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    start(folder)


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        if (
            "RANK" in os.environ
        ):  # started by torchrun: the folder name must be the same on both ranks
            start(
                os.path.join(
                    tempfile.gettempdir(), f"nanosft_tp_{os.environ.get('MASTER_PORT', '0')}"
                )
            )
        else:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            print(
                f"not started by torchrun: spawning {WORLD} gloo processes on this machine",
                flush=True,
            )
            mp.spawn(_spawned, args=(port, tmp), nprocs=WORLD, join=True)

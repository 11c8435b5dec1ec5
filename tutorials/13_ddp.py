"""Tutorial 13: distributed data parallel on two CPU processes (guide: 分布式训练 / 数据并行 DDP).

The guide's picture: every rank holds a model replica and the replicas 梯度同步 (all-reduce) their
gradients. Walkthrough 2.3 adds when: gradients are synchronised only on the window's last
micro-batch (DDP `no_sync` on the others), and `num_items_in_batch` counts the supervised tokens of
*all* ranks (an all-reduce), while each rank's loss is multiplied by world_size to undo DDP's
averaging. Together: 2 ranks x batch 2 x GA 2 give the gradient of one process with batch 4 x GA 2
on the same 8 rows, which we check at the optimizer step.
Run:      torchrun --standalone --nproc_per_node=2 tutorials/13_ddp.py
          (or python tutorials/13_ddp.py, which starts the 2 gloo processes itself)
Runtime:  about 9 s of CPU over the two processes (starting them is most of it).
You should see:
  - per micro-step: DDP sync False then True, each rank's own token count, and one
    num_items_in_batch for both;
  - rank 0 and rank 1 gradients different after the no_sync micro-step and identical after the
    sync step;
  - max |2-rank grad - one big batch by hand| and max |2-rank grad - 1-process Trainer grad| ~1e-8,
    while ranks dividing by their own token counts (no all-reduce) would be off by ~1e-2;
  - "OK: DDP checked".
"""

# %%
import contextlib
import io
import os
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from nanosft.args import TrainingArguments
from nanosft.collator import DataCollatorForLanguageModeling
from nanosft.distributed import cleanup
from nanosft.model import CausalLM, ModelConfig
from nanosft.trainer import Trainer
from nanosft.trainer_callback import TrainerCallback

TINY = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
COLLATOR = DataCollatorForLanguageModeling(pad_token_id=0)
WORLD = 2


def make_rows():
    """8 rows with uneven numbers of trained tokens, so the ranks' counts differ."""
    g = torch.Generator().manual_seed(4)
    rows = []
    for _ in range(8):
        length = int(torch.randint(4, 14, (1,), generator=g))
        ids = torch.randint(1, TINY["vocab_size"], (length,), generator=g).tolist()
        labels = [t if j >= length // 2 else -100 for j, t in enumerate(ids)]
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def banner(title):
    print(f"\n{'=' * 20} {title} {'=' * 20}", flush=True)


def tiny_model():
    torch.manual_seed(0)
    return CausalLM(ModelConfig(**TINY))


def one_step_trainer(per_device_train_batch_size):
    """A Trainer for one optimizer step (GA 2) at lr 0, to read the gradient the optimizer gets."""
    model = tiny_model()
    args = TrainingArguments(output_dir=tempfile.mkdtemp(),
                             per_device_train_batch_size=per_device_train_batch_size,
                             gradient_accumulation_steps=2, max_steps=1, logging_steps=1,
                             save_strategy="no", use_cpu=True, report_to="none", disable_tqdm=True,
                             seed=0, ddp_timeout=120, max_grad_norm=0.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    trainer = Trainer(model, args, train_dataset=make_rows(), data_collator=COLLATOR,
                      optimizers=(optimizer, None))
    seen = {}

    def keep_grads(*_):
        seen.update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})

    optimizer.register_step_pre_hook(keep_grads)
    return trainer, seen


def gather(value):
    """[value on rank 0, value on rank 1] (a float each), via all_gather."""
    out = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(out, torch.tensor([float(value)], dtype=torch.float64))
    return [t.item() for t in out]


def max_diff(a, b):
    return max((a[n] - b[n]).abs().max().item() for n in a)


# %% [markdown]
# ## Two ranks: no_sync, num_items_in_batch, the sync step
# A forward pre-hook on the model reads, per micro-batch: whether DDP will all-reduce in this
# backward (`require_backward_grad_sync` of `trainer.model_wrapped`, False inside no_sync), this
# rank's tokens and the num_items_in_batch it got; a callback reads a fingerprint of the lm_head
# gradient after each backward (on_substep_end, and on_pre_optimizer_step at the sync step), both
# gathered from the two ranks. The Trainer's own methods run unchanged.

# %%
class GradientFingerprint(TrainerCallback):
    """The lm_head gradient's norm on both ranks after each micro-batch's backward."""

    def __init__(self, trainer):
        self.trainer, self.prints = trainer, []

    def on_substep_end(self, args, state, control, **kwargs):
        grad = self.trainer.model.lm_head.weight.grad
        self.prints.append(gather(grad.double().norm().item()))

    on_pre_optimizer_step = on_substep_end  # the sync step's backward (max_grad_norm=0: no clip)


def run_two_ranks(rank):
    trainer, seen = one_step_trainer(per_device_train_batch_size=2)
    forwards = []

    def before_forward(module, args, kwargs):
        wrapped = trainer.model_wrapped  # what training_step gets: the DDP wrapper
        sync = getattr(wrapped, "require_backward_grad_sync", True)  # no_sync() sets it False
        own = int((kwargs["labels"][:, 1:] != -100).sum())
        forwards.append((type(wrapped).__name__, sync, gather(own),
                         kwargs["num_items_in_batch"].item()))

    trainer.model.register_forward_pre_hook(before_forward, with_kwargs=True)
    fingerprints = GradientFingerprint(trainer)
    trainer.add_callback(fingerprints)
    with contextlib.redirect_stdout(io.StringIO()) if rank else contextlib.nullcontext():
        trainer.train()  # rank 0 prints the banner: note "Total train batch size ... = 8"
    # this rank's share of the seeded epoch order
    sampler = trainer.get_train_dataloader().batch_sampler
    sampler.set_epoch(0)
    mine = [i for batch in sampler for i in batch]
    shares = [None] * dist.get_world_size()
    dist.all_gather_object(shares, mine)
    records = [(*f, p) for f, p in zip(forwards, fingerprints.prints, strict=True)]
    return seen, records, shares


def report_two_ranks(records):
    banner("梯度同步 / gradient sync: no_sync on non-sync micro-steps, "
           "num_items_in_batch all-reduced")
    print(f"training_step receives the wrapped model: {records[0][0]}")
    print(" micro-step | DDP sync | tokens rank0, rank1 | num_items_in_batch | "
          "lm_head grad norm rank0, rank1")
    for step, (_, sync, owns, num_items, prints) in enumerate(records):
        print(f"     {step}      |  {sync!s:5}   |       {owns[0]:g}, {owns[1]:g}        |"
              f"        {num_items:g}          | {prints[0]:.8f}, {prints[1]:.8f}")
    window_tokens = sum(sum(owns) for _, _, owns, _, _ in records)
    assert records[0][0] == "DistributedDataParallel"
    assert [sync for _, sync, _, _, _ in records] == [False, True]  # no_sync, then the sync step
    # both ranks' whole window
    assert all(num_items == window_tokens for _, _, _, num_items, _ in records)
    assert records[0][2][0] != records[0][2][1]  # the ranks really hold different numbers of tokens
    first, last = records[0][4], records[-1][4]
    print(f"after the no_sync micro-step the ranks' gradients differ: {first[0] != first[1]}; "
          f"after the sync step they are identical: {last[0] == last[1]}")
    assert first[0] != first[1] and last[0] == last[1]


# %% [markdown]
# ## The same gradient as one big batch
# One process sees the same 8 rows: the token-weighted mean of -log p over all their supervised
# tokens.

# %%
def big_batch_gradient(rows):
    """Gradient of sum(-log p) / (number of supervised tokens) over `rows` as one batch."""
    model = tiny_model()
    batch = COLLATOR(rows)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    targets = batch["labels"][:, 1:]
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten(), ignore_index=-100,
                           reduction="sum")
    (loss / (targets != -100).sum()).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def main():
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    two_rank_grads, records, shares = run_two_ranks(rank)
    if rank == 0:
        report_two_ranks(records)
    cleanup()
    if rank != 0:
        return
    banner("2 ranks == 1 process: the gradient at the optimizer step")
    # all 8 rows form the one accumulation window of max_steps=1
    by_hand = big_batch_gradient(make_rows())
    print(f"max |2-rank grad - one big batch by hand| = {max_diff(two_rank_grads, by_hand):.1e}")
    # negative control: each rank normalising by its own tokens, then DDP's average of the two
    # rank gradients
    rows = make_rows()
    per_rank = [big_batch_gradient([rows[i] for i in share]) for share in shares]
    own_counts = {n: (per_rank[0][n] + per_rank[1][n]) / 2 for n in by_hand}
    print(f"rows per rank {shares}; "
          "if each rank divided by its own tokens (no all-reduce of the count): "
          f"max |grad - one big batch| = {max_diff(own_counts, by_hand):.1e}")
    assert max_diff(own_counts, by_hand) > 1e-4
    # the process group is gone: one process now
    os.environ.update(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0")
    single, single_grads = one_step_trainer(per_device_train_batch_size=4)
    with contextlib.redirect_stdout(io.StringIO()):
        single.train()
    print("max |2-rank grad - 1-process Trainer grad (batch 4 x GA 2)| = "
          f"{max_diff(two_rank_grads, single_grads):.1e}")
    assert max_diff(two_rank_grads, by_hand) < 1e-6
    assert max_diff(two_rank_grads, single_grads) < 1e-6
    print("\nOK: DDP checked")


def _spawned(rank, port):
    """What torchrun would set up, for `python tutorials/13_ddp.py`."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    main()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    if "RANK" in os.environ:  # started by torchrun
        main()
    else:
        print(f"not started by torchrun: spawning {WORLD} gloo processes on this machine",
              flush=True)
        mp.spawn(_spawned, args=(free_port(),), nprocs=WORLD, join=True)

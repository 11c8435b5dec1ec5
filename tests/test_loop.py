"""nanosft/loop.py, piece by piece, against references written out in the tests.

Compared: a window's accumulated gradient (micro_step over count_window_tokens) with the gradient
of one big batch of the same rows (a plain forward and cross entropy), for full windows and the
short last one, with the mean-of-means and divide-by-GA bugs as negative controls; optimizer_step
under a GradScaler on an inf gradient (skipped: weights, scheduler kept, scale backed off) and on
a finite one (unscaled before clipping: the clipped SGD update by formula); train_loop with a
short window and max_steps against a plain one-big-batch-per-step loop; under 2 gloo ranks, a DDP
comm hook fires on the window's last micro-batch only and the window's gradient equals one process
on all rows. The whole loop against nanosft's Trainer: tests/test_tutorial_15.py.
Hermetic: tiny CausalLM (tests/tiny.py) or nn.Linear, random rows from fixed seeds, CPU, localhost
gloo via torch.multiprocessing spawn; no network.
Run: python -m pytest -q tests/test_loop.py
"""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from nanosft.distributed import cleanup
from nanosft.trainer_utils import no_sync
from nanosft.loop import (count_window_tokens, micro_step, optimizer_step, train_loop,
                          windows)
from tiny import TINY_LLAMA, join_as_rank, tiny_model

T = 8  # every row has T tokens, so a big batch is a torch.cat of micro-batches (no padding)


def make_batches(n, rows=2, seed=1):
    """`n` micro-batches of `rows` rows; row j masks its first prompt[j] labels with -100, so the
    rows hold T - prompt[j] targets after the shift. Also returns those target counts per batch."""
    g = torch.Generator().manual_seed(seed)
    batches, targets = [], []
    for _ in range(n):
        input_ids = torch.randint(1, TINY_LLAMA["vocab_size"], (rows, T), generator=g)
        prompt = torch.randint(1, T - 1, (rows, 1), generator=g)  # at least one target per row
        labels = input_ids.masked_fill(torch.arange(T) < prompt, -100)
        batches.append({"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
                        "labels": labels})
        targets.append(int((T - prompt).sum()))
    return batches, targets


def concat(batches):
    return {k: torch.cat([b[k] for b in batches]) for k in batches[0]}


def big_batch_loss(model, batch):
    """One big batch, written out: mean next-token cross entropy over all its targets."""
    logits = model(input_ids=batch["input_ids"]).logits  # (B, T, V)
    # position t predicts token t+1: (B, T-1, V) against (B, T-1)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(),
                           ignore_index=-100)


def grads(model):
    return [p.grad.clone() for p in model.parameters()]


def big_batch_grads(batch):
    model = tiny_model()
    big_batch_loss(model, batch).backward()
    return grads(model)


def window_grads(window, divisors):
    """Gradients after micro_step over the window, micro-batch i divided by divisors[i]."""
    model = tiny_model()
    for i, (batch, divisor) in enumerate(zip(window, divisors)):
        micro_step(model, batch, divisor, sync=i == len(window) - 1)
    return grads(model)


def max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


# ----------------------------------------------------------------------------- accumulation
def test_windows_of_five_micro_batches_with_ga_2_end_short():
    batches, _ = make_batches(5)
    split = list(windows(batches, gradient_accumulation_steps=2))
    assert [len(w) for w in split] == [2, 2, 1]
    assert [b is c for b, c in zip([b for w in split for b in w], batches)] == [True] * 5


def test_window_gradient_equals_one_big_batch_and_mean_of_means_does_not():
    batches, targets = make_batches(2)
    num_items_in_batch = count_window_tokens(batches)
    assert num_items_in_batch.dtype == torch.float32
    assert num_items_in_batch.item() == sum(targets)
    reference = big_batch_grads(concat(batches))
    ours = window_grads(batches, [num_items_in_batch] * 2)
    for got, want in zip(ours, reference):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    # negative control: each micro-batch's own mean, halved (the mean of per-micro-batch means)
    assert targets[0] != targets[1]  # the bug only shows when the counts differ
    mean_of_means = window_grads(batches, [count_window_tokens([b]) * 2 for b in batches])
    assert max_diff(mean_of_means, reference) > 1e-4


def test_short_last_window_is_divided_by_its_own_tokens():
    batches, targets = make_batches(5)
    last = list(windows(batches, gradient_accumulation_steps=2))[-1]
    num_items_in_batch = count_window_tokens(last)
    assert num_items_in_batch.item() == targets[4]  # not the 2-batch windows' count
    reference = big_batch_grads(last[0])
    ours = window_grads(last, [num_items_in_batch])
    for got, want in zip(ours, reference):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    # negative control: a fixed divisor of GA micro-batches halves the short window's gradient
    assert max_diff(window_grads(last, [num_items_in_batch * 2]), reference) > 1e-4


# ----------------------------------------------------------------------------- optimizer step
def linear_setup(init_scale=2.0 ** 10):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    x = torch.randn(5, 4)
    return model, optimizer, lr_scheduler, scaler, x


def test_gradscaler_skips_an_inf_gradient_and_holds_the_scheduler():
    model, optimizer, lr_scheduler, scaler, x = linear_setup()
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale(model(x).pow(2).mean()).backward()
    model.weight.grad[0, 0] = float("inf")  # an fp16 overflow in one gradient entry
    grad_norm, skipped = optimizer_step(model, optimizer, lr_scheduler, max_grad_norm=1.0,
                                        scaler=scaler)
    assert skipped and not torch.isfinite(grad_norm)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert lr_scheduler.last_epoch == 0 and optimizer.param_groups[0]["lr"] == 0.1
    assert scaler.get_scale() == 2.0 ** 10 * 0.5  # GradScaler's default backoff_factor
    assert all(p.grad is None for p in model.parameters())  # zero_grad: the next window is clean


def test_finite_step_unscales_before_clipping_and_steps_the_scheduler():
    model, optimizer, lr_scheduler, scaler, x = linear_setup()
    before = [p.detach().clone() for p in model.parameters()]
    model(x).pow(2).mean().backward()
    true_grads = grads(model)  # the reference: no scaler at all
    model.zero_grad()
    scaler.scale(model(x).pow(2).mean()).backward()
    max_grad_norm = 0.1
    grad_norm, skipped = optimizer_step(model, optimizer, lr_scheduler,
                                        max_grad_norm=max_grad_norm, scaler=scaler)
    norm = torch.cat([g.flatten() for g in true_grads]).norm()
    assert norm > max_grad_norm  # so clipping acts
    torch.testing.assert_close(grad_norm, norm, rtol=1e-6, atol=0)  # of the unscaled gradients
    # SGD with clip_grad_norm_'s coefficient max_norm / (norm + 1e-6)
    coefficient = max_grad_norm / (norm + 1e-6)
    for p, b, g in zip(model.parameters(), before, true_grads):
        torch.testing.assert_close(p.detach(), b - 0.1 * coefficient * g, rtol=0, atol=1e-7)
    assert not skipped
    assert lr_scheduler.last_epoch == 1 and optimizer.param_groups[0]["lr"] == 0.1 * 0.5
    assert scaler.get_scale() == 2.0 ** 10  # no growth before growth_interval (2000) good steps


# ----------------------------------------------------------------------------- the whole loop
def test_train_loop_equals_one_big_batch_per_step_with_a_short_window_and_max_steps():
    batches, _ = make_batches(5)  # GA 2: windows of 2, 2, 1 micro-batches each epoch
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (step + 1))
    log_history = train_loop(model, batches, optimizer, lr_scheduler, max_steps=5,
                             gradient_accumulation_steps=2, max_grad_norm=1.0)

    reference = tiny_model()
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    ref_scheduler = torch.optim.lr_scheduler.LambdaLR(ref_optimizer, lambda step: 1 / (step + 1))
    expected = []
    for start in [0, 2, 4, 0, 2]:  # epoch 1: windows of 2, 2, 1 micro-batches; epoch 2: cut at 5
        loss = big_batch_loss(reference, concat(batches[start:start + 2]))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        expected.append((loss.item(), norm.item(), ref_scheduler.get_last_lr()[0]))
        ref_optimizer.step()
        ref_scheduler.step()
        ref_optimizer.zero_grad()
    assert [h["step"] for h in log_history] == [1, 2, 3, 4, 5]
    assert [h["learning_rate"] for h in log_history] == [lr for _, _, lr in expected]
    ours = torch.tensor([[h["loss"], h["grad_norm"]] for h in log_history])
    torch.testing.assert_close(ours, torch.tensor([e[:2] for e in expected]), rtol=1e-5, atol=0)
    assert max_diff(list(model.parameters()), list(reference.parameters())) < 1e-6


# ----------------------------------------------------------------------------- distributed
def test_no_sync_toggles_fsdp2_gradient_sync_and_restores_it_on_error():
    class Sharded(torch.nn.Module):  # stands in for a module FSDP2's fully_shard wrapped
        def __init__(self):
            super().__init__()
            self.calls = []

        def set_requires_gradient_sync(self, requires_gradient_sync):
            self.calls.append(requires_gradient_sync)

    model = Sharded()
    with pytest.raises(RuntimeError), no_sync(model):
        assert model.calls == [False]
        raise RuntimeError("a failed backward")
    assert model.calls == [False, True]


WORLD, MICRO = 2, 3  # 2 ranks, a window of 3 micro-batches each


def _ddp_worker(rank, port, out_dir):
    join_as_rank(rank, port, world_size=WORLD)
    dist.init_process_group("gloo")
    batches, _ = make_batches(WORLD * MICRO)
    mine = batches[rank::WORLD]  # BatchSamplerShard: global micro-batches r, r + W, ...
    model = torch.nn.parallel.DistributedDataParallel(tiny_model())
    hook_calls = []

    def counting_allreduce(state, bucket):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        hook_calls.append(bucket.index())
        return allreduce_hook(state, bucket)

    model.register_comm_hook(None, counting_allreduce)
    num_items_in_batch = count_window_tokens(mine)
    calls, local_grads = [], []
    for i, batch in enumerate(mine):
        micro_step(model, batch, num_items_in_batch, sync=i == MICRO - 1)
        calls.append(len(hook_calls))
        local_grads.append(grads(model.module))
    torch.save({"count": num_items_in_batch, "calls": calls, "grads": local_grads},
               os.path.join(out_dir, f"rank{rank}.pt"))
    cleanup()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in")
def test_two_ranks_all_reduce_only_on_the_last_micro_batch(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_ddp_worker, args=(port, str(tmp_path)), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    batches, targets = make_batches(WORLD * MICRO)
    # the divisor counts both ranks' tokens
    assert [r["count"].item() for r in ranks] == [float(sum(targets))] * WORLD
    for r in ranks:  # no_sync: no all-reduce before the last micro-batch, then at least one bucket
        assert r["calls"][:-1] == [0] * (MICRO - 1) and r["calls"][-1] > 0
    for i in range(MICRO - 1):  # local gradients differ while the window accumulates ...
        assert max_diff(ranks[0]["grads"][i], ranks[1]["grads"][i]) > 1e-6
    # ... and after the all-reduce both ranks hold the gradient of one process on all the rows
    assert max_diff(ranks[0]["grads"][-1], ranks[1]["grads"][-1]) == 0
    reference = big_batch_grads(concat(batches))
    for got, want in zip(ranks[0]["grads"][-1], reference):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)

"""The guide's gradient-accumulation loop written by hand, no Trainer, in importable pieces.

Guide: custom training loop (自定义训练: no Trainer API). Read top to bottom: `windows` cuts
an epoch into optimizer steps, `count_window_tokens` is a window's divisor, `no_sync` and
`micro_step` are one forward/backward, `optimizer_step` clips and steps under a GradScaler, and
`train_loop` strings them together. It is trainer.py's `_inner_training_loop` less the bookkeeping
(callbacks, logging, evaluation, checkpoints); tutorials/15_custom_loop.py asserts that both give
the same per-step losses and final weights, in one process and under torchrun.
"""

import contextlib
import math

import torch

from nanosft import distributed
from nanosft.trainer_utils import count_num_items_in_batch, no_sync


# ----------------------------------------------------------------------------- the data side
def windows(dataloader, gradient_accumulation_steps):
    """Yield an epoch's micro-batches in lists of gradient_accumulation_steps, the last maybe short.
    Guide: gradient accumulation | Mirrors: transformers Trainer.get_batch_samples (one list per
    update step)"""
    window = []
    for batch in dataloader:
        window.append(batch)
        if len(window) == gradient_accumulation_steps:
            yield window
            window = []
    if window:  # the epoch's leftover micro-batches still make one (short) optimizer step
        yield window


def count_window_tokens(batches, device=None) -> torch.Tensor:
    """Supervised tokens in a window's micro-batches, summed over all ranks under torchrun (float).
    Guide: gradient accumulation | Mirrors: transformers Trainer._get_num_items_in_batch"""
    # the model shifts the labels: position 0 is never a target, hence labels[..., 1:]
    num_items_in_batch = torch.as_tensor(count_num_items_in_batch(batches), device=device)
    # "average tokens across devices": every rank divides by the same, global count
    distributed.all_reduce_sum(num_items_in_batch)
    return num_items_in_batch.float()


# ----------------------------------------------------------------------------- one micro-batch
def micro_step(model, batch, num_items_in_batch, *, sync=True, scaler=None, autocast_dtype=None):
    """Forward and backward of one micro-batch, its loss divided by the window's token count;
    returns that loss, detached. sync=False keeps the gradients local (not the window's last).
    Guide: gradient accumulation, mixed precision | Mirrors: transformers Trainer.training_step"""
    device_type = batch["input_ids"].device.type
    with contextlib.nullcontext() if sync else no_sync(model):
        with torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            # the model returns sum of this micro-batch's token losses / num_items_in_batch
            loss = model(**batch, num_items_in_batch=num_items_in_batch).loss
        # DDP (and FSDP) average the ranks' gradients, but num_items_in_batch already counts every
        # rank's tokens: x world size undoes the average (Trainer: average_tokens_across_devices)
        loss = loss * distributed.get_world_size()
        if scaler is not None:
            scaler.scale(loss).backward()  # fp16: scale up so small gradients survive
        else:
            loss.backward()
    return loss.detach()


# ----------------------------------------------------------------------------- one optimizer step
def optimizer_step(model, optimizer, lr_scheduler, *, max_grad_norm, scaler=None):
    """Clip, step the optimizer (a GradScaler skips gradients holding inf/nan), step the scheduler
    after a real step only, zero the gradients. Returns (grad_norm before clipping, skipped).
    Guide: gradient clipping, mixed precision | Mirrors: transformers Trainer._clip_grad_norm and
    the do_sync_step branch of Trainer._inner_training_loop"""
    if scaler is not None:
        scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
    max_norm = max_grad_norm if max_grad_norm > 0 else math.inf  # 0: measure the norm, no clip
    # under FSDP the norm of sharded gradients is a DTensor: to_full makes it one number
    grad_norm = distributed.to_full(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
    if scaler is None:
        optimizer.step()
        skipped = False
    else:
        scale_before = scaler.get_scale()
        scaler.step(optimizer)  # skipped when the unscaled gradients hold inf/nan ...
        scaler.update()  # ... and then the scale is lowered: that is how a skip shows
        skipped = scaler.get_scale() < scale_before
    if not skipped:
        lr_scheduler.step()  # the scheduler AFTER the optimizer, and only after a real step
    optimizer.zero_grad()  # "确保梯度清零": the next window starts from zero
    return grad_norm, skipped


# ----------------------------------------------------------------------------- the loop
def _set_epoch(dataloader, epoch):
    # a seeded sampler draws a new order each epoch, the same on every rank (torch's
    # DistributedSampler sits on .sampler, nanosft's SeedableBatchSampler on .batch_sampler)
    for name in ("sampler", "batch_sampler"):
        sampler = getattr(dataloader, name, None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)


def train_loop(model, dataloader, optimizer, lr_scheduler, *, num_train_epochs=1, max_steps=-1,
               gradient_accumulation_steps=1, max_grad_norm=1.0, scaler=None, autocast_dtype=None):
    """Epochs -> optimizer steps (windows) -> micro-batches; returns one log per optimizer step:
    loss (the window's, mean over ranks, as the Trainer logs it), grad_norm, learning_rate, step.
    Walkthrough 1 | Mirrors: transformers Trainer._inner_training_loop
    Differs: no callbacks, logging, evaluation, checkpoints or resume; max_steps > 0 wins."""
    device = next(model.parameters()).device
    steps_per_epoch = math.ceil(len(dataloader) / gradient_accumulation_steps)
    if max_steps > 0:  # as the Trainer: as many epochs as max_steps needs, stopping inside the last
        num_train_epochs = math.ceil(max_steps / steps_per_epoch)
    model.train()
    log_history = []
    global_step = 0
    for epoch in range(num_train_epochs):
        _set_epoch(dataloader, epoch)
        for window in windows(dataloader, gradient_accumulation_steps):
            window = [{k: v.to(device) for k, v in batch.items()} for batch in window]
            # "accumulation normalised by the token count": one divisor for the whole window
            num_items_in_batch = count_window_tokens(window, device)
            tr_loss = torch.zeros((), device=device)
            for i, inputs in enumerate(window):
                # DDP all-reduces the gradients only on the window's last micro-batch
                last = i == len(window) - 1
                tr_loss += micro_step(model, inputs, num_items_in_batch, sync=last, scaler=scaler,
                                      autocast_dtype=autocast_dtype)
            learning_rate = lr_scheduler.get_last_lr()[0]  # the rate this optimizer step uses
            grad_norm, _ = optimizer_step(model, optimizer, lr_scheduler,
                                          max_grad_norm=max_grad_norm, scaler=scaler)
            global_step += 1
            # each rank's tr_loss holds x world size (see micro_step): the mean over ranks is the
            # window's token-mean loss over all ranks, the number the Trainer logs
            loss = distributed.all_reduce_sum(tr_loss).item() / distributed.get_world_size()
            log_history.append({"loss": loss, "grad_norm": grad_norm.item(),
                                "learning_rate": learning_rate, "step": global_step})
            if global_step == max_steps:
                return log_history
    return log_history

"""Tutorial 15: the training loop written by hand, no Trainer (guide: 自定义训练 / custom training).

nanosft/loop.py holds the guide's loop as importable pieces: `count_window_tokens` (one divisor
per window, all ranks), `micro_step` (loss / the window's tokens, backward under DDP no_sync except
on the window's last micro-batch), `optimizer_step` (clip, GradScaler step, the scheduler after a
real step) and `train_loop`. We string the pieces by hand into a draft, assert it equals
train_loop, and run train_loop beside nanosft's Trainer on the same seed and arguments: the Trainer
is this loop + bookkeeping. Then an eval loop and an atomic checkpoint.
Run:      python tutorials/15_custom_loop.py
          torchrun --standalone --nproc_per_node=2 tutorials/15_custom_loop.py   (2 gloo ranks)
Runtime:  about 5 s on one CPU core.
You should see:
  - the first window: each micro-batch's tokens, num_items_in_batch, sync and loss;
  - per optimizer step: loss, grad_norm and learning rate from train_loop and from the Trainer;
  - "max |loss - Trainer loss|" below 1e-6, and the same for grad_norm, eval loss and weights;
  - the mean-of-means control off by ~1e-2; a checkpoint reloaded equal; "OK: custom loop ..."
"""

# %%
import contextlib
import io
import math
import os
import tempfile

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from nanosft.args import TrainingArguments
from nanosft.collator import DataCollatorForLanguageModeling
from nanosft.distributed import all_reduce_sum
from nanosft.loop import count_window_tokens, micro_step, optimizer_step, train_loop, windows
from nanosft.model import CausalLM, ModelConfig
from nanosft.optim import create_optimizer, get_scheduler
from nanosft.trainer import Trainer
from nanosft.trainer_utils import SeedableBatchSampler

torch.set_num_threads(1)
TINY = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
COLLATOR = DataCollatorForLanguageModeling(pad_token_id=0)
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
RANK = int(os.environ.get("RANK", "0"))
say = print if RANK == 0 else (lambda *args: None)  # rank 0 speaks for all


def make_rows(n, seed):
    """`n` rows of 4-13 tokens whose first half is prompt (-100), so token counts differ per row."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, 14, (n,), generator=g).tolist()
    rows = [torch.randint(1, TINY["vocab_size"], (t,), generator=g).tolist() for t in lengths]
    return [{"input_ids": ids, "labels": [-100] * (len(ids) // 2) + ids[len(ids) // 2:]}
            for ids in rows]


def tiny_model():
    torch.manual_seed(0)
    return CausalLM(ModelConfig(**TINY))


TRAIN, EVAL = make_rows(16, seed=1), make_rows(8, seed=2)
ARGS = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=2,
                         gradient_accumulation_steps=2, num_train_epochs=2, learning_rate=3e-3,
                         warmup_steps=2, max_grad_norm=0.5, logging_steps=1, save_strategy="no",
                         per_device_eval_batch_size=4, seed=7, report_to="none", disable_tqdm=True,
                         use_cpu=not torch.cuda.is_available(), fp16=torch.cuda.is_available())
DEVICE = ARGS.device
AUTOCAST = torch.float16 if ARGS.fp16 else None
if WORLD > 1:
    dist.init_process_group("gloo" if DEVICE.type == "cpu" else "nccl")


def setup():
    """A fresh model (DDP-wrapped under torchrun), this rank's seeded loader, AdamW, the scheduler
    and a GradScaler: what both the draft and train_loop start from."""
    model = tiny_model().to(DEVICE)
    # the Trainer's sampler: randperm(seed + epoch), rank r taking global micro-batches r, r+W, ...
    sampler = SeedableBatchSampler(len(TRAIN), ARGS.per_device_train_batch_size, seed=ARGS.seed,
                                   num_replicas=WORLD, rank=RANK)
    loader = DataLoader(TRAIN, batch_sampler=sampler, collate_fn=COLLATOR)
    optimizer = create_optimizer(model, ARGS)
    max_steps = int(ARGS.num_train_epochs) * math.ceil(len(loader) /
                                                       ARGS.gradient_accumulation_steps)
    scheduler = get_scheduler(ARGS.lr_scheduler_type, optimizer, num_training_steps=max_steps,
                              num_warmup_steps=ARGS.get_warmup_steps(max_steps))
    # fp16 on CUDA needs the scaler; on CPU the same object (tutorial 12) scales by 2**16 exactly
    scaler = torch.amp.GradScaler(DEVICE.type)
    ddp = torch.nn.parallel.DistributedDataParallel(model) if WORLD > 1 else model
    return ddp, loader, optimizer, scheduler, scaler


# %%  The draft: loop.py's pieces strung by hand, epoch -> optimizer step (a window) -> micro-batch
def draft_loop(mean_of_means=False, show=False):
    """[(loss, grad_norm, lr) per optimizer step]. mean_of_means=True is the classic bug: each
    micro-batch normalised by its own tokens (x the window's size) instead of the window's."""
    ddp, loader, optimizer, scheduler, scaler = setup()
    history = []
    for epoch in range(int(ARGS.num_train_epochs)):
        loader.batch_sampler.set_epoch(epoch)  # a new order each epoch, the same on every rank
        for window in windows(loader, ARGS.gradient_accumulation_steps):
            window = [{k: v.to(DEVICE) for k, v in b.items()} for b in window]
            # "accumulation normalised by token count": one count for the whole window, all ranks
            num_items_in_batch = count_window_tokens(window, DEVICE)
            step_loss = torch.zeros((), device=DEVICE)
            for i, batch in enumerate(window):
                divisor = num_items_in_batch
                if mean_of_means:  # the bug: this micro-batch's own tokens x the window's size
                    divisor = count_window_tokens([batch], DEVICE) * len(window)
                last = i == len(window) - 1  # DDP all-reduces gradients only on the last one
                loss = micro_step(ddp, batch, divisor, sync=last, scaler=scaler,
                                  autocast_dtype=AUTOCAST)
                step_loss += loss
                if show and not history:
                    tokens = (batch["labels"][:, 1:] != -100).sum().item()
                    say(f"  micro-batch {i}: {tokens:2d} tokens on rank 0, num_items_in_batch "
                        f"{num_items_in_batch.item():.0f} (window, all ranks), sync={last}, "
                        f"loss {loss.item():.6f}")
            lr = scheduler.get_last_lr()[0]
            grad_norm, _ = optimizer_step(ddp, optimizer, scheduler,
                                          max_grad_norm=ARGS.max_grad_norm, scaler=scaler)
            history.append((all_reduce_sum(step_loss).item() / WORLD, grad_norm.item(), lr))
            if show and len(history) == 1:
                say(f"  step 1 loss = sum of the micro-batch losses (mean over ranks) = "
                    f"{history[0][0]:.6f}")
    return history


def evaluate(model):
    """Mean of the batches' mean losses weighted by batch size, over all ranks' eval batches."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=DEVICE)
    batches = torch.arange(len(EVAL)).split(ARGS.per_device_eval_batch_size)[RANK::WORLD]
    with torch.no_grad(), torch.autocast(DEVICE.type, dtype=AUTOCAST, enabled=ARGS.fp16):
        for index in batches:
            batch = {k: v.to(DEVICE) for k, v in COLLATOR([EVAL[i] for i in index]).items()}
            loss = model(**batch).loss  # no num_items_in_batch: the batch's own token mean
            total += torch.tensor([loss.item() * len(index), len(index)], device=DEVICE)
    all_reduce_sum(total)
    model.train()
    return (total[0] / total[1]).item()


def save_checkpoint(path, model, optimizer, scheduler, scaler, step):
    """Everything a resume needs, written to a temp file and renamed: never half a file."""
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                "cpu_rng": torch.get_rng_state()}, path + ".tmp")
    os.replace(path + ".tmp", path)


# %%  The first window, piece by piece; then the draft == nanosft.loop.train_loop
say(f"the draft's first optimizer step, one micro-batch a line (rank 0's; losses x world size "
    f"{WORLD}, which DDP's gradient average takes back):")
draft = draft_loop(show=True)
ddp, loader, optimizer, scheduler, scaler = setup()
log_history = train_loop(ddp, loader, optimizer, scheduler,
                         num_train_epochs=int(ARGS.num_train_epochs),
                         gradient_accumulation_steps=ARGS.gradient_accumulation_steps,
                         max_grad_norm=ARGS.max_grad_norm, scaler=scaler, autocast_dtype=AUTOCAST)
model = ddp.module if WORLD > 1 else ddp
history = [(h["loss"], h["grad_norm"], h["learning_rate"]) for h in log_history]
draft_diff = max(abs(a - b) for d, h in zip(draft, history) for a, b in zip(d, h))
say(f"draft vs loop.train_loop: {len(draft)} steps, max |difference| = {draft_diff:.1e}")
assert len(draft) == len(history) and draft_diff < 1e-6

# %%  train_loop beside the Trainer, same seed and arguments
eval_loss = evaluate(model)
trainer = Trainer(tiny_model(), ARGS, train_dataset=TRAIN, eval_dataset=EVAL,
                  data_collator=COLLATOR)
with contextlib.redirect_stdout(io.StringIO()):  # the banner and log lines: tutorial 04 shows them
    trainer.train()
    trainer_eval = trainer.evaluate()["eval_loss"]
logs = [h for h in trainer.state.log_history if "grad_norm" in h]
say(f"world size {WORLD}, device {DEVICE}, fp16 {ARGS.fp16}, {len(history)} optimizer steps")
say(" step | loss (ours)  loss (Trainer) | grad_norm (ours)  (Trainer) | learning rate")
for step, ((loss, norm, lr), h) in enumerate(zip(history, logs), start=1):
    say(f"  {step:2d}  | {loss:.7f}    {h['loss']:.7f}   | {norm:.7f}        "
        f"{h['grad_norm']:.7f} | {lr:.3e}")
loss_diff = max(abs(ours[0] - h["loss"]) for ours, h in zip(history, logs))
norm_diff = max(abs(ours[1] - h["grad_norm"]) for ours, h in zip(history, logs))
weight_diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(),
                                                             trainer.model.parameters()))
say(f"max |loss - Trainer loss| = {loss_diff:.1e}; max |grad_norm - Trainer| = {norm_diff:.1e}; "
    f"max |final weight - Trainer's| = {weight_diff:.1e}")
say(f"eval loss: ours {eval_loss:.7f}, Trainer.evaluate {trainer_eval:.7f} "
    f"(difference {abs(eval_loss - trainer_eval):.1e})")
assert len(history) == len(logs) == trainer.state.global_step
assert [h[2] for h in history] == [h["learning_rate"] for h in logs]
assert max(loss_diff, norm_diff, weight_diff, abs(eval_loss - trainer_eval)) < 1e-6
control = draft_loop(mean_of_means=True)
control_diff = max(abs(ours[0] - h["loss"]) for ours, h in zip(control, logs))
say(f"negative control, mean of per-micro-batch means: max |loss - Trainer| = {control_diff:.1e}")
assert control_diff > 1e-3  # the comparison catches the classic accumulation bug

# %%  A checkpoint: written atomically, read back into fresh objects, compared
path = os.path.join(ARGS.output_dir, f"custom-loop-rank{RANK}.pt")
save_checkpoint(path, model, optimizer, scheduler, scaler, step=len(history))
restored = torch.load(path, weights_only=False)
fresh = tiny_model().to(DEVICE)  # a new model and optimizer, as a resumed process would build
fresh.load_state_dict(restored["model"])
fresh_optimizer = create_optimizer(fresh, ARGS)
fresh_optimizer.load_state_dict(restored["optimizer"])
pairs = list(zip(fresh.parameters(), model.parameters()))
same = all(torch.equal(a, b) and torch.equal(fresh_optimizer.state[a]["exp_avg"],
                                             optimizer.state[b]["exp_avg"]) for a, b in pairs)
say(f"checkpoint {os.path.basename(path)} at step {restored['step']}: "
    f"weights and Adam moments equal after reload: {same}")
assert same and restored["step"] == len(history) and not os.path.exists(path + ".tmp")
say("\nOK: custom loop equals the Trainer")
if WORLD > 1:
    dist.destroy_process_group()

"""Tutorial 15: the training loop written by hand, no Trainer (guide: 自定义训练 / custom training).

Plain PyTorch over nanosft's CausalLM, collator, create_optimizer and get_scheduler: a seeded
sampler, accumulation normalised by the window's token count, clipping, the scheduler after the
optimizer, a GradScaler, an eval loop, an atomic checkpoint, DDP no_sync under torchrun. The Trainer
then logs the same per-step losses on the same seed and arguments: it is this loop + bookkeeping.
Run:      python tutorials/15_custom_loop.py
          torchrun --standalone --nproc_per_node=2 tutorials/15_custom_loop.py   (2 gloo ranks)
Runtime:  about 5 s on one CPU core.
You should see:
  - per optimizer step: loss, grad_norm and learning rate from our loop and from the Trainer;
  - "max |loss - Trainer loss|" below 1e-6, and the same for grad_norm, eval loss and weights;
  - the mean-of-means control off by ~1e-2; a checkpoint reloaded equal; "OK: custom loop ..."
"""

# %%
import contextlib
import io
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nanosft.args import TrainingArguments
from nanosft.collator import DataCollatorForLanguageModeling
from nanosft.model import CausalLM, ModelConfig
from nanosft.optim import create_optimizer, get_scheduler
from nanosft.trainer import Trainer

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


def window_loss(model, batch, num_items_in_batch, world=WORLD):
    """Sum of this micro-batch's token losses / tokens of the whole window (all ranks) x world."""
    with torch.autocast(DEVICE.type, dtype=torch.float16, enabled=ARGS.fp16):
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    # position t predicts token t+1: (B, T-1, V) against (B, T-1)
    targets = batch["labels"][:, 1:]
    summed = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), targets.flatten(),
                             ignore_index=-100, reduction="sum")
    return summed / num_items_in_batch * world  # x world: DDP averages the ranks' gradients


# %%  The loop: epoch -> optimizer step (a window of GA micro-batches) -> micro-batch
def custom_loop(mean_of_means=False):
    """The guide's loop; returns [(loss, grad_norm, lr) per step], eval loss, model, state.
    mean_of_means=True is the classic bug: each micro-batch normalised by its own tokens."""
    if WORLD > 1 and not dist.is_initialized():
        dist.init_process_group("gloo" if DEVICE.type == "cpu" else "nccl")
    model = tiny_model().to(DEVICE)
    optimizer = create_optimizer(model, ARGS)
    ga, bs = ARGS.gradient_accumulation_steps, ARGS.per_device_train_batch_size
    # ceil at each division: a short last batch, rank share or window still counts (rows divide
    # evenly here, so the ranks' shares need none of the Trainer's even-batches topping up)
    steps_per_epoch = -(-len(TRAIN) // bs // WORLD // ga)
    max_steps = int(ARGS.num_train_epochs) * steps_per_epoch
    scheduler = get_scheduler(ARGS.lr_scheduler_type, optimizer, num_training_steps=max_steps,
                              num_warmup_steps=ARGS.get_warmup_steps(max_steps))
    # fp16 on CUDA needs the scaler; on CPU the same object (tutorial 12) scales by 2**16 exactly
    scaler = torch.amp.GradScaler(DEVICE.type)
    ddp = torch.nn.parallel.DistributedDataParallel(model) if WORLD > 1 else model
    history = []
    for epoch in range(int(ARGS.num_train_epochs)):
        # seeded sampler: a new order each epoch, the same on every rank and every run
        seeded = torch.Generator().manual_seed(ARGS.seed + epoch)
        order = torch.randperm(len(TRAIN), generator=seeded)
        batches = [order[i:i + bs].tolist() for i in range(0, len(TRAIN), bs)][RANK::WORLD]
        loader = torch.utils.data.DataLoader(TRAIN, batch_sampler=batches, collate_fn=COLLATOR)
        micro = [{k: v.to(DEVICE) for k, v in b.items()} for b in loader]
        for start in range(0, len(micro), ga):
            window = micro[start:start + ga]
            # "accumulation normalised by token count": one count for the whole window, all ranks
            num_items_in_batch = sum((b["labels"][:, 1:] != -100).sum() for b in window).float()
            if WORLD > 1:
                dist.all_reduce(num_items_in_batch)
            step_loss = torch.zeros((), device=DEVICE)
            for i, batch in enumerate(window):
                last = i == len(window) - 1  # DDP all-reduces gradients only on the last one
                sync = contextlib.nullcontext() if last or WORLD == 1 else ddp.no_sync()
                own = (batch["labels"][:, 1:] != -100).sum() * len(window) * WORLD
                with sync:
                    loss = window_loss(ddp, batch, own if mean_of_means else num_items_in_batch)
                    scaler.scale(loss).backward()
                step_loss += loss.detach() / WORLD
            scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), ARGS.max_grad_norm)
            lr = scheduler.get_last_lr()[0]
            scale = scaler.get_scale()
            scaler.step(optimizer)  # skipped when the gradients hold inf/nan
            scaler.update()
            if scaler.get_scale() >= scale:  # not skipped: the scheduler steps AFTER the optimizer
                scheduler.step()
            optimizer.zero_grad()
            if WORLD > 1:
                dist.all_reduce(step_loss)  # mean over ranks, as the Trainer logs it
            history.append((step_loss.item(), grad_norm.item(), lr))
    return history, evaluate(model), model, (optimizer, scheduler, scaler)


def evaluate(model):
    """Mean of the batches' mean losses weighted by batch size, over all ranks' eval batches."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=DEVICE)
    batches = torch.arange(len(EVAL)).split(ARGS.per_device_eval_batch_size)[RANK::WORLD]
    with torch.no_grad():
        for index in batches:
            batch = {k: v.to(DEVICE) for k, v in COLLATOR([EVAL[i] for i in index]).items()}
            loss = window_loss(model, batch, (batch["labels"][:, 1:] != -100).sum(), world=1)
            total += torch.tensor([loss.item() * len(index), len(index)], device=DEVICE)
    if WORLD > 1:
        dist.all_reduce(total)
    model.train()
    return (total[0] / total[1]).item()


def save_checkpoint(path, model, optimizer, scheduler, scaler, step):
    """Everything a resume needs, written to a temp file and renamed: never half a file."""
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                "cpu_rng": torch.get_rng_state()}, path + ".tmp")
    os.replace(path + ".tmp", path)


# %%
history, eval_loss, model, (optimizer, scheduler, scaler) = custom_loop()
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
control = custom_loop(mean_of_means=True)[0]
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

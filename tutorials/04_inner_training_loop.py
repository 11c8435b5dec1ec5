"""Tutorial 04: _inner_training_loop, read in lockstep with walkthrough 2.3.

Ten tiny rows, per-device batch 2, gradient_accumulation_steps 3: 5 micro-batches per epoch, so
every epoch ends on a short window of 2. We print the derived counts (num_train_epochs,
num_update_steps_per_epoch, max_steps, total_train_batch_size), the "***** Running training *****"
banner, then one line per micro-batch with its window, num_items_in_batch and do_sync_step, and
check each against the rule written out here.
With transformers installed, its Trainer computes the same counts and data order beside ours.
Run: python tutorials/04_inner_training_loop.py   (about 15 s with transformers, 5 s without)
You should see: "max_steps = 4", the banner, "do_sync_step" True on micro-steps 3 and 5 of each
epoch, "num_items_in_batch == window count: True", and "train_loss == mean of logged losses: True".
"""

# %%
from nanosft.reference import start_reference_mode

start_reference_mode()  # for reading: the walkthrough's own statements run, no speed paths

import importlib.util
import math
import tempfile

import torch

from nanosft.args import TrainingArguments
from nanosft.collator import DataCollatorForLanguageModeling
from nanosft.model import CausalLM, ModelConfig
from nanosft.trainer import Trainer

torch.set_num_threads(1)
VOCAB, N, BATCH, GA, EPOCHS, SEED = 64, 10, 2, 3, 2, 42


def banner(title):
    print(f"\n{'=' * 10} {title} {'=' * 10}")


def make_rows():
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(N):
        length = int(torch.randint(4, 10, (1,), generator=g))
        ids = torch.randint(1, VOCAB, (length,), generator=g).tolist()
        # 2 prompt tokens: no loss there
        rows.append({"input_ids": ids, "labels": [-100] * 2 + ids[2:]})
    return rows


def make_model():
    torch.manual_seed(0)
    return CausalLM(ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                max_position_embeddings=64))


ROWS = make_rows()
ARGS = {"per_device_train_batch_size": BATCH, "gradient_accumulation_steps": GA,
        "num_train_epochs": EPOCHS, "learning_rate": 1e-3, "logging_steps": 1,
        "save_strategy": "no", "use_cpu": True, "seed": SEED, "optim": "adamw_torch",
        "report_to": "none", "disable_tqdm": True}
output_dir = tempfile.mkdtemp()
trainer = Trainer(make_model(), TrainingArguments(output_dir=output_dir, **ARGS),
                  train_dataset=ROWS, data_collator=DataCollatorForLanguageModeling(pad_token_id=0))

# %%
banner("# Data loader and number of training steps")
train_dataloader = trainer.get_train_dataloader()
train_dataloader.batch_sampler.set_epoch(0)
order = [i for batch in train_dataloader.batch_sampler for i in batch]
print("epoch 0 order  :", order, " (randperm(N) seeded with seed + epoch)")
print("micro-batches  :", list(train_dataloader.batch_sampler))
assert order == torch.randperm(N, generator=torch.Generator().manual_seed(SEED)).tolist()

# %%
banner("# Setting up training control variables")
(num_train_epochs, num_update_steps_per_epoch, num_examples, num_train_samples,
 total_train_batch_size, steps_in_epoch, max_steps) = trainer.set_initial_training_values(
    trainer.args, train_dataloader)
print(f"len(train_dataloader) = steps_in_epoch = {steps_in_epoch}   (ceil({N} / {BATCH}))")
print(f"num_update_steps_per_epoch = {num_update_steps_per_epoch}   "
      f"(ceil({steps_in_epoch} / {GA}): the short last window still steps)")
print(f"num_train_epochs = {num_train_epochs}")
print(f"max_steps = {max_steps}   (num_train_epochs * num_update_steps_per_epoch)")
print(f"total_train_batch_size = {total_train_batch_size}   "
      f"({BATCH} per device * GA {GA} * world_size 1)")
assert (steps_in_epoch, num_update_steps_per_epoch, max_steps) == (5, 2, 4)
assert total_train_batch_size == BATCH * GA * 1

if importlib.util.find_spec("transformers") and importlib.util.find_spec("datasets"):
    import datasets
    import transformers

    hf_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2))
    hf_args = transformers.TrainingArguments(output_dir=output_dir, **ARGS)
    hf = transformers.Trainer(model=hf_model, args=hf_args,
                              train_dataset=datasets.Dataset.from_list(ROWS),
                              data_collator=DataCollatorForLanguageModeling(pad_token_id=0))
    hf_loader = hf.get_train_dataloader()
    hf_counts = hf.set_initial_training_values(hf.args, hf_loader)
    our_counts = (num_train_epochs, num_update_steps_per_epoch, num_examples, num_train_samples,
                  total_train_batch_size, steps_in_epoch, max_steps)
    fields = "(epochs, nupe, examples, samples, total batch, steps_in_epoch, max_steps)"
    print(f"transformers: {fields} = {hf_counts}")
    print(f"nanosft     : {fields} = {our_counts}")
    assert tuple(hf_counts) == our_counts
    hf_loader.set_epoch(0)
    hf_first = next(iter(hf_loader))["input_ids"]
    print("transformers first micro-batch == nanosft's:",
          torch.equal(hf_first, next(iter(train_dataloader))["input_ids"]))

# %%
banner("# We chunkify the epoch iterator into gradient accumulation steps `n` batches")
walkthrough_remainder = num_examples % GA or GA  # the walkthrough's line counts examples ...
# ... transformers 5.23 counts micro-batches (what the window holds)
remainder = steps_in_epoch % GA or GA
print(f"remainder = steps_in_epoch % GA = {remainder}  (the walkthrough's num_examples % GA gives "
      f"{walkthrough_remainder}: an older version, off when batch size > 1)")
assert remainder == 2

# Watch the real loop: a forward hook on the model records each micro-batch's forward (one per
# training_step call). The Trainer's methods stay as they are, so a debugger's `s` at the loop's
# `self.training_step(...)` lands in Trainer.training_step.
calls = []


def record_forward(model, args, kwargs, outputs):
    calls.append({"global_step": trainer.state.global_step,
                  "window": trainer.current_gradient_accumulation_steps,
                  "num_items": kwargs["num_items_in_batch"].item(),
                  "own": int((kwargs["labels"][:, 1:] != -100).sum()),
                  "loss": outputs["loss"].item()})  # = tr_loss_step: divided by num_items


trainer.model.register_forward_hook(record_forward, with_kwargs=True)

banner("# Train!")
result = trainer.train()

# %%
banner("micro-batch loop: step, window, num_items_in_batch, do_sync_step")
print(" epoch step | window | own tokens | num_items_in_batch | do_sync_step | tr_loss_step")
windows_ok = True
for k, call in enumerate(calls):
    epoch, step = divmod(k, steps_in_epoch)
    do_sync_step = (step + 1) % GA == 0 or (step + 1) == steps_in_epoch
    # the optimizer stepped exactly when the next micro-batch sees a larger global_step
    stepped = k + 1 == len(calls) or calls[k + 1]["global_step"] > call["global_step"]
    assert stepped == do_sync_step
    print(f"   {epoch}    {step}  |   {call['window']}    |     {call['own']:2d}     |"
          f"        {call['num_items']:5.1f}       |    {do_sync_step!s:5}     |"
          f" {call['loss']:.4f}")
    start = k - (step % GA)  # first micro-batch of this window
    window = calls[start:start + call["window"]]
    windows_ok &= call["num_items"] == sum(c["own"] for c in window)
print("num_items_in_batch == window count:", windows_ok)
assert windows_ok and len(calls) == EPOCHS * steps_in_epoch

# %%
banner("# get leaning rate before update / # add remaining tr_loss")
logged = [h for h in trainer.state.log_history if "loss" in h]
for h in logged:
    print(f"step {h['step']}: loss {h['loss']:.4f}  lr {h['learning_rate']:.2e}  "
          f"grad_norm {h['grad_norm']:.4f}  epoch {h['epoch']:.2f}")
# linear schedule, no warmup: step s (1-based) trains with lr * (max_steps - (s-1)) / max_steps
assert all(math.isclose(h["learning_rate"], 1e-3 * (max_steps - h["step"] + 1) / max_steps)
           for h in logged)
mean_logged = sum(h["loss"] for h in logged) / len(logged)
print(f"TrainOutput(global_step={result.global_step}, training_loss={result.training_loss:.4f})")
loss_matches = math.isclose(result.training_loss, mean_logged, rel_tol=1e-6)
print("train_loss == mean of logged losses:", loss_matches)
assert loss_matches and result.global_step == max_steps

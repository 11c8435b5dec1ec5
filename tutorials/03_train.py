"""Tutorial 03: Trainer.train(), the entry point, and what it settles before the inner loop
(walkthrough 2.2).

The walkthrough's train() is one line ("Main training entry point"):
    return inner_training_loop(args=args, resume_from_checkpoint=..., trial=trial,
                               ignore_keys_for_eval=...)
Before that line transformers 5.23 (and nanosft) turn on activation (gradient) checkpointing when
asked, and resolve resume_from_checkpoint (True means the newest output_dir/checkpoint-N). We record
the call train() makes, measure that checkpointing cuts the bytes saved for backward but not the
gradients, and resume a run from its checkpoint to the same weights as an uninterrupted run.
Run:      python tutorials/03_train.py
Runtime:  about 8 s on one CPU core with transformers installed (importing it is half), 4 s without.
You should see:
  - "train() -> _inner_training_loop(args, resume_from_checkpoint=None)" and checkpointing
    False -> True;
  - the bytes saved for backward per layer, then 0 per layer with gradient checkpointing, and the
    same gradient (it recomputes, it does not approximate);
  - resume_from_checkpoint=True resolving to checkpoint-2, and the resumed weights equal the
    uninterrupted ones;
  - transformers' TrainOutput beside ours, and "OK: walkthrough 2.2 checked".
"""

# %%
from nanosft.reference import start_reference_mode

start_reference_mode()  # for reading: the walkthrough's own statements run, no speed paths

import contextlib
import io
import os
import tempfile

import torch

from nanosft.args import TrainingArguments
from nanosft.collator import DataCollatorForLanguageModeling
from nanosft.memory import count_saved_tensors
from nanosft.model import CausalLM, ModelConfig
from nanosft.trainer import Trainer
from nanosft.trainer_callback import TrainerCallback

torch.set_num_threads(1)
TINY = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
ROWS = [{"input_ids": [5, 17, 42, 8, 9, 2], "labels": [-100, -100, 42, 8, 9, 2]},
        {"input_ids": [7, 33, 12, 2], "labels": [-100, 33, 12, 2]},
        {"input_ids": [3, 9, 14, 21, 8, 2], "labels": [-100, 9, 14, 21, 8, 2]},
        {"input_ids": [11, 6, 2], "labels": [-100, 6, 2]}] * 2
COLLATOR = DataCollatorForLanguageModeling(pad_token_id=0)


def banner(title):
    print(f"\n{'=' * 20} {title} {'=' * 20}")


def tiny_model():
    torch.manual_seed(0)
    return CausalLM(ModelConfig(**TINY))


def make_trainer(output_dir, **overrides):
    settings = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 1, "max_steps": 4,
                "learning_rate": 1e-3, "logging_steps": 1, "save_strategy": "no", "use_cpu": True,
                "optim": "adamw_torch", "report_to": "none", "disable_tqdm": True, "seed": 0,
                **overrides}
    return Trainer(tiny_model(), TrainingArguments(output_dir=output_dir, **settings),
                   train_dataset=ROWS, data_collator=COLLATOR)


def quiet(fn, *args, **kwargs):
    # the banner and log lines: tutorial 04 shows them
    with contextlib.redirect_stdout(io.StringIO()):
        return fn(*args, **kwargs)


# %% [markdown]
# ## def train(): """Main training entry point."""
# We replace this one trainer's _inner_training_loop by a recorder, so train() runs up to that
# call only.

# %%
banner("2.2 Trainer.train(): return inner_training_loop(args=args, resume_from_checkpoint=...)")
trainer = make_trainer(tempfile.mkdtemp(), gradient_checkpointing=True)
calls = []
print("before train(): model.is_gradient_checkpointing = "
      f"{trainer.model.is_gradient_checkpointing}")
def record_inner_loop(args, resume_from_checkpoint=None):
    calls.append((args, resume_from_checkpoint, trainer.model.is_gradient_checkpointing))
    return "the loop's TrainOutput"


trainer._inner_training_loop = record_inner_loop
returned = trainer.train()
args_seen, resume_seen, checkpointing_seen = calls[0]
print(f"train() -> _inner_training_loop(args, resume_from_checkpoint={resume_seen})   "
      f"returned {returned!r}")
print(f"when the loop starts: model.is_gradient_checkpointing = {checkpointing_seen} "
      f"(gradient_checkpointing_kwargs={trainer.args.gradient_checkpointing_kwargs})")
assert len(calls) == 1 and args_seen is trainer.args
assert resume_seen is None and checkpointing_seen is True
assert returned == "the loop's TrainOutput"

# %% [markdown]
# ## gradient_checkpointing: memory, not math
# A checkpointed layer keeps only its input in the forward and recomputes its activations during
# backward. We measure both halves of that claim: the bytes autograd saves for backward, counted
# with torch.autograd.graph.saved_tensors_hooks (nanosft.memory.count_saved_tensors: every saved
# tensor's storage once, the model's own weights left out), and the gradients.

# %%
banner("2.2 Trainer.train(): if args.gradient_checkpointing: model.gradient_checkpointing_enable()")
inputs = COLLATOR(ROWS[:2])
grads, saved = {}, {}
for checkpointing in (False, True):
    model = tiny_model()
    if checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    with count_saved_tensors(model) as counted:  # the forward: what autograd keeps for backward
        loss = model(**inputs).loss
    loss.backward()
    grads[checkpointing] = torch.cat([p.grad.flatten() for p in model.parameters()])
    saved[checkpointing] = counted
    print(f"checkpointing={checkpointing!s:5}: bytes saved for backward per decoder layer "
          f"{counted.per_layer}, outside the layers {counted.outside}, total {counted.total}")
B, T = inputs["input_ids"].shape
# (B, T, C) fp32 per layer
kept_inputs = TINY["num_hidden_layers"] * B * T * TINY["hidden_size"] * 4
print(f"with checkpointing the layers save nothing; outside grows by "
      f"{saved[True].outside - saved[False].outside} bytes, about the layer inputs the checkpoints "
      f"keep ({TINY['num_hidden_layers']} x (B={B}, T={T}, C={TINY['hidden_size']}) fp32 = "
      f"{kept_inputs})")
print(f"activation memory: {saved[False].total} -> {saved[True].total} bytes "
      f"({saved[True].total / saved[False].total:.0%})")
difference = (grads[True] - grads[False]).abs().max().item()
print(f"max |grad with checkpointing - grad without| = {difference:.1e}")
assert all(b > 0 for b in saved[False].per_layer) and all(b == 0 for b in saved[True].per_layer)
assert saved[True].total < saved[False].total / 2
assert difference < 1e-6

# %% [markdown]
# ## resume_from_checkpoint
# `True` means the newest output_dir/checkpoint-N; a folder resumes from that folder. The inner loop
# then restores model, optimizer, scheduler and RNG, and skips the micro-batches that step already
# consumed.

# %%
banner("2.2 Trainer.train(resume_from_checkpoint=...)")
full_dir, cut_dir = tempfile.mkdtemp(), tempfile.mkdtemp()
full = make_trainer(full_dir)
full_result = quiet(full.train)
cut = make_trainer(cut_dir, max_steps=4, save_strategy="steps", save_steps=1)


class StopAfterTwo(TrainerCallback):
    """"Interrupt" the run after step 2 (its checkpoint is written first)."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 2:
            control.should_training_stop = True


cut.add_callback(StopAfterTwo)
quiet(cut.train)
print(f"interrupted run wrote: {sorted(os.listdir(cut_dir))}")
try:
    make_trainer(tempfile.mkdtemp()).train(resume_from_checkpoint=True)
except ValueError as error:
    print(f"resume_from_checkpoint=True in an empty output_dir -> ValueError: {error}")
resumed = make_trainer(cut_dir)
resolved = []
original_loop = resumed._inner_training_loop
resumed._inner_training_loop = lambda args, resume_from_checkpoint=None: resolved.append(
    resume_from_checkpoint) or original_loop(args, resume_from_checkpoint)
resumed_result = quiet(resumed.train, resume_from_checkpoint=True)
print(f"resume_from_checkpoint=True resolved to {os.path.basename(resolved[0])}; "
      f"resumed global_step {resumed_result.global_step}")
weight_difference = max((a - b).abs().max().item() for a, b in
                        zip(full.model.state_dict().values(), resumed.model.state_dict().values()))
full_losses = [h["loss"] for h in full.state.log_history if "loss" in h]
resumed_losses = [h["loss"] for h in resumed.state.log_history if "loss" in h]
print(f"logged losses: uninterrupted {[round(x, 5) for x in full_losses]}")
print(f"               resumed       {[round(x, 5) for x in resumed_losses]}")
print(f"max |resumed weights - uninterrupted weights| = {weight_difference:.1e}")
assert os.path.basename(resolved[0]) == "checkpoint-2" and resumed_result.global_step == 4
assert resumed_losses == full_losses and weight_difference == 0.0

# %%
banner("reference: transformers Trainer.train() on the same weights and data")
try:
    import datasets
    import transformers
except ImportError:
    print("reference check skipped: transformers / datasets not installed")
else:
    transformers.utils.logging.set_verbosity_error()
    hf_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    hf_model.load_state_dict(tiny_model().state_dict())
    hf_args = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=2, max_steps=4,
        learning_rate=1e-3, logging_steps=1, save_strategy="no", use_cpu=True, optim="adamw_torch",
        report_to="none", disable_tqdm=True, seed=0)
    hf = transformers.Trainer(model=hf_model, args=hf_args,
                              train_dataset=datasets.Dataset.from_list(ROWS),
                              data_collator=COLLATOR)
    hf_result = quiet(hf.train)
    print(f"TrainOutput: nanosft (global_step={full_result.global_step}, training_loss="
          f"{full_result.training_loss:.6f})   transformers (global_step={hf_result.global_step}, "
          f"training_loss={hf_result.training_loss:.6f})")
    assert hf_result.global_step == full_result.global_step
    assert abs(hf_result.training_loss - full_result.training_loss) < 1e-5
    print("reference check ran: transformers Trainer.train")

print("\nOK: walkthrough 2.2 checked")

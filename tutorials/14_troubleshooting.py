"""Tutorial 14: troubleshooting and monitoring, a NaN loss and an exploding gradient (guide: 故障排除指南).

The guide's 梯度爆炸 entry: "症状: 损失值突然变为NaN或无穷大; 解决方案: 启用梯度裁剪, 检查学习率设置".
Walkthrough 2.3's loop has two monitors for this: `args.logging_nan_inf_filter` (a nan/inf micro-batch loss is
replaced by the average accumulated so far, so the logged curve stays finite) and grad_norm (the pre-clip norm
logged at every step, the first number to watch). We make both failures happen on purpose:
A) a micro-batch with no trained token under a per-batch mean loss gives loss nan (0/0) with zero gradient;
B) one bad batch whose loss is 10^4 times too large; without clipping the weights blow up, with it they do not.
Run:      python tutorials/14_troubleshooting.py
Runtime:  about 8 s on one CPU core with transformers installed (importing it is half), 4 s without.
You should see:
  - A: tr_loss_step nan on the empty micro-batch; logged loss finite with the filter, nan without; same weights;
  - A: with num_items_in_batch (the default) the empty micro-batch adds 0 and nothing is nan;
  - B: grad_norm ~1e5 at the bad step; without clipping nan afterwards, a logged loss of 0.0 hiding it, and
    nanosft's "Stopping at step ..." message; with max_grad_norm=1.0 the run recovers;
  - "OK: troubleshooting checked".
"""

# %%
import contextlib
import io
import math
import tempfile

import torch

from nanosft.args import TrainingArguments
from nanosft.collator import DataCollatorForLanguageModeling
from nanosft.model import CausalLM, ModelConfig
from nanosft.trainer import Trainer

torch.set_num_threads(1)
TINY = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
COLLATOR = DataCollatorForLanguageModeling(pad_token_id=0)


def banner(title):
    print(f"\n{'=' * 20} {title} {'=' * 20}")


def tiny_model():
    torch.manual_seed(0)
    return CausalLM(ModelConfig(**TINY))


def train(rows, **overrides):
    """A Trainer over a fresh tiny model (plain SGD, constant lr, logging every step); run() trains it."""
    settings = {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 2, "learning_rate": 1e-2,
                "logging_steps": 1, "save_strategy": "no", "use_cpu": True, "optim": "sgd", "report_to": "none",
                "lr_scheduler_type": "constant", "disable_tqdm": True, "seed": 0, **overrides}
    trainer = Trainer(tiny_model(), TrainingArguments(output_dir=tempfile.mkdtemp(), **settings),
                      train_dataset=rows, data_collator=COLLATOR)
    return trainer


def run(trainer, per_batch_mean=False, bad_micro_batch=None):
    """trainer.train(), quietly; returns what it printed and (supervised tokens, tr_loss_step) per micro-batch."""
    if per_batch_mean:  # a model that ignores num_items_in_batch and returns its own per-batch mean
        trainer.model_accepts_loss_kwargs = False
    steps, original_step, original_loss = [], trainer.training_step, trainer.compute_loss

    def training_step(model, inputs, num_items_in_batch=None):
        loss = original_step(model, inputs, num_items_in_batch)
        steps.append((int((inputs["labels"][:, 1:] != -100).sum()), loss.item()))
        return loss

    def compute_loss(model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = original_loss(model, inputs, return_outputs, num_items_in_batch)
        return loss * 1e4 if len(steps) == bad_micro_batch else loss  # B: one bad batch

    trainer.training_step, trainer.compute_loss = training_step, compute_loss
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        trainer.train()
    return printed.getvalue(), steps


# %% [markdown]
# ## A) A NaN loss and logging_nan_inf_filter
# The third row's labels are all -100 (say a prompt truncated before its answer; nanosft.data and TRL drop
# such rows while preparing, but a hand-made dataset may not). A per-batch mean over zero targets is 0/0.

# %%
banner("故障排除 A: 损失值变为NaN / a NaN loss, caught by logging_nan_inf_filter")
ROWS_A = [{"input_ids": [5, 17, 42, 8, 9, 2], "labels": [-100, -100, 42, 8, 9, 2]},
          {"input_ids": [7, 33, 12, 2], "labels": [-100, 33, 12, 2]},
          {"input_ids": [3, 9, 14, 21], "labels": [-100, -100, -100, -100]},  # nothing to train on
          {"input_ids": [11, 6, 2], "labels": [-100, 6, 2]}]
results = {}
for nan_filter in (True, False):
    trainer = train(ROWS_A, logging_nan_inf_filter=nan_filter, max_steps=2)
    _, steps = run(trainer, per_batch_mean=True)
    results[nan_filter] = trainer
    logged = [(h["step"], h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "grad_norm" in h]
    print(f"logging_nan_inf_filter={nan_filter}:")
    print("   micro-batch tokens / tr_loss_step: " + ", ".join(f"{n} -> {loss:.4f}" for n, loss in steps))
    print("   logged (step, loss, grad_norm):    " + ", ".join(f"({s}, {loss:.4f}, {g:.4f})" for s, loss, g in logged))
    bad = next(i for i, (n, _) in enumerate(steps) if n == 0)
    assert math.isnan(steps[bad][1])
    assert all(math.isfinite(g) for _, _, g in logged)  # 0/0 has zero gradient: only the reported loss is nan
    bad_step = logged[bad // 2]
    if nan_filter:
        # "if loss is nan or inf simply add the average of previous logged losses": tr_loss += tr_loss / (1 + 0)
        partner = steps[bad - 1][1] if bad % 2 else 0.0  # what tr_loss held when the nan arrived
        assert math.isclose(bad_step[1], 2 * partner, rel_tol=1e-6)
        assert all(math.isfinite(loss) for _, loss, _ in logged)
    else:
        assert math.isnan(bad_step[1])
same = all(torch.equal(a, b) for a, b in zip(results[True].model.parameters(), results[False].model.parameters()))
print(f"weights after training equal with and without the filter: {same}  (the filter only changes the log)")
assert same

trainer = train(ROWS_A, max_steps=2)
_, steps = run(trainer)  # the default: the model divides by num_items_in_batch, the window's token count
print("fix, num_items_in_batch: micro-batch tokens / tr_loss_step: "
      + ", ".join(f"{n} -> {loss:.4f}" for n, loss in steps))
assert all(math.isfinite(loss) for _, loss in steps) and 0.0 in [loss for n, loss in steps if n == 0]

try:
    import datasets
    import transformers
except ImportError:
    print("reference check skipped: transformers / datasets not installed")
else:
    transformers.utils.logging.set_verbosity_error()
    hf_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    hf_model.load_state_dict(tiny_model().state_dict())
    hf = transformers.Trainer(model=hf_model, train_dataset=datasets.Dataset.from_list(ROWS_A), data_collator=COLLATOR,
                              args=transformers.TrainingArguments(
                                  output_dir=tempfile.mkdtemp(), per_device_train_batch_size=1,
                                  gradient_accumulation_steps=2, learning_rate=1e-2, max_steps=2, logging_steps=1,
                                  save_strategy="no", use_cpu=True, optim="sgd", lr_scheduler_type="constant",
                                  report_to="none", disable_tqdm=True, seed=0))
    hf.model_accepts_loss_kwargs = False  # the same per-batch-mean set-up
    with contextlib.redirect_stdout(io.StringIO()):
        hf.train()
    hf_losses = [h["loss"] for h in hf.state.log_history if "grad_norm" in h]
    our_losses = [h["loss"] for h in results[True].state.log_history if "grad_norm" in h]
    print(f"logged losses with the filter: nanosft {[round(x, 5) for x in our_losses]}   "
          f"transformers {[round(x, 5) for x in hf_losses]}")
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(our_losses, hf_losses))
    print("reference check ran: transformers Trainer (zero-token micro-batch)")

# %% [markdown]
# ## B) 梯度爆炸 / an exploding gradient, seen in grad_norm, stopped by clipping
# Plain SGD at lr 1.0; the third micro-batch's loss is multiplied by 10^4 (a bad batch). Watch grad_norm.

# %%
banner("故障排除 B: 梯度爆炸 / exploding gradients: grad_norm and clip_grad_norm_")
g = torch.Generator().manual_seed(0)
ROWS_B = []
for _ in range(8):
    ids = torch.randint(1, TINY["vocab_size"], (8,), generator=g).tolist()
    ROWS_B.append({"input_ids": ids, "labels": ids})
runs = {}
for max_grad_norm in (0.0, 1.0):
    trainer = train(ROWS_B * 3, per_device_train_batch_size=2, gradient_accumulation_steps=1, max_steps=10,
                    learning_rate=1.0, max_grad_norm=max_grad_norm)
    printed, _ = run(trainer, bad_micro_batch=2)
    logged = [(h["step"], h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "grad_norm" in h]
    runs[max_grad_norm] = (printed, logged)
    print(f"max_grad_norm={max_grad_norm} ({'no clipping' if max_grad_norm == 0 else 'clipping'}):")
    for step, loss, norm in logged:
        print(f"   step {step:2d}  loss {loss:12.4f}  grad_norm {norm:14.4f}")
    for line in printed.splitlines():
        if line.startswith("Stopping"):
            print(f"   trainer: {line}")
no_clip, clip = runs[0.0][1], runs[1.0][1]
assert no_clip[2][2] > 1e4 and clip[2][2] > 1e4  # the bad step shows in grad_norm either way (pre-clip norm)
assert any(math.isnan(norm) for _, _, norm in no_clip)  # the update blew the weights up
assert any(loss == 0.0 for _, loss, norm in no_clip if math.isnan(norm))  # the filter logs 0.0 over a nan
assert "Stopping at step" in runs[0.0][0] and len(no_clip) < 10
assert len(clip) == 10 and all(math.isfinite(loss) and math.isfinite(n) for _, loss, n in clip)
assert clip[-1][1] < 10  # back to an ordinary loss after the bad batch
print("the bad step's own loss is huge in both runs; what differs is every step after it")
print("no clipping: one bad batch ruins the weights; with max_grad_norm=1.0 the same batch moves them by at most "
      "lr * 1.0 and training goes on")

print("\nOK: troubleshooting checked")

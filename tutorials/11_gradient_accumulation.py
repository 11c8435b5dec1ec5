"""Tutorial 11: gradient accumulation and clipping (guide: 梯度累积与裁剪 / accumulation, clipping).

Walkthrough 1 "梯度累积,更新参数" and 2.4 "normalize the loss": k micro-batches whose gradients
are summed in .grad before one optimizer step must give the gradient of one big batch. That holds
only when every micro-batch divides its token-loss sum by the token count of the whole window
(num_items_in_batch); the old rule, each micro-batch's mean divided by k (a mean of means),
weights a short micro-batch's tokens more. Then clipping: clip_grad_norm_ scales the gradients to
max_grad_norm and returns the norm from before. We capture the gradient the optimizer sees at its
one step, for 4 rows as 1 x 4, 2 x 2 and 4 x 1.
Run:      python tutorials/11_gradient_accumulation.py
Runtime:  about 9 s on one CPU core with transformers installed (importing it is half), 4 s without.
You should see:
  - the rows' token counts and, per set-up, the micro-batches with their num_items_in_batch;
  - "max |grad - grad(1 x 4)|" ~1e-8 for 2 x 2 and 4 x 1, with num_items_in_batch (the Trainer) and
    with torchtune's rule (sum, then scale by 1/tokens at the step), ~1e-2 for the mean of means;
  - grad_norm (logged) == the pre-clip norm by hand, and the clipped norm == max_grad_norm;
  - transformers' grad_norm beside ours, and "OK: gradient accumulation and clipping checked".
"""

# %%
import contextlib
import io
import tempfile

import torch

from nanosft.args import TrainingArguments
from nanosft.collator import DataCollatorForLanguageModeling
from nanosft.model import CausalLM, ModelConfig
from nanosft.trainer import Trainer

torch.set_num_threads(1)
TINY = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
ROWS = [  # very different numbers of supervised tokens per row: 11, 2, 7, 1 (after the shift)
    {
        "input_ids": [3, 9, 14, 21, 8, 30, 41, 5, 12, 19, 27, 2],
        "labels": [3, 9, 14, 21, 8, 30, 41, 5, 12, 19, 27, 2],
    },
    {"input_ids": [7, 33, 12, 2], "labels": [-100, -100, 12, 2]},
    {"input_ids": [5, 17, 42, 8, 9, 2, 44, 50], "labels": [5, 17, 42, 8, 9, 2, 44, 50]},
    {"input_ids": [11, 6, 2], "labels": [-100, -100, 2]},
]


def banner(title):
    print(f"\n{'=' * 20} {title} {'=' * 20}")


def tiny_model():
    torch.manual_seed(0)
    return CausalLM(ModelConfig(**TINY))


def one_step(batch_size, ga, max_grad_norm=0.0, mean_of_means=False):
    """One optimizer step over all 4 rows; returns (grads the optimizer saw, trainer, micro)."""
    model = tiny_model()
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=ga,
        max_steps=1,
        max_grad_norm=max_grad_norm,
        logging_steps=1,
        save_strategy="no",
        use_cpu=True,
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    optimizer = torch.optim.SGD(
        model.parameters(), lr=0.0
    )  # lr 0: we only want to look at the gradients
    trainer = Trainer(
        model,
        args,
        train_dataset=ROWS,
        data_collator=DataCollatorForLanguageModeling(pad_token_id=0),
        optimizers=(optimizer, None),
    )
    if (
        mean_of_means
    ):  # the pre-4.46 behaviour: the model ignores num_items_in_batch, loss = mean / GA
        trainer.model_accepts_loss_kwargs = False
    seen, micro = {}, []
    optimizer.register_step_pre_hook(
        lambda *_: seen.update(
            {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        )
    )

    def record(model_, args, kwargs, outputs):  # a forward hook: each micro-batch's forward
        # its own tokens, the window's count it got, its loss (tr_loss_step when the model divides
        # by num_items_in_batch; a mean of means divides it by GA afterwards, in training_step)
        micro.append((int((kwargs["labels"][:, 1:] != -100).sum()),
                      kwargs.get("num_items_in_batch"), outputs["loss"].item()))

    model.register_forward_hook(record, with_kwargs=True)
    with contextlib.redirect_stdout(
        io.StringIO()
    ):  # the banner and log lines: tutorial 04 shows them
        trainer.train()
    return seen, trainer, micro


def max_diff(a, b):
    return max((a[n] - b[n]).abs().max().item() for n in a)


def global_norm(grads):
    return torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(g) for g in grads.values()])
    ).item()


# %%
banner("梯度累积 / gradient accumulation: k micro-batches == one big batch")
counts = [sum(1 for t in r["labels"][1:] if t != -100) for r in ROWS]
print(f"supervised (shifted) tokens per row: {counts}, total {sum(counts)}")
results = {}
for batch_size, ga in ((4, 1), (2, 2), (1, 4)):
    grads, trainer, micro = one_step(batch_size, ga)
    results[(batch_size, ga)] = grads
    reference = results[(4, 1)]  # one big batch of all 4 rows
    detail = ", ".join(
        f"{own} tok / num_items_in_batch {n.item():g} -> loss {loss:.4f}" for own, n, loss in micro
    )
    print(f"batch {batch_size} x GA {ga}: {detail}")
    print(
        f"   sum of micro-batch losses {sum(m[2] for m in micro):.6f}   "
        f"max |grad - grad(1 x 4)| = {max_diff(grads, reference):.2e}"
    )
    assert all(
        n.item() == sum(counts) for _, n, _ in micro
    )  # every micro-batch divides by the window's count
    assert max_diff(grads, reference) < 1e-6

# %% [markdown]
# ## The second exact normalisation: torchtune's (sum now, scale at the step)
# num_items_in_batch needs the window's token count before its first backward (the Trainer looks
# ahead: get_batch_samples fetches the whole window first). torchtune's recipes need no look-ahead:
# each micro-batch backpropagates its *sum* of token losses, the tokens are counted as they come,
# and just before optimizer.step() every gradient is multiplied by 1 / (tokens in the window).
# Written here as a plain loop over the same 4 rows, the same model and the same collator.

# %%
banner("torchtune: backward(sum of token losses), then grad *= 1 / tokens in the window")
COLLATE = DataCollatorForLanguageModeling(pad_token_id=0)


def torchtune_window(batch_size):
    """One window over the 4 rows in micro-batches of `batch_size`; returns (grads, tokens seen)."""
    model = tiny_model()
    num_tokens, seen_counts = 0, []
    for start in range(0, len(ROWS), batch_size):
        batch = COLLATE(ROWS[start : start + batch_size])
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        targets = batch["labels"][:, 1:]  # position t predicts token t + 1
        loss_sum = torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum"
        )
        loss_sum.backward()  # summed into .grad, unnormalised
        seen_counts.append(int((targets != -100).sum()))
        num_tokens += seen_counts[-1]
    for p in model.parameters():  # at the step: scale by the tokens actually seen
        p.grad.mul_(1.0 / num_tokens)
    return {n: p.grad.clone() for n, p in model.named_parameters()}, seen_counts


torchtune = {}
for batch_size, ga in ((2, 2), (1, 4)):
    grads, seen_counts = torchtune_window(batch_size)
    torchtune[(batch_size, ga)] = max_diff(grads, reference)
    print(
        f"batch {batch_size} x GA {ga} (torchtune): tokens per micro-batch {seen_counts}, "
        f"scaled by 1/{sum(seen_counts)} at the step   "
        f"max |grad - grad(1 x 4)| = {torchtune[(batch_size, ga)]:.2e}"
    )
    assert sum(seen_counts) == sum(counts) and torchtune[(batch_size, ga)] < 1e-6

# %% [markdown]
# ## The classic bug: a mean of per-micro-batch means
# Before transformers 4.46 (and the walkthrough's `loss = loss /
# self.args.gradient_accumulation_steps` rule when the model takes no loss kwargs) each micro-batch
# returned its own mean and was divided by GA. With 1 x 4 the single "mean" is the token mean; with
# 4 x 1 a row of 1 token weighs as much as a row of 11.

# %%
banner("negative control: mean of means (loss / gradient_accumulation_steps per micro-batch)")
mean_of_means = {}
for batch_size, ga in ((2, 2), (1, 4)):
    grads, _, micro = one_step(batch_size, ga, mean_of_means=True)
    mean_of_means[(batch_size, ga)] = max_diff(grads, reference)
    detail = ", ".join(f"{own} tok -> mean/{ga} {loss:.4f}" for own, _, loss in micro)
    print(f"batch {batch_size} x GA {ga} (mean of means): {detail}")
    print(
        f"   max |grad - grad(1 x 4)| = {max_diff(grads, reference):.2e}   "
        "(not equal: tokens weighted unevenly)"
    )
    assert max_diff(grads, reference) > 1e-4

# %%
banner("all three against one big batch of 4 rows: max |grad - grad(1 x 4)|")
print(
    f"{'set-up':10} | {'num_items_in_batch':>18} | {'torchtune 1/tokens':>18} | "
    f"{'mean of means':>13}"
)
for key in ((2, 2), (1, 4)):
    print(
        f"{key[0]} x GA {key[1]:<3} | {max_diff(results[key], reference):18.2e} | "
        f"{torchtune[key]:18.2e} | "
        f"{mean_of_means[key]:13.2e}"
    )
    assert max(max_diff(results[key], reference), torchtune[key]) < 1e-6 < 1e-4 < mean_of_means[key]

# %% [markdown]
# ## 梯度裁剪 / gradient clipping
# On the sync step: total_norm = || per-tensor 2-norms ||_2, clip_coef = max_grad_norm / (total_norm
# + 1e-6), clamped to <= 1, every grad multiplied by it. The returned (and logged) grad_norm is the
# norm *before*.

# %%
banner("梯度裁剪 / gradient clipping: clip_grad_norm_ returns the pre-clip norm")
pre_clip = global_norm(results[(2, 2)])
MAX_NORM = round(pre_clip / 4, 3)  # a limit the gradient exceeds, so clipping acts
clipped, trainer, _ = one_step(2, 2, max_grad_norm=MAX_NORM)
logged = next(h for h in trainer.state.log_history if "grad_norm" in h)["grad_norm"]
clip_coef = min(MAX_NORM / (pre_clip + 1e-6), 1.0)
print(f"pre-clip norm by hand {pre_clip:.6f}   logged grad_norm {logged:.6f}")
print(
    f"max_grad_norm {MAX_NORM}: clip_coef {clip_coef:.6f}; norm of the grads the optimizer saw "
    f"{global_norm(clipped):.6f}"
)
assert abs(logged - pre_clip) < 1e-5 * pre_clip
assert abs(global_norm(clipped) - MAX_NORM) < 1e-5
assert max_diff(clipped, {n: g * clip_coef for n, g in results[(2, 2)].items()}) < 1e-7
unclipped, trainer, _ = one_step(2, 2, max_grad_norm=10 * pre_clip)  # a loose limit changes nothing
print(
    f"max_grad_norm {10 * pre_clip:.3f} (above the norm): "
    f"max |grad change| {max_diff(unclipped, results[(2, 2)]):.1e}"
)
assert max_diff(unclipped, results[(2, 2)]) < 1e-6

# %%
banner("reference: transformers Trainer, batch 2 x GA 2, max_grad_norm clipping")
try:
    import datasets
    import transformers
except ImportError:
    print("reference check skipped: transformers / datasets not installed")
else:
    transformers.utils.logging.set_verbosity_error()
    hf_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    hf_model.load_state_dict(tiny_model().state_dict())  # the same weights, the same key names
    hf_args = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=1,
        max_grad_norm=MAX_NORM,
        logging_steps=1,
        save_strategy="no",
        use_cpu=True,
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    hf_optimizer = torch.optim.SGD(hf_model.parameters(), lr=0.0)
    hf_seen = {}
    hf_optimizer.register_step_pre_hook(
        lambda *_: hf_seen.update(
            {n: p.grad.clone() for n, p in hf_model.named_parameters() if p.grad is not None}
        )
    )
    hf = transformers.Trainer(
        model=hf_model,
        args=hf_args,
        train_dataset=datasets.Dataset.from_list(ROWS),
        data_collator=DataCollatorForLanguageModeling(pad_token_id=0),
        optimizers=(hf_optimizer, None),
    )
    with contextlib.redirect_stdout(io.StringIO()):
        hf.train()
    hf_logged = next(h for h in hf.state.log_history if "grad_norm" in h)["grad_norm"]
    print(
        f"grad_norm: nanosft {logged:.6f}   transformers {hf_logged:.6f}   "
        f"max |clipped grad difference| {max_diff(clipped, hf_seen):.1e}"
    )
    assert abs(hf_logged - logged) < 1e-5 * logged
    assert max_diff(clipped, hf_seen) < 1e-6
    print("reference check ran: transformers Trainer (accumulation + clipping)")

print("\nOK: gradient accumulation and clipping checked")

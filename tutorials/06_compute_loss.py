"""Tutorial 06: compute_loss, from `outputs = model(**inputs)` to the number backward sees
(walkthrough 2.5).

Trainer.compute_loss runs the model and returns `outputs["loss"]` (with num_items_in_batch passed
into the model, so the loss is a sum over tokens divided by the window's token count), or applies
label smoothing / a user compute_loss_func to the logits. TRL's SFTTrainer.compute_loss computes
the same negative log-likelihood through a chunked log-softmax over the LM head. We write each of
these out by hand on a tiny batch and assert they equal nanosft's; transformers' ForCausalLMLoss
and LabelSmoother and TRL's ChunkedLogProbFunction are printed beside ours when installed.
Run:      python tutorials/06_compute_loss.py
Runtime:  about 7 s on one CPU core with transformers / trl installed, 5 s without.
You should see:
  - the shifted (input position -> target) pairs and the loss as mean and as
    sum / num_items_in_batch;
  - the error a batch without labels gives;
  - the label-smoothed loss = (1 - eps) * NLL + eps * mean over the vocabulary of -log p;
  - an online (tiled) logsumexp equal to log_softmax in fp32, and
    "OK: walkthrough 2.5 compute_loss checked".
"""

# %%
import tempfile

import torch

from nanosft.args import SFTConfig, TrainingArguments
from nanosft.collator import DataCollatorForLanguageModeling
from nanosft.model import CausalLM, ModelConfig, causal_lm_loss
from nanosft.sft import SFTTrainer
from nanosft.tokenizer import Tokenizer
from nanosft.trainer import Trainer

torch.set_num_threads(1)
TINY = {"vocab_size": 300, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}


def banner(title):
    print(f"\n{'=' * 20} {title} {'=' * 20}")


def tiny_args(**overrides):
    return TrainingArguments(output_dir=tempfile.mkdtemp(), use_cpu=True, report_to="none",
                             disable_tqdm=True, save_strategy="no", **overrides)


torch.manual_seed(0)
model = CausalLM(ModelConfig(**TINY))
rows = [{"input_ids": [5, 17, 42, 8, 9, 2], "labels": [-100, -100, 42, 8, 9, 2]},
        {"input_ids": [7, 33, 12, 2], "labels": [-100, 33, 12, 2]}]
inputs = DataCollatorForLanguageModeling(pad_token_id=0)(rows)
trainer = Trainer(model, tiny_args())

# %% [markdown]
# ## outputs = model(**inputs); loss = outputs["loss"]
# With labels in the batch the model computes the loss itself; compute_loss just reads it.

# %%
banner('2.5 compute_loss: outputs = model(**inputs); loss = outputs["loss"]')
loss, outputs = trainer.compute_loss(model, dict(inputs), return_outputs=True)
print(f"outputs.logits {tuple(outputs.logits.shape)} (B, T, V); "
      f"outputs['loss'] = {outputs['loss'].item():.6f}")
assert loss is outputs["loss"]

# The same number by hand. "shift by one": position t predicts labels[t + 1]; the last position
# has no target.
labels = inputs["labels"]
shift_labels = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)  # (B, T)
pairs = zip(inputs["input_ids"][0].tolist(), shift_labels[0].tolist())
print("row 0 (position: input -> target):", [f"{t}:{i}->{s}" for t, (i, s) in enumerate(pairs)])
# (B, T, V), fp32 as transformers upcasts
log_probs = torch.log_softmax(outputs.logits.float(), dim=-1)
supervised = shift_labels != -100
token_nll = -log_probs.gather(-1, shift_labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)[supervised]
mean_by_hand = token_nll.mean()
print(f"{int(supervised.sum())} supervised targets; "
      f"mean of -log p(target) by hand = {mean_by_hand.item():.6f}")
torch.testing.assert_close(loss, mean_by_hand, rtol=1e-6, atol=1e-6)

# %% [markdown]
# ## num_items_in_batch
# Under gradient accumulation the Trainer counts the supervised (shifted) tokens of the whole
# window and passes the count in: each micro-batch returns sum(-log p) / num_items_in_batch, so the
# window's losses add up to one token-weighted mean (tutorial 11 shows why a mean of per-batch
# means is wrong).

# %%
banner("2.5 compute_loss: num_items_in_batch (the model normalises by the window's token count)")
# say the window holds 20 targets, 7 of them in this micro-batch
num_items_in_batch = torch.tensor(20.0)
loss_n = trainer.compute_loss(model, dict(inputs), num_items_in_batch=num_items_in_batch)
sum_by_hand = token_nll.sum() / num_items_in_batch
ours_fn = causal_lm_loss(outputs.logits, labels, num_items_in_batch)
print(f"compute_loss(num_items_in_batch=20) {loss_n.item():.6f}   "
      f"sum by hand / 20 {sum_by_hand.item():.6f}   "
      f"nanosft.model.causal_lm_loss {ours_fn.item():.6f}")
torch.testing.assert_close(loss_n, sum_by_hand, rtol=1e-6, atol=1e-6)
torch.testing.assert_close(ours_fn, sum_by_hand, rtol=1e-6, atol=1e-6)
try:
    from transformers.loss.loss_utils import ForCausalLMLoss
except ImportError:
    print("reference check skipped: transformers is not installed (ForCausalLMLoss)")
else:
    hf_mean = ForCausalLMLoss(outputs.logits, labels, TINY["vocab_size"])
    hf_sum = ForCausalLMLoss(outputs.logits, labels, TINY["vocab_size"],
                             num_items_in_batch=num_items_in_batch)
    print(f"transformers ForCausalLMLoss: mean {hf_mean.item():.6f} (ours {loss.item():.6f}), "
          f"sum/20 {hf_sum.item():.6f} (ours {loss_n.item():.6f})")
    torch.testing.assert_close(hf_mean, loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(hf_sum, loss_n, rtol=1e-6, atol=1e-6)
    print("reference check ran: transformers ForCausalLMLoss")

# %% [markdown]
# Under DDP compute_loss also multiplies this loss by world_size (average_tokens_across_devices):
# the count already covers every rank's tokens and DDP averages the ranks' gradients. Tutorial 13
# checks that.

# %%
banner('2.5 compute_loss: "The model did not return a loss from the inputs"')
try:
    trainer.compute_loss(model, {k: v for k, v in inputs.items() if k != "labels"})
except ValueError as error:
    print(f"ValueError: {error}")
else:
    raise AssertionError("a batch without labels must be refused")

# %% [markdown]
# ## label_smoother: labels = inputs.pop("labels")
# With label_smoothing_factor eps > 0 the Trainer pops the labels, runs the model without them and
# mixes the NLL with the mean -log p over the whole vocabulary:
# (1 - eps) * NLL + eps * sum_v(-log p_v) / V.

# %%
banner("2.5 compute_loss: label_smoother(outputs, labels, shift_labels=True)")
EPS = 0.1
smooth_trainer = Trainer(model, tiny_args(label_smoothing_factor=EPS))
smoothed = smooth_trainer.compute_loss(model, dict(inputs))
# sum over v of -log p_v at each target position
all_vocab = (-log_probs[:, :-1]).sum(-1)[supervised[:, :-1]]
smooth_by_hand = (1 - EPS) * token_nll.mean() + EPS * all_vocab.mean() / TINY["vocab_size"]
print(f"label_smoothing_factor={EPS}: compute_loss {smoothed.item():.6f}   "
      f"by hand {smooth_by_hand.item():.6f}   (unsmoothed {loss.item():.6f})")
torch.testing.assert_close(smoothed, smooth_by_hand, rtol=1e-6, atol=1e-6)
try:
    from transformers.trainer_pt_utils import LabelSmoother
except ImportError:
    print("reference check skipped: transformers is not installed (LabelSmoother)")
else:
    hf_smoothed = LabelSmoother(epsilon=EPS)({"logits": outputs.logits}, labels, shift_labels=True)
    print(f"transformers LabelSmoother: {hf_smoothed.item():.6f}")
    torch.testing.assert_close(hf_smoothed, smoothed, rtol=1e-6, atol=1e-6)
    print("reference check ran: transformers LabelSmoother")

# %%
banner("2.5 compute_loss: compute_loss_func(outputs, labels, num_items_in_batch=...)"
       "  # User-defined")
seen = {}


def my_loss(outputs, labels, num_items_in_batch=None):
    seen.update(keys=sorted(vars(outputs)), labels=labels.shape,
                num_items_in_batch=num_items_in_batch)
    return causal_lm_loss(outputs.logits, labels, num_items_in_batch)


func_trainer = Trainer(model, tiny_args(), compute_loss_func=my_loss)
func_loss = func_trainer.compute_loss(model, dict(inputs), num_items_in_batch=num_items_in_batch)
print(f"compute_loss_func got labels {tuple(seen['labels'])} and num_items_in_batch "
      f"{seen['num_items_in_batch'].item():g}; loss {func_loss.item():.6f}")
torch.testing.assert_close(func_loss, loss_n, rtol=1e-6, atol=1e-6)

# %% [markdown]
# ## The SFT loss: TRL's chunked log-softmax
# TRL never builds the (B, T, V) logits: it multiplies the hidden states by vocabulary tiles of the
# lm_head and keeps a running max m, a running sum s of exp(z - m) and the target logit, so
# log p(target) = z_target - (m + log s). Here is that online logsumexp on tiles of 64 of our 300
# tokens.

# %%
banner("2.5 compute_loss (SFT): per-token log p from a chunked, online log-softmax")
with torch.no_grad():
    # (B, T, C), after the final norm
    hidden, _ = model.model(inputs["input_ids"], inputs["attention_mask"])
hidden_flat = hidden[:, :-1].flatten(0, 1)  # (N, C): positions that have a next token
targets = labels[:, 1:].flatten()  # (N,)
weight = model.lm_head.weight.detach()  # (V, C)
TILE = 64
running_max = torch.full((len(targets),), float("-inf"))
sum_exp = torch.zeros(len(targets))
target_logit = torch.zeros(len(targets))
for start in range(0, weight.shape[0], TILE):
    # (N, tile): one slice of the logits, never all of them
    z = hidden_flat @ weight[start:start + TILE].T
    new_max = torch.maximum(running_max, z.max(-1).values)
    sum_exp = sum_exp * torch.exp(running_max - new_max) + torch.exp(z - new_max[:, None]).sum(-1)
    running_max = new_max
    inside = (targets >= start) & (targets < start + TILE)
    target_logit[inside] = z[inside, targets[inside] - start]
chunked_log_p = target_logit - (running_max + torch.log(sum_exp))
mask = targets != -100
full_log_p = log_probs[:, :-1].flatten(0, 1).gather(-1, targets.clamp(min=0)[:, None]).squeeze(-1)
print(f"{(weight.shape[0] + TILE - 1) // TILE} tiles; "
      "max |chunked - log_softmax| over supervised tokens = "
      f"{(chunked_log_p - full_log_p)[mask].abs().max().item():.2e}")
torch.testing.assert_close(chunked_log_p[mask], full_log_p[mask], rtol=1e-5, atol=1e-5)
sft_by_hand = -chunked_log_p[mask].sum() / num_items_in_batch

tokenizer = Tokenizer.train(["a tiny corpus for a tiny tokenizer"] * 4,
                            vocab_size=TINY["vocab_size"])
sft_args = SFTConfig(output_dir=tempfile.mkdtemp(), use_cpu=True, bf16=False,
                     gradient_checkpointing=False, report_to="none", disable_tqdm=True)
sft = SFTTrainer(model, sft_args, train_dataset=rows, processing_class=tokenizer)
sft_loss = sft.compute_loss(model, dict(inputs), num_items_in_batch=num_items_in_batch)
print(f"SFTTrainer.compute_loss {sft_loss.item():.6f}   "
      f"chunked by hand {sft_by_hand.item():.6f}   "
      f"Trainer.compute_loss {loss_n.item():.6f}")
torch.testing.assert_close(sft_loss, sft_by_hand, rtol=1e-5, atol=1e-6)
torch.testing.assert_close(sft_loss, loss_n, rtol=1e-5, atol=1e-6)
try:
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction
except ImportError:
    print("reference check skipped: trl is not installed (ChunkedLogProbFunction)")
else:
    trl_log_p = ChunkedLogProbFunction.apply(hidden_flat, weight, None, targets.clamp(min=0), 1.0,
                                             TILE)[0]
    trl_loss = -trl_log_p[mask].sum() / num_items_in_batch
    print(f"trl ChunkedLogProbFunction (fp32, tiles of {TILE}): loss {trl_loss.item():.6f}")
    torch.testing.assert_close(trl_log_p[mask], chunked_log_p[mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(trl_loss, sft_loss, rtol=1e-5, atol=1e-6)
    print("reference check ran: trl ChunkedLogProbFunction")

print("\nOK: walkthrough 2.5 compute_loss checked")

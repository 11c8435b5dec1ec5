"""Tutorial 06: compute_loss, from `outputs = model(**inputs)` to the number backward sees
(walkthrough 2.5).

Trainer.compute_loss runs the model and returns `outputs["loss"]` (with num_items_in_batch passed
into the model, so the loss is a sum over tokens divided by the window's token count), or applies
label smoothing / a user compute_loss_func to the logits. SFTTrainer.compute_loss returns the same
loss plus TRL's token metrics: in reference mode (this script) through Trainer.compute_loss, by
default through nanosft's fused LM head (nanosft.fast.lm_head.TileLogProbs), which scores the
supervised tokens a tile of rows at a time and never holds the (B, T, V) logits. We write each
piece out by hand on a tiny batch, derive the tile's gradient and check it against autograd, run
the fast path beside the reference one and count the memory it saves; transformers'
ForCausalLMLoss / LabelSmoother and TRL's ChunkedLogProbFunction are printed beside ours.
Run:      python tutorials/06_compute_loss.py
Runtime:  about 7 s on one CPU core with transformers / trl installed, 5 s without.
You should see:
  - the reference-mode banner, the shifted pairs, the loss as mean and as sum / num_items_in_batch;
  - the no-labels error and the label-smoothed loss (1 - eps) * NLL + eps * mean_v(-log p_v);
  - d log p / dh = w_target - E_p[w] by hand on tiles of 3 tokens, equal to autograd on the full
    logits (max diff ~1e-8 in fp32; asserted within 1e-6) and to TileLogProbs;
  - the fast path (`with reference_mode(False):`) equal to the reference in loss and gradients;
  - 7.83 GiB of (n, V) fp32 logits against 250.5 MiB of tiles at n = 8 x 1024, V = 128,256, and
    "OK: walkthrough 2.5 compute_loss checked".
"""

# %%
from nanosft.reference import start_reference_mode

start_reference_mode()  # for reading: the walkthrough's own statements run, no speed paths

import tempfile

import torch

from nanosft.args import SFTConfig, TrainingArguments
from nanosft.collator import DataCollatorForLanguageModeling
from nanosft.fast.lm_head import LOSS_CHUNK_SIZE, TileLogProbs, fused_lm_head_outputs
from nanosft.loss import causal_lm_loss
from nanosft.model import CausalLM, ModelConfig
from nanosft.reference import reference_mode
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
      f"nanosft.loss.causal_lm_loss {ours_fn.item():.6f}")
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
# ## The SFT loss: the fused LM head, one tile of tokens at a time
# TRL's SFTTrainer.compute_loss asks the model for per-token log p (`fused_lm_head=True`) rather
# than logits; nanosft answers with TileLogProbs (a speed path, off in reference mode). For one
# token with hidden state h (C,) and a frozen head W (V, C) the logits are z = W h, and
#   log p(y) = w_y . h - logsumexp(W h)
#   d log p(y) / dh = w_y - softmax(W h)^T W = w_y - E_p[w]      (C,)
# since d logsumexp(z) / dz = softmax(z). Both need only this token's own row of V logits, so the
# supervised tokens can go through the head a tile of rows at a time: TileLogProbs takes
# LOSS_CHUNK_SIZE of them per tile, we take 3 so our 7 targets make three tiles.

# %%
banner("2.5 compute_loss (SFT): the fused LM head's tile, d log p / dh = w_y - E_p[w]")
print("log p(y) = w_y . h - logsumexp(W h);  "
      "d log p(y) / dh = w_y - softmax(W h)^T W = w_y - E_p[w]")
with torch.no_grad():
    # (B, T, C), after the final norm
    hidden, _ = model.model(inputs["input_ids"], inputs["attention_mask"])
targets = labels[:, 1:]  # position t predicts labels[t + 1]
h = hidden[:, :-1][targets != -100]  # (N, C): supervised positions only, as the fused head
y = targets[targets != -100]  # (N,)
W = model.lm_head.weight.detach()  # (V, C), frozen
TILE = 3
tile_log_p, tile_grad = [], []
for h_tile, y_tile in zip(h.split(TILE), y.split(TILE)):
    z = h_tile @ W.T  # (tile, V): the only logits that exist at any moment
    tile_log_p.append(z.gather(1, y_tile[:, None]).squeeze(1) - torch.logsumexp(z, dim=-1))
    tile_grad.append(W[y_tile] - torch.softmax(z, dim=-1) @ W)  # (tile, C): w_y - E_p[w]
by_hand_log_p = torch.cat(tile_log_p)  # (N,)
by_hand_grad = torch.cat(tile_grad)  # (N, C)

# autograd on the full (N, V) logits: row i of d(sum_i log p_i)/dh is d log p_i / dh_i
h_full = h.clone().requires_grad_()
full_log_p = torch.log_softmax(h_full @ W.T, dim=-1).gather(1, y[:, None]).squeeze(1)
full_log_p.sum().backward()
log_p_diff = (by_hand_log_p - full_log_p).abs().max().item()
grad_diff = (by_hand_grad - h_full.grad).abs().max().item()
print(f"{len(y)} supervised tokens in {len(tile_log_p)} tiles of <= {TILE}: "
      f"max |log p by hand - log_softmax| = {log_p_diff:.1e}; "
      f"max |d log p / dh by hand - autograd| = {grad_diff:.1e} (fp32, atol 1e-6)")
# log p ~ -5.7, where an fp32 ulp is 4.8e-7, and logsumexp rounds apart from log_softmax: so a
# relative tolerance on log p too (the gradients, at most 5e-2, get the plain atol 1e-6)
torch.testing.assert_close(by_hand_log_p, full_log_p, rtol=1e-6, atol=1e-6)
torch.testing.assert_close(by_hand_grad, h_full.grad, rtol=0, atol=1e-6)

# nanosft's own tile on the same tiles: with a frozen head its forward keeps w_y - E_p[w] and its
# backward only scales that by the incoming gradient (a trained head recomputes the tile instead,
# since dW needs p). The two (tile, V) buffers are shared by the tiles.
workspace = torch.empty(2, TILE, TINY["vocab_size"])
h_tiles = h.clone().requires_grad_()
nanosft_log_p = torch.cat([TileLogProbs.apply(h_tile, W, y_tile, workspace)[0]
                           for h_tile, y_tile in zip(h_tiles.split(TILE), y.split(TILE))])
nanosft_log_p.sum().backward()
print("nanosft.fast.lm_head.TileLogProbs on the same tiles: "
      f"max |log p - by hand| = {(nanosft_log_p - by_hand_log_p).abs().max().item():.1e}; "
      f"max |grad h - by hand| = {(h_tiles.grad - by_hand_grad).abs().max().item():.1e}")
torch.testing.assert_close(nanosft_log_p, by_hand_log_p, rtol=1e-6, atol=1e-6)
torch.testing.assert_close(h_tiles.grad, by_hand_grad, rtol=0, atol=1e-6)
tiled_by_hand = -by_hand_log_p.sum() / num_items_in_batch

# TRL tiles the tokens (4096 a tile) and also the vocabulary (chunk_size), folding the vocabulary
# tiles with an online logsumexp; nanosft keeps each token's whole row of V logits in its tile.
try:
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction
except ImportError:
    print("reference check skipped: trl is not installed (ChunkedLogProbFunction)")
else:
    VOCAB_TILE = 64
    h_trl = h.clone().requires_grad_()
    trl_log_p = ChunkedLogProbFunction.apply(h_trl, W, None, y, 1.0, VOCAB_TILE)[0]
    trl_log_p.sum().backward()
    trl_loss = -trl_log_p.sum() / num_items_in_batch
    print(f"trl ChunkedLogProbFunction (fp32, vocabulary tiles of {VOCAB_TILE}): loss "
          f"{trl_loss.item():.6f} (ours {tiled_by_hand.item():.6f}); "
          f"max |grad h - ours| = {(h_trl.grad - by_hand_grad).abs().max().item():.1e}")
    torch.testing.assert_close(trl_log_p, by_hand_log_p, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h_trl.grad, by_hand_grad, rtol=1e-5, atol=1e-6)
    print("reference check ran: trl ChunkedLogProbFunction")

# %% [markdown]
# ## SFTTrainer.compute_loss: reference mode and the fast path
# In reference mode SFTTrainer.compute_loss is Trainer.compute_loss (`outputs = model(**inputs)`,
# `loss = outputs["loss"]`) plus TRL's token metrics. `with reference_mode(False):` turns the
# speed paths on and the same call goes through `model(**inputs, fused_lm_head=True)` and
# TileLogProbs. Both must give the same loss and the same gradients: into the hidden states (the
# head's backward) and into every trainable parameter, with the head frozen (as under LoRA) and
# trained (TileLogProbs' other backward).

# %%
banner("2.5 compute_loss (SFT): SFTTrainer.compute_loss, reference path and fast path")
tokenizer = Tokenizer.train(["a tiny corpus for a tiny tokenizer"] * 4,
                            vocab_size=TINY["vocab_size"])
sft_args = SFTConfig(output_dir=tempfile.mkdtemp(), use_cpu=True, bf16=False,
                     gradient_checkpointing=False, report_to="none", disable_tqdm=True)
sft = SFTTrainer(model, sft_args, train_dataset=rows, processing_class=tokenizer)
sft_loss = sft.compute_loss(model, dict(inputs), num_items_in_batch=num_items_in_batch)
print(f"SFTTrainer.compute_loss {sft_loss.item():.6f}   "
      f"tiled by hand {tiled_by_hand.item():.6f}   "
      f"Trainer.compute_loss {loss_n.item():.6f}")
torch.testing.assert_close(sft_loss, loss_n, rtol=0, atol=1e-6)
torch.testing.assert_close(sft_loss, tiled_by_hand, rtol=1e-6, atol=1e-6)


def sft_step(fast):
    """SFTTrainer.compute_loss and backward on `inputs`, in reference mode or on the speed paths:
    the loss, outputs.logits, d loss / d hidden states (B, T, C) and the parameters' gradients."""
    model.zero_grad(set_to_none=True)
    kept = []

    def keep_hidden(module, args, output):  # model.model's output (h, cache): keep h's gradient
        output[0].retain_grad()
        kept.append(output[0])

    handle = model.model.register_forward_hook(keep_hidden)
    with reference_mode(not fast):  # the training call: return_outputs=False
        loss = sft.compute_loss(model, dict(inputs), num_items_in_batch=num_items_in_batch)
    loss.backward()
    handle.remove()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    with torch.no_grad():  # what each path's forward returns as logits
        logits = model(**inputs, fused_lm_head=fast).logits
    return loss.detach(), logits, kept[0].grad, grads


for head in ("frozen", "trained"):
    model.lm_head.weight.requires_grad_(head == "trained")
    ref_loss, ref_logits, ref_grad_h, ref_grads = sft_step(fast=False)
    fast_loss, fast_logits, fast_grad_h, fast_grads = sft_step(fast=True)
    assert ref_grads.keys() == fast_grads.keys()
    grad_diff = max((fast_grads[k] - ref_grads[k]).abs().max().item() for k in ref_grads)
    print(f"lm_head {head:7s}: loss reference {ref_loss.item():.6f} fast {fast_loss.item():.6f}; "
          f"max |fast - reference|: loss {(fast_loss - ref_loss).abs().item():.1e}, "
          f"grad h {(fast_grad_h - ref_grad_h).abs().max().item():.1e}, "
          f"grads of {len(ref_grads)} params {grad_diff:.1e}")
    torch.testing.assert_close(fast_loss, ref_loss, rtol=0, atol=1e-6)
    torch.testing.assert_close(fast_grad_h, ref_grad_h, rtol=0, atol=1e-6)
    for name in ref_grads:
        torch.testing.assert_close(fast_grads[name], ref_grads[name], rtol=0, atol=1e-6)
model.lm_head.weight.requires_grad_(True)
print(f"outputs.logits: reference {tuple(ref_logits.shape)} (B, T, V), fast {fast_logits}")
assert fast_logits is None

# %% [markdown]
# ## What the tiles save
# The full-logits path holds the (n, V) fp32 logits and, for backward, their log-softmax, another
# (n, V). The tiled path holds two (tile, V) fp32 buffers during the forward and, with a frozen
# head, keeps w_y - E_p[w], (n, C), for backward. At a realistic shape, in bytes:

# %%
banner("2.5 compute_loss (SFT): memory, (n, V) logits against (tile, V) tiles")
N_TOKENS = 8 * 1024  # 8 sequences of 1024 tokens, every one supervised (the worst case)
LLAMA3_VOCAB = 128_256
LLAMA3_8B_HIDDEN = 4096
FP32 = 4  # bytes
full_bytes = 2 * N_TOKENS * LLAMA3_VOCAB * FP32
tile_bytes = 2 * LOSS_CHUNK_SIZE * LLAMA3_VOCAB * FP32
direction_bytes = N_TOKENS * LLAMA3_8B_HIDDEN * FP32
print(f"n = 8 x 1024 tokens, V = {LLAMA3_VOCAB:,} (Llama 3), C = {LLAMA3_8B_HIDDEN:,}, fp32")
print(f"full logits path: logits + log-softmax, 2 x (n, V) = {full_bytes:,} bytes "
      f"({full_bytes / 2**30:.2f} GiB)")
print(f"tiled path: 2 x ({LOSS_CHUNK_SIZE}, V) tile buffers = {tile_bytes:,} bytes "
      f"({tile_bytes / 2**20:.1f} MiB); kept for backward (frozen head) (n, C) = "
      f"{direction_bytes:,} bytes ({direction_bytes / 2**20:.1f} MiB)")
assert tile_bytes + direction_bytes < full_bytes


# Measured on our batch: what autograd saves for backward between the hidden states and the loss,
# counted as each tensor is saved (saved_tensors_hooks; deterministic). The head is frozen, as
# under LoRA: a trained head's tile buffers sit on the autograd node, where this hook cannot see.
def saved_for_backward(loss_fn):
    """Bytes of the distinct storages autograd saves while loss_fn(h) builds its graph, with the
    parameters' own storages left out (they are held anyway); and the largest shape saved."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = (storage.nbytes(), tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss_fn(hidden.clone().requires_grad_())  # (B, T, C)
    return sum(nbytes for nbytes, _ in saved.values()), max(saved.values())[1]


model.lm_head.weight.requires_grad_(False)
full_saved, full_largest = saved_for_backward(
    lambda h: causal_lm_loss(model.lm_head(h), labels, num_items_in_batch))
tiled_saved, tiled_largest = saved_for_backward(  # as model(**inputs, fused_lm_head=True)
    lambda h: -fused_lm_head_outputs(h, model.lm_head, labels)[0].sum() / num_items_in_batch)
model.lm_head.weight.requires_grad_(True)
print(f"saved for backward on this batch (lm_head frozen): full logits path {full_saved:,} bytes "
      f"(largest {full_largest}), tiled path {tiled_saved:,} bytes (largest {tiled_largest})")
assert tiled_saved < full_saved

print("\nOK: walkthrough 2.5 compute_loss checked")

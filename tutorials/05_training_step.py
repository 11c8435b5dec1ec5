"""Tutorial 05: training_step, one micro-batch's forward, loss, GA rule, backward (walkthrough 2.4).

training_step(model, inputs, num_items_in_batch) does five things, in this order: model.train();
compute_loss; maybe divide the loss by the number of micro-batches in the accumulation window;
backward; return the loss detached. The division is the subtle part: a loss already divided by the
window's token count (num_items_in_batch) must not be divided again; a per-micro-batch mean must.
We call nanosft's Trainer.training_step on one batch in each case, check loss and gradients against
formulas written out here, and, when transformers is installed, run its Trainer.training_step on
the same weights beside ours.
Run:      python tutorials/05_training_step.py
Runtime:  about 8 s on one CPU core with transformers installed (importing it is half), 3 s without.
You should see:
  - "model.training: False -> True" (training_step switches to train mode itself);
  - a table of four cases: which losses are divided by current_gradient_accumulation_steps and
    which not;
  - the gradient after backward equal to the hand-made loss's gradient, the returned loss detached;
  - transformers' loss and gradient norm beside ours, and
    "OK: walkthrough 2.4 training_step checked".
"""

# %%
from nanosft.reference import start_reference_mode

start_reference_mode()  # for reading: the walkthrough's own statements run, no speed paths

import tempfile

import torch
import torch.nn.functional as F

from nanosft.args import TrainingArguments
from nanosft.collator import DataCollatorForLanguageModeling
from nanosft.model import CausalLM, ModelConfig
from nanosft.trainer import Trainer

torch.set_num_threads(1)
TINY = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}


def banner(title):
    print(f"\n{'=' * 20} {title} {'=' * 20}")


torch.manual_seed(0)
model = CausalLM(ModelConfig(**TINY))
# the first row's 2 prompt tokens get label -100
rows = [{"input_ids": [5, 17, 42, 8, 9, 2], "labels": [-100, -100, 42, 8, 9, 2]},
        {"input_ids": [7, 33, 12, 2], "labels": [-100, 33, 12, 2]}]
inputs = DataCollatorForLanguageModeling(pad_token_id=0)(rows)
GA = 4
args = TrainingArguments(output_dir=tempfile.mkdtemp(), gradient_accumulation_steps=GA,
                         use_cpu=True, report_to="none", disable_tqdm=True, save_strategy="no")
trainer = Trainer(model, args)
for key, value in inputs.items():
    print(f"inputs[{key!r}] = {value.tolist()}")

# The reference numbers, written out: position t predicts labels[t+1]; -100 is never a target.
logits = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
targets = inputs["labels"][:, 1:]
token_nll = F.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten(), ignore_index=-100,
                            reduction="none")
n_tokens = int((targets != -100).sum())
sum_nll, mean_nll = token_nll.sum().item(), token_nll.sum().item() / n_tokens
print(f"shifted targets: {n_tokens} tokens, sum of -log p = {sum_nll:.6f}, mean = {mean_nll:.6f}")

# %% [markdown]
# ## model.train()
# The Trainer may have evaluated just before (eval mode: no dropout); training_step switches
# back itself.

# %%
banner("2.4 training_step: model.train()  # 切换到训练模式")
model.eval()
before = model.training
# the loop sets this to len(batch_samples) per window
trainer.current_gradient_accumulation_steps = GA
# num_items_in_batch counts the whole window of GA micro-batches: say this one holds 7 of the
# window's 20 tokens
WINDOW_TOKENS = 20
num_items_in_batch = torch.tensor(float(WINDOW_TOKENS))
loss = trainer.training_step(model, dict(inputs), num_items_in_batch)
print(f"model.training: {before} -> {model.training}")
assert before is False and model.training is True

# %% [markdown]
# ## loss = self.compute_loss(...); "Finally we need to normalize the loss for reporting"
# The walkthrough's rule: `if not self.model_accepts_loss_kwargs and self.compute_loss_func is None:
# loss = loss / self.args.gradient_accumulation_steps`. transformers 5.23 (and nanosft) refine it:
# the loss counts as already scaled when (model_accepts_loss_kwargs and num_items_in_batch is not
# None) or a compute_loss_func is given; otherwise it is divided by
# current_gradient_accumulation_steps, the number of micro-batches in *this* window (smaller than
# GA in an epoch's short last window).

# %%
banner("2.4 training_step: the GA division rule  # normalize the loss for reporting")


def run_case(accepts, num_items, loss_func, window):
    trainer.model_accepts_loss_kwargs = accepts
    trainer.compute_loss_func = loss_func
    trainer.current_gradient_accumulation_steps = window
    model.zero_grad()
    return trainer.training_step(model, dict(inputs), num_items).item()


def sum_over_window(outputs, labels, num_items_in_batch=None):
    """A user loss: the sum of -log p over the targets / the window's tokens."""
    shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]
    total = F.cross_entropy(outputs.logits.flatten(0, 1), shifted.flatten(), ignore_index=-100,
                            reduction="sum")
    return total / num_items_in_batch


# (description, model_accepts_loss_kwargs, num_items_in_batch, compute_loss_func, window, expected)
cases = [
    ("model takes num_items_in_batch", True, num_items_in_batch, None, GA, sum_nll / WINDOW_TOKENS),
    ("no count (num_items_in_batch=None)", True, None, None, GA, mean_nll / GA),
    ("model without loss kwargs", False, num_items_in_batch, None, GA, mean_nll / GA),
    ("... in a short last window of 3", False, num_items_in_batch, None, 3, mean_nll / 3),
    ("compute_loss_func given", False, num_items_in_batch, sum_over_window, GA,
     sum_nll / WINDOW_TOKENS),
]
print(f"{'case':38s} | accepts | num_items | window | divided? | returned loss | by hand")
for name, accepts, num_items, loss_func, window, expected in cases:
    got = run_case(accepts, num_items, loss_func, window)
    scaled = (accepts and num_items is not None) or loss_func is not None
    divided = "no" if scaled else f"/ {window}"
    shown = "None" if num_items is None else f"{num_items.item():g}"
    print(f"{name:38s} | {accepts!s:7s} | {shown:9s} | {window:6d} | {divided:8s} | "
          f"{got:.6f}      | {expected:.6f}")
    assert abs(got - expected) < 1e-5, (name, got, expected)
# back to the default set-up
trainer.model_accepts_loss_kwargs = True
trainer.compute_loss_func = None

# %% [markdown]
# The walkthrough's `if self.args.n_gpu > 1: loss = loss.mean()` (DataParallel) and
# `amp.scale_loss` (apex) branches have no counterpart in nanosft: TRL refuses DataParallel and
# apex is gone from transformers 5; multi-GPU is DDP (tutorial 13) and fp16 loss scaling is the
# GradScaler (tutorial 12).
#
# ## self.accelerator.backward(loss); return loss.detach()
# backward adds into .grad (that is how micro-batches accumulate); the returned loss carries no
# graph.

# %%
banner("2.4 training_step: backward and return loss.detach()")
model.zero_grad()
trainer.current_gradient_accumulation_steps = GA
returned = trainer.training_step(model, dict(inputs), num_items_in_batch)
ours = model.lm_head.weight.grad.clone()
hand_logits = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
hand_loss = F.cross_entropy(hand_logits[:, :-1].flatten(0, 1), targets.flatten(), ignore_index=-100,
                            reduction="sum") / WINDOW_TOKENS
(by_hand,) = torch.autograd.grad(hand_loss, model.lm_head.weight)
print(f"returned loss {returned.item():.6f}  requires_grad={returned.requires_grad}  "
      f"grad_fn={returned.grad_fn}")
print(f"lm_head.weight.grad norm: training_step {ours.norm():.6e}   "
      f"autograd of the hand loss {by_hand.norm():.6e}")
torch.testing.assert_close(ours, by_hand, rtol=1e-5, atol=1e-7)
assert not returned.requires_grad and returned.grad_fn is None
# a second call without zero_grad adds the same gradient again: accumulation is just "+=" in .grad
trainer.training_step(model, dict(inputs), num_items_in_batch)
torch.testing.assert_close(model.lm_head.weight.grad, 2 * by_hand, rtol=1e-5, atol=1e-7)
print("second training_step without zero_grad: grad == 2 x one step's grad (accumulated)")

# %%
banner("reference: transformers Trainer.training_step on the same weights")
try:
    import transformers
except ImportError:
    print("reference check skipped: transformers is not installed")
else:
    transformers.utils.logging.set_verbosity_error()
    hf_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    hf_model.load_state_dict(model.state_dict())  # same keys by design
    hf_args = transformers.TrainingArguments(output_dir=args.output_dir,
                                             gradient_accumulation_steps=GA, use_cpu=True,
                                             report_to="none", save_strategy="no")
    hf = transformers.Trainer(model=hf_model, args=hf_args)
    hf.current_gradient_accumulation_steps = GA
    for name, num_items in (("with num_items_in_batch", num_items_in_batch),
                            ("without (None)", None)):
        hf_model.zero_grad()
        model.zero_grad()
        hf_loss = hf.training_step(hf_model, dict(inputs), num_items)
        our_loss = trainer.training_step(model, dict(inputs), num_items)
        hf_grad, our_grad = hf_model.lm_head.weight.grad, model.lm_head.weight.grad
        print(f"{name:24s} loss: nanosft {our_loss.item():.6f}  "
              f"transformers {hf_loss.item():.6f}   "
              f"grad norm: nanosft {our_grad.norm():.6e}  transformers {hf_grad.norm():.6e}")
        torch.testing.assert_close(our_loss, hf_loss, rtol=1e-5, atol=1e-6)
        # same math, other order
        torch.testing.assert_close(our_grad, hf_grad, rtol=1e-4, atol=1e-7)
    print("reference check ran: transformers Trainer.training_step")

print("\nOK: walkthrough 2.4 training_step checked")

"""Tutorial 24: a text classifier with the generic Trainer (guide: task types, text classification).

The Trainer is not only for causal LMs: like transformers' it trains any nn.Module whose forward
returns a loss (a tuple's first element or a dict's "loss"), with whatever input keys its batches
hold. We train a tiny bag-of-embeddings sentiment classifier on made-up sentences with
DataCollatorWithPadding and an accuracy metric, beside transformers.Trainer on the same weights,
data and seed, and compare every logged loss and the evaluation.
Run:      python tutorials/24_text_classifier.py
Runtime:  about 15 s on CPU (most of it importing transformers).
You should see:
  - three examples padded by DataCollatorWithPadding, equal to transformers' collator;
  - the throughput and memory reporters saying once that they step aside (not a causal LM);
  - step | loss (nanosft) | loss (transformers), and "max |loss diff|" below 1e-5;
  - eval_accuracy before and after training (chance -> 1.0), equal on both sides;
  - "OK: a text classifier trained with the generic Trainer" at the end.
"""

# %%
import importlib.util
import random
import tempfile
import warnings

import torch
from torch import nn

from nanosft.args import TrainingArguments
from nanosft.collator import DataCollatorWithPadding
from nanosft.tokenizer import Tokenizer
from nanosft.trainer import Trainer

warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' notes, not ours
torch.set_num_threads(1)
HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


def banner(title):
    print(f"\n{'=' * 20} {title} {'=' * 20}")


# %% [markdown]
# ## The data: sentences labelled 1 (positive) or 0 (negative)
# Word counts decide the label, so a bag of embeddings can learn it.

# %%
POSITIVE = ["good", "great", "lovely", "fun", "superb"]
NEGATIVE = ["bad", "awful", "dull", "poor", "boring"]
FILLER = ["the", "movie", "was", "really", "plot", "and", "acting", "quite", "a", "story"]


def make_sentences(n, seed):
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        label = rng.randint(0, 1)
        strong, weak = (POSITIVE, NEGATIVE) if label else (NEGATIVE, POSITIVE)
        words = rng.choices(FILLER, k=rng.randint(2, 6)) + rng.choices(strong, k=2)
        words += rng.choices(weak, k=rng.randint(0, 1))
        rng.shuffle(words)
        rows.append({"text": " ".join(words), "label": label})
    return rows


train_text, eval_text = make_sentences(160, seed=0), make_sentences(32, seed=1)
tokenizer = Tokenizer.train([r["text"] for r in train_text], vocab_size=360)  # every word one token
pad_id = tokenizer.pad_token_id


def tokenize(rows):
    return [{"input_ids": tokenizer.encode(r["text"]), "label": r["label"]} for r in rows]


train_rows, eval_rows = tokenize(train_text), tokenize(eval_text)
print(f"{len(train_rows)} train / {len(eval_rows)} eval sentences, e.g. {train_text[0]}")

# %% [markdown]
# ## DataCollatorWithPadding: pad input_ids, add attention_mask, `label` -> `labels`

# %%
banner("DataCollatorWithPadding(pad_token_id)")
collator = DataCollatorWithPadding(pad_token_id=pad_id)
sample = collator(train_rows[:3])
for key, value in sample.items():
    print(f"{key}:\n{value}")
assert sample["input_ids"].shape[1] == max(len(r["input_ids"]) for r in train_rows[:3])
if HAVE_TRANSFORMERS:
    import transformers

    hf_tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend,
                                                        pad_token=tokenizer.pad_token)
    hf_collator = transformers.DataCollatorWithPadding(hf_tokenizer)
    theirs = hf_collator(train_rows[:3])
    assert all(torch.equal(sample[k], theirs[k]) for k in ("input_ids", "attention_mask",
                                                           "labels"))
    print("transformers' DataCollatorWithPadding gives the same three tensors")

# %% [markdown]
# ## The model: any nn.Module whose forward returns a loss
# No config, no lm_head, no causal shift: the Trainer reads `outputs["loss"]` and trains it.

# %%


class TextClassifier(nn.Module):
    """Mean of the real tokens' embeddings -> tanh MLP -> 2 logits; cross-entropy given labels."""

    def __init__(self, vocab_size, width=32, num_labels=2):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab_size, width)
        self.head = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, num_labels))

    def forward(self, input_ids, attention_mask, labels=None):
        mask = attention_mask[..., None].float()  # (B, T, 1): padding does not count
        pooled = (self.embed(input_ids) * mask).sum(1) / mask.sum(1)  # (B, C)
        logits = self.head(pooled)  # (B, num_labels)
        loss = None if labels is None else nn.functional.cross_entropy(logits, labels)
        return {"loss": loss, "logits": logits} if loss is not None else {"logits": logits}


def accuracy(eval_pred):
    predictions, labels = eval_pred
    return {"accuracy": float((predictions.argmax(-1) == labels).mean())}


ARGS = {"per_device_train_batch_size": 8, "num_train_epochs": 4, "learning_rate": 2e-2,
        "warmup_steps": 4, "weight_decay": 0.01, "logging_steps": 8, "seed": 42,
        "eval_strategy": "no", "save_strategy": "no", "report_to": "none",
        "disable_tqdm": True, "use_cpu": True, "optim": "adamw_torch"}


def run(trainer):
    """eval_accuracy before, train, eval after: (before, after, logged training losses)."""
    before = trainer.evaluate()
    trainer.train()
    after = trainer.evaluate()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return before, after, losses


banner("Trainer(model, args, data_collator=DataCollatorWithPadding, compute_metrics=accuracy)")
with tempfile.TemporaryDirectory() as d:
    # report_to="nanosft": nanosft's throughput and memory-ledger reporters, which step aside for a
    # model that is not a causal LM, saying so once each
    our_args = TrainingArguments(d, **{**ARGS, "report_to": "nanosft"})
    ours = Trainer(TextClassifier(len(tokenizer)), our_args,
                   data_collator=collator, train_dataset=train_rows, eval_dataset=eval_rows,
                   compute_metrics=accuracy)
    before, after, losses = run(ours)

# %% [markdown]
# ## Beside transformers.Trainer: the same model, data, seed and arguments

# %%
if HAVE_TRANSFORMERS:
    banner("transformers.Trainer on the same weights, data and seed")
    with tempfile.TemporaryDirectory() as d:
        ref = transformers.Trainer(TextClassifier(len(tokenizer)),
                                   transformers.TrainingArguments(d, **ARGS),
                                   data_collator=hf_collator, train_dataset=train_rows,
                                   eval_dataset=eval_rows, compute_metrics=accuracy)
        ref_before, ref_after, ref_losses = run(ref)
    banner("step | loss (nanosft) | loss (transformers)")
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        print(f"{(i + 1) * ARGS['logging_steps']:4d} | {a:.6f} | {b:.6f}")
    diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
    eval_diff = abs(after["eval_loss"] - ref_after["eval_loss"])
    print(f"max |loss diff| vs transformers: {diff:.2e}; |eval_loss diff|: {eval_diff:.2e}")
    assert len(losses) == len(ref_losses) and diff < 1e-5 and eval_diff < 1e-5
    assert (before["eval_accuracy"], after["eval_accuracy"]) == (ref_before["eval_accuracy"],
                                                                 ref_after["eval_accuracy"])
    print("reference check ran: transformers")
else:
    print("reference check skipped: transformers is not installed")

# %%
banner("evaluate(): eval_accuracy before and after training")
print(f"before: {before['eval_accuracy']:.3f} (eval_loss {before['eval_loss']:.4f})")
print(f"after:  {after['eval_accuracy']:.3f} (eval_loss {after['eval_loss']:.4f})")
assert after["eval_accuracy"] >= 0.9 and after["eval_loss"] < before["eval_loss"]
model = ours.model.eval()
for text in ("a superb and lovely story", "the acting was dull and awful"):
    ids = torch.tensor([tokenizer.encode(text)])
    with torch.no_grad():
        label = model(ids, torch.ones_like(ids))["logits"].argmax(-1).item()
    print(f"{text!r}: {'positive' if label else 'negative'}")

print("\nOK: a text classifier trained with the generic Trainer")

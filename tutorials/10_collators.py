"""Tutorial 10: data collators, built up in drafts (guide "数据加载与批处理"; walkthrough 2.1).

SFTTrainer hands the Trainer a collator that turns a list of token-id lists into one padded batch
with labels (-100 = no loss). We grow it in three drafts on three tiny prompt/completion examples:
pad, then labels, then the completion mask; then check the last draft against
nanosft.collator.DataCollatorForLanguageModeling, show padding-free rows and BERT-style MLM, the
guide's other tasks (classification: default_data_collator, DataCollatorWithPadding; token
classification: DataCollatorForTokenClassification) beside transformers' own, and TRL's collator.
Run: python tutorials/10_collators.py   (about 15 s with transformers and trl installed)
You should see: a token / input_id / label / attn table per draft; "naive rule drops 3 real EOS";
"draft 3 == nanosft DataCollatorForLanguageModeling: True"; position_ids restarting at 0 in the
padding-free row; roughly 80/10/10 MLM replacements; (B,) labels for classification and -100-padded
per-token labels for NER, each equal to transformers'; "TRL == nanosft: True".
"""

# %%
import importlib.util

import torch

from nanosft.collator import (
    DataCollatorForLanguageModeling,
    DataCollatorForTokenClassification,
    DataCollatorWithPadding,
    default_data_collator,
)
from nanosft.data import build_labels

# A toy vocabulary: id 0 is the end-of-turn token, and (as in many chat models) also the pad token.
VOCAB = ["<|im_end|>", "2", "+", "=", "4", "hi", "hello", "1", "3"]
EOS = PAD = 0
WORDS = {w: i for i, w in enumerate(VOCAB)}


def ids(text):
    return [WORDS[w] for w in text.split()]


# Three prompt/completion examples, tokenized as nanosft.data does: prompt + completion + EOS,
# with completion_mask = 1 on the completion tokens (EOS included).
EXAMPLES = []
for prompt, completion in [("2 + 2 =", "4"), ("hi", "hello"), ("1 + 2 =", "3")]:
    p, c = ids(prompt), ids(completion) + [EOS]
    EXAMPLES.append({"input_ids": p + c, "completion_mask": [0] * len(p) + [1] * len(c)})


def banner(title):
    print(f"\n{'=' * 12} {title} {'=' * 12}")


def show(batch, title):
    """Print each row as a table: token / input_id / label / attention (or position)."""
    print(f"-- {title}")
    side = "attention_mask" if "attention_mask" in batch else "position_ids"
    for b in range(batch["input_ids"].shape[0]):
        rows = {
            "token": [VOCAB[i] for i in batch["input_ids"][b].tolist()],
            "input_id": batch["input_ids"][b].tolist(),
        }
        if "labels" in batch:
            rows["label"] = batch["labels"][b].tolist()
        rows["attn" if side == "attention_mask" else "position"] = batch[side][b].tolist()
        widths = [max(len(str(row[j])) for row in rows.values()) for j in range(len(rows["token"]))]
        for name, values in rows.items():
            print(f"  {name:>8} | " + " ".join(f"{v!s:>{w}}" for v, w in zip(values, widths)))
        print()


# %%
banner("数据加载与批处理: draft 1, pad")
# Sequences differ in length; a tensor needs one length T = the longest. Pad on the right with
# PAD and record which slots are real in attention_mask (1 real, 0 padding).


def draft1(examples):
    T = max(len(ex["input_ids"]) for ex in examples)
    input_ids = torch.full((len(examples), T), PAD)
    attention_mask = torch.zeros((len(examples), T), dtype=torch.long)
    for b, ex in enumerate(examples):
        n = len(ex["input_ids"])
        input_ids[b, :n] = torch.tensor(ex["input_ids"])
        attention_mask[b, :n] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


show(draft1(EXAMPLES), "draft 1: (B, T) = " + str(tuple(draft1(EXAMPLES)["input_ids"].shape)))

# %%
banner("数据整理器设计模式: draft 2, labels")
# The classic rule derives labels from the inputs: labels = input_ids, -100 where input == PAD.
# With PAD == EOS it also erases every real EOS, so the model never learns to stop.
naive = draft1(EXAMPLES)["input_ids"].clone()
naive[naive == PAD] = -100
real_eos = sum(ex["input_ids"].count(EOS) for ex in EXAMPLES)
kept_naive = sum(
    int((naive[b, : len(ex["input_ids"])] == EOS).sum()) for b, ex in enumerate(EXAMPLES)
)
print(f"naive rule drops {real_eos - kept_naive} real EOS")
assert kept_naive == 0 and real_eos == 3


def draft2(examples):
    # Labels come from the example and are padded with -100 by position, never by value.
    batch = draft1(examples)
    labels = torch.full_like(batch["input_ids"], -100)
    for b, ex in enumerate(examples):
        labels[b, : len(ex["input_ids"])] = torch.tensor(ex.get("labels", ex["input_ids"]))
    batch["labels"] = labels
    return batch


show(draft2(EXAMPLES), "draft 2: every real token is a target, every EOS kept")
assert int((draft2(EXAMPLES)["labels"] == EOS).sum()) == 3

# %%
banner("不同任务类型的数据处理: draft 3, completion mask")
# SFT on prompt/completion data trains on the completion only: -100 where completion_mask == 0.


def draft3(examples):
    batch = draft2(examples)
    for b, ex in enumerate(examples):
        mask = torch.tensor(ex["completion_mask"])
        batch["labels"][b, : len(mask)][mask == 0] = -100
    return batch


mine = draft3(EXAMPLES)
show(mine, "draft 3: loss on the completion and its EOS only")
ours = DataCollatorForLanguageModeling(pad_token_id=PAD)(EXAMPLES)
same = all(torch.equal(mine[k], ours[k]) for k in ("input_ids", "attention_mask", "labels"))
print(f"draft 3 == nanosft DataCollatorForLanguageModeling: {same}")
assert same and set(ours) == set(mine)

# %%
banner("padding-free: one row, positions restart per example")
# No padding at all: concatenate into a (1, sum T_i) row; position_ids restart at 0 for each
# example so attention stays within it, and each example's first token is no target.
flat = DataCollatorForLanguageModeling(pad_token_id=PAD, padding_free=True)(EXAMPLES)
show(flat, "padding-free batch")
starts = (flat["position_ids"][0] == 0).nonzero().flatten().tolist()
assert starts == [0, 6, 9] and (flat["labels"][0, starts] == -100).all()

# %%
banner("MLM: 15% picked, then 80% [MASK] / 10% random / 10% unchanged")
MASK_ID, V = 1, 1000
rows = torch.randint(2, V, (32, 256), generator=torch.Generator().manual_seed(0))
mlm = DataCollatorForLanguageModeling(
    pad_token_id=PAD, mlm=True, mask_token_id=MASK_ID, vocab_size=V, seed=0
)
batch = mlm([{"input_ids": r.tolist()} for r in rows])
picked = batch["labels"] != -100
new, old = batch["input_ids"][picked], rows[picked]
shares = [(new == MASK_ID).float().mean().item(), (new == old).float().mean().item()]
shares.append(1 - sum(shares))
print(
    f"picked {picked.float().mean().item():.3f} of tokens; [MASK] {shares[0]:.3f}, "
    f"unchanged {shares[1]:.3f}, random {shares[2]:.3f}"
)
assert abs(picked.float().mean().item() - 0.15) < 0.01 and abs(shares[0] - 0.8) < 0.03

# %% [markdown]
# ## 不同任务类型的数据处理: the non-LM collators beside the LM ones
# The guide's table pairs each task with a collator. Sentence classification has one label per
# row: `default_data_collator` (transformers' DefaultDataCollator) only stacks rows that are already
# one length, and DataCollatorWithPadding pads variable rows and leaves the (B,) labels alone. Token
# classification (NER, the guide's 序列标注) has one label per token:
# DataCollatorForTokenClassification
# pads them with -100, as the LM collators do, but there is no shift: label t belongs to token t.

# %%
banner("不同任务类型的数据处理: classification and token classification collators")
CLS_ROWS = [
    {"input_ids": ids("2 + 2 = 4"), "label": 1},
    {"input_ids": ids("hi hello"), "label": 0},
    {"input_ids": ids("1 + 2 ="), "label": 1},
]
TAGS = {"2": 1, "1": 1, "3": 1, "4": 1}  # a toy NER: numbers are tag 1, everything else tag 0
NER_ROWS = [
    {"input_ids": r["input_ids"], "labels": [TAGS.get(VOCAB[i], 0) for i in r["input_ids"]]}
    for r in CLS_ROWS
]
fixed = [{"input_ids": r["input_ids"][:2], "label": r["label"]} for r in CLS_ROWS]  # one length
batches = {
    "文本分类 default_data_collator (rows of one length)": (default_data_collator(fixed), fixed),
    "文本分类 DataCollatorWithPadding": (
        DataCollatorWithPadding(pad_token_id=PAD)(CLS_ROWS),
        CLS_ROWS,
    ),
    "序列标注 DataCollatorForTokenClassification": (
        DataCollatorForTokenClassification(pad_token_id=PAD)(NER_ROWS),
        NER_ROWS,
    ),
    "语言建模 DataCollatorForLanguageModeling": (
        DataCollatorForLanguageModeling(pad_token_id=PAD)(EXAMPLES),
        EXAMPLES,
    ),
}
for name, (batch, _) in batches.items():
    shapes = {k: tuple(v.shape) for k, v in batch.items()}
    print(f"{name:52s} {shapes}")
    print(f"{'':52s} labels {batch['labels'].tolist()}")
token_labels = batches["序列标注 DataCollatorForTokenClassification"][0]["labels"]
assert batches["文本分类 DataCollatorWithPadding"][0]["labels"].shape == (3,)  # one per row
assert token_labels.shape == (3, 5) and token_labels[1, 2:].eq(-100).all()  # padded per token
assert token_labels[0].tolist() == [1, 0, 1, 0, 1]  # no shift: label t is token t's tag

if importlib.util.find_spec("transformers") is None:
    print("reference check skipped: transformers is not installed")
else:
    import transformers
    from tokenizers import Tokenizer as BackendTokenizer
    from tokenizers.models import WordLevel

    hf_tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=BackendTokenizer(WordLevel(WORDS, unk_token=VOCAB[0])),
        pad_token=VOCAB[PAD],
    )
    theirs = {
        "文本分类 default_data_collator (rows of one length)": transformers.default_data_collator,
        "文本分类 DataCollatorWithPadding": transformers.DataCollatorWithPadding(hf_tok),
        "序列标注 DataCollatorForTokenClassification": (
            transformers.DataCollatorForTokenClassification(hf_tok)
        ),
    }
    for name, collate in theirs.items():
        ours_batch, rows_in = batches[name]
        ref = collate([dict(r) for r in rows_in])
        same = set(ref) == set(ours_batch) and all(torch.equal(ref[k], ours_batch[k]) for k in ref)
        print(f"transformers {name.split()[1]} == nanosft: {same}")
        assert same
    print(
        "reference check ran: transformers default_data_collator, DataCollatorWithPadding, "
        "DataCollatorForTokenClassification"
    )

# %%
banner("TRL beside nanosft (SFTTrainer's own collator)")
if importlib.util.find_spec("trl") is None:
    print("reference check skipped: trl is not installed")
else:
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling as TrlCollator

    # TRL 1.16 builds labels during dataset preparation; its collator only pads them.
    prepared = [
        {
            "input_ids": ex["input_ids"],
            "labels": build_labels(ex["input_ids"], [ex["completion_mask"]]),
        }
        for ex in EXAMPLES
    ]
    for padding_free in (False, True):
        theirs = TrlCollator(pad_token_id=PAD, padding_free=padding_free)(prepared)
        ours = DataCollatorForLanguageModeling(pad_token_id=PAD, padding_free=padding_free)(
            EXAMPLES
        )
        print(f"padding_free={padding_free}")
        print("  TRL labels    ", theirs["labels"].tolist())
        print("  nanosft labels", ours["labels"].tolist())
        same = all(torch.equal(ours[k], theirs[k]) for k in ours)
        print(f"  TRL == nanosft: {same}")
        assert same
    print("reference check ran: trl DataCollatorForLanguageModeling")

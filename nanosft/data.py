"""SFT datasets: load JSONL, tell TRL's dataset formats apart, tokenize with loss masks, pack.

Walkthrough 2.1 (SFTTrainer.__init__ prepares `train_dataset` before Trainer sees it) and
hf-reference 4.2-4.3. `prepare_dataset` follows TRL SFTTrainer._prepare_dataset step by step:
append EOS, tokenize (chat template for conversations), completion / assistant masks -> labels
(-100), truncate (keep_start), drop fully masked examples, pack with Best-Fit-Decreasing
("Fewer Truncations Improve Language Modeling", 2404.10830). Knows nothing of models.
"""

import bisect
import json
import logging
import os
import warnings
from collections import defaultdict, deque

from nanosft.tokenizer import validate_messages

logger = logging.getLogger(__name__)

MAP_BATCH_SIZE = 1000  # datasets.map(batched=True) default: TRL's BFD bins form within each batch
PACKING_STRATEGIES = ("bfd", "bfd_split", "wrapped")
FORMATS = ("language_modeling", "prompt_completion", "conversational", "conversational_prompt_completion")


# ----------------------------------------------------------------------------- loading, formats

def _read_jsonl(path):
    """One JSON object per line (blank lines skipped); returns (examples, where-strings)."""
    examples, wheres = [], []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                example = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}, line {n}: not valid JSON ({error.msg}, column {error.colno}); "
                                 "fix: write exactly one JSON object per line") from None
            if not isinstance(example, dict):
                raise TypeError(f"{path}, line {n}: expected a JSON object such as "
                                 f'{{"text": "..."}}, got a {type(example).__name__}')
            examples.append(example)
            wheres.append(f"{path}, line {n} (example {len(examples) - 1})")
    return examples, wheres


def dataset_format(example, dataset_text_field="text"):
    """Name an example's TRL format (one of FORMATS); raises if it has none of their fields.
    Walkthrough 2.1 | Mirrors: trl is_conversational and the branches of SFTTrainer tokenize_fn"""
    if "prompt" in example or "completion" in example:
        missing = "completion" if "prompt" in example else "prompt"
        if missing not in example:
            raise ValueError(f"field {missing!r} is missing (prompt-completion examples need both "
                             "'prompt' and 'completion')")
        return "conversational_prompt_completion" if isinstance(example["prompt"], list) else "prompt_completion"
    if "messages" in example:
        return "conversational"
    if dataset_text_field in example:
        return "language_modeling"
    raise ValueError(f"no {dataset_text_field!r}, 'messages' or 'prompt'/'completion' field "
                     f"(keys: {sorted(example)}); fix: use one of TRL's three dataset formats")


def _check_field(example, field, kind):
    value = example[field]
    if kind == "str" and not isinstance(value, str):
        raise TypeError(f"field {field!r} must be a string, got {type(value).__name__}")
    if kind == "messages":
        try:
            validate_messages(value)
        except (TypeError, ValueError) as error:
            raise type(error)(f"field {field!r}: {error}") from None


def check_example(example, dataset_text_field="text"):
    """Validate one example's fields for its format; returns the format name.
    Walkthrough 2.1 | Mirrors: the checks TRL leaves to a failing tokenizer call | Differs: fails early."""
    fmt = dataset_format(example, dataset_text_field)
    kinds = {"language_modeling": {dataset_text_field: "str"},
             "prompt_completion": {"prompt": "str", "completion": "str"},
             "conversational_prompt_completion": {"prompt": "messages", "completion": "messages"},
             "conversational": {"messages": "messages"}}[fmt]
    for field, kind in kinds.items():
        _check_field(example, field, kind)
    return fmt


def load_examples(source, dataset_text_field="text"):
    """Read a JSONL path or take a list of dicts; check every example and that all share one format.
    Walkthrough 2.1 | Mirrors: datasets load_dataset("json") + TRL's format detection"""
    if isinstance(source, (str, os.PathLike)):
        examples, wheres = _read_jsonl(source)
        name = os.fspath(source)
    elif isinstance(source, list):
        examples, wheres, name = source, [f"example {i}" for i in range(len(source))], "the example list"
    else:
        raise TypeError(f"source must be a JSONL path or a list of dicts, got {type(source).__name__}")
    if not examples:
        raise ValueError(f"{name}: the dataset is empty (0 examples); fix: give at least one example")
    formats = []
    for example, where in zip(examples, wheres):
        try:
            if not isinstance(example, dict):
                raise TypeError(f"expected a dict, got {type(example).__name__}")
            formats.append(check_example(example, dataset_text_field))
        except (TypeError, ValueError) as error:
            raise type(error)(f"{where}: {error}") from None
        if formats[-1] != formats[0]:
            raise ValueError(f"{where}: format {formats[-1]} differs from {wheres[0]}'s {formats[0]}; "
                             "fix: one dataset holds one format")
    return examples


# ----------------------------------------------------------------------------- tokenizing, masks

def common_prefix_length(ids, other_ids):
    """Number of leading tokens two id lists share.
    Walkthrough 2.1 | Mirrors: trl common_prefix_length"""
    n = 0
    for a, b in zip(ids, other_ids):
        if a != b:
            break
        n += 1
    return n


def assistant_char_spans(tokenizer, messages):
    """Character span of each assistant turn in the rendered chat, found by rendering prefixes:
    turn i runs from len(render(messages[:i]) + generation prompt) to len(render(messages[:i+1])).
    Walkthrough 2.1 | Mirrors: transformers {% generation %} spans | Differs: needs no template tags."""
    full = tokenizer.render_chat(messages)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if i == 0:
            raise ValueError("messages[0] is an assistant turn; assistant_only_loss needs a system or "
                             "user message before it to render the generation prompt")
        head = tokenizer.render_chat(messages[:i], add_generation_prompt=True)
        turn = tokenizer.render_chat(messages[: i + 1])
        if not (full.startswith(head) and full.startswith(turn)):
            raise ValueError(f"the chat template does not render messages[:{i}] as a prefix of the whole "
                             "chat, so assistant turns cannot be located; use a prefix-preserving template")
        spans.append((len(head), len(turn)))  # the turn's text incl. its end-of-turn token
    return spans


def assistant_token_mask(tokenizer, messages, input_ids):
    """1 on every token overlapping an assistant turn (content and `<|im_end|>`), else 0.
    Walkthrough 2.1 | Mirrors: transformers apply_chat_template(return_assistant_tokens_mask=True)"""
    ids, offsets = tokenizer.encode_with_offsets(tokenizer.render_chat(messages))
    if list(ids) != list(input_ids):
        raise ValueError("the chat re-encoded for offsets differs from its input_ids")
    mask = [0] * len(input_ids)
    for start, end in assistant_char_spans(tokenizer, messages):
        for j, (s, e) in enumerate(offsets):
            if s < end and e > start:
                mask[j] = 1
    return mask


def tokenize_example(example, tokenizer, fmt, *, dataset_text_field="text", eos_token=None,
                     assistant_only_loss=False):
    """Token ids of one example plus `completion_mask` / `assistant_masks` where they apply.
    Walkthrough 2.1 | Mirrors: trl SFTTrainer._prepare_dataset add_eos + tokenize_fn"""
    eos = eos_token or tokenizer.eos_token
    if fmt == "language_modeling":
        text = example[dataset_text_field]
        # "EOS appending (non-conversational only)", a string check as TRL's add_eos.
        return {"input_ids": tokenizer.encode(text if text.endswith(eos) else text + eos)}
    if fmt == "conversational":
        out = {"input_ids": tokenizer.apply_chat_template(example["messages"])}
        if assistant_only_loss:
            out["assistant_masks"] = assistant_token_mask(tokenizer, example["messages"], out["input_ids"])
        return out
    prompt, completion = example["prompt"], example["completion"]
    out = {}
    if fmt == "prompt_completion":
        completion = completion if completion.endswith(eos) else completion + eos
        prompt_ids = tokenizer.encode(prompt)
        full_ids = tokenizer.encode(prompt + completion)  # string concatenation, as TRL
    else:
        prompt_ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True)
        full_ids = tokenizer.apply_chat_template(prompt + completion)
        if assistant_only_loss:
            out["assistant_masks"] = assistant_token_mask(tokenizer, prompt + completion, full_ids)
    # The completion starts where prompt and prompt+completion diverge (tokens may merge across).
    n = common_prefix_length(prompt_ids, full_ids)
    if n < len(prompt_ids):  # shown once per run, as TRL's warning_once
        warnings.warn("the tokenized prompt is not a prefix of the tokenized prompt+completion (tokens "
                      "merge across the boundary); the completion mask starts where they diverge. "
                      "Fix: end prompts on a token boundary, e.g. without a trailing space", stacklevel=2)
    out["input_ids"] = full_ids
    out["completion_mask"] = [0] * n + [1] * (len(full_ids) - n)
    return out


def build_labels(input_ids, masks):
    """labels[i] = input_ids[i] where every mask is 1, else -100.
    Walkthrough 2.1 | Mirrors: trl SFTTrainer._prepare_dataset build_labels"""
    return [tok if all(bits) else -100 for tok, *bits in zip(input_ids, *masks)]


# ----------------------------------------------------------------------------- packing

def _bfd_bins(lengths, seq_length):
    """Best-Fit-Decreasing: longest first, each into the open bin with the least room that fits
    (oldest first among equal room), else a new bin. Returns bins as lists of indices.
    Walkthrough 2.1 | Mirrors: trl _pack_bfd, _SegmentTree | Differs: a sorted list of free spaces."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable, as Arrow's sort
    bins, free, by_free = [], [], defaultdict(deque)  # free: sorted distinct spaces of open bins
    for i in order:
        k = bisect.bisect_left(free, lengths[i])
        if k < len(free):
            space = free[k]
            members = by_free[space].popleft()
            if not by_free[space]:
                free.pop(k)
        else:
            space, members = seq_length, []
            bins.append(members)
        members.append(i)
        space -= lengths[i]
        if space > 0:
            if not by_free[space]:
                bisect.insort(free, space)
            by_free[space].append(members)
    return bins


def _pack_batch_bfd(rows, seq_length, split):
    pieces = []
    for row in rows:
        n = len(row["input_ids"])
        # bfd truncates a long sequence to seq_length; bfd_split cuts it into fragments.
        starts = range(0, n, seq_length) if split else [0]
        pieces += [{k: v[s : s + seq_length] for k, v in row.items()} for s in starts]
    lengths = [len(p["input_ids"]) for p in pieces]
    packed = []
    for members in _bfd_bins(lengths, seq_length):
        row = {k: [x for i in members for x in pieces[i][k]] for k in pieces[0]}
        row["seq_lengths"] = [lengths[i] for i in members]
        packed.append(row)
    return packed


def _pack_batch_wrapped(rows, seq_length):
    flat = {k: [x for row in rows for x in row[k]] for k in rows[0]}
    total = len(flat["input_ids"])
    return [{k: v[s : s + seq_length] for k, v in flat.items()} for s in range(0, total, seq_length)]


def pack_dataset(examples, max_length, strategy="bfd"):
    """Pack token rows into rows of at most max_length, per 1000-example batch; bfd adds seq_lengths.
    Walkthrough 2.1 | Mirrors: trl pack_dataset (strategies bfd, bfd_split, wrapped)"""
    if strategy not in PACKING_STRATEGIES:
        raise ValueError(f"unknown packing strategy {strategy!r}; expected one of {PACKING_STRATEGIES}")
    if not isinstance(max_length, int) or max_length < 1:
        raise ValueError(f"packing needs a positive integer max_length, got {max_length!r}")
    packed = []
    for b in range(0, len(examples), MAP_BATCH_SIZE):
        rows = [row for row in examples[b : b + MAP_BATCH_SIZE] if len(row["input_ids"]) > 0]
        if not rows:
            continue
        if strategy == "wrapped":
            packed += _pack_batch_wrapped(rows, max_length)
        else:
            packed += _pack_batch_bfd(rows, max_length, split=strategy == "bfd_split")
    return packed


# ----------------------------------------------------------------------------- the whole preparation

def _drop_fully_masked(rows):
    kept = [row for row in rows if any(label != -100 for label in row["labels"])]
    if len(kept) < len(rows):
        logger.warning("dropped %d of %d examples with no trainable token after masking and truncation",
                       len(rows) - len(kept), len(rows))
    if not kept:
        raise ValueError(f"all {len(rows)} examples have labels that are all -100 (nothing to train on); "
                         "fix: raise max_length, or check the prompt/completion or assistant turns")
    return kept


def prepare_dataset(examples, tokenizer, *, max_length=1024, packing=False, packing_strategy="bfd",
                    completion_only_loss=None, assistant_only_loss=False, dataset_text_field="text",
                    eos_token=None):
    """Examples (path or dicts) -> rows of `input_ids`, `labels` (-100 = no loss) [, `seq_lengths`].
    Walkthrough 2.1 | Mirrors: trl SFTTrainer._prepare_dataset (+ SFTTrainer.__init__ option checks)"""
    if isinstance(examples, list) and examples and "input_ids" in examples[0]:
        fmt = "tokenized"  # already tokenized: TRL skips straight to labels, truncation, packing
        rows = [dict(ex) for ex in examples]
    else:
        examples = load_examples(examples, dataset_text_field)
        fmt = dataset_format(examples[0], dataset_text_field)
        if assistant_only_loss and not fmt.startswith("conversational"):
            raise ValueError(f"assistant_only_loss=True needs a conversational dataset, got {fmt}")
        kwargs = {"dataset_text_field": dataset_text_field, "eos_token": eos_token,
                  "assistant_only_loss": assistant_only_loss}
        rows = [tokenize_example(ex, tokenizer, fmt, **kwargs) for ex in examples]
        for i, row in enumerate(rows):
            if "assistant_masks" in row and 1 not in row["assistant_masks"]:
                raise ValueError(f"example {i} has no assistant turn, so assistant_only_loss leaves "
                                 "nothing to train; fix: drop it or add the assistant reply")
    if completion_only_loss is None:
        completion_only_loss = fmt.endswith("prompt_completion")
    if "labels" not in rows[0]:
        names = (["completion_mask"] if completion_only_loss else []) + ["assistant_masks"]
        for row in rows:
            row["labels"] = build_labels(row["input_ids"], [row[m] for m in names if m in row])
    rows = [{"input_ids": row["input_ids"], "labels": row["labels"]} for row in rows]
    if packing:
        if max_length is None:
            raise ValueError("packing=True needs max_length (the packed row length), got None")
        return pack_dataset(rows, max_length, packing_strategy)
    if max_length is not None:  # keep_start truncation, then drop rows left without a target
        rows = [{k: v[:max_length] for k, v in row.items()} for row in rows]
        rows = _drop_fully_masked(rows)
    return rows

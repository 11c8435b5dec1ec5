"""SFT datasets: read examples, tell TRL's dataset formats apart, tokenize with loss masks, pack.

SFTTrainer.__init__ prepares `train_dataset` with it before Trainer sees it. Examples come
from JSONL / JSON / Parquet / CSV files, lists, datasets.Dataset-like sequences or iterables.
`prepare_dataset` follows TRL SFTTrainer._prepare_dataset step by step: ShareGPT rows to
messages, append EOS, tokenize (chat template for conversations, with the row's tools and
chat_template_kwargs), completion / assistant masks -> labels
(-100), truncate (keep_start), drop fully masked examples, pack with Best-Fit-Decreasing
("Fewer Truncations Improve Language Modeling", 2404.10830). Knows nothing of models.
"""

import bisect
import itertools
import json
import logging
import os
import stat
import warnings
from collections import defaultdict, deque
from collections.abc import Mapping

from nanosft.tokenizer import validate_messages

logger = logging.getLogger(__name__)

MAP_BATCH_SIZE = 1000  # datasets.map(batched=True) default: TRL's BFD bins form within each batch
PACKING_STRATEGIES = ("bfd", "bfd_split", "wrapped")
FORMATS = ("language_modeling", "prompt_completion", "conversational",
           "conversational_prompt_completion")


# ----------------------------------------------------------------------------- loading, formats

COLUMNAR = {".parquet": "parquet", ".csv": "csv"}  # read through `datasets` (a `data` extra)


def _too_deep(where):
    return ValueError(f"{where}: JSON nested deeper than the reader can follow (Python's recursion "
                      "limit); fix: flatten the row (an example is a few fields of text or "
                      "messages)")


def _check_text(value, where):
    """Refuse a lone UTF-16 surrogate ("\\ud800" in JSON decodes to one; Python strings may hold
    one too): it is not text, and the tokenizer would fail far from the row that holds it."""
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        for item in value:
            _check_text(item, where)
        return
    if not isinstance(value, str):
        return
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        bad = error.object[error.start:error.end].encode("unicode_escape").decode()
        raise ValueError(f"{where}: holds a lone UTF-16 surrogate ({bad}), which is not a "
                         "character; fix: remove it, or write the whole surrogate pair (or the "
                         "character itself)") from None


def _read_jsonl(path):
    """One JSON object per line (blank lines skipped); returns (examples, where-strings)."""
    examples, wheres = [], []
    with open(path, "rb") as f:  # bytes, so a line that is not UTF-8 is named by its number
        for n, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise ValueError(f"{path}, line {n}: not UTF-8 text (byte "
                                 f"{raw[error.start]:#04x} at column {error.start + 1}); fix: save "
                                 "the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                example = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}, line {n}: not valid JSON ({error.msg}, column "
                                 f"{error.colno}); fix: write one JSON object per line") from None
            except RecursionError:
                raise _too_deep(f"{path}, line {n}") from None
            if not isinstance(example, dict):
                raise TypeError(f"{path}, line {n}: expected a JSON object such as "
                                f'{{"text": "..."}}, got a {type(example).__name__}')
            examples.append(example)
            wheres.append(f"{path}, line {n} (example {len(examples) - 1})")
    return examples, wheres


def _read_json_array(path):
    """A .json file holding one array of objects; returns (examples, where-strings)."""
    with open(path, encoding="utf-8") as f:
        try:
            examples = json.load(f)
        except UnicodeDecodeError as error:
            raise ValueError(f"{path}: not UTF-8 text (byte {error.object[error.start]:#04x} "
                             f"at byte offset {error.start} of a read block); fix: save the file "
                             "as UTF-8") from None
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: not valid JSON ({error.msg}, line {error.lineno} column "
                             f"{error.colno}); fix: a .json dataset is one array of objects, "
                             "[{...}, {...}], or JSON Lines (one object per line)") from None
        except RecursionError:
            raise _too_deep(path) from None
    if not isinstance(examples, list):
        raise TypeError(f"{path}: expected a JSON array of examples, got a "
                        f"{type(examples).__name__}; fix: write [{{...}}, {{...}}], or one "
                        "object per line as JSON Lines")
    return examples, [f"{path}, item {i}" for i in range(len(examples))]


def _read_columnar(path, kind):
    """A .parquet / .csv file through `datasets` (rows as dicts); a clear pip hint without it."""
    try:
        import datasets
    except ImportError:
        raise ImportError(f"{path}: reading .{kind} files needs the datasets library; fix: "
                          'pip install "nanosft[data]" (or pip install datasets), or convert '
                          "the file to JSONL") from None
    try:
        examples = datasets.load_dataset(kind, data_files=os.fspath(path), split="train").to_list()
    except Exception as error:  # noqa: BLE001 (datasets wraps the parser's error, e.g. a ragged row)
        fix = ("give every row as many fields as the header, or convert the file to JSONL"
               if kind == "csv" else "re-save the file, or convert it to JSONL")
        cause = error.__cause__ or error
        reason = " ".join(str(cause).split())
        raise ValueError(f"{path}: cannot read it as .{kind} ({type(cause).__name__}: {reason}); "
                         f"fix: {fix}") from error
    return examples, [f"{path}, row {i}" for i in range(len(examples))]


def _file_kind(path) -> str | None:
    """What a path that exists but is not a regular file or folder is, in words."""
    mode = os.stat(path).st_mode
    for test, kind in ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return None


def check_data_path(path, flag=None):
    """A data path that can be read: a regular file. A folder, a missing path, or one that is
    not a regular file (a named pipe, a device, a socket: reading one waits for a writer that may
    never come) is refused at once, naming what it is and `flag` (a command-line flag) when given.
    Differs: datasets opens a FIFO and waits."""
    name = f"{flag} {path}" if flag else os.fspath(path)
    kind = _file_kind(path) if os.path.exists(path) and not os.path.isdir(path) else None
    if kind is not None:
        why = ("reading it would wait for whatever writes to it" if "pipe" in kind
               else "it holds no file of examples")
        raise ValueError(f"{name} is {kind}, not a regular file: {why}. Write the examples to a "
                         ".jsonl file first (e.g. zcat data.jsonl.gz > data.jsonl), or, in Python, "
                         "pass an iterable of examples as train_dataset with max_steps set.")
    if os.path.isdir(path):
        raise ValueError(f"{name} is a folder; give one .jsonl, .json, .parquet or .csv file of "
                         "examples (a folder written by datasets' save_to_disk: load it in Python "
                         "with datasets.load_from_disk and pass the Dataset as train_dataset)")
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"{name}: no such file; give a JSONL file with one example per line "
            '({"text": ...}, {"prompt": ..., "completion": ...} or {"messages": [...]}), '
            "or a .json array, .parquet or .csv file")


def read_dataset_file(path):
    """Rows of a .jsonl, .json (array or JSON Lines), .parquet or .csv file; others read as JSONL.
    Mirrors: datasets load_dataset("json" | "parquet" | "csv", data_files=path)"""
    check_data_path(path)
    suffix = os.path.splitext(os.fspath(path))[1].lower()
    if suffix in COLUMNAR:
        return _read_columnar(path, COLUMNAR[suffix])
    if suffix == ".json":
        with open(path, encoding="utf-8", errors="replace") as f:  # a decode error: named below
            head = f.read(4096).lstrip()
        if head.startswith("["):
            return _read_json_array(path)
    return _read_jsonl(path)


def head_of_stream(source, max_steps, max_examples, name="train_dataset"):
    """An iterable without a length (a generator, a datasets.IterableDataset) -> a list of its first
    `max_examples` rows, all that max_steps can train on, so an endless stream starts training;
    any other source is returned as it is. Mirrors: the IterableDataset TRL streams with max_steps
    Differs: those rows are read at the start, not as the steps go."""
    if isinstance(source, (str, os.PathLike, Mapping, list)) or hasattr(source, "__len__") \
            or not hasattr(source, "__iter__"):
        return source
    if max_steps is None or max_steps <= 0:
        raise ValueError(f"{name} is an iterable without a length (an IterableDataset?), so the "
                         "number of training steps is unknown; fix: set max_steps, e.g. "
                         "SFTConfig(max_steps=500) or --max_steps 500")
    return list(itertools.islice(source, max_examples))


def to_example_list(source, name="the dataset", max_steps=None):
    """(examples, where-strings) from a path, a list, any sequence of dicts (a datasets.Dataset,
    not imported) or an iterable of dicts (an IterableDataset: then max_steps > 0 is required).
    Mirrors: the datasets TRL accepts as train_dataset / eval_dataset
    Differs: an iterable is read whole here (SFTTrainer first cuts a train stream with
    head_of_stream); TRL streams it."""
    if isinstance(source, (str, os.PathLike)):
        examples, wheres = read_dataset_file(source)
        name = os.fspath(source)
    elif isinstance(source, Mapping):
        raise TypeError(f"{name}: got a {type(source).__name__} (a dict of splits or columns); "
                        "fix: pass one split such as dataset['train'], or a list of dicts")
    elif isinstance(source, list):
        examples, wheres = source, None
    elif hasattr(source, "__len__") and hasattr(source, "__getitem__"):  # datasets.Dataset, ...
        examples, wheres = [source[i] for i in range(len(source))], None
    elif hasattr(source, "__iter__"):  # datasets.IterableDataset, a generator, ...
        if max_steps is not None and max_steps <= 0:
            raise ValueError(f"{name} is an iterable without a length (an IterableDataset?), so "
                             "the number of training steps is unknown; fix: set max_steps, e.g. "
                             "SFTConfig(max_steps=500) or --max_steps 500")
        examples, wheres = list(source), None
    else:
        raise TypeError(f"{name} must be a dataset file path, a list or sequence of dicts (such "
                        "as a datasets.Dataset) or an iterable of dicts; got "
                        f"{type(source).__name__}")
    wheres = wheres or [f"example {i}" for i in range(len(examples))]
    if not examples:
        raise ValueError(f"{name}: the dataset is empty (0 examples); fix: give at least one "
                         "example")
    for example, where in zip(examples, wheres):
        if not isinstance(example, Mapping):
            raise TypeError(f"{where}: expected a dict of fields such as {{'text': ...}}, got a "
                            f"{type(example).__name__}; fix: each row is one example with named "
                            "fields")
    return examples, wheres


def is_conversational_from_value(example):
    """A ShareGPT row: "conversations" is a list of {"from", "value"} messages.
    Mirrors: trl is_conversational_from_value"""
    messages = example.get("conversations")
    return (isinstance(messages, list) and bool(messages) and isinstance(messages[0], Mapping)
            and "from" in messages[0] and "value" in messages[0])


def maybe_convert_to_chatml(example):
    """A copy of the row with from/value messages as role/content and "conversations" renamed
    "messages" (moved last, as datasets' map adds it). Roles are kept as written.
    Mirrors: trl maybe_convert_to_chatml"""
    example = dict(example)
    for key in ("prompt", "completion", "chosen", "rejected", "messages", "conversations"):
        if isinstance(example.get(key), list):
            example[key] = [_chatml_message(m) if isinstance(m, Mapping) else m
                            for m in example[key]]
    if "conversations" in example:
        example["messages"] = example.pop("conversations")
    return example


def _chatml_message(message):
    renamed = {"from": "role", "value": "content"}
    out = {renamed.get(k, k): v for k, v in message.items() if k not in renamed}
    out.update({renamed[k]: message[k] for k in renamed if k in message})
    return out


def chat_template_kwargs(example):
    """The chat-template variables of one row: its `tools` (a list, or a JSON string) plus its
    `chat_template_kwargs` dict. Mirrors: trl SFTTrainer._prepare_dataset tokenize_fn"""
    tools = example.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as error:
            raise ValueError(f"field 'tools' is a string but not JSON ({error.msg}, column "
                             f"{error.colno}); fix: give a list of tool schemas or their JSON "
                             "text") from None
    extra = example.get("chat_template_kwargs") or {}
    if not isinstance(extra, Mapping):
        raise TypeError(f"field 'chat_template_kwargs' must be a dict of template variables, got "
                        f"{type(extra).__name__}")
    return {"tools": tools, **extra}


def dataset_format(example, dataset_text_field="text"):
    """Name an example's TRL format (one of FORMATS); raises if it has none of their fields.
    Mirrors: trl is_conversational and the branches of SFTTrainer tokenize_fn"""
    if "prompt" in example or "completion" in example:
        missing = "completion" if "prompt" in example else "prompt"
        if missing not in example:
            raise ValueError(f"field {missing!r} is missing (prompt-completion examples need both "
                             "'prompt' and 'completion')")
        conversational = isinstance(example["prompt"], list)
        return "conversational_prompt_completion" if conversational else "prompt_completion"
    if "messages" in example:
        return "conversational"
    if dataset_text_field in example:
        return "language_modeling"
    raise ValueError(f"no {dataset_text_field!r}, 'messages' or 'prompt'/'completion' field "
                     f"(keys: {sorted(example)}); fix: use one of TRL's three dataset formats")


def _check_field(example, field, kind):
    value = example[field]
    if kind in ("str", "messages"):
        _check_text(value, f"field {field!r}")
    if kind == "str" and not isinstance(value, str):
        raise TypeError(f"field {field!r} must be a string, got {type(value).__name__} {value!r}; "
                        "fix: write it as "
                        f"text, e.g. \"{value}\" in JSONL (a CSV column holding only numbers is "
                        "read as numbers: convert such a file to JSONL)")
    if kind == "messages":
        try:
            validate_messages(value)
        except (TypeError, ValueError) as error:
            raise type(error)(f"field {field!r}: {error}") from None


def check_example(example, dataset_text_field="text"):
    """Validate one example's fields for its format; returns the format name.
    Mirrors: the checks TRL leaves to a failing tokenizer call
    Differs: fails early."""
    fmt = dataset_format(example, dataset_text_field)
    kinds = {"language_modeling": {dataset_text_field: "str"},
             "prompt_completion": {"prompt": "str", "completion": "str"},
             "conversational_prompt_completion": {"prompt": "messages", "completion": "messages"},
             "conversational": {"messages": "messages"}}[fmt]
    for field, kind in kinds.items():
        _check_field(example, field, kind)
    return fmt


def load_examples(source, dataset_text_field="text", max_steps=None, name="the dataset"):
    """Examples from a file, list, sequence or iterable (see to_example_list), each checked and all
    of one format (tokenized rows pass as they are); fields a format does not use are ignored.
    Mirrors: datasets load_dataset + TRL's format detection"""
    examples, wheres = to_example_list(source, name, max_steps)
    if "input_ids" in examples[0]:
        return examples  # already tokenized: TRL skips straight to labels, truncation, packing
    if is_conversational_from_value(examples[0]):  # ShareGPT: "Converting ... to ChatML"
        examples = [maybe_convert_to_chatml(example) for example in examples]
    formats = []
    for example, where in zip(examples, wheres):
        try:
            formats.append(check_example(example, dataset_text_field))
        except (TypeError, ValueError) as error:
            raise type(error)(f"{where}: {error}") from None
        if formats[-1] != formats[0]:
            raise ValueError(f"{where}: format {formats[-1]} differs from {wheres[0]}'s "
                             f"{formats[0]}; fix: one dataset holds one format")
    return examples


# ----------------------------------------------------------------------------- tokenizing, masks

def common_prefix_length(ids, other_ids):
    """Number of leading tokens two id lists share.
    Mirrors: trl common_prefix_length"""
    n = 0
    for a, b in zip(ids, other_ids):
        if a != b:
            break
        n += 1
    return n


def assistant_char_spans(tokenizer, messages, **template_kwargs):
    """Character span of each assistant turn in the rendered chat, found by rendering prefixes:
    turn i runs from len(render(messages[:i]) + generation prompt) to len(render(messages[:i+1])).
    Mirrors: transformers {% generation %} spans
    Differs: needs no template tags; a template that has them (TRL's *_training.jinja, which
    need not render prefixes: harmony ends the last turn otherwise) gives its spans directly."""
    full, marked = tokenizer.render_chat_with_spans(messages, **template_kwargs)
    if marked:
        return marked
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if i == 0:
            raise ValueError("messages[0] is an assistant turn; assistant_only_loss needs a system "
                             "or user message before it to render the generation prompt")
        head = tokenizer.render_chat(messages[:i], add_generation_prompt=True, **template_kwargs)
        turn = tokenizer.render_chat(messages[: i + 1], **template_kwargs)
        if not (full.startswith(head) and full.startswith(turn)):
            raise ValueError(f"the chat template does not render messages[:{i}] as a prefix of the "
                             "whole chat (Qwen3's drops the reasoning of earlier turns), so "
                             "assistant turns cannot be located; set chat_template_path to a "
                             "prefix-preserving template with {% generation %} markers (SFTTrainer "
                             "swaps in Qwen3's training variant itself, as TRL does; TRL ships "
                             "others as trl/chat_templates/*_training.jinja)")
        spans.append((len(head), len(turn)))  # the turn's text incl. its end-of-turn token
    return spans


def assistant_token_mask(tokenizer, messages, input_ids, **template_kwargs):
    """1 on every token overlapping an assistant turn (content and `<|im_end|>`), else 0.
    Mirrors: transformers apply_chat_template(return_assistant_tokens_mask=True)"""
    ids, offsets = tokenizer.encode_with_offsets(tokenizer.render_chat(messages,
                                                                       **template_kwargs))
    if list(ids) != list(input_ids):
        raise ValueError("the chat re-encoded for offsets differs from its input_ids")
    mask = [0] * len(input_ids)
    for start, end in assistant_char_spans(tokenizer, messages, **template_kwargs):
        for j, (s, e) in enumerate(offsets):
            if s < end and e > start:
                mask[j] = 1
    return mask


def tokenize_example(example, tokenizer, fmt, *, dataset_text_field="text", eos_token=None,
                     assistant_only_loss=False, chat_template=None):
    """Token ids of one example plus `completion_mask` / `assistant_masks` where they apply;
    chat_template: the template to render chats with instead of the tokenizer's (TRL's training
    variant under assistant_only_loss). Mirrors: trl SFTTrainer._prepare_dataset add_eos +
    tokenize_fn"""
    eos = eos_token or tokenizer.eos_token
    if fmt == "language_modeling":
        text = example[dataset_text_field]
        # "EOS appending (non-conversational only)", a string check as TRL's add_eos.
        return {"input_ids": tokenizer.encode(text if text.endswith(eos) else text + eos)}
    template_kwargs = chat_template_kwargs(example)  # tools, per-row template variables
    if chat_template is not None:
        template_kwargs["chat_template"] = chat_template
    if fmt == "conversational":
        out = {"input_ids": tokenizer.apply_chat_template(example["messages"], **template_kwargs)}
        if assistant_only_loss:
            out["assistant_masks"] = assistant_token_mask(tokenizer, example["messages"],
                                                          out["input_ids"], **template_kwargs)
        return out
    prompt, completion = example["prompt"], example["completion"]
    out = {}
    if fmt == "prompt_completion":
        completion = completion if completion.endswith(eos) else completion + eos
        prompt_ids = tokenizer.encode(prompt)
        full_ids = tokenizer.encode(prompt + completion)  # string concatenation, as TRL
    else:
        prompt_ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True,
                                                   **template_kwargs)
        full_ids = tokenizer.apply_chat_template(prompt + completion, **template_kwargs)
        if assistant_only_loss:
            out["assistant_masks"] = assistant_token_mask(tokenizer, prompt + completion, full_ids,
                                                          **template_kwargs)
    # The completion starts where prompt and prompt+completion diverge (tokens may merge across).
    n = common_prefix_length(prompt_ids, full_ids)
    if n < len(prompt_ids):  # shown once per run, as TRL's warning_once
        warnings.warn("the tokenized prompt is not a prefix of the tokenized prompt+completion "
                      "(tokens merge across the boundary); the completion mask starts where they "
                      "diverge. "
                      "Fix: end prompts on a token boundary, e.g. without a trailing space",
                      stacklevel=2)
    out["input_ids"] = full_ids
    out["completion_mask"] = [0] * n + [1] * (len(full_ids) - n)
    return out


def build_labels(input_ids, masks):
    """labels[i] = input_ids[i] where every mask is 1, else -100.
    Mirrors: trl SFTTrainer._prepare_dataset build_labels"""
    return [tok if all(bits) else -100 for tok, *bits in zip(input_ids, *masks)]


# ----------------------------------------------------------------------------- packing

def _bfd_bins(lengths, seq_length):
    """Best-Fit-Decreasing: longest first, each into the open bin with the least room that fits
    (oldest first among equal room), else a new bin. Returns bins as lists of indices.
    Mirrors: trl _pack_bfd, _SegmentTree
    Differs: a sorted list of free spaces."""
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
    starts = range(0, total, seq_length)
    return [{k: v[s : s + seq_length] for k, v in flat.items()} for s in starts]


def pack_dataset(examples, max_length, strategy="bfd"):
    """Pack token rows into rows of at most max_length, per 1000-example batch (bfd: seq_lengths).
    Mirrors: trl pack_dataset (strategies bfd, bfd_split, wrapped)"""
    if strategy not in PACKING_STRATEGIES:
        raise ValueError(f"unknown packing strategy {strategy!r}; expected one of "
                         f"{PACKING_STRATEGIES}")
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


# ----------------------------------------------------------------------------- whole preparation

def _drop_fully_masked(rows, name="the dataset"):
    kept = [row for row in rows if any(label != -100 for label in row["labels"])]
    if len(kept) < len(rows):
        logger.warning("%s: dropped %d of %d examples with no trainable token after masking and "
                       "truncation (max_length cut off every completion or assistant token)",
                       name, len(rows) - len(kept), len(rows))
    if not kept:
        raise ValueError(f"{name}: all {len(rows)} examples have labels that are all -100 "
                         "(nothing to train on); fix: raise max_length, or check the "
                         "prompt/completion or assistant turns")
    return kept


def _check_tokens_to_train(rows, name):
    # labels[0] is never predicted (the loss shifts by one), so a one-token row, such as an empty
    # text plus EOS, trains nothing; TRL keeps such rows, so they stay, with a warning
    empty = sum(not any(label != -100 for label in row["labels"][1:]) for row in rows)
    if empty == len(rows):
        raise ValueError(f"{name}: no example has a token to train on ({empty} examples, each "
                         "with an empty text or completion); fix: give examples with text")
    if empty:
        logger.warning("%s: %d of %d examples have no token to train on (an empty text or "
                       "completion); they add nothing to the loss", name, empty, len(rows))


def _with_eos(example, fmt, eos, dataset_text_field):
    """The row as TRL's add_eos leaves it: EOS appended to the text or completion field."""
    field = {"language_modeling": dataset_text_field, "prompt_completion": "completion"}.get(fmt)
    if field is None or example[field].endswith(eos):
        return dict(example)
    return {**example, field: example[field] + eos}


def _answer_start(row, example, fmt, tokenizer):
    """Index of a tokenized row's first completion / assistant token (None: plain text)."""
    for mask in ("completion_mask", "assistant_masks"):
        if mask in row:
            return row[mask].index(1) if 1 in row[mask] else len(row[mask])
    if fmt != "conversational":
        return None
    roles = [m["role"] for m in example["messages"]]
    if "assistant" not in roles:
        return len(row["input_ids"])
    # the chat up to the first assistant turn, with its header: where the first answer starts
    return len(tokenizer.apply_chat_template(example["messages"][:roles.index("assistant")],
                                             add_generation_prompt=True))


def _warn_answers_cut(rows, examples, fmt, tokenizer, max_length, masked, name):
    """Count rows whose every completion / assistant token lies past max_length but which still
    train (their loss is not limited to the answer, so the cut leaves the prompt as the target)."""
    if masked or max_length is None or fmt in ("tokenized", "language_modeling"):
        return  # masked rows lose every label and _drop_fully_masked drops them, saying so
    cut = sum(len(row["input_ids"]) > max_length
              and _answer_start(row, example, fmt, tokenizer) >= max_length
              for row, example in zip(rows, examples))
    if cut:
        logger.warning("%s: %d of %d examples lose every completion or assistant token to "
                       "max_length=%d (the answer comes last), so they train on their prompt "
                       "alone; raise max_length, or set completion_only_loss / "
                       "assistant_only_loss to drop them", name, cut, len(rows), max_length)


def prepare_dataset(examples, tokenizer, *, max_length=1024, packing=False, packing_strategy="bfd",
                    completion_only_loss=None, assistant_only_loss=False, dataset_text_field="text",
                    eos_token=None, name=None, keep_columns=False, chat_template=None):
    """Examples (path or dicts) -> rows of `input_ids`, `labels` (-100 = no loss) [, `seq_lengths`].
    Mirrors: trl SFTTrainer._prepare_dataset (+ SFTTrainer.__init__ option checks)
    `name` (the data file, or e.g. "train_dataset") is what warnings and errors call it.
    keep_columns: each row also keeps the columns TRL's prepared Dataset keeps (the example's own
    fields, EOS appended as add_eos does, and a completion_mask the labels did not use)."""
    if name is None:
        name = os.fspath(examples) if isinstance(examples, (str, os.PathLike)) else "the dataset"
    examples = load_examples(examples, dataset_text_field)
    if "input_ids" in examples[0]:
        fmt = "tokenized"
        rows = [dict(ex) for ex in examples]
    else:
        fmt = dataset_format(examples[0], dataset_text_field)
        if assistant_only_loss and not fmt.startswith("conversational"):
            raise ValueError(f"assistant_only_loss=True needs a conversational dataset, got {fmt}")
        kwargs = {"dataset_text_field": dataset_text_field, "eos_token": eos_token,
                  "assistant_only_loss": assistant_only_loss, "chat_template": chat_template}
        rows = [tokenize_example(ex, tokenizer, fmt, **kwargs) for ex in examples]
        if keep_columns:  # datasets' map keeps the input columns, then adds its outputs
            eos = eos_token or tokenizer.eos_token
            rows = [{**_with_eos(ex, fmt, eos, dataset_text_field), **row}
                    for ex, row in zip(examples, rows)]
        for i, row in enumerate(rows):
            if "assistant_masks" in row and 1 not in row["assistant_masks"]:
                raise ValueError(f"example {i} has no assistant turn, so assistant_only_loss "
                                 "leaves nothing to train; fix: drop it or add the assistant "
                                 "reply")
    if completion_only_loss is None:
        completion_only_loss = fmt.endswith("prompt_completion")
    if not packing or packing_strategy == "bfd":  # those cut a row at max_length
        _warn_answers_cut(rows, examples, fmt, tokenizer, max_length,
                          assistant_only_loss or completion_only_loss and fmt != "conversational",
                          name)
    if "labels" not in rows[0]:
        names = (["completion_mask"] if completion_only_loss else []) + ["assistant_masks"]
        for row in rows:
            row["labels"] = build_labels(row["input_ids"], [row[m] for m in names if m in row])
            for used in names if keep_columns else ():  # TRL's build_labels removes them
                row.pop(used, None)
    if packing or not keep_columns:
        rows = [{"input_ids": row["input_ids"], "labels": row["labels"]} for row in rows]
    if packing:
        if max_length is None:
            raise ValueError("packing=True needs max_length (the packed row length), got None")
        _check_tokens_to_train(rows, name)
        return pack_dataset(rows, max_length, packing_strategy)
    _check_tokens_to_train(rows, name)
    if max_length is not None:  # keep_start truncation, then drop rows left without a target
        rows = [{**row, "input_ids": row["input_ids"][:max_length],
                 "labels": row["labels"][:max_length]} for row in rows]
        rows = _drop_fully_masked(rows, name)
    return rows


def is_datasets_object(dataset):
    """A `datasets` Dataset or IterableDataset (checked by type, `datasets` is not imported)."""
    return type(dataset).__module__.startswith("datasets.") and type(dataset).__name__ in (
        "Dataset", "IterableDataset")


def as_datasets_dataset(rows):
    """Prepared rows as a datasets.Dataset (columns: the rows' keys), what TRL's trainer holds.
    Mirrors: trl SFTTrainer._prepare_dataset's return value
    Differs: an IterableDataset input comes back as a Dataset too (its rows were read in)."""
    import datasets  # the caller passed a datasets object, so it is installed

    return datasets.Dataset.from_list(rows)

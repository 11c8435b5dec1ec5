"""Batch collators: pad lists of token ids into tensors and build labels (-100 = no loss).

Guide: data collators (数据加载与批处理). SFTTrainer.__init__ picks its `data_collator` here.
The causal path mirrors TRL's DataCollatorForLanguageModeling (right padding, padding-free
rows with restarting position_ids); the MLM path mirrors transformers' BERT rule (15%, then
80/10/10; Devlin et al. 1810.04805). Labels come from the examples, never from `input_ids == pad`,
so a real EOS stays supervised when pad id == eos id. Knows nothing of models.
"""

from dataclasses import dataclass

import numpy as np
import torch


def pad(sequences, padding_value, padding_side="right", pad_to_multiple_of=None):
    """Stack 1-D sequences into a (B, T) tensor, T = longest rounded up to a multiple.
    Guide: data collators | Mirrors: trl.trainer.utils.pad, transformers _torch_collate_batch"""
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    seqs = [torch.as_tensor(s, dtype=torch.long) for s in sequences]
    T = max(len(s) for s in seqs)
    if pad_to_multiple_of:
        T = -(-T // pad_to_multiple_of) * pad_to_multiple_of
    out = torch.full((len(seqs), T), padding_value, dtype=torch.long)
    for i, s in enumerate(seqs):
        if padding_side == "right":
            out[i, : len(s)] = s
        else:
            out[i, T - len(s) :] = s
    return out


def position_ids_from_seq_lengths(seq_lengths):
    """Positions restarting at 0 for each packed document: [3, 2] -> [0, 1, 2, 0, 1].
    Guide: data collators | Mirrors: trl get_position_ids_from_packed_seq_lengths"""
    return torch.cat([torch.arange(n) for n in seq_lengths])


def _check_examples(examples, keys=("input_ids",)):
    if not examples:
        raise ValueError("cannot collate an empty batch: got 0 examples")
    for i, ex in enumerate(examples):
        for k in keys:
            if k not in ex:
                raise KeyError(f"example {i} of the batch has no {k!r} (keys: {sorted(ex)})")


def _example_labels(i, example, completion_only_loss):
    """Labels of example i: its own `labels`, kept as given (as TRL's collator); else its
    input_ids with -100 where a mask (assistant_masks, completion_mask) is 0."""
    names = ["labels", "assistant_masks"] + (["completion_mask"] if completion_only_loss else [])
    n = len(example["input_ids"])
    for name in names:
        if name in example and len(example[name]) != n:
            raise ValueError(f"example {i} of the batch: {name} has {len(example[name])} entries "
                             f"but input_ids has {n}; fix: build both from the same tokenization")
    if "labels" in example:  # the caller's labels win over any mask column
        return torch.tensor(example["labels"], dtype=torch.long)
    labels = torch.tensor(example["input_ids"], dtype=torch.long)
    for name in names[1:]:
        if name in example:
            labels[torch.tensor(example[name]) == 0] = -100
    return labels


def _pad_features(features, pad_token_id, padding_side, pad_to_multiple_of):
    """Pad the tokenizer fields as transformers' `tokenizer.pad` does; tensorize the rest."""
    fill = {"input_ids": pad_token_id, "attention_mask": 0, "token_type_ids": 0,
            "special_tokens_mask": 1}
    rows = [dict(f) for f in features]
    if "attention_mask" not in rows[0]:
        for r in rows:
            r["attention_mask"] = [1] * len(r["input_ids"])
    batch = {}
    for k in rows[0]:
        values = [r[k] for r in rows]
        if k in fill:
            batch[k] = pad(values, fill[k], padding_side, pad_to_multiple_of)
        else:
            batch[k] = torch.tensor(values)
    return batch


@dataclass
class DataCollatorForLanguageModeling:
    """Causal-LM (default) or masked-LM batches with -100 labels; padding-free rows on request.
    Guide: data collators | Mirrors: trl and transformers DataCollatorForLanguageModeling
    Differs: takes ids, not a tokenizer; no cu_seq_lens_* (the model masks from position_ids)."""

    pad_token_id: int
    completion_only_loss: bool = True
    padding_free: bool = False
    pad_to_multiple_of: int | None = None
    padding_side: str = "right"
    mlm: bool = False
    mlm_probability: float = 0.15
    mask_token_id: int | None = None
    vocab_size: int | None = None
    mask_replace_prob: float = 0.8
    random_replace_prob: float = 0.1
    return_tensors: str = "pt"
    seed: int | None = None
    special_token_ids: tuple | None = None  # MLM never masks these; default (pad, mask)

    def __post_init__(self):
        if self.return_tensors != "pt":
            raise ValueError(f"only return_tensors='pt' is supported, got {self.return_tensors!r}")
        if self.pad_token_id is None:
            raise ValueError("pad_token_id is None: set tokenizer.pad_token "
                             "(e.g. to the EOS token) first")
        if self.mlm and (self.mask_token_id is None or self.vocab_size is None):
            raise ValueError("mlm=True needs mask_token_id and vocab_size "
                             "(random replacements draw from it)")
        if self.mlm and self.padding_free:
            raise ValueError("padding_free is for causal LM; use mlm=False or padding_free=False")
        for name in ("mlm_probability", "mask_replace_prob", "random_replace_prob"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.mask_replace_prob + self.random_replace_prob > 1:
            raise ValueError("mask_replace_prob + random_replace_prob must not exceed 1")
        self.generator = None

    def __call__(self, examples):
        """One batch of tensors: input_ids, attention_mask (padded) or position_ids
        (padding-free), labels.
        Guide: data collators | Mirrors: trl DataCollatorForLanguageModeling.torch_call"""
        _check_examples(examples)
        if self.mlm:
            return self._mlm_batch(examples)
        input_ids = [torch.tensor(ex["input_ids"], dtype=torch.long) for ex in examples]
        labels = [_example_labels(i, ex, self.completion_only_loss)
                  for i, ex in enumerate(examples)]
        if not self.padding_free:
            padded = pad(input_ids, self.pad_token_id, self.padding_side, self.pad_to_multiple_of)
            batch = {"input_ids": padded}
            ones = [torch.ones_like(ids) for ids in input_ids]
            batch["attention_mask"] = pad(ones, 0, self.padding_side, self.pad_to_multiple_of)
            batch["labels"] = pad(labels, -100, self.padding_side, self.pad_to_multiple_of)
            return batch
        # Padding-free: one row (1, sum T_i); positions restart per document instead of a mask.
        if "seq_lengths" in examples[0]:
            positions = [position_ids_from_seq_lengths(ex["seq_lengths"]) for ex in examples]
        else:
            positions = [torch.arange(len(ids)) for ids in input_ids]
        m = self.pad_to_multiple_of
        batch = {"input_ids": pad([torch.cat(input_ids)], self.pad_token_id, "right", m)}
        batch["position_ids"] = pad([torch.cat(positions)], 0, "right", m)
        batch["labels"] = pad([torch.cat(labels)], -100, "right", m)
        # A document's first token is no target of the previous document's last token.
        batch["labels"][batch["position_ids"] == 0] = -100
        return batch

    @staticmethod
    def get_position_ids_from_packed_seq_lengths(batch_seq_lengths):
        """Per row, positions restarting at 0 for each packed document: [[3, 2]] ->
        [tensor([0, 1, 2, 0, 1])].
        Mirrors: trl DataCollatorForLanguageModeling.get_position_ids_from_packed_seq_lengths"""
        return [position_ids_from_seq_lengths(seq_lengths) for seq_lengths in batch_seq_lengths]

    def _get_generator(self):
        if self.seed is None:
            return None  # the global torch RNG, as transformers does without a seed
        if self.generator is None:
            worker = torch.utils.data.get_worker_info()
            self.generator = torch.Generator().manual_seed(self.seed + (worker.id if worker else 0))
        return self.generator

    def _mlm_batch(self, examples):
        batch = _pad_features(
            [{k: v for k, v in ex.items() if k != "labels"} for ex in examples],
            self.pad_token_id, self.padding_side, self.pad_to_multiple_of,
        )
        special = batch.pop("special_tokens_mask", None)
        if special is None:
            ids = self.special_token_ids or (self.pad_token_id, self.mask_token_id)
            special = torch.isin(batch["input_ids"], torch.tensor(ids))
        batch["input_ids"], batch["labels"] = self.mask_tokens(batch["input_ids"], special.bool())
        return batch

    def mask_tokens(self, inputs, special_tokens_mask):
        """BERT masking: pick mlm_probability of the non-special tokens; of those, mask_replace_prob
        become the mask token, random_replace_prob a random id, the rest stay. Same RNG draws,
        same order.
        Guide: data collators
        Mirrors: transformers DataCollatorForLanguageModeling.torch_mask_tokens"""
        g = self._get_generator()
        labels = inputs.clone()
        prob = torch.full(labels.shape, self.mlm_probability).masked_fill_(special_tokens_mask, 0.0)
        masked = torch.bernoulli(prob, generator=g).bool()
        labels[~masked] = -100  # loss only on the picked tokens
        p_replace = torch.full(labels.shape, self.mask_replace_prob)
        replaced = torch.bernoulli(p_replace, generator=g).bool() & masked
        inputs[replaced] = self.mask_token_id
        if self.mask_replace_prob == 1 or self.random_replace_prob == 0:
            return inputs, labels
        # Of the picked-but-not-replaced share (1 - mask_replace_prob), this fraction goes random.
        p_random = torch.full(labels.shape, self.random_replace_prob / (1 - self.mask_replace_prob))
        randomized = torch.bernoulli(p_random, generator=g).bool() & masked & ~replaced
        words = torch.randint(self.vocab_size, labels.shape, dtype=torch.long, generator=g)
        inputs[randomized] = words[randomized]
        return inputs, labels


@dataclass
class DataCollatorWithPadding:
    """Pad input_ids / attention_mask / token_type_ids / special_tokens_mask; labels pass unpadded.
    Guide: data collators | Mirrors: transformers DataCollatorWithPadding (via tokenizer.pad)"""

    pad_token_id: int
    padding_side: str = "right"
    pad_to_multiple_of: int | None = None
    return_tensors: str = "pt"

    def __call__(self, features):
        """Padded tensors; `label` / `label_ids` renamed to `labels`.
        Mirrors: DataCollatorWithPadding.__call__"""
        _check_examples(features)
        batch = _pad_features(features, self.pad_token_id, self.padding_side,
                              self.pad_to_multiple_of)
        for old in ("label", "label_ids"):
            if old in batch:
                batch["labels"] = batch.pop(old)
        return batch


@dataclass
class DataCollatorForTokenClassification:
    """Pad the inputs and pad per-token labels with -100 on the same side.
    Guide: data collators | Mirrors: transformers DataCollatorForTokenClassification"""

    pad_token_id: int
    padding_side: str = "right"
    pad_to_multiple_of: int | None = None
    label_pad_token_id: int = -100
    return_tensors: str = "pt"

    def __call__(self, features):
        """Padded tensors with labels padded by label_pad_token_id.
        Mirrors: torch_call of the same class"""
        _check_examples(features)
        name = "label" if "label" in features[0] else "labels"
        rest = [{k: v for k, v in f.items() if k != name} for f in features]
        batch = _pad_features(rest, self.pad_token_id, self.padding_side, self.pad_to_multiple_of)
        if name in features[0]:
            T, fill = batch["input_ids"].shape[1], self.label_pad_token_id
            labels = [list(f[name]) for f in features]
            if self.padding_side == "right":
                rows = [lab + [fill] * (T - len(lab)) for lab in labels]
            else:
                rows = [[fill] * (T - len(lab)) + lab for lab in labels]
            batch[name] = torch.tensor(rows, dtype=torch.long)
        return batch


def default_data_collator(features, return_tensors="pt"):
    """Stack features without padding; `label` / `label_ids` become `labels`.
    Guide: data collators | Mirrors: transformers default_data_collator"""
    _check_examples(features, keys=())
    first = features[0]
    batch = {}
    if first.get("label") is not None:
        value = first["label"]
        if isinstance(value, torch.Tensor):
            value = value.item()
        dtype = torch.long if isinstance(value, (int, np.integer)) else torch.float
        batch["labels"] = torch.tensor([f["label"] for f in features], dtype=dtype)
    elif first.get("label_ids") is not None:
        batch["labels"] = _stack([f["label_ids"] for f in features])
    for k, v in first.items():
        if k not in ("label", "label_ids") and v is not None and not isinstance(v, str):
            batch[k] = _stack([f[k] for f in features])
    return batch


def _stack(values):
    if isinstance(values[0], torch.Tensor):
        return torch.stack(values)
    if isinstance(values[0], np.ndarray):
        return torch.from_numpy(np.stack(values))
    return torch.tensor(values)

"""Pieces the Trainer is built from: seeding, TrainOutput, TrainerState/TrainerControl, the logging window, the
seeded batch sampler, resume skipping, label smoothing, and the loss-kwargs check.

Walkthrough 2.3 - 2.5. The split mirrors transformers, where these live beside trainer.py in trainer_utils.py
(set_seed, TrainOutput), trainer_callback.py (TrainerState, TrainerControl), trainer_pt_utils.py (LabelSmoother)
and accelerate data_loader.py (SeedableRandomSampler, skip_first_batches).
"""

import inspect
import math
import random
import time
from dataclasses import asdict, dataclass, field, fields
from typing import NamedTuple

import numpy as np
import torch
from torch.utils.data import DataLoader

from nanosft import distributed

IGNORE_INDEX = -100


def set_seed(seed: int) -> None:
    """Seed python, numpy and torch. Walkthrough 2.1 | Mirrors: transformers trainer_utils.set_seed"""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class TrainOutput(NamedTuple):
    """What train() returns. Walkthrough 2.3 | Mirrors: transformers trainer_utils.TrainOutput"""

    global_step: int
    training_loss: float
    metrics: dict


@dataclass
class TrainerState:
    """Progress that a checkpoint must carry: step, epoch, log history, best metric, step intervals.
    Walkthrough 2.3 | Mirrors: transformers TrainerState (to_dict/from_dict instead of save_to_json/load_from_json)"""

    epoch: float = 0.0
    global_step: int = 0
    max_steps: int = 0
    num_train_epochs: int = 0
    train_batch_size: int | None = None
    logging_steps: int = 500
    eval_steps: int = 500
    save_steps: int = 500
    log_history: list = field(default_factory=list)
    best_metric: float | None = None
    best_global_step: int | None = None
    best_model_checkpoint: str | None = None

    def compute_steps(self, args, max_steps: int) -> None:
        """Turn logging/eval/save steps given as a ratio (< 1) of max_steps into step counts. Mirrors: TrainerState.compute_steps"""
        for kind in ("logging", "eval", "save"):
            value = getattr(args, f"{kind}_steps")
            if value is not None:
                setattr(self, f"{kind}_steps", math.ceil(max_steps * value) if value < 1 else int(value))

    def to_dict(self) -> dict:
        """A JSON-ready dict (trainer_state.json). Mirrors: TrainerState.save_to_json"""
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "TrainerState":
        """Rebuild from to_dict() output, ignoring unknown keys. Mirrors: TrainerState.load_from_json"""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})


@dataclass
class TrainerControl:
    """Flags set after each step / epoch and cleared once acted on. Mirrors: transformers TrainerControl"""

    should_log: bool = False
    should_evaluate: bool = False
    should_save: bool = False
    should_training_stop: bool = False


@dataclass
class LogWindow:
    """Tokens, samples, wall time and a nan/inf flag since the last log: tokens/s and the stop-on-nan check.
    Guide: troubleshooting, monitoring | Mirrors: transformers speed_metrics, Trainer.num_input_tokens_seen"""

    start: float = field(default_factory=time.time)
    tokens: int = 0
    samples: int = 0
    nonfinite: torch.Tensor | bool = False  # becomes a 0-d bool tensor, so flagging a loss needs no host sync

    def add(self, inputs: dict) -> None:
        """Count one (host-side) micro-batch: its attention_mask ones, or every id when padding-free."""
        mask = inputs.get("attention_mask")
        self.tokens += int(mask.sum()) if mask is not None else inputs["input_ids"].numel()
        self.samples += len(inputs["input_ids"])

    def speed(self, world_size: int) -> dict:
        """tokens/s and samples/s of all ranks (each rank sees about as many tokens as this one)."""
        seconds = max(time.time() - self.start, 1e-9)
        return {"tokens_per_second": round(self.tokens * world_size / seconds, 1),
                "samples_per_second": round(self.samples * world_size / seconds, 3)}


class SeedableBatchSampler:
    """Batches of the epoch order randperm(N, seed + epoch), this rank's share of them.
    Walkthrough 2.3 | Mirrors: accelerate SeedableRandomSampler + BatchSampler + BatchSamplerShard"""

    def __init__(self, num_samples, batch_size, seed, shuffle=True, drop_last=False, num_replicas=1, rank=0):
        self.num_samples, self.batch_size, self.seed, self.shuffle = num_samples, batch_size, seed, shuffle
        self.drop_last, self.num_replicas, self.rank, self.epoch = drop_last, num_replicas, rank, 0

    def set_epoch(self, epoch: int) -> None:
        """Pick the order of `epoch`; called at every epoch start. Mirrors: SeedableRandomSampler.set_epoch"""
        self.epoch = epoch

    def __iter__(self):
        if self.shuffle:
            order = torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(self.seed + self.epoch))
            order = order.tolist()
        else:
            order = list(range(self.num_samples))
        batches = [order[i : i + self.batch_size] for i in range(0, self.num_samples, self.batch_size)]
        if self.drop_last and batches and len(batches[-1]) < self.batch_size:
            batches.pop()
        return iter(distributed.shard_batches(batches, self.num_replicas, self.rank, self.batch_size, self.drop_last))

    def __len__(self) -> int:
        full, rest = divmod(self.num_samples, self.batch_size)
        num_batches = full if self.drop_last else full + (rest > 0)
        if self.drop_last:
            return num_batches // self.num_replicas
        return math.ceil(num_batches / self.num_replicas)


def skip_first_batches(dataloader: DataLoader, num_batches: int) -> DataLoader:
    """The same dataloader for the current epoch, less its first `num_batches` batches (resume).
    Mirrors: accelerate skip_first_batches | Differs: slices the batch index lists, so skipped batches are not collated."""
    remaining = list(dataloader.batch_sampler)[num_batches:]
    return DataLoader(dataloader.dataset, batch_sampler=remaining, collate_fn=dataloader.collate_fn,
                      num_workers=dataloader.num_workers, generator=torch.Generator())


def select_columns(features: list, collator, keep: set | None):
    """Collate after dropping the keys the model cannot take. Mirrors: Trainer._remove_unused_columns"""
    if keep is not None:
        features = [{k: v for k, v in f.items() if k in keep} for f in features]
    return collator(features)


def label_smoothed_loss(logits, labels, epsilon, num_items_in_batch=None, shift_labels=True):
    """(1-eps) * NLL + eps * mean over the vocabulary of -log p, over the supervised tokens.
    Walkthrough 2.5 | Mirrors: transformers LabelSmoother.__call__ (hf-reference 1.9)"""
    if shift_labels:  # position t predicts token t+1
        logits, labels = logits[..., :-1, :], labels[..., 1:]
    neg_log_probs = -torch.nn.functional.log_softmax(logits, dim=-1)  # (B, T, V)
    labels = labels.unsqueeze(-1)
    padding = labels.eq(IGNORE_INDEX)
    nll = neg_log_probs.gather(-1, labels.clamp(min=0)).masked_fill(padding, 0.0)
    smooth = neg_log_probs.sum(-1, keepdim=True, dtype=torch.float32).masked_fill(padding, 0.0)
    denom = padding.numel() - padding.sum() if num_items_in_batch is None else num_items_in_batch
    return (1 - epsilon) * nll.sum() / denom + epsilon * smooth.sum() / (denom * neg_log_probs.shape[-1])


def model_accepts_loss_kwargs(model) -> bool:
    """Whether the model normalises its loss by num_items_in_batch. Mirrors: Trainer.__init__ model_accepts_loss_kwargs"""
    flag = getattr(model, "accepts_loss_kwargs", None)
    if flag is not None:
        return bool(flag)
    return any(p.kind is p.VAR_KEYWORD for p in inspect.signature(model.forward).parameters.values())

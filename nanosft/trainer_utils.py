"""Pieces the Trainer is built from: seeding, TrainOutput, TrainerState/TrainerControl, the logging
window and the model FLOPs it counts (model_flops), the seeded batch sampler (random, or grouped
by length), resume skipping, label smoothing, the fp32 upcast of the logits and the loss-kwargs
check.

Walkthrough 2.3 - 2.5. The split mirrors transformers, where these live beside trainer.py in
trainer_utils.py (set_seed, TrainOutput), trainer_callback.py (TrainerState, TrainerControl),
trainer_pt_utils.py (LabelSmoother, LengthGroupedSampler) and accelerate (SeedableRandomSampler,
skip_first_batches, convert_outputs_to_fp32).
"""

import contextlib
import gc
import inspect
import math
import random
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import NamedTuple

import numpy as np
import torch
from torch.utils.data import DataLoader

from nanosft import distributed
from nanosft.parallel import fsdp
from nanosft.parallel import tensor_parallel
from nanosft.masking import packed_segment_ids

IGNORE_INDEX = -100


def set_seed(seed: int) -> None:
    """Seed python, numpy and torch. Walkthrough 2.1 | Mirrors: transformers set_seed"""
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
    """Progress that a checkpoint must carry: step, epoch, log history, best metric, intervals.
    Walkthrough 2.3 | Mirrors: transformers TrainerState (to_dict/from_dict: save/load_from_json)"""

    epoch: float = 0.0
    global_step: int = 0
    max_steps: int = 0
    num_train_epochs: int = 0
    train_batch_size: int | None = None
    total_flos: float = 0.0  # 6 x input_ids elements x parameters, summed over steps and ranks
    logging_steps: int = 500
    eval_steps: int = 500
    save_steps: int = 500
    log_history: list = field(default_factory=list)
    best_metric: float | None = None
    best_global_step: int | None = None
    best_model_checkpoint: str | None = None

    def compute_steps(self, args, max_steps: int) -> None:
        """Logging/eval/save steps given as a ratio (< 1) of max_steps become step counts.
        Mirrors: TrainerState.compute_steps"""
        for kind in ("logging", "eval", "save"):
            value = getattr(args, f"{kind}_steps")
            if value is not None:
                steps = math.ceil(max_steps * value) if value < 1 else int(value)
                setattr(self, f"{kind}_steps", steps)

    def to_dict(self) -> dict:
        """A JSON-ready dict (trainer_state.json). Mirrors: TrainerState.save_to_json"""
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "TrainerState":
        """Rebuild from to_dict() output, ignoring unknown keys.
        Mirrors: TrainerState.load_from_json"""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})


@dataclass
class TrainerControl:
    """Flags set after each step / epoch, cleared once acted on.
    Mirrors: transformers TrainerControl"""

    should_log: bool = False
    should_evaluate: bool = False
    should_save: bool = False
    should_training_stop: bool = False


@dataclass
class LogWindow:
    """Tokens, samples, sequence lengths, wall time and a nan/inf flag since the last log: the
    throughput and model FLOP/s of the window and the stop-on-nan check. Guide: monitoring
    Mirrors: transformers speed_metrics (its names), Trainer.num_input_tokens_seen, current_flos"""

    start: float = field(default_factory=time.time)
    tokens: int = 0
    samples: int = 0
    input_ids: int = 0  # every input_ids element, padding too: what transformers' total_flos counts
    seq_lengths: list = field(default_factory=list)  # tokens of each sequence: the attention FLOPs
    nonfinite: torch.Tensor | bool = False  # a 0-d bool tensor: flagging a loss needs no host sync

    def add(self, inputs: dict) -> None:
        """Count one (host-side) micro-batch: its attention_mask ones, or all ids (padding-free)."""
        mask = inputs.get("attention_mask")
        self.tokens += int(mask.sum()) if mask is not None else inputs["input_ids"].numel()
        self.samples += len(inputs["input_ids"])
        self.input_ids += inputs["input_ids"].numel()
        self.seq_lengths += sequence_lengths(inputs["input_ids"], mask, inputs.get("position_ids"))

    def speed(self, world_size: int, steps: int, model_flos=None, peak_flops=None) -> dict:
        """Tokens/s and samples/s of all ranks (each sees about as many as this one), steps/s and
        seconds per optimizer step, over the window of `steps` optimizer steps; given the window's
        model FLOPs of all ranks, their rate, and its share of world_size x peak_flops (mfu)."""
        seconds = max(time.time() - self.start, 1e-9)
        speed = {"train_tokens_per_second": round(self.tokens * world_size / seconds, 1),
                 "train_samples_per_second": round(self.samples * world_size / seconds, 3),
                 "train_steps_per_second": round(steps / seconds, 3),
                 "train_step_time": round(seconds / max(steps, 1), 4)}
        if model_flos is not None:
            speed["train_model_flops_per_second"] = round(model_flos / seconds, 1)
        if model_flos is not None and peak_flops:
            speed["mfu"] = model_flos / seconds / (peak_flops * world_size)
        return speed


def sequence_lengths(input_ids, attention_mask=None, position_ids=None) -> list:
    """Tokens of each sequence in a batch: the attention_mask row sums; without a mask, each row's
    documents, split where position_ids do not step by +1 (padding-free), else whole rows.
    Guide: performance | Mirrors: the documents nanosft.masking.varlen_layout attends within"""
    if attention_mask is not None:
        return attention_mask.sum(-1).tolist()
    if position_ids is None:
        return [input_ids.shape[-1]] * len(input_ids)
    segments = packed_segment_ids(position_ids.reshape(-1, position_ids.shape[-1]))
    return [n for row in segments for n in torch.bincount(row).tolist() if n]


def model_flops(matmul_params, trainable_matmul_params, attention_width, num_layers,
                seq_lengths) -> int:
    """FLOPs of one forward + backward over sequences of `seq_lengths` tokens: per token 4 a matmul
    weight (forward, input gradient) and 2 more a trainable one (weight gradient), so 6N for full
    fine-tuning and 4N + 6 an adapter weight on a frozen base; plus causal attention, 6 x width x
    layers x T(T+1) a sequence of T. Guide: performance | Mirrors: nanoGPT estimate_mfu"""
    # Differs: nanoGPT (PaLM's appendix B) counts the whole T x T square, 12 x layers x width x T
    # a token; the causal products need the lower triangle only: T(T+1)/2 of its entries, which
    # fused kernels skip (QK^T and AV: 2 x 2 x width a pair forward, twice that backward)
    tokens = sum(seq_lengths)
    pairs = sum(t * (t + 1) for t in seq_lengths)
    return ((4 * matmul_params + 2 * trainable_matmul_params) * tokens
            + 6 * attention_width * num_layers * pairs)


def convert_outputs_to_fp32(outputs):
    """Half-precision logits (autocast) back to fp32, so the loss and metrics are fp32.
    Walkthrough 2.5 | Mirrors: accelerate convert_outputs_to_fp32 (on the logits)"""
    logits = getattr(outputs, "logits", None)
    if logits is not None and logits.dtype in (torch.float16, torch.bfloat16):
        outputs.logits = logits.float()
    return outputs


def get_length_grouped_indices(lengths, batch_size, mega_batch_mult=None, generator=None) -> list:
    """A random order whose runs of `batch_size` indices hold similar lengths: randperm, cut into
    megabatches of mega_batch_mult x batch_size (default min(N // (4 x batch_size), 50), at least
    1), each sorted longest first; the longest example of all goes first (an OOM shows at once).
    Walkthrough 2.3 | Mirrors: transformers get_length_grouped_indices"""
    if mega_batch_mult is None:  # 50, or fewer so that a small dataset still has 4 megabatches
        mega_batch_mult = max(min(len(lengths) // (4 * batch_size), 50), 1)
    if len(lengths) == 0:
        return []
    size = mega_batch_mult * batch_size
    order = torch.randperm(len(lengths), generator=generator).tolist()
    megabatches = [sorted(order[start : start + size], key=lengths.__getitem__, reverse=True)
                   for start in range(0, len(order), size)]
    # each head is its megabatch's longest; the first of the longest heads swaps with the front
    heads = [lengths[megabatch[0]] for megabatch in megabatches]
    longest = heads.index(max(heads))
    megabatches[0][0], megabatches[longest][0] = megabatches[longest][0], megabatches[0][0]
    return [index for megabatch in megabatches for index in megabatch]


class SeedableBatchSampler:
    """Batches of the epoch order, this rank's share of them. The order: randperm(N, seed + epoch),
    or with `lengths`, get_length_grouped_indices(lengths, group_size) drawn from that generator.
    Walkthrough 2.3 | Mirrors: accelerate SeedableRandomSampler, BatchSampler, BatchSamplerShard;
    transformers LengthGroupedSampler, get_length_grouped_indices
    Differs: LengthGroupedSampler draws from the global torch RNG (accelerate: a generator seeded
    from it, broadcast from rank 0); here seed + epoch, so a resumed run sees the same order."""

    def __init__(self, num_samples, batch_size, seed, shuffle=True, drop_last=False, num_replicas=1,
                 rank=0, lengths=None, group_size=None):
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.num_replicas = num_replicas
        self.rank = rank
        self.lengths = None if lengths is None else list(lengths)
        self.group_size = group_size if group_size is not None else batch_size
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Pick the order of `epoch`; called at every epoch start.
        Mirrors: SeedableRandomSampler.set_epoch"""
        self.epoch = epoch

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        if self.lengths is not None:  # train_sampling_strategy="group_by_length"
            order = get_length_grouped_indices(self.lengths, self.group_size, generator=generator)
        elif self.shuffle:
            order = torch.randperm(self.num_samples, generator=generator).tolist()
        else:
            order = list(range(self.num_samples))
        size = self.batch_size
        batches = [order[i : i + size] for i in range(0, self.num_samples, size)]
        if self.drop_last and batches and len(batches[-1]) < size:
            batches.pop()
        shard = distributed.shard_batches(batches, self.num_replicas, self.rank, size,
                                          self.drop_last)
        return iter(shard)

    def __len__(self) -> int:
        full, rest = divmod(self.num_samples, self.batch_size)
        num_batches = full if self.drop_last else full + (rest > 0)
        if self.drop_last:
            return num_batches // self.num_replicas
        return math.ceil(num_batches / self.num_replicas)


def skip_first_batches(dataloader: DataLoader, num_batches: int) -> DataLoader:
    """The same dataloader for the current epoch, less its first `num_batches` batches (resume).
    Mirrors: accelerate skip_first_batches
    Differs: slices the batch index lists, so skipped batches are not collated."""
    remaining = list(dataloader.batch_sampler)[num_batches:]
    return DataLoader(dataloader.dataset, batch_sampler=remaining, collate_fn=dataloader.collate_fn,
                      num_workers=dataloader.num_workers, generator=torch.Generator())


def select_columns(features: list, collator, keep: set | None):
    """Collate after dropping the keys the model cannot take.
    Mirrors: Trainer._remove_unused_columns"""
    if keep is not None:
        features = [{k: v for k, v in f.items() if k in keep} for f in features]
    return collator(features)


def label_smoothed_loss(logits, labels, epsilon, num_items_in_batch=None, shift_labels=True):
    """(1-eps) * NLL + eps * mean over the vocabulary of -log p, over the supervised tokens.
    Walkthrough 2.5 | Mirrors: transformers LabelSmoother.__call__"""
    if shift_labels:  # position t predicts token t+1
        logits, labels = logits[..., :-1, :], labels[..., 1:]
    neg_log_probs = -torch.nn.functional.log_softmax(logits, dim=-1)  # (B, T, V)
    labels = labels.unsqueeze(-1)
    padding = labels.eq(IGNORE_INDEX)
    nll = neg_log_probs.gather(-1, labels.clamp(min=0)).masked_fill(padding, 0.0)
    smooth = neg_log_probs.sum(-1, keepdim=True, dtype=torch.float32).masked_fill(padding, 0.0)
    denom = padding.numel() - padding.sum() if num_items_in_batch is None else num_items_in_batch
    vocab = neg_log_probs.shape[-1]
    return (1 - epsilon) * nll.sum() / denom + epsilon * smooth.sum() / (denom * vocab)


def model_accepts_loss_kwargs(model) -> bool:
    """Whether the model normalises its loss by num_items_in_batch.
    Mirrors: Trainer.__init__ model_accepts_loss_kwargs"""
    flag = getattr(model, "accepts_loss_kwargs", None)
    if flag is not None:
        return bool(flag)
    params = inspect.signature(model.forward).parameters.values()
    return any(p.kind is p.VAR_KEYWORD for p in params)


def dataset_lengths(dataset, length_column_name: str | None = "length") -> list:
    """Each example's length: a datasets.Dataset's `length_column_name` column, else len(input_ids).
    Walkthrough 2.3 | Mirrors: Trainer._get_train_sampler + LengthGroupedSampler (lengths)"""
    if length_column_name and length_column_name in (getattr(dataset, "column_names", None) or ()):
        return list(dataset[length_column_name])
    if len(dataset) and not (isinstance(dataset[0], Mapping) and "input_ids" in dataset[0]):
        raise ValueError(
            "train_sampling_strategy='group_by_length' needs each example's length: give every "
            "example an 'input_ids' list, or pass a datasets.Dataset with a column of lengths "
            "(named by length_column_name, read when remove_unused_columns=False).")
    return [len(example["input_ids"]) for example in dataset]


def build_dataloader(dataset, batch_size, args, collate_fn, shuffle, drop_last) -> DataLoader:
    """A DataLoader over this rank's share of the seeded order. shuffle=True (training): the order
    args.train_sampling_strategy names - random (randperm(seed + epoch)), sequential, or
    group_by_length over windows of train_batch_size x gradient_accumulation_steps; shuffle=False
    (eval): dataset order, or group_by_length over eval batches, as transformers' eval sampler.
    Walkthrough 2.3 | Mirrors: Trainer._get_dataloader, _get_train_sampler, _get_eval_sampler +
    accelerate prepare_data_loader"""
    seed = args.data_seed if args.data_seed is not None else args.seed
    lengths = group_size = None
    if args.train_sampling_strategy == "group_by_length":
        # transformers drops unused columns (the length column too) before its sampler reads them
        column = None if args.remove_unused_columns else args.length_column_name
        lengths = dataset_lengths(dataset, column)
        # transformers groups by args' batch size (not auto_find_batch_size's) x accumulation
        group_size = (args.train_batch_size * args.gradient_accumulation_steps if shuffle
                      else batch_size)
    sampler = SeedableBatchSampler(len(dataset), batch_size, seed=seed,
                                   shuffle=shuffle and args.train_sampling_strategy == "random",
                                   drop_last=drop_last, rank=distributed.get_rank(),
                                   num_replicas=distributed.get_world_size(), lengths=lengths,
                                   group_size=group_size)
    # its own generator: iter() must not draw from the global RNG (a resumed run's dropout)
    return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate_fn,
                      num_workers=args.dataloader_num_workers, generator=torch.Generator())


def count_num_items_in_batch(batch_samples: list) -> torch.Tensor:
    """Supervised tokens of a window: sum of (labels[..., 1:] != -100), since the model shifts
    (position 0 is never a target). Walkthrough 2.3 | Mirrors: Trainer._get_num_items_in_batch"""
    return sum((b["shift_labels"] if "shift_labels" in b else b["labels"][..., 1:])
               .ne(IGNORE_INDEX).sum() for b in batch_samples)


def speed_metrics(split: str, start_time: float, num_samples=None, num_steps=None) -> dict:
    """{split}_runtime, _samples_per_second, _steps_per_second since start_time.
    Mirrors: transformers trainer_utils.speed_metrics"""
    runtime = max(time.time() - start_time, 1e-9)
    metrics = {f"{split}_runtime": round(runtime, 4)}
    if num_samples is not None:
        metrics[f"{split}_samples_per_second"] = round(num_samples / runtime, 3)
    if num_steps is not None:
        metrics[f"{split}_steps_per_second"] = round(num_steps / runtime, 3)
    return metrics


def signature_columns(model) -> set:
    """The batch keys the model's forward takes, plus the label names.
    Mirrors: Trainer._set_signature_columns_if_needed"""
    return set(inspect.signature(model.forward).parameters) | {"labels", "label", "label_ids"}


def prepare_model(model, args):
    """DDP under torchrun (unless FSDP sharded it), torch.compile, as args say; returns the model
    to call (Trainer.model stays the unwrapped one, what checkpoints save).
    Walkthrough 2.3 | Mirrors: accelerate Accelerator.prepare_model"""
    if args.world_size > 1 and not args.fsdp:
        tensor_parallel.refuse_tensor_parallel(model)  # DDP would all-reduce its shards' grads
        device_ids = [args.local_process_index] if args.device.type == "cuda" else None
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    if args.torch_compile:
        model = torch.compile(model)  # shares its parameters with the model it wraps
    return model


def no_sync(model):
    """DDP's no_sync (skip the gradient all-reduce), FSDP2's, or nothing for one process.
    Guide: distributed | Mirrors: accelerate Accelerator.no_sync"""
    inner = getattr(model, "_orig_mod", model)  # torch.compile wraps the DDP module
    if fsdp.is_fsdp(inner):  # FSDP2: no reduce-scatter until the window's last batch
        return fsdp.fsdp_no_sync(inner)
    if isinstance(inner, torch.nn.parallel.DistributedDataParallel):
        return inner.no_sync()
    return contextlib.nullcontext()


def evaluation_loop(model, dataloader, compute_loss, prepare_inputs, device):
    """(mean loss with each batch weighted by its size, examples, batches) over all ranks.
    Mirrors: Trainer.evaluation_loop (losses repeated batch-size times, then averaged)"""
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss x size, examples, batches
    with torch.no_grad():
        for batch in dataloader:
            loss = compute_loss(model, prepare_inputs(batch))
            size = len(batch["input_ids"])
            totals += torch.cat([(loss.double() * size)[None], totals.new_tensor([size, 1.0])])
    loss_sum, examples, batches = distributed.all_reduce_sum(totals).tolist()
    return loss_sum / max(examples, 1), examples, batches


# Substrings accelerate looks for in a one-argument RuntimeError's message (CUDA/HIP/XPU, MPS,
# cuDNN, CPU allocator): the errors a smaller batch can cure.
OUT_OF_MEMORY_MESSAGES = (" out of memory.", "MPS backend out of memory",
                          "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",
                          "DefaultCPUAllocator: can't allocate memory")


def should_reduce_batch_size(exception: BaseException) -> bool:
    """True for an out-of-memory error that a smaller batch may avoid.
    Guide: performance | Mirrors: accelerate utils.memory.should_reduce_batch_size"""
    if isinstance(exception, RuntimeError) and len(exception.args) == 1:
        return any(text in str(exception.args[0]) for text in OUT_OF_MEMORY_MESSAGES)
    return False


def _free_device_memory() -> None:
    gc.collect()  # the failed attempt's tensors are only garbage once its frames are gone
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def find_executable_batch_size(function, starting_batch_size: int):
    """function(batch_size) from starting_batch_size; on out-of-memory retry with int(0.9 x it).
    Guide: performance | Mirrors: transformers find_executable_batch_size (auto_find_batch_size),
    accelerate find_executable_batch_size | Differs: a call, not a decorator."""
    batch_size = starting_batch_size
    _free_device_memory()
    while True:
        if batch_size == 0:
            raise RuntimeError("No executable batch size found, reached zero. Even a batch of one "
                               "row ran out of memory: lower max_length, set gradient_checkpointing"
                               "=True, or train a quantized (QLoRA) model.")
        try:
            return function(batch_size)
        except Exception as error:  # noqa: BLE001 (re-raised unless it is out-of-memory)
            if not should_reduce_batch_size(error):
                raise
        _free_device_memory()
        batch_size = int(batch_size * 0.9)


def autocast_context(args):
    """bf16 / fp16 autocast (CPU or CUDA) as args say, else nothing.
    Walkthrough 2.5 | Mirrors: accelerate Accelerator.autocast"""
    if not (args.bf16 or args.fp16):
        return contextlib.nullcontext()
    return torch.autocast(args.device.type, dtype=torch.bfloat16 if args.bf16 else torch.float16)

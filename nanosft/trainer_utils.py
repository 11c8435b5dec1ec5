"""Pieces the Trainer is built from: seeding, TrainOutput / PredictionOutput / EvalLoopOutput, the
seeded batch sampler (random, or grouped by length) or a stream's loader (has_length, with_last),
the unused-column drop (RemoveColumnsCollator), resume skipping and the checkpoint-args warning,
label smoothing, the fp32 upcast of the logits and the loss-kwargs check.

The walkthrough prints none of it; trainer.py's loop (2.3-2.5) calls it. The split mirrors
transformers, where these live beside trainer.py in trainer_utils.py (set_seed, TrainOutput),
trainer_callback.py (TrainerState, TrainerControl), trainer_pt_utils.py (LabelSmoother,
LengthGroupedSampler) and accelerate (SeedableRandomSampler, skip_first_batches,
convert_outputs_to_fp32).
"""

import contextlib
import functools
import gc
import inspect
import itertools
import logging
import math
import random
import time
import warnings
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np
import torch
from torch.utils.data import DataLoader

from nanosft import distributed

IGNORE_INDEX = -100
PREFIX_CHECKPOINT_DIR = "checkpoint"  # output_dir/checkpoint-<global_step> (nanosft.io writes them)
logger = logging.getLogger(__name__)


def set_seed(seed: int) -> None:
    """Seed python, numpy and torch. Mirrors: transformers set_seed"""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class TrainOutput(NamedTuple):
    """What train() returns (2.3 ends with it). Mirrors: transformers trainer_utils.TrainOutput"""

    global_step: int
    training_loss: float
    metrics: dict


class PredictionOutput(NamedTuple):
    """What predict() returns. Mirrors: transformers trainer_utils.PredictionOutput"""

    predictions: np.ndarray | tuple
    label_ids: np.ndarray | tuple | None
    metrics: dict | None


class EvalLoopOutput(NamedTuple):
    """What evaluation_loop() returns. Mirrors: transformers trainer_utils.EvalLoopOutput
    Differs: also the number of batches (speed_metrics' steps)."""

    predictions: np.ndarray | tuple | None
    label_ids: np.ndarray | tuple | None
    metrics: dict | None
    num_samples: int | None
    num_batches: int = 0


class IntervalStrategy:
    """The values of logging_strategy / eval_strategy / save_strategy ("best" is save's alone).
    Mirrors: transformers trainer_utils.IntervalStrategy (a str enum; these are its strings)"""

    NO = "no"
    STEPS = "steps"
    EPOCH = "epoch"


def compare_trainer_and_checkpoint_args(training_args, trainer_state) -> None:
    """Warn, naming each one, about the logging / eval / save steps and the batch size that
    differ between this run's args and a checkpoint's trainer_state.json being resumed.
    Mirrors: transformers trainer_utils.compare_trainer_and_checkpoint_args"""
    differs = []
    for name in ("logging_steps", "eval_steps", "save_steps"):
        arg_value, state_value = getattr(training_args, name, None), getattr(trainer_state, name)
        if arg_value is not None and state_value is not None and arg_value != state_value:
            differs.append(f"{name}: {arg_value} (from args) != {state_value} "
                           "(from trainer_state.json)")
    batch, saved = training_args.per_device_train_batch_size, trainer_state.train_batch_size
    if saved is not None and batch != saved:
        differs.append(f"per_device_train_batch_size: {batch} (from args) != {saved} "
                       "(from trainer_state.json)")
    if differs:
        logger.warning("Warning: The following arguments do not match the ones in the "
                       "`trainer_state.json` within the checkpoint directory: \n\t"
                       + "\n\t".join(differs))


def with_last(iterable):
    """(item, is_last) for each item, reading one ahead: a stream's last batch is known without
    its length. Mirrors: accelerate GradientState.end_of_dataloader"""
    iterator = iter(iterable)
    try:
        item = next(iterator)
    except StopIteration:
        return
    for following in iterator:
        yield item, False
        item = following
    yield item, True


def has_length(dataset) -> bool:
    """Whether len(dataset) works (an IterableDataset streams: it has none).
    Mirrors: transformers trainer_utils.has_length"""
    try:
        return len(dataset) is not None
    except (TypeError, NotImplementedError):
        return False


def label_smoothing_unsupported(model) -> bool:
    """True, with transformers' warning, for a multi-label classifier: label smoothing would
    smooth its 0/1 targets. Mirrors: Trainer.__init__ (label_smoother)"""
    config = getattr(model, "config", None)
    if getattr(config, "problem_type", None) != "multi_label_classification":
        return False
    warnings.warn("Label smoothing is not compatible with multi-label classification. Disabling "
                  "label smoothing for this training run.", UserWarning, stacklevel=3)
    return True


def convert_outputs_to_fp32(outputs):
    """Half-precision logits (autocast) back to fp32, so the loss and metrics are fp32.
    Guide: mixed precision | Mirrors: accelerate convert_outputs_to_fp32 (on the logits)"""
    logits = getattr(outputs, "logits", None)
    if logits is not None and logits.dtype in (torch.float16, torch.bfloat16):
        outputs.logits = logits.float()
    return outputs


def get_length_grouped_indices(lengths, batch_size, mega_batch_mult=None, generator=None) -> list:
    """A random order whose runs of `batch_size` indices hold similar lengths: randperm, cut into
    megabatches of mega_batch_mult x batch_size (default min(N // (4 x batch_size), 50), at least
    1), each sorted longest first; the longest example of all goes first (an OOM shows at once).
    Mirrors: transformers get_length_grouped_indices"""
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
    Mirrors: accelerate SeedableRandomSampler, BatchSampler, BatchSamplerShard;
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
    if not has_length(dataloader):  # a stream: read past the batches already trained on
        return _SkippedStream(dataloader, num_batches)
    remaining = list(dataloader.batch_sampler)[num_batches:]
    return DataLoader(dataloader.dataset, batch_sampler=remaining, collate_fn=dataloader.collate_fn,
                      num_workers=dataloader.num_workers, generator=torch.Generator())


class _SkippedStream:
    """A dataloader without a length, less its first `num_batches` batches."""

    def __init__(self, dataloader, num_batches):
        self.dataloader = dataloader
        self.num_batches = num_batches

    def __iter__(self):
        return itertools.islice(iter(self.dataloader), self.num_batches, None)


class RemoveColumnsCollator:
    """data_collator over features without the keys the model's forward cannot take; the keys
    dropped are logged once (logger.info). Mirrors: transformers RemoveColumnsCollator

    Args:
        data_collator: what collates the kept features.
        signature_columns: the keys kept.
        logger, model_name, description: where and how the dropped keys are reported."""

    def __init__(self, data_collator, signature_columns, logger=None, model_name=None,
                 description=None):
        self.data_collator = data_collator
        self.signature_columns = signature_columns
        self.logger = logger
        self.model_name = model_name
        self.description = description
        self.message_logged = False

    def _remove_columns(self, feature):
        if not isinstance(feature, Mapping):
            return feature
        if not self.message_logged and self.logger and self.model_name:
            ignored = sorted(set(feature) - set(self.signature_columns))
            if ignored:
                where = "" if self.description is None else f"in the {self.description} set "
                self.logger.info(f"The following columns {where}don't have a corresponding "
                                 f"argument in `{self.model_name}.forward` and have been ignored: "
                                 f"{', '.join(ignored)}.")
                self.message_logged = True
        return {k: v for k, v in feature.items() if k in self.signature_columns}

    def __call__(self, features):
        return self.data_collator([self._remove_columns(f) for f in features])


def label_smoothed_loss(logits, labels, epsilon, num_items_in_batch=None, shift_labels=True):
    """(1-eps) * NLL + eps * mean over the vocabulary of -log p, over the supervised tokens.
    What 2.5's `self.label_smoother(outputs, labels, ...)` computes.
    Mirrors: transformers LabelSmoother.__call__"""
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
    Mirrors: Trainer._get_train_sampler + LengthGroupedSampler (lengths)"""
    if length_column_name and length_column_name in (getattr(dataset, "column_names", None) or ()):
        return list(dataset[length_column_name])
    if len(dataset) and not (isinstance(dataset[0], Mapping) and "input_ids" in dataset[0]):
        raise ValueError(
            "train_sampling_strategy='group_by_length' needs each example's length: give every "
            "example an 'input_ids' list, or pass a datasets.Dataset with a column of lengths "
            "(named by length_column_name, read when remove_unused_columns=False).")
    return [len(example["input_ids"]) for example in dataset]


def loader_kwargs(args) -> dict:
    """The DataLoader arguments TrainingArguments' dataloader_* fields give: workers, pinned
    memory (only where batches go to CUDA), persistent workers and prefetch (with workers).
    Mirrors: Trainer._get_dataloader (dataloader_params)"""
    kwargs = {"num_workers": args.dataloader_num_workers,
              "pin_memory": args.dataloader_pin_memory and args.device.type == "cuda"}
    if args.dataloader_num_workers > 0:
        kwargs["persistent_workers"] = args.dataloader_persistent_workers
        kwargs["prefetch_factor"] = args.dataloader_prefetch_factor
    return kwargs


class _StreamShard(torch.utils.data.IterableDataset):  # what DataLoader takes for a stream
    """This data shard's rows of a stream every rank reads (distributed.shard_stream)."""

    def __init__(self, dataset, batch_size, num_replicas, rank, drop_last):
        self.dataset = dataset
        self.shard = (batch_size, num_replicas, rank, drop_last)

    def __iter__(self):
        return distributed.shard_stream(iter(self.dataset), *self.shard)


def build_dataloader(dataset, batch_size, args, collate_fn, shuffle, drop_last) -> DataLoader:
    """A DataLoader over this rank's share of the seeded order. shuffle=True (training): the order
    args.train_sampling_strategy names - random (randperm(seed + epoch)), sequential, or
    group_by_length over windows of train_batch_size x gradient_accumulation_steps; shuffle=False
    (eval): dataset order, or group_by_length over eval batches, as transformers' eval sampler.
    Mirrors: Trainer._get_dataloader, _get_train_sampler, _get_eval_sampler +
    accelerate prepare_data_loader"""
    # the ranks reading different rows: all, or parallelism_config's data-parallel ones
    num_replicas, rank, _ = distributed.data_parallel(args)
    if not has_length(dataset):  # streamed: read in order, never whole (no sampler, no length)
        if num_replicas > 1:  # every rank reads the stream, keeps its data shard's rows
            dataset = _StreamShard(dataset, batch_size, num_replicas, rank, drop_last)
        loader = DataLoader(dataset, batch_size=batch_size, collate_fn=collate_fn,
                            drop_last=drop_last, **loader_kwargs(args))
        loader.total_batch_size = batch_size * num_replicas
        return loader
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
                                   drop_last=drop_last, rank=rank,
                                   num_replicas=num_replicas, lengths=lengths,
                                   group_size=group_size)
    # No generator, as transformers' loaders have none: each iter() draws one int64 from the
    # global RNG (torch's base seed), so the dropout masks after it are peft's under TRL. A run
    # resumed mid-epoch iterates skip_first_batches' loader, which draws nothing: it starts from
    # the restored RNG, as transformers, which restores it after its iter().
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=collate_fn,
                        **loader_kwargs(args))
    loader.total_batch_size = batch_size * num_replicas  # accelerate's attribute
    return loader


def count_num_items_in_batch(batch_samples: list, shift_labels=True) -> torch.Tensor:
    """Supervised tokens of a window: sum of (labels[..., 1:] != -100) when the model shifts
    (a causal LM: position 0 is never a target), else of (labels != -100).
    Guide: gradient accumulation | Mirrors: Trainer._get_num_items_in_batch"""
    return sum((b["shift_labels"] if "shift_labels" in b else
                b["labels"][..., 1:] if shift_labels else b["labels"])
               .ne(IGNORE_INDEX).sum() for b in batch_samples)


def loss_shifts_labels(model) -> bool:
    """Whether the model's loss shifts its labels (a causal LM), so position 0 is never counted.
    Mirrors: Trainer.__init__ _loss_shifts_labels (loss_type ForCausalLM)"""
    from nanosft.model import CausalLM

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return isinstance(base, CausalLM) or getattr(base, "loss_type", None) == "ForCausalLM"


def find_batch_size(inputs):
    """The first dimension of the first tensor in a batch (dict, list or tuple, searched in order),
    or None. Mirrors: transformers trainer_pt_utils.find_batch_size"""
    if isinstance(inputs, Mapping):
        inputs = list(inputs.values())
    if isinstance(inputs, (list, tuple)):
        for value in inputs:
            size = find_batch_size(value)
            if size is not None:
                return size
        return None
    if torch.is_tensor(inputs) or isinstance(inputs, np.ndarray):
        return inputs.shape[0] if inputs.ndim >= 1 else None
    return None


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


def no_sync(model):
    """DDP's no_sync (skip the gradient all-reduce), FSDP2's, or nothing for one process.
    Guide: distributed training | Mirrors: accelerate Accelerator.no_sync"""
    inner = getattr(model, "_orig_mod", model)  # torch.compile wraps the DDP module
    if isinstance(inner, torch.nn.parallel.DistributedDataParallel):
        return inner.no_sync()
    if hasattr(inner, "set_requires_gradient_sync"):  # FSDP2: no reduce-scatter until the last
        return _fsdp_no_sync(inner)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _fsdp_no_sync(model):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def evaluation_loop(model, dataloader, compute_loss, prepare_inputs, args, on_step=None):
    """(mean loss with each batch weighted by its size, examples, batches) over the data-parallel
    ranks (tensor-parallel ranks read the same batches: counted once); on_step() after each batch
    (the callbacks' on_prediction_step).
    Mirrors: Trainer.evaluation_loop (losses repeated batch-size times, then averaged)"""
    totals = torch.zeros(3, dtype=torch.float64, device=args.device)  # loss x size, examples, batch
    with torch.no_grad():
        for batch in dataloader:
            loss = compute_loss(model, prepare_inputs(batch))
            size = find_batch_size(batch)
            totals += torch.cat([(loss.double() * size)[None], totals.new_tensor([size, 1.0])])
            if on_step is not None:
                on_step()
    loss_sum, examples, batches = distributed.all_reduce_data_parallel(totals, args).tolist()
    return loss_sum / max(examples, 1), examples, batches


def _check_optimizer(model, optimizer) -> None:
    """An optimizer passed in must be one (param_groups, step) and update the model being trained:
    one built before get_peft_model, or over another model, holds none of its trainable parameters
    and would train nothing while the run logs losses and saves an unchanged adapter."""
    if not (hasattr(optimizer, "param_groups") and callable(getattr(optimizer, "step", None))):
        raise TypeError(f"Trainer: optimizers[0] must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}; pass optimizers=(torch.optim.AdamW(...), "
                        "None), or (None, None) for the one args.optim names.")
    trainable = [p for p in model.parameters() if p.requires_grad]
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if trainable and not any(id(p) in held for p in trainable):
        raise ValueError(f"Trainer: the optimizer passed in optimizers holds none of the model's "
                         f"{len(trainable)} trainable parameters (was it built before "
                         "get_peft_model wrapped the model, or over another model?), so training "
                         "would change nothing. Build it over the trainer's model, e.g. "
                         "AdamW(p for p in model.parameters() if p.requires_grad) after the LoRA "
                         "wrap, or pass optimizer_cls_and_kwargs=(AdamW, {...}) and let the "
                         "trainer build it.")


def check_trainer_arguments(model, model_init, optimizers, optimizer_cls_and_kwargs,
                            compute_metrics, args, callbacks=None) -> None:
    """Refuse, by name, the Trainer arguments nanosft does not act on or that contradict.
    Mirrors: Trainer.__init__'s checks (optimizers vs optimizer_cls_and_kwargs, compute_result)
    Differs: also the types transformers leaves to a later failure (callbacks, optimizers)."""
    if model_init is not None:
        raise ValueError("Trainer: model_init is not supported; it serves hyperparameter search "
                         "(Trainer.hyperparameter_search), which nanosft leaves out. Build the "
                         "model and pass it as model=.")
    if model is None:
        raise ValueError("Trainer: model is required (nanosft has no model_init).")
    if optimizer_cls_and_kwargs is not None and optimizers[0] is not None:
        raise RuntimeError("Passing both `optimizers` and `optimizer_cls_and_kwargs` arguments is "
                           "incompatible.")
    if (args is not None and args.batch_eval_metrics and compute_metrics is not None
            and "compute_result" not in inspect.signature(compute_metrics).parameters):
        raise ValueError("batch_eval_metrics=True calls compute_metrics(eval_pred, "
                         "compute_result=...) after every batch (True after the last, when it "
                         "returns the metrics); add a `compute_result` argument to it.")
    if not isinstance(optimizers, (tuple, list)) or len(optimizers) != 2:
        raise TypeError(f"Trainer: optimizers must be a pair (optimizer, lr_scheduler), got "
                        f"{type(optimizers).__name__}; pass optimizers=(optimizer, None) to keep "
                        "the scheduler args.lr_scheduler_type names.")
    if optimizers[0] is not None:
        _check_optimizer(model, optimizers[0])
    if callbacks is not None and not isinstance(callbacks, (list, tuple)):
        raise TypeError(f"Trainer: callbacks must be a list of TrainerCallback classes or "
                        f"instances, got {type(callbacks).__name__}; pass callbacks=[...] (one "
                        "callback goes in a list of one).")
    for callback in callbacks or ():
        if not (isinstance(callback, type) or hasattr(callback, "on_step_end")):
            raise TypeError(f"Trainer: callbacks holds a {type(callback).__name__}, which is not a "
                            "TrainerCallback class or instance; subclass TrainerCallback.")


def checked_metrics(metrics, prefix="eval") -> dict:
    """compute_metrics' result, refused unless it is a dict (None would fail in the key prefixing,
    far from the function that returned it)."""
    if not isinstance(metrics, Mapping):
        raise TypeError(f"compute_metrics returned {type(metrics).__name__}, not a dict of "
                        f"metrics; return e.g. {{'accuracy': 0.9}} (reported as "
                        f"{prefix}_accuracy).")
    return metrics


class EvalPrediction:
    """What compute_metrics receives: predictions, label_ids (numpy, batches concatenated), plus
    inputs / losses when args.include_for_metrics asks; unpacks as a tuple of those it holds.
    Mirrors: transformers trainer_utils.EvalPrediction"""

    def __init__(self, predictions, label_ids, inputs=None, losses=None):
        self.predictions = predictions
        self.label_ids = label_ids
        self.inputs = inputs
        self.losses = losses
        self.elements = (predictions, label_ids) + tuple(x for x in (inputs, losses)
                                                         if x is not None)

    def __iter__(self):
        return iter(self.elements)

    def __getitem__(self, idx):
        if not 0 <= idx < len(self.elements):
            raise IndexError("tuple index out of range")
        return self.elements[idx]


def denumpify_detensorize(metrics):
    """numpy scalars and 0-d tensors -> Python numbers (JSON-ready), through lists and dicts.
    Mirrors: transformers trainer_utils.denumpify_detensorize"""
    if isinstance(metrics, dict):
        return {key: denumpify_detensorize(value) for key, value in metrics.items()}
    if isinstance(metrics, (list, tuple)):
        return type(metrics)(map(denumpify_detensorize, metrics))
    one_number = isinstance(metrics, np.generic) or (torch.is_tensor(metrics)
                                                     and metrics.numel() == 1)
    return metrics.item() if one_number else metrics


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


def find_executable_batch_size(function=None, starting_batch_size: int = 128,
                               auto_find_batch_size: bool = True):
    """`function` wrapped so that it runs with batch_size=starting_batch_size and, on
    out-of-memory, again with int(0.9 x batch_size); a decorator without `function`. With
    auto_find_batch_size=False it runs once, with starting_batch_size.
    Guide: performance | Mirrors: transformers find_executable_batch_size (auto_find_batch_size),
    accelerate find_executable_batch_size"""
    if function is None:
        return functools.partial(find_executable_batch_size,
                                 starting_batch_size=starting_batch_size,
                                 auto_find_batch_size=auto_find_batch_size)
    if not auto_find_batch_size:
        return functools.partial(function, batch_size=starting_batch_size)

    @functools.wraps(function)
    def decorator(*args, **kwargs):
        batch_size = starting_batch_size
        _free_device_memory()
        while True:
            if batch_size == 0:
                raise RuntimeError("No executable batch size found, reached zero. Even a batch of "
                                   "one row ran out of memory: lower max_length, set "
                                   "gradient_checkpointing=True, or train a quantized (QLoRA) "
                                   "model.")
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as error:  # noqa: BLE001 (re-raised unless it is out-of-memory)
                if not should_reduce_batch_size(error):
                    raise
            _free_device_memory()
            batch_size = int(batch_size * 0.9)

    return decorator


def autocast_context(args):
    """bf16 / fp16 autocast (CPU or CUDA) as args say, else nothing.
    Guide: mixed precision | Mirrors: accelerate Accelerator.autocast"""
    if not (args.bf16 or args.fp16):
        return contextlib.nullcontext()
    return torch.autocast(args.device.type, dtype=torch.bfloat16 if args.bf16 else torch.float16)


# ----------------------------------------------------------------------------- memory metrics
def cpu_peak_reset():
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS; False where /proc refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def cpu_memory():
    """(RSS, peak RSS since the last reset) of this process in bytes, from /proc/self/status.
    Mirrors: psutil Process.memory_info().rss (transformers' cpu_mem_used)"""
    values = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    values[line.split(":")[0]] = int(line.split()[1]) * 1024
    except OSError:
        import psutil

        rss = psutil.Process().memory_info().rss
        return rss, rss
    return values["VmRSS"], values["VmHWM"]


class MemoryTracker:
    """Memory deltas per stage (init, train, eval) under transformers' metric names.
    Mirrors: transformers TrainerMemoryTracker (start, stop, update_metrics)
    Differs: the CPU peak is the kernel's VmHWM (reset per stage), not RSS polled by a thread."""

    def __init__(self, skip_memory_metrics=False):
        self.skip_memory_metrics = skip_memory_metrics
        self.cur_stage, self.cpu, self.gpu, self.init_reported = None, {}, {}, False
        self.cuda = torch.cuda.is_available()

    def start(self, stage):
        """Begin measuring `stage`; a stage inside another (eval inside train) is ignored."""
        if self.skip_memory_metrics or (self.cur_stage is not None and self.cur_stage != stage):
            return
        self.cur_stage = stage
        gc.collect()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.empty_cache()
            self.gpu_begin = torch.cuda.memory_allocated()
        cpu_peak_reset()
        self.cpu_begin = cpu_memory()[0]

    def stop(self, stage):
        """End `stage`: alloc = end - begin, peaked = max(0, peak - end), as in transformers."""
        if self.skip_memory_metrics or self.cur_stage != stage:
            return
        _, peak = cpu_memory()  # read before gc.collect can lower anything
        gc.collect()
        now = cpu_memory()[0]
        self.cpu[stage] = {"begin": self.cpu_begin, "end": now, "alloc": now - self.cpu_begin,
                           "peaked": max(0, peak - now)}
        if self.cuda:
            torch.cuda.empty_cache()
            now, peak = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
            self.gpu[stage] = {"begin": self.gpu_begin, "end": now, "alloc": now - self.gpu_begin,
                               "peaked": max(0, peak - now)}
        self.cur_stage = None

    def update_metrics(self, stage, metrics):
        """Add `{stage}_mem_cpu_alloc_delta`, `..._peaked_delta` (+ `_gpu_`); init's go first."""
        if self.skip_memory_metrics:
            return
        stages = [stage]
        if not self.init_reported and "init" in self.cpu:
            stages.insert(0, "init")
            self.init_reported = True
            metrics["before_init_mem_cpu"] = self.cpu["init"]["begin"]
            if self.cuda:
                metrics["before_init_mem_gpu"] = self.gpu["init"]["begin"]
        for s in stages:
            for kind in ("alloc", "peaked"):
                if s in self.cpu:
                    metrics[f"{s}_mem_cpu_{kind}_delta"] = self.cpu[s][kind]
                if self.cuda and s in self.gpu:
                    metrics[f"{s}_mem_gpu_{kind}_delta"] = self.gpu[s][kind]

    def stop_and_update_metrics(self, stage, metrics=None):
        """stop(stage), then update_metrics(stage, metrics) when a dict is given."""
        self.stop(stage)
        if metrics is not None:
            self.update_metrics(stage, metrics)

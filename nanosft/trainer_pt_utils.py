"""transformers' trainer_pt_utils under its names: samplers (length-grouped, sharded, looping),
the padding concatenation of evaluation outputs (EvalLoopContainer), LabelSmoother and
get_parameter_names.

The walkthrough prints none of it. The Trainer's own training order is trainer_utils'
SeedableBatchSampler (seed + epoch, so a resumed run sees the same order); the samplers here are
transformers' public classes for code that builds its own DataLoader, each the reference's
behaviour. Guide: data collators, evaluation.
"""

import math
import re
from collections.abc import Mapping

import numpy as np
import torch
from torch.utils.data import DistributedSampler, IterableDataset, Sampler

from nanosft.distributed import shard_stream
from nanosft.trainer_utils import IGNORE_INDEX, get_length_grouped_indices, label_smoothed_loss


# ----------------------------------------------------------------------------- padding concat
def torch_pad_and_concatenate(tensor1, tensor2, padding_index=IGNORE_INDEX):
    """Concatenate on dim 0; rows of another width are right-padded with padding_index; 0-d
    tensors become one row each. Mirrors: transformers torch_pad_and_concatenate"""
    tensor1, tensor2 = torch.atleast_1d(tensor1), torch.atleast_1d(tensor2)
    if tensor1.ndim == 1 or tensor1.shape[1:] == tensor2.shape[1:]:
        return torch.cat((tensor1, tensor2), dim=0)
    width = max(tensor1.shape[1], tensor2.shape[1])
    shape = (tensor1.shape[0] + tensor2.shape[0], width) + tensor1.shape[2:]
    result = tensor1.new_full(shape, padding_index)
    result[: tensor1.shape[0], : tensor1.shape[1]] = tensor1
    result[tensor1.shape[0]:, : tensor2.shape[1]] = tensor2
    return result


def numpy_pad_and_concatenate(array1, array2, padding_index=IGNORE_INDEX):
    """torch_pad_and_concatenate for numpy arrays (and Python scalars).
    Mirrors: transformers numpy_pad_and_concatenate"""
    array1, array2 = np.atleast_1d(array1), np.atleast_1d(array2)
    if array1.ndim == 1 or array1.shape[1:] == array2.shape[1:]:
        return np.concatenate((array1, array2), axis=0)
    width = max(array1.shape[1], array2.shape[1])
    shape = (array1.shape[0] + array2.shape[0], width) + array1.shape[2:]
    result = np.full_like(array1, padding_index, shape=shape)
    result[: array1.shape[0], : array1.shape[1]] = array1
    result[array1.shape[0]:, : array2.shape[1]] = array2
    return result


def nested_concat(tensors, new_tensors, padding_index=IGNORE_INDEX):
    """Concatenate two batches of outputs of the same structure (tensors, arrays, or lists /
    tuples / dicts of them), padding rows of another width. Mirrors: transformers nested_concat"""
    if isinstance(tensors, (list, tuple)):
        return type(tensors)(nested_concat(t, n, padding_index)
                             for t, n in zip(tensors, new_tensors))
    if isinstance(tensors, Mapping):
        return type(tensors)({k: nested_concat(t, new_tensors[k], padding_index)
                              for k, t in tensors.items()})
    if torch.is_tensor(tensors):
        return torch_pad_and_concatenate(tensors, new_tensors, padding_index)
    return numpy_pad_and_concatenate(tensors, new_tensors, padding_index)


def nested_numpify(tensors):
    """Tensors (at any depth of lists / tuples / dicts) to numpy arrays on the CPU; bf16 goes
    through fp32 (numpy has no bf16). Mirrors: transformers nested_numpify"""
    if isinstance(tensors, (list, tuple)):
        return type(tensors)(nested_numpify(t) for t in tensors)
    if isinstance(tensors, Mapping):
        return type(tensors)({k: nested_numpify(t) for k, t in tensors.items()})
    if not torch.is_tensor(tensors):
        return tensors
    tensors = tensors.detach().cpu()
    return (tensors.float() if tensors.dtype == torch.bfloat16 else tensors).numpy()


class EvalLoopContainer:
    """Evaluation outputs batch by batch: concatenated (padded) as they come, or kept as a list;
    to_cpu_and_numpy() moves what is held to numpy (eval_accumulation_steps).
    Mirrors: transformers EvalLoopContainer"""

    def __init__(self, do_nested_concat: bool = True, padding_index: int = IGNORE_INDEX):
        self.do_nested_concat = do_nested_concat
        self.padding_index = padding_index
        self.tensors = None
        self.arrays = None

    def add(self, tensors) -> None:
        if self.tensors is None:
            self.tensors = tensors if self.do_nested_concat else [tensors]
        elif self.do_nested_concat:
            self.tensors = nested_concat(self.tensors, tensors, self.padding_index)
        else:
            self.tensors.append(tensors)

    def to_cpu_and_numpy(self) -> None:
        if self.tensors is None:
            return
        new_arrays = nested_numpify(self.tensors)
        if self.arrays is None:
            self.arrays = new_arrays
        elif self.do_nested_concat:
            self.arrays = nested_concat(self.arrays, new_arrays, self.padding_index)
        else:
            self.arrays.extend(new_arrays)
        self.tensors = None

    def get_arrays(self):
        self.to_cpu_and_numpy()
        return self.arrays


# ----------------------------------------------------------------------------- label smoothing
class LabelSmoother:
    """(1 - epsilon) x NLL + epsilon x mean over the vocabulary of -log p, over the tokens whose
    label is not ignore_index. Guide: label smoothing | Mirrors: transformers LabelSmoother

    Args:
        epsilon: the smoothing weight (TrainingArguments.label_smoothing_factor).
        ignore_index: the label of tokens left out (-100)."""

    def __init__(self, epsilon: float = 0.1, ignore_index: int = IGNORE_INDEX):
        self.epsilon = epsilon
        self.ignore_index = ignore_index

    def __call__(self, model_output, labels, shift_labels=False):
        logits = model_output["logits"] if isinstance(model_output, Mapping) else model_output[0]
        if self.ignore_index != IGNORE_INDEX:
            labels = labels.masked_fill(labels.eq(self.ignore_index), IGNORE_INDEX)
        return label_smoothed_loss(logits, labels, self.epsilon, shift_labels=shift_labels)


def get_parameter_names(model, forbidden_layer_types, forbidden_layer_names=None) -> list:
    """Names of the parameters not inside a module of forbidden_layer_types and not matching a
    forbidden_layer_names pattern (searched in the lower-cased name).
    Mirrors: transformers get_parameter_names"""
    patterns = [re.compile(p) for p in forbidden_layer_names or ()]
    result = []
    for name, child in model.named_children():
        child_params = get_parameter_names(child, forbidden_layer_types, forbidden_layer_names)
        result += [f"{name}.{n}" for n in child_params
                   if not isinstance(child, tuple(forbidden_layer_types))
                   and not any(p.search(f"{name}.{n}".lower()) for p in patterns)]
    result += [k for k in model._parameters if not any(p.search(k.lower()) for p in patterns)]
    return result


# ----------------------------------------------------------------------------- samplers
def _lengths_of(dataset, lengths, model_input_name):
    if lengths is not None:
        return list(lengths)
    name = model_input_name or "input_ids"
    if not (isinstance(dataset[0], Mapping) and name in dataset[0]):
        raise ValueError("Can only automatically infer lengths for datasets whose items are "
                         f"dictionaries with an '{name}' key.")
    return [len(feature[name]) for feature in dataset]


class LengthGroupedSampler(Sampler):
    """Indices in a random order whose runs of batch_size hold similar lengths, the longest
    example first. Mirrors: transformers LengthGroupedSampler

    Args:
        batch_size: the size of the groups.
        dataset / lengths: the examples (their model_input_name lengths), or the lengths.
        generator: the torch.Generator of the permutation (None: the global RNG)."""

    def __init__(self, batch_size, dataset=None, lengths=None, model_input_name=None,
                 generator=None):
        if dataset is None and lengths is None:
            raise ValueError("One of dataset and lengths must be provided.")
        self.batch_size = batch_size
        self.lengths = _lengths_of(dataset, lengths, model_input_name)
        self.generator = generator

    def __len__(self):
        return len(self.lengths)

    def __iter__(self):
        return iter(get_length_grouped_indices(self.lengths, self.batch_size,
                                               generator=self.generator))


class DistributedLengthGroupedSampler(DistributedSampler):
    """LengthGroupedSampler's order (seeded by seed + epoch), split over num_replicas ranks.
    Mirrors: transformers DistributedLengthGroupedSampler"""

    def __init__(self, batch_size, dataset=None, num_replicas=None, rank=None, seed=0,
                 drop_last=False, lengths=None, model_input_name=None):
        if dataset is None and lengths is None:
            raise ValueError("One of dataset and lengths must be provided.")
        self.lengths = _lengths_of(dataset, lengths, model_input_name)
        super().__init__(self.lengths, num_replicas=num_replicas, rank=rank, shuffle=True,
                         seed=seed, drop_last=drop_last)
        self.batch_size = batch_size

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        indices = get_length_grouped_indices(self.lengths, self.batch_size, generator=generator)
        if not self.drop_last:  # pad with the first indices to a multiple of num_replicas
            indices += indices[: self.total_size - len(indices)]
        else:
            indices = indices[: self.total_size]
        return iter(indices[self.rank: self.total_size: self.num_replicas])


class DistributedSamplerWithLoop(DistributedSampler):
    """DistributedSampler whose shard is topped up with its first indices to a multiple of
    batch_size. Mirrors: transformers DistributedSamplerWithLoop"""

    def __init__(self, dataset, batch_size, **kwargs):
        super().__init__(dataset, **kwargs)
        self.batch_size = batch_size

    def __iter__(self):
        indices = list(super().__iter__())
        remainder = 0 if len(indices) % self.batch_size == 0 else \
            self.batch_size - len(indices) % self.batch_size
        # DistributedSampler already added one sample to the ranks below len % num_replicas
        start = 1 if self.rank < len(self.dataset) % self.num_replicas else 0
        indices += indices[start: start + remainder]
        return iter(indices)


class ShardSampler(Sampler):
    """Process `process_index`'s batches of dataset order: batch i of the total batch
    (batch_size x num_processes) goes to process i; the last one loops to the start unless
    drop_last. Mirrors: transformers ShardSampler"""

    def __init__(self, dataset, batch_size=1, drop_last=False, num_processes=1, process_index=0):
        self.dataset = dataset
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.num_processes = num_processes
        self.process_index = process_index
        self.total_batch_size = total = batch_size * num_processes
        num_batches = len(dataset) // total if drop_last else math.ceil(len(dataset) / total)
        self.total_num_samples = num_batches * total

    def __iter__(self):
        indices = list(range(len(self.dataset)))
        while len(indices) < self.total_num_samples:  # loop to the start to fill the last batch
            indices += indices[: self.total_num_samples - len(indices)]
        result = []
        for start in range(self.batch_size * self.process_index, self.total_num_samples,
                           self.total_batch_size):
            result += indices[start: start + self.batch_size]
        return iter(result)

    def __len__(self):
        return self.total_num_samples // self.num_processes


class IterableDatasetShard(IterableDataset):
    """ShardSampler for a stream: reads total batches of batch_size x num_processes and yields
    this process's slice of each; the last one is filled from the first unless drop_last.
    Mirrors: transformers IterableDatasetShard"""

    def __init__(self, dataset, batch_size=1, drop_last=False, num_processes=1, process_index=0,
                 seed=0):
        self.dataset = dataset
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.num_processes = num_processes
        self.process_index = process_index
        self.seed = seed
        self.epoch = 0
        self.num_examples = 0

    def set_epoch(self, epoch):
        self.epoch = epoch
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __iter__(self):
        self.num_examples = 0
        generator = getattr(self.dataset, "generator", None)
        if not hasattr(self.dataset, "set_epoch") and isinstance(generator, torch.Generator):
            generator.manual_seed(self.seed + self.epoch)
        yield from shard_stream(self._counted(), self.batch_size, self.num_processes,
                                self.process_index, self.drop_last)

    def _counted(self):
        for element in self.dataset:
            self.num_examples += 1
            yield element

    def __len__(self):
        total = self.batch_size * self.num_processes
        if self.drop_last:
            return (len(self.dataset) // total) * self.batch_size
        return math.ceil(len(self.dataset) / total) * self.batch_size

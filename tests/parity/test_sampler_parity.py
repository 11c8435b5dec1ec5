"""train_sampling_strategy="group_by_length" against transformers and accelerate.

Compared, exactly (index lists): nanosft's get_length_grouped_indices with transformers'
get_length_grouped_indices for the same lengths (many ties), batch size, megabatch multiplier
(default and given) and generator seed; the batches each of 1-3 ranks receives from
SeedableBatchSampler(lengths=...) with accelerate's BatchSamplerShard over
BatchSampler(LengthGroupedSampler); and, through both Trainers, the train order (group of
per_device_train_batch_size x gradient_accumulation_steps), the eval order and the length column
(read only with remove_unused_columns=False, as transformers drops the column first otherwise).
transformers' sampler draws from an unseeded generator, so the test hands both the same seeded one.
Negative controls: the plain random order and a fixed 50x megabatch both differ from the reference.
Hermetic: index arithmetic and a hidden-32 Llama built in-process; no network.
Run: python -m pytest -q tests/parity/test_sampler_parity.py
"""

import random

import datasets
import pytest
import torch
import transformers
from accelerate import data_loader
from torch.utils.data import BatchSampler
from transformers.trainer_pt_utils import LengthGroupedSampler
from transformers.trainer_pt_utils import get_length_grouped_indices as hf_grouped_indices

from nanosft.args import TrainingArguments
from nanosft.model import CausalLM, ModelConfig
from nanosft.trainer import Trainer
from nanosft.trainer_utils import SeedableBatchSampler, get_length_grouped_indices

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def _lengths(n, seed=0, high=9):
    rng = random.Random(seed)
    return [rng.randint(1, high) for _ in range(n)]  # few distinct values: many ties to break


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def test_grouped_indices_equal_transformers():
    cases = 0
    for n in (1, 3, 8, 17, 40, 99, 256):
        for batch_size in (1, 2, 3, 8):
            for mult in (None, 1, 3, 50):
                for seed in (0, 1, 42):
                    lengths = _lengths(n, seed=n + seed)
                    ref = hf_grouped_indices(lengths, batch_size, mult, generator=_gen(seed))
                    ours = get_length_grouped_indices(lengths, batch_size, mult, _gen(seed))
                    assert ours == ref, (n, batch_size, mult, seed)
                    cases += 1
    assert cases == 7 * 4 * 4 * 3


def test_negative_controls_differ_from_the_reference():
    lengths, batch_size, seed = _lengths(200, seed=3, high=60), 4, 7
    ref = hf_grouped_indices(lengths, batch_size, generator=_gen(seed))
    plain = next(iter(SeedableBatchSampler(200, 200, seed=seed)))  # randperm(seed), no grouping
    assert sorted(plain) == sorted(ref) and plain != ref
    # a fixed 50 x batch megabatch (ignoring the 4-megabatch default for small data) also differs
    assert get_length_grouped_indices(lengths, batch_size, 50, _gen(seed)) != ref
    assert get_length_grouped_indices(lengths, batch_size, None, _gen(seed)) == ref


@pytest.mark.parametrize("num_replicas", [1, 2, 3])
@pytest.mark.parametrize("drop_last", [False, True])
def test_rank_shares_equal_accelerate_over_length_grouped_sampler(num_replicas, drop_last):
    for n in (5, 23, 64):
        lengths = _lengths(n, seed=n, high=30)
        for batch_size, accumulation in ((1, 1), (2, 3), (4, 2)):
            group = batch_size * accumulation  # transformers: train_batch_size x accumulation
            for rank in range(num_replicas):
                # a fresh generator per rank: every rank draws the same order (accelerate
                # broadcasts rank 0's generator state)
                hf = LengthGroupedSampler(group, lengths=lengths, generator=_gen(5))
                ref = BatchSampler(hf, batch_size, drop_last)
                if num_replicas > 1:
                    ref = data_loader.BatchSamplerShard(ref, num_replicas, rank)
                ours = SeedableBatchSampler(n, batch_size, seed=5, drop_last=drop_last,
                                            num_replicas=num_replicas, rank=rank,
                                            lengths=lengths, group_size=group)
                assert list(ours) == list(ref), (n, batch_size, accumulation, rank)
                assert len(ours) == len(ref)


def _rows(n, seed=0):
    rng = random.Random(seed)
    return [{"input_ids": [rng.randint(1, 63) for _ in range(rng.randint(2, 40))]}
            for _ in range(n)]


def _flat(batch_sampler):
    return [index for batch in batch_sampler for index in batch]


@pytest.mark.parametrize("remove_unused_columns", [True, False])
def test_trainer_orders_equal_transformers_trainer(tmp_path, remove_unused_columns):
    rows = _rows(90)
    # a length column that disagrees with len(input_ids): only read when the column survives
    for i, row in enumerate(rows):
        row["length"] = (i * 37) % 11
    train, evaluation = datasets.Dataset.from_list(rows), datasets.Dataset.from_list(rows[:30])
    settings = dict(per_device_train_batch_size=2, per_device_eval_batch_size=3,
                    gradient_accumulation_steps=3, train_sampling_strategy="group_by_length",
                    remove_unused_columns=remove_unused_columns, seed=11, use_cpu=True,
                    report_to="none", save_strategy="no")
    hf_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    hf = transformers.Trainer(model=hf_model, train_dataset=train, eval_dataset=evaluation,
                              args=transformers.TrainingArguments(str(tmp_path / "hf"),
                                                                  **settings))
    ours = Trainer(CausalLM(ModelConfig(**TINY)), TrainingArguments(str(tmp_path / "ours"),
                                                                    **settings),
                   train_dataset=train, eval_dataset=evaluation)
    if remove_unused_columns:  # transformers' sampler sees the dataset after column removal
        train = hf._remove_unused_columns(train)
        evaluation = hf._remove_unused_columns(evaluation)
    hf_train = hf._get_train_sampler(train)
    assert isinstance(hf_train, LengthGroupedSampler) and hf_train.batch_size == 6
    hf_train.generator = _gen(11)  # transformers leaves it unseeded; ours is seed + epoch 0
    assert _flat(ours.get_train_dataloader().batch_sampler) == list(hf_train)
    hf_eval = hf._get_eval_sampler(evaluation)  # already seeded by transformers with args.seed
    assert _flat(ours.get_eval_dataloader().batch_sampler) == list(hf_eval)
    uses_column = list(hf_train.lengths) == list(rows[i]["length"] for i in range(90))
    assert uses_column is not remove_unused_columns

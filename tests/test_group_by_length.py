"""train_sampling_strategy="group_by_length" in the Trainer: what training sees, epoch by epoch.

Asserted: over two epochs of Trainer.train, every example reaches training_step exactly once per
epoch, the two epochs' orders differ, the longest example opens each epoch, and the batches waste
under 0.6 x the padding of the default random order on the same data and seed (measured 0.17 vs
0.34; each batch's lengths span under half as much); the first epoch's batches are what a 2-rank
split hands out (rank 0 and 1 take alternate batches, every example once); "sequential" keeps
dataset order; a dataset without input_ids, or an unknown strategy, fails naming the fix. The
exact order is compared with transformers in parity/test_sampler_parity.py.
Hermetic: a tiny nanosft CausalLM (hidden 32) and random token rows made in-process, CPU.
Run: python -m pytest -q tests/test_group_by_length.py
"""

import random

import pytest
from tiny import one_thread, tiny_model  # noqa: F401 (one_thread: an autouse fixture)

from nanosft.args import TrainingArguments
from nanosft.collator import DataCollatorForLanguageModeling
from nanosft.trainer import Trainer
from nanosft.trainer_utils import SeedableBatchSampler, dataset_lengths

BATCH = 4


def _rows(n=48, seed=0):
    rng = random.Random(seed)
    rows = [{"input_ids": [rng.randint(1, 63) for _ in range(rng.randint(2, 40))]}
            for _ in range(n)]
    assert len({tuple(r["input_ids"]) for r in rows}) == n  # each row recognisable in a batch
    return rows


def _trainer(tmp_path, rows, strategy, **overrides):
    args = TrainingArguments(output_dir=str(tmp_path / strategy), train_sampling_strategy=strategy,
                             per_device_train_batch_size=BATCH, num_train_epochs=2,
                             save_strategy="no", logging_steps=100, disable_tqdm=True,
                             use_cpu=True, seed=3, **overrides)
    return Trainer(tiny_model(), args, train_dataset=rows,
                   data_collator=DataCollatorForLanguageModeling(pad_token_id=0))


def _train_and_record(trainer):
    """Train; return each micro-batch as the rows (tuples of unpadded ids) training_step got, and
    the padding fraction of all batches."""
    seen, padding, slots, original = [], 0, 0, trainer.training_step

    def training_step(model, inputs, num_items_in_batch=None):
        nonlocal padding, slots
        mask = inputs["attention_mask"]
        padding, slots = padding + int((mask == 0).sum()), slots + mask.numel()
        seen.append([tuple(ids[m.bool()].tolist()) for ids, m in zip(inputs["input_ids"], mask)])
        return original(model, inputs, num_items_in_batch)

    trainer.training_step = training_step
    trainer.train()
    return seen, padding / slots


def test_group_by_length_visits_every_example_once_per_epoch_with_less_padding(tmp_path):
    rows = _rows()
    everyone = sorted(tuple(r["input_ids"]) for r in rows)
    grouped, grouped_padding = _train_and_record(_trainer(tmp_path, rows, "group_by_length"))
    plain, plain_padding = _train_and_record(_trainer(tmp_path, rows, "random"))
    per_epoch = len(rows) // BATCH
    assert len(grouped) == len(plain) == 2 * per_epoch
    epochs = [grouped[:per_epoch], grouped[per_epoch:]]
    for epoch in epochs:
        assert sorted(row for batch in epoch for row in batch) == everyone
    assert epochs[0] != epochs[1]  # a new order each epoch (seed + epoch)
    assert grouped_padding < 0.6 * plain_padding, (grouped_padding, plain_padding)

    def spread(batches):  # mean over batches of longest - shortest
        return sum(max(map(len, b)) - min(map(len, b)) for b in batches) / len(batches)

    assert spread(grouped) < spread(plain) / 2
    # longest first: the first batch of each epoch holds the epoch's longest example
    longest = max(len(r["input_ids"]) for r in rows)
    assert all(max(map(len, epoch[0])) == longest for epoch in epochs)

    # two ranks split the same grouped order the DDP way: alternate batches, every example once
    lengths = dataset_lengths(rows)
    shares = [list(SeedableBatchSampler(len(rows), BATCH, seed=3, num_replicas=2, rank=rank,
                                        lengths=lengths, group_size=BATCH)) for rank in (0, 1)]
    for sampler_share in shares:
        for batch in sampler_share:
            assert len(batch) == BATCH
    interleaved = [b for pair in zip(*shares) for b in pair]
    assert [[tuple(rows[i]["input_ids"]) for i in b] for b in interleaved] == epochs[0]


def test_sequential_keeps_dataset_order(tmp_path):
    rows = _rows(12)
    order = list(_trainer(tmp_path, rows, "sequential").get_train_dataloader().batch_sampler)
    assert order == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


def test_bad_inputs_name_the_fix(tmp_path):
    trainer = _trainer(tmp_path, [{"text": "no ids yet"}] * 4, "group_by_length")
    with pytest.raises(ValueError, match="needs each example's length.*'input_ids'"):
        trainer.get_train_dataloader()
    with pytest.raises(ValueError, match="train_sampling_strategy.*group_by_length"):
        TrainingArguments(train_sampling_strategy="group_by_lenght")

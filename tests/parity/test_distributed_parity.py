"""Data order and DDP sharding against accelerate: nanosft's shard_batches / SeedableBatchSampler vs
accelerate's BatchSamplerShard (even_batches=True, split_batches=False) and
SeedableRandomSampler, the pieces transformers' Trainer gets from
accelerator.prepare(dataloader).

Compared: for every dataset size 1..29, batch size 1..4, 2 or 3 ranks, drop_last on and off, the
exact index lists each rank receives; and the seeded epoch order for epochs 0..2. Hermetic: index
arithmetic only, no network.
Run: python -m pytest -q tests/parity/test_distributed_parity.py
"""

import pytest
from accelerate import data_loader
from torch.utils.data import BatchSampler, SequentialSampler

from nanosft.distributed import shard_batches
from nanosft.trainer_utils import SeedableBatchSampler


@pytest.mark.parametrize("num_replicas", [2, 3])
@pytest.mark.parametrize("drop_last", [False, True])
def test_shard_batches_matches_batch_sampler_shard(num_replicas, drop_last):
    for n in range(1, 30):
        for batch_size in range(1, 5):
            sampler = BatchSampler(SequentialSampler(range(n)), batch_size, drop_last)
            for rank in range(num_replicas):
                ref = list(data_loader.BatchSamplerShard(sampler, num_replicas, rank))
                ours = shard_batches(list(sampler), num_replicas, rank, batch_size, drop_last)
                assert ours == ref, (n, batch_size, rank)


def test_seeded_order_matches_seedable_random_sampler():
    ref = data_loader.SeedableRandomSampler(range(11), data_seed=42)
    ours = SeedableBatchSampler(11, batch_size=11, seed=42)
    for epoch in range(3):
        ref.set_epoch(epoch)
        ours.set_epoch(epoch)
        assert next(iter(ours)) == list(ref)
    assert (
        len(SeedableBatchSampler(11, 4, seed=0, num_replicas=2, rank=1)) == 2
    )  # ceil(ceil(11/4) / 2)

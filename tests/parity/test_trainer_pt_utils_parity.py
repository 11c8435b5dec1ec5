"""nanosft.trainer_pt_utils and the new trainer_callback / trainer_utils pieces against
transformers': the same inputs through both, outputs compared exactly (samplers' index lists,
padded concatenations, label-smoothed losses, early stopping's counter, TrainerState JSON).

Hermetic: in-process lists and tensors, CPU, a second. transformers is the reference (a parity test
that skips fails the run). Run: python -m pytest -q tests/parity/test_trainer_pt_utils_parity.py
"""

import json

import numpy as np
import pytest
import torch

from nanosft import trainer_pt_utils as ours
from nanosft.trainer_callback import EarlyStoppingCallback, TrainerControl, TrainerState

tpu = pytest.importorskip("transformers.trainer_pt_utils")
tcb = pytest.importorskip("transformers.trainer_callback")


@pytest.mark.parametrize("n, batch, drop_last, processes", [(10, 2, False, 2), (23, 4, True, 3),
                                                           (23, 4, False, 3), (64, 4, True, 2)])
def test_shard_samplers_equal_transformers(n, batch, drop_last, processes):
    data = list(range(n))
    for i in range(processes):
        kw = dict(batch_size=batch, drop_last=drop_last, num_processes=processes, process_index=i)
        assert list(ours.ShardSampler(data, **kw)) == list(tpu.ShardSampler(data, **kw))
        assert list(ours.IterableDatasetShard(data, **kw)) == \
            list(tpu.IterableDatasetShard(data, **kw))
        assert len(ours.IterableDatasetShard(data, **kw)) == \
            len(tpu.IterableDatasetShard(data, **kw))


@pytest.mark.parametrize("length", [23, 64, 123])
def test_distributed_samplers_equal_transformers(length):
    data = list(range(length))
    lengths = torch.randint(0, 25, (length,), generator=torch.Generator().manual_seed(length))
    for rank in range(2):
        a = ours.DistributedSamplerWithLoop(data, 16, num_replicas=2, rank=rank)
        b = tpu.DistributedSamplerWithLoop(data, 16, num_replicas=2, rank=rank)
        assert list(a) == list(b)
        a = ours.DistributedLengthGroupedSampler(4, num_replicas=2, rank=rank,
                                                 lengths=lengths.tolist())
        b = tpu.DistributedLengthGroupedSampler(4, num_replicas=2, rank=rank,
                                                lengths=lengths.tolist())
        assert list(a) == list(b)


def test_length_grouped_sampler_equals_transformers():
    lengths = torch.randint(0, 50, (100,), generator=torch.Generator().manual_seed(0)).tolist()
    a = ours.LengthGroupedSampler(4, lengths=lengths, generator=torch.Generator().manual_seed(1))
    b = tpu.LengthGroupedSampler(4, lengths=lengths, generator=torch.Generator().manual_seed(1))
    assert list(a) == list(b)


def test_pad_and_concatenate_and_container_equal_transformers():
    batches = [(torch.ones(2, 3), {"loss": torch.tensor(1.0)}),
               (torch.full((1, 5), 2.0), {"loss": torch.tensor(2.0)})]
    a, b = ours.EvalLoopContainer(), tpu.EvalLoopContainer()
    for batch in batches:
        a.add(batch)
        b.add(batch)
    (x, dx), (y, dy) = a.get_arrays(), b.get_arrays()
    np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(dx["loss"], dy["loss"])
    torch.testing.assert_close(ours.torch_pad_and_concatenate(torch.ones(2, 3), torch.ones(1, 4)),
                               tpu.torch_pad_and_concatenate(torch.ones(2, 3), torch.ones(1, 4)))
    np.testing.assert_array_equal(ours.numpy_pad_and_concatenate(1.0, 2.0),
                                  tpu.numpy_pad_and_concatenate(1.0, 2.0))


@pytest.mark.parametrize("shift", [False, True])
def test_label_smoother_equals_transformers(shift):
    logits = torch.randn(3, 6, 11, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 11, (3, 6), generator=torch.Generator().manual_seed(1))
    labels[0, 2] = labels[2, 4] = -100
    torch.testing.assert_close(ours.LabelSmoother(0.1)({"logits": logits}, labels, shift),
                               tpu.LabelSmoother(0.1)({"logits": logits}, labels, shift),
                               rtol=1e-6, atol=1e-6)


def test_get_parameter_names_equals_transformers():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3),
                                torch.nn.ModuleList([torch.nn.Linear(3, 2)]))
    for types, names in (([torch.nn.LayerNorm], None), ([], ["bias"])):
        assert ours.get_parameter_names(model, types, names) == \
            tpu.get_parameter_names(model, types, names)


def test_early_stopping_and_state_equal_transformers(tmp_path):
    class Args:
        greater_is_better = False

    values = [0.9, 0.85, 0.86, 0.7, 0.71, 0.72]
    a = EarlyStoppingCallback(early_stopping_patience=2, early_stopping_threshold=0.02)
    b = tcb.EarlyStoppingCallback(early_stopping_patience=2, early_stopping_threshold=0.02)
    state_a, state_b = TrainerState(), tcb.TrainerState()
    for value in values:
        a.check_metric_value(Args(), state_a, TrainerControl(), value)
        b.check_metric_value(Args(), state_b, tcb.TrainerControl(), value)
        assert a.early_stopping_patience_counter == b.early_stopping_patience_counter
        if state_a.best_metric is None or value < state_a.best_metric:
            state_a.best_metric = state_b.best_metric = value
    assert a.state() == b.state()
    assert TrainerControl(should_save=True).state() == tcb.TrainerControl(should_save=True).state()
    theirs = tcb.TrainerState(global_step=3, best_metric=0.5,
                              stateful_callbacks=[b, tcb.TrainerControl()])
    theirs.save_to_json(str(tmp_path / "state.json"))
    loaded = TrainerState.load_from_json(str(tmp_path / "state.json"))
    assert loaded.stateful_callbacks == json.loads((tmp_path / "state.json").read_text())[
        "stateful_callbacks"]
    assert (loaded.global_step, loaded.best_metric) == (3, 0.5)

"""The generic Trainer: loss extraction, batch size, token counting, reporters stepping aside.

Compared against what transformers does, written out here: a dict output without "loss" is refused
with transformers' message naming the output and input keys; find_batch_size reads the first
tensor's first dimension through nested containers; num_items_in_batch counts labels[..., 1:] for
a causal LM and every label otherwise; a causal LM fed inputs_embeds (no input_ids) trains while
ThroughputCallback says once that it steps aside. (The losses against transformers.Trainer itself:
tests/parity/test_generic_trainer_parity.py.) Hermetic: tiny in-process models, temp folders.
Run: python -m pytest -q tests/test_generic_trainer.py
"""

import pytest
import torch
from tiny import one_thread, tiny_model  # noqa: F401 (one_thread: an autouse fixture)
from torch import nn

from nanosft.args import TrainingArguments
from nanosft.trainer import Trainer
from nanosft.trainer_utils import count_num_items_in_batch, find_batch_size, loss_shifts_labels

ARGS = {"per_device_train_batch_size": 2, "num_train_epochs": 1, "logging_steps": 1,
        "report_to": "none", "disable_tqdm": True, "save_strategy": "no", "use_cpu": True}


class NoLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, x, labels=None):
        return {"prediction": x * self.w}


def test_dict_output_without_loss_is_refused_naming_the_keys(tmp_path):
    rows = [{"x": torch.tensor(1.0), "labels": torch.tensor(2.0)}] * 4
    trainer = Trainer(NoLoss(), TrainingArguments(str(tmp_path), **ARGS), train_dataset=rows)
    with pytest.raises(ValueError, match="did not return a loss from the inputs, only the "
                                         "following keys: prediction.*received are x,labels"):
        trainer.train()


def test_find_batch_size_reads_the_first_tensor():
    assert find_batch_size({"meta": "text", "pair": (torch.zeros(3, 2), torch.zeros(5))}) == 3
    assert find_batch_size({"scalar": torch.tensor(1.0)}) is None
    assert find_batch_size([{"a": None}, {"b": torch.zeros(7)}]) == 7


def test_num_items_in_batch_shifts_only_for_a_causal_lm():
    labels = torch.tensor([[-100, 5, 6], [7, -100, -100]])
    assert count_num_items_in_batch([{"labels": labels}]) == 2  # labels[..., 1:]
    assert count_num_items_in_batch([{"labels": labels}], shift_labels=False) == 3
    assert loss_shifts_labels(tiny_model()) and not loss_shifts_labels(NoLoss())


def test_causal_lm_on_inputs_embeds_trains_and_throughput_steps_aside_once(tmp_path, capsys):
    model = tiny_model()
    g = torch.Generator().manual_seed(0)
    rows = [{"inputs_embeds": torch.randn(5, 32, generator=g),
             "labels": torch.randint(0, 64, (5,), generator=g)} for _ in range(6)]
    args = TrainingArguments(str(tmp_path), **{**ARGS, "report_to": "nanosft"})  # throughput on
    trainer = Trainer(model, args, train_dataset=rows)
    before = model.lm_head.weight.detach().clone()
    trainer.train()
    assert not torch.equal(model.lm_head.weight, before)
    out = capsys.readouterr().out
    assert out.count("ThroughputCallback steps aside: its batches have no input_ids "
                     "(keys: inputs_embeds, labels)") == 1
    assert all("train_tokens_per_second" not in h for h in trainer.state.log_history)


class ListLabels(nn.Module):
    """Takes **kwargs (so the Trainer would count num_items_in_batch) but its labels are a list."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, x, labels=None, **kwargs):
        assert "num_items_in_batch" not in kwargs  # nothing was counted, so nothing is passed
        return (((x * self.w - torch.tensor(labels)) ** 2).mean(),)


def test_labels_that_cannot_be_counted_train_with_a_warning(tmp_path):
    rows = [{"x": float(i), "labels": 2.0 * i} for i in range(4)]

    def collate(features):
        return {"x": torch.tensor([f["x"] for f in features]),
                "labels": [f["labels"] for f in features]}

    trainer = Trainer(ListLabels(), TrainingArguments(str(tmp_path), **ARGS), train_dataset=rows,
                      data_collator=collate)
    with pytest.warns(UserWarning, match="labels are not a tensor, so num_items_in_batch"):
        trainer.train()
    assert trainer.state.global_step == 2

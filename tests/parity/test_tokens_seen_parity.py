"""num_input_tokens_seen of nanosft Trainer against transformers Trainer on the same run.

include_num_input_tokens_seen="all" counts every input_ids element of each micro-batch (padding
too), "non_padding" the attention_mask ones; transformers adds the count to state and to every
log. Compared: each training log's num_input_tokens_seen and state.num_input_tokens_seen, exactly
(integer counts), on padded micro-batches of varied lengths, batch 2 x GA 3, one epoch. Negative
control: the two modes give different numbers on these padded batches (so a mode that is ignored
shows). Hermetic: CPU, fp32, models built in-process.
Run: python -m pytest -q tests/parity/test_tokens_seen_parity.py
"""

import datasets
import pytest
import transformers
from test_trainer_parity import COMMON, make_models, make_rows
from tiny import one_thread  # noqa: F401 (an autouse fixture)

from nanosft.args import TrainingArguments
from nanosft.collator import DataCollatorForLanguageModeling
from nanosft.trainer import Trainer


def seen(trainer):
    return [h["num_input_tokens_seen"] for h in trainer.state.log_history if "loss" in h]


@pytest.fixture(scope="module")
def counts(tmp_path_factory):
    out = tmp_path_factory.mktemp("seen")
    rows = make_rows()
    collator = DataCollatorForLanguageModeling(pad_token_id=0)
    result = {}
    for which in ("all", "non_padding"):
        ref_model, our_model = make_models()
        common = {**COMMON, "num_train_epochs": 1, "logging_steps": 1,
                  "include_num_input_tokens_seen": which}
        ref = transformers.Trainer(
            model=ref_model,
            args=transformers.TrainingArguments(str(out / f"ref-{which}"), **common),
            train_dataset=datasets.Dataset.from_list(rows), data_collator=collator)
        ours = Trainer(our_model, TrainingArguments(str(out / f"ours-{which}"), **common),
                       train_dataset=rows, data_collator=collator)
        ref.train()
        ours.train()
        result[which] = (ref, ours)
    return result


@pytest.mark.parametrize("which", ["all", "non_padding"])
def test_num_input_tokens_seen_equals_transformers(counts, which):
    ref, ours = counts[which]
    assert len(seen(ref)) >= 2 and seen(ref)[-1] > 0
    assert seen(ours) == seen(ref)
    assert ours.state.num_input_tokens_seen == ref.state.num_input_tokens_seen


def test_the_modes_differ_on_padded_batches(counts):
    assert counts["all"][1].state.num_input_tokens_seen > \
        counts["non_padding"][1].state.num_input_tokens_seen

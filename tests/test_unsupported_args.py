"""The fields of transformers 5.23 TrainingArguments / TRL 1.16 SFTConfig that nanosft lacks are
refused by name with a reason (nanosft.args.*_NOT_SUPPORTED), never ignored.

Compared: the tables against dataclasses.fields of the installed transformers / trl classes (so a
field a new release adds, or one nanosft gains, fails here until the table follows), and each
entry's reference default against the library's. Then one refusal's message, the reference
default accepted, from_dict giving the same reason, and a field neither library has still a
TypeError. Hermetic: no model, no network.
Run: python -m pytest -q tests/test_unsupported_args.py
"""

import dataclasses

import pytest
import torch

from nanosft.args import (SFT_CONFIG_NOT_SUPPORTED, TRAINING_ARGS_NOT_SUPPORTED, SFTConfig,
                          TrainingArguments)
from nanosft.trainer import Trainer


def _names(cls):
    return {f.name for f in dataclasses.fields(cls)}


def _defaults(cls):
    return {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
            for f in dataclasses.fields(cls)}


def test_training_args_table_is_exactly_what_transformers_has_and_nanosft_lacks():
    transformers = pytest.importorskip("transformers")
    missing = _names(transformers.TrainingArguments) - _names(TrainingArguments)
    assert set(TRAINING_ARGS_NOT_SUPPORTED) == missing
    reference = _defaults(transformers.TrainingArguments)
    assert {k: v[0] for k, v in TRAINING_ARGS_NOT_SUPPORTED.items()} == {
        k: reference[k] for k in missing}


def test_sft_config_table_is_exactly_what_trl_has_and_nanosft_lacks():
    trl = pytest.importorskip("trl")
    table = {**TRAINING_ARGS_NOT_SUPPORTED, **SFT_CONFIG_NOT_SUPPORTED}
    missing = _names(trl.SFTConfig) - _names(SFTConfig)
    assert set(table) == missing
    reference = _defaults(trl.SFTConfig)
    assert {k: v[0] for k, v in table.items()} == {k: reference[k] for k in missing}


def test_every_reason_is_one_short_line():
    for name, (_, reason) in {**TRAINING_ARGS_NOT_SUPPORTED, **SFT_CONFIG_NOT_SUPPORTED}.items():
        assert reason and "\n" not in reason and len(reason) < 100, name


def test_refused_field_is_named_with_its_reason(tmp_path):
    with pytest.raises(ValueError) as error:
        SFTConfig(str(tmp_path), use_liger_kernel=True)
    assert str(error.value) == ("SFTConfig(use_liger_kernel=True): not supported by nanosft: "
                                + TRAINING_ARGS_NOT_SUPPORTED["use_liger_kernel"][1])
    with pytest.raises(ValueError, match=r"SFTConfig\(dataset_num_proc=4\).*one process"):
        SFTConfig.from_dict({"output_dir": str(tmp_path), "dataset_num_proc": 4})


def test_reference_default_is_accepted_and_changes_nothing(tmp_path):
    plain = SFTConfig(str(tmp_path))
    given = SFTConfig(str(tmp_path), push_to_hub=False, dataloader_pin_memory=True,
                      trust_remote_code=False, log_level="passive")
    assert given.to_dict() == plain.to_dict()
    assert given.push_to_hub is False  # present, as scripts read it (TRL's sft.py)


def test_push_to_hub_is_present_and_asking_to_push_says_it_needs_the_network(tmp_path):
    args = SFTConfig(str(tmp_path), hub_model_id="me/tiny", hub_token="hf_secret")
    assert (args.push_to_hub, args.hub_model_id, args.hub_strategy) == (False, "me/tiny",
                                                                          "every_save")
    assert "hf_secret" not in args.to_json_string()  # as transformers: <HUB_TOKEN>
    assert args.to_dict()["hub_token"] == "<HUB_TOKEN>"
    for cls in (TrainingArguments, SFTConfig):
        with pytest.raises(ValueError, match=r"push_to_hub=True.*needs the network.*does not "
                                             r"push"):
            cls(str(tmp_path), push_to_hub=True)


def test_field_no_reference_has_stays_a_type_error(tmp_path):
    with pytest.raises(TypeError, match="unexpected keyword argument 'dataset_num_proc'"):
        TrainingArguments(str(tmp_path), dataset_num_proc=4)  # an SFTConfig field only
    with pytest.raises(TypeError, match="unexpected keyword argument 'learnig_rate'"):
        SFTConfig(str(tmp_path), learnig_rate=1e-4)


def test_trainer_push_to_hub_says_it_needs_the_network(tmp_path):
    trainer = Trainer(torch.nn.Linear(2, 2), args=TrainingArguments(str(tmp_path), use_cpu=True))
    with pytest.raises(RuntimeError, match="needs the network"):
        trainer.push_to_hub(commit_message="done")

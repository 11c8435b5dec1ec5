"""Behaviour of nanosft.args: validation errors, derived values, torchrun properties, JSON round
trip.

Compared: each bad value raises ValueError naming the field and the value; derived fields follow
the rules written out here (eval_steps <- logging_steps, warmup ratio -> ceil(total * ratio),
the gradient_checkpointing alias); world_size / ranks / device come from the torchrun
environment variables. Hermetic: no reference library, no network; env vars are set with
monkeypatch.
Run: python -m pytest -q tests/test_args.py
"""

import json
import math

import pytest
import torch

from nanosft.args import SFTConfig, TrainingArguments


@pytest.mark.parametrize("kwargs,field", [
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps"),
    ({"gradient_accumulation_steps": 2.5}, "gradient_accumulation_steps"),
    ({"per_device_train_batch_size": 0}, "per_device_train_batch_size"),
    ({"learning_rate": -1e-4}, "learning_rate"),
    ({"weight_decay": -0.1}, "weight_decay"),
    ({"fp16": True, "bf16": True}, "fp16"),
    ({"lr_scheduler_type": "cosin"}, "lr_scheduler_type"),
    ({"optim": "adamw_8bit_bnb"}, "optim"),
    ({"warmup_steps": -1}, "warmup_steps"),
    ({"warmup_steps": 2.5}, "warmup_steps"),
    ({"logging_steps": 0}, "logging_steps"),
    ({"logging_steps": 12.5}, "logging_steps"),
    ({"save_strategy": "sometimes"}, "save_strategy"),
    ({"eval_strategy": "step"}, "eval_strategy"),
    ({"report_to": "wandb"}, "report_to"),
    ({"label_smoothing_factor": 1.0}, "label_smoothing_factor"),
    ({"load_best_model_at_end": True, "eval_strategy": "epoch"}, "load_best_model_at_end"),
    ({"load_best_model_at_end": True, "eval_strategy": "steps", "eval_steps": 3, "save_steps": 10},
     "save_steps"),
    ({"lr_scheduler_type": "reduce_lr_on_plateau"}, "lr_scheduler_type"),
    ({"lr_scheduler_kwargs": [1, 2]}, "lr_scheduler_kwargs"),
])
def test_invalid_value_names_field_and_value(kwargs, field):
    with pytest.raises(ValueError) as err:
        TrainingArguments(**kwargs)
    message = str(err.value)
    assert message.startswith(f"{field}=")
    assert repr(kwargs.get(field, True)) in message or field == "save_steps"


def test_unknown_choice_suggests_closest_name():
    with pytest.raises(ValueError, match="did you mean 'cosine'"):
        TrainingArguments(lr_scheduler_type="cosin")


def test_output_dir_that_is_a_file_is_refused(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("x")
    with pytest.raises(ValueError, match="output_dir=.*existing file"):
        TrainingArguments(output_dir=str(path))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_fp16_without_cuda_is_refused():
    with pytest.raises(ValueError, match="fp16=True.*CUDA"):
        TrainingArguments(fp16=True)
    with pytest.raises(ValueError, match="fp16=True.*CUDA"):
        SFTConfig(fp16=True)  # bf16 None resolves to False first, so the fp16 check is what fires


@pytest.mark.parametrize("kwargs,field", [
    ({"max_length": 0}, "max_length"),
    ({"packing_strategy": "ffd"}, "packing_strategy"),
    ({"truncation_mode": "keep_middle"}, "truncation_mode"),
    ({"loss_type": "focal"}, "loss_type"),
    ({"pad_to_multiple_of": 0}, "pad_to_multiple_of"),
])
def test_sft_config_invalid_values(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}="):
        SFTConfig(**kwargs)


def test_sft_defaults_differ_from_training_arguments_where_trl_says():
    ta, sft = TrainingArguments(), SFTConfig()
    assert (ta.learning_rate, sft.learning_rate) == (5e-5, 2e-5)
    assert (ta.logging_steps, sft.logging_steps) == (500, 10)
    assert (ta.gradient_checkpointing, sft.gradient_checkpointing) == (False, True)
    assert (ta.bf16, sft.bf16) == (False, True)
    assert sft.activation_checkpointing is True  # the alias follows


def test_gradient_checkpointing_alias_both_ways():
    assert TrainingArguments(gradient_checkpointing=True).activation_checkpointing is True
    args = TrainingArguments(
        activation_checkpointing=True, activation_checkpointing_kwargs={"use_reentrant": True}
    )
    assert args.gradient_checkpointing is True and args.gradient_checkpointing_kwargs == {
        "use_reentrant": True
    }
    # The new name wins when both are given.
    assert (
        TrainingArguments(
            gradient_checkpointing=True, activation_checkpointing=False
        ).gradient_checkpointing
        is False
    )


def test_eval_steps_defaults_to_logging_steps_and_best_metric_is_loss():
    args = TrainingArguments(
        eval_strategy="steps", logging_steps=20, save_steps=40, load_best_model_at_end=True
    )
    assert args.eval_steps == 20
    assert args.metric_for_best_model == "loss" and args.greater_is_better is False
    assert TrainingArguments(metric_for_best_model="accuracy").greater_is_better is True


@pytest.mark.parametrize("warmup,total", [(0.1, 25), (0.5, 7), (0.0, 10), (3, 100), (0.999, 3)])
def test_warmup_below_one_is_a_ratio(warmup, total):
    expected = int(warmup) if warmup >= 1 else math.ceil(total * warmup)
    assert TrainingArguments(warmup_steps=warmup).get_warmup_steps(total) == expected


def test_json_string_dict_fields_are_parsed():
    args = TrainingArguments(lr_scheduler_type="cosine", lr_scheduler_kwargs='{"num_cycles": 2}')
    assert args.lr_scheduler_kwargs == {"num_cycles": 2}


def test_torchrun_environment_sets_ranks_and_batch_sizes(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    args = TrainingArguments(
        per_device_train_batch_size=2, per_device_eval_batch_size=5, use_cpu=True
    )
    assert (args.world_size, args.process_index, args.local_process_index) == (4, 3, 1)
    assert args.should_save is False
    assert (args.train_batch_size, args.eval_batch_size) == (2, 5)
    assert args.device == torch.device("cpu")


def test_single_process_defaults(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    args = TrainingArguments()
    assert (args.world_size, args.process_index, args.local_process_index, args.should_save) == (
        1,
        0,
        0,
        True,
    )
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert args.device.type == expected
    assert TrainingArguments(use_cpu=True).device == torch.device("cpu")


def test_to_dict_from_dict_round_trip():
    args = SFTConfig(output_dir="out", learning_rate=1e-4, lr_scheduler_type="cosine",
                     lr_scheduler_kwargs={"num_cycles": 1}, packing=True, max_length=64)
    data = json.loads(args.to_json_string())
    again = SFTConfig.from_dict(data)
    assert again == args


def test_from_dict_names_unknown_keys():
    with pytest.raises(ValueError, match=r"'learnig_rate' \(did you mean 'learning_rate'\?\)"):
        SFTConfig.from_dict({"learnig_rate": 1e-4, "packing": True})
    with pytest.raises(ValueError, match="'max_length'"):
        # an SFTConfig field is unknown to TrainingArguments
        TrainingArguments.from_dict({"max_length": 128})


def test_from_json_file_errors_name_file_and_line(tmp_path):
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"learning_rate": 3e-4, "max_steps": 5}))
    args = SFTConfig.from_json_file(str(good))
    assert (args.learning_rate, args.max_steps) == (3e-4, 5)
    bad = tmp_path / "bad.json"
    bad.write_text('{\n  "learning_rate": 3e-4,\n  "max_steps": ,\n}')
    with pytest.raises(ValueError, match=r"bad\.json: line 3"):
        SFTConfig.from_json_file(str(bad))
    wrong = tmp_path / "typo.json"
    wrong.write_text(json.dumps({"num_train_epoch": 1}))
    with pytest.raises(ValueError, match=r"typo\.json has keys .*'num_train_epoch'"):
        SFTConfig.from_json_file(str(wrong))

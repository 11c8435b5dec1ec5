"""Parity of nanosft.args defaults with transformers.TrainingArguments and trl.SFTConfig.

Compared: for every field nanosft shares with the reference class, the value after __post_init__ of
a default-constructed instance (both built with use_cpu=True, report_to="none", so the reference
does not refuse bf16 on a CPU), and get_warmup_steps for step counts and ratios. Enums are compared
by value; report_to is the one documented difference ("none" here, [] there). Hermetic: nothing is
downloaded.
Run: python -m pytest -q tests/parity/test_args_parity.py
"""

import dataclasses
import enum

import pytest
import transformers
import trl

from nanosft.args import SFTConfig, TrainingArguments

# Fields whose value differs on purpose (documented in nanosft/args.py).
DOCUMENTED_DIFFERENCES = {"report_to", "output_dir", "use_cpu"}


def _value(v):
    return v.value if isinstance(v, enum.Enum) else v


def _compare_shared(ours, theirs):
    ours_names = {f.name for f in dataclasses.fields(ours)}
    theirs_names = {f.name for f in dataclasses.fields(theirs)}
    shared = sorted((ours_names & theirs_names) - DOCUMENTED_DIFFERENCES)
    mismatched = {
        n: (getattr(ours, n), _value(getattr(theirs, n)))
        for n in shared
        if getattr(ours, n) != _value(getattr(theirs, n))
    }
    assert mismatched == {}
    return shared, ours_names - theirs_names


def test_training_arguments_defaults_equal_transformers(tmp_path):
    theirs = transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to="none"
    )
    # use_cpu on both sides: it sets dataloader_pin_memory=False in both
    shared, only_ours = _compare_shared(TrainingArguments(output_dir=str(tmp_path), use_cpu=True),
                                        theirs)
    assert len(shared) >= 50  # the comparison really covers the fields nanosft has
    # the field transformers 5 dropped, nanosft's own denominator of the mfu log and its 4-bit
    # dequantize schedule (a speed path)
    assert only_ours == {"overwrite_output_dir", "peak_flops", "nf4_dequantize"}
    assert theirs.report_to == [] and TrainingArguments().report_to == "none"


def test_sft_config_defaults_equal_trl(tmp_path):
    theirs = trl.SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    shared, only_ours = _compare_shared(SFTConfig(output_dir=str(tmp_path), use_cpu=True),
                                        theirs)
    for name in (
        "learning_rate",
        "logging_steps",
        "gradient_checkpointing",
        "bf16",
        "max_length",
        "packing",
        "packing_strategy",
        "padding_free",
        "completion_only_loss",
        "assistant_only_loss",
        "dataset_text_field",
        "eos_token",
        "pad_token",
        "shuffle_dataset",
        "pad_to_multiple_of",
    ):
        assert name in shared, name
    assert only_ours == {"overwrite_output_dir", "peak_flops", "nf4_dequantize"}


def test_sft_config_bf16_follows_fp16_like_trl(tmp_path):
    theirs = trl.SFTConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False)
    assert SFTConfig(output_dir=str(tmp_path), bf16=False).bf16 is theirs.bf16 is False
    assert SFTConfig(output_dir=str(tmp_path)).bf16 is True


@pytest.mark.parametrize("warmup", [0, 3, 7.0, 0.1, 0.25, 0.5, 0.999])
@pytest.mark.parametrize("total", [1, 10, 37])
def test_get_warmup_steps_equals_transformers(warmup, total, tmp_path):
    theirs = transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, warmup_steps=warmup
    )
    ours = TrainingArguments(output_dir=str(tmp_path), warmup_steps=warmup)
    assert ours.get_warmup_steps(total) == theirs.get_warmup_steps(total)


def test_eval_steps_and_best_metric_derivation_equal_transformers(tmp_path):
    kw = {
        "eval_strategy": "steps",
        "logging_steps": 7,
        "save_steps": 14,
        "load_best_model_at_end": True,
    }
    theirs = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, **kw)
    ours = TrainingArguments(output_dir=str(tmp_path), **kw)
    assert (ours.eval_steps, ours.metric_for_best_model, ours.greater_is_better) == (
        theirs.eval_steps,
        theirs.metric_for_best_model,
        theirs.greater_is_better,
    )

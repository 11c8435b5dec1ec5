"""evaluate() with compute_metrics, and SFT's loss_type="dft", against transformers 5.23 / TRL 1.16.

Compared: the metrics dict of `evaluate()` (every key but timings, transformers' model
preparation time, nanosft's extra eval_perplexity, and epoch: None there, 0.0 here before
training; values at atol 1e-5, fp32) for compute_metrics on raw logits with
include_for_metrics=["inputs", "loss"], on preprocess_logits_for_metrics' argmax with
eval_accumulation_steps=2, and with batch_eval_metrics; then SFTTrainer + LoRA against TRL with a
dict of two eval sets (eval_<name>_loss); then loss_type="dft": per-step training losses against
TRL, and one batch's loss on the fused and the reference path (negative control: the same batch's
NLL differs). Eval batches of 4 over 10 rows of varying length: the last batch is short and
predictions are padded with -100 across batches.
Hermetic: the tiny Llama of test_trainer_parity, CPU, no downloads.
Run: python -m pytest -q tests/parity/test_eval_metrics.py
"""

import datasets
import numpy as np
import peft
import pytest
import torch
import transformers
import trl
from test_trainer_parity import (COMMON, assert_logs_close, make_models, make_rows, train_logs,
                                 wordlevel_tokenizers)
from tiny import one_thread  # noqa: F401 (an autouse fixture)

from nanosft.args import SFTConfig, TrainingArguments
from nanosft.collator import DataCollatorForLanguageModeling
from nanosft.peft import LoraConfig
from nanosft.reference import reference_mode
from nanosft.sft import SFTTrainer
from nanosft.trainer import Trainer

EVAL = {**COMMON, "per_device_eval_batch_size": 4}
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}
NOT_COMPARED = ("_runtime", "_per_second", "_model_preparation_time", "_perplexity")


def comparable(metrics):
    # before any training transformers' state.epoch is None (no "epoch" in the logs), nanosft's 0.0
    return {k: v for k, v in metrics.items() if not k.endswith(NOT_COMPARED) and k != "epoch"}


def assert_metrics_equal(ours, ref):
    ours, ref = comparable(ours), comparable(ref)
    assert sorted(ours) == sorted(ref)
    for key in ref:
        torch.testing.assert_close(ours[key], ref[key], rtol=0, atol=1e-5, msg=key)


def logits_metrics(pred):
    """Statistics of raw logits (N, T, V), -100-padded labels and inputs, and per-example losses."""
    logits, labels = pred.predictions, pred.label_ids
    mask = labels != -100
    return {"logit_mean": logits[mask].mean(), "width": np.float64(logits.shape[1]),
            "input_sum": float(pred.inputs[pred.inputs != -100].sum()),
            "loss_mean": float(np.mean(pred.losses))}


def argmax_accuracy(pred):
    """Next-token accuracy from argmax ids (preprocess_logits_for_metrics ran per batch)."""
    hits = (pred.predictions[:, :-1] == pred.label_ids[:, 1:]) & (pred.label_ids[:, 1:] != -100)
    return {"accuracy": hits.sum() / (pred.label_ids[:, 1:] != -100).sum()}


def argmax(logits, labels):
    return logits.argmax(-1)


class RunningAccuracy:
    """batch_eval_metrics: sums over batches, the result when compute_result is True."""

    def __init__(self):
        self.hits = self.total = 0

    def __call__(self, pred, compute_result):
        preds, labels = pred.predictions, pred.label_ids
        mask = labels[:, 1:] != -100
        self.hits += int(((preds[:, :-1].argmax(-1) == labels[:, 1:]) & mask).sum())
        self.total += int(mask.sum())
        if compute_result:
            return {"accuracy": self.hits / self.total}
        return {}


CASES = {
    "logits_inputs_loss": ({"compute_metrics": logits_metrics},
                           {"include_for_metrics": ["inputs", "loss"]}),
    "preprocess_accumulate": ({"compute_metrics": argmax_accuracy,
                               "preprocess_logits_for_metrics": argmax},
                              {"eval_accumulation_steps": 2}),
    "batch_eval_metrics": ({"compute_metrics": "running"}, {"batch_eval_metrics": True}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_trainer_evaluate_metrics_match_transformers(tmp_path, case):
    trainer_kwargs, arg_kwargs = CASES[case]
    rows, eval_rows = make_rows(), make_rows(10, seed=5)
    ref_model, our_model = make_models()
    collator = DataCollatorForLanguageModeling(pad_token_id=0)

    def kwargs():
        k = dict(trainer_kwargs)
        if k["compute_metrics"] == "running":
            k["compute_metrics"] = RunningAccuracy()
        return k

    ref = transformers.Trainer(
        model=ref_model,
        args=transformers.TrainingArguments(str(tmp_path / "ref"), **EVAL, **arg_kwargs),
        train_dataset=datasets.Dataset.from_list(rows),
        eval_dataset=datasets.Dataset.from_list(eval_rows), data_collator=collator, **kwargs())
    ours = Trainer(our_model, TrainingArguments(str(tmp_path / "ours"), **EVAL, **arg_kwargs),
                   train_dataset=rows, eval_dataset=eval_rows, data_collator=collator,
                   **kwargs())
    ref_metrics, our_metrics = ref.evaluate(), ours.evaluate()
    assert_metrics_equal(our_metrics, ref_metrics)
    assert len(comparable(our_metrics)) >= 2  # the loss and at least one computed metric


def _sft_pair(tmp_path, eval_dataset=None, **overrides):
    rows = make_rows()
    ref_model, our_model = make_models()
    ref_tok, our_tok = wordlevel_tokenizers()
    sft = {**EVAL, "gradient_checkpointing": False, "max_length": None, **overrides}
    ref_eval = None if eval_dataset is None else {
        name: datasets.Dataset.from_list(d) for name, d in eval_dataset.items()}
    ref = trl.SFTTrainer(model=ref_model, args=trl.SFTConfig(str(tmp_path / "ref"), **sft),
                         train_dataset=datasets.Dataset.from_list(rows), eval_dataset=ref_eval,
                         processing_class=ref_tok, peft_config=peft.LoraConfig(**LORA),
                         compute_metrics=argmax_accuracy if eval_dataset else None,
                         preprocess_logits_for_metrics=argmax if eval_dataset else None)
    ours = SFTTrainer(our_model, SFTConfig(str(tmp_path / "ours"), **sft), train_dataset=rows,
                      eval_dataset=eval_dataset, processing_class=our_tok,
                      peft_config=LoraConfig(**LORA),
                      compute_metrics=argmax_accuracy if eval_dataset else None,
                      preprocess_logits_for_metrics=argmax if eval_dataset else None)
    ref_params = dict(ref.model.named_parameters())
    with torch.no_grad():
        for name, param in ours.model.named_parameters():
            if param.requires_grad:
                param.copy_(ref_params[name])
    return ours, ref


def test_sft_evaluate_dict_of_sets_with_metrics_matches_trl(tmp_path):
    sets = {"short": make_rows(6, seed=5), "long": make_rows(9, seed=6)}
    with pytest.warns(FutureWarning):  # TRL: return_outputs / compute_metrics is deprecated
        ours, ref = _sft_pair(tmp_path, eval_dataset=sets)
        ref_metrics = ref.evaluate()
    our_metrics = ours.evaluate()
    assert {"eval_short_loss", "eval_long_loss", "eval_short_accuracy"} <= set(our_metrics)
    assert_metrics_equal(our_metrics, ref_metrics)


def test_dft_training_losses_match_trl(tmp_path):
    ours, ref = _sft_pair(tmp_path, loss_type="dft")
    assert_logs_close(train_logs(ours), train_logs(ref),
                      ("loss", "grad_norm", "entropy", "mean_token_accuracy"))


def test_dft_batch_loss_fused_and_reference_equal_trl(tmp_path):
    ours, ref = _sft_pair(tmp_path, loss_type="dft")
    batch = DataCollatorForLanguageModeling(pad_token_id=0)(make_rows(4, seed=7))
    ours.model.train()
    ref.model.train()
    expected = ref.compute_loss(ref.model, dict(batch)).item()
    with reference_mode(False):
        fused = ours.compute_loss(ours.model, dict(batch)).item()
    with reference_mode(True):  # Trainer.compute_loss's full logits, then dft_loss
        reference = ours.compute_loss(ours.model, dict(batch)).item()
    ours.args.loss_type = "nll"  # negative control: the plain NLL of the same batch differs
    plain = ours.compute_loss(ours.model, dict(batch)).item()
    assert fused == pytest.approx(expected, abs=1e-5)
    assert reference == pytest.approx(expected, abs=1e-5)
    assert abs(plain - expected) > 1e-3

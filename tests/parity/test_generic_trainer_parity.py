"""The generic Trainer against transformers.Trainer: any nn.Module whose forward returns a loss.

Compared, on the same model weights, data, seed and arguments (adamw_torch, linear warmup, weight
decay, clipping, batch 4 x GA 2, shuffled epochs ending on a short window): every logged step's
loss, grad_norm and learning_rate, the final parameters, eval_loss (and eval_accuracy through
compute_metrics), all fp32 at 1e-5 or tighter. Models: a regression y = a x + b with two bare
parameters, no nn.Linear and no input_ids, returning a tuple or a dict; a bag-of-embeddings text
classifier over input_ids / attention_mask batched by DataCollatorWithPadding, with and without
label smoothing (transformers' LabelSmoother, unshifted labels). Also: a run stopped at a
checkpoint and resumed ends with the per-step losses and parameters of the uninterrupted run;
save_model writes model.safetensors with transformers' keys; the reporting callbacks that need a
causal LM say once that they step aside. Hermetic: CPU, in-process models and a WordLevel
tokenizer, temp folders.
Run: python -m pytest -q tests/parity/test_generic_trainer_parity.py
"""

import types

import pytest
import torch
import transformers
from safetensors.torch import load_file
from tiny import one_thread  # noqa: F401 (an autouse fixture)
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import WordLevel
from torch import nn

from nanosft.args import TrainingArguments
from nanosft.collator import DataCollatorWithPadding
from nanosft.trainer import Trainer

COMMON = {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
          "num_train_epochs": 3, "learning_rate": 0.05, "warmup_steps": 2, "weight_decay": 0.01,
          "max_grad_norm": 1.0, "logging_steps": 1, "optim": "adamw_torch", "seed": 7,
          "use_cpu": True, "report_to": "none", "disable_tqdm": True, "save_strategy": "no"}
TOL = {"rtol": 0, "atol": 1e-5}
VOCAB = 32


class RegressionModel(nn.Module):
    """y = a * input_x + b, MSE against labels: two scalars, no nn.Linear, no input_ids."""

    def __init__(self, a=0.5, b=-0.5, return_dict=False):
        super().__init__()
        self.a = nn.Parameter(torch.tensor(a))
        self.b = nn.Parameter(torch.tensor(b))
        self.return_dict = return_dict

    def forward(self, input_x, labels=None):
        y = input_x * self.a + self.b
        if labels is None:
            return {"logits": y} if self.return_dict else (y,)
        loss = nn.functional.mse_loss(y, labels)
        return {"loss": loss, "logits": y} if self.return_dict else (loss, y)


class BagClassifier(nn.Module):
    """Mean of the real tokens' embeddings -> a linear head over 2 classes."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.embed = nn.Embedding(VOCAB, 16)
        self.head = nn.Linear(16, 2)
        # transformers' Trainer reads config.problem_type when label smoothing is on
        self.config = types.SimpleNamespace(problem_type=None)

    def forward(self, input_ids, attention_mask=None, labels=None):
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        h = (self.embed(input_ids) * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        logits = self.head(h)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits, labels)
        return out


class SummedLossClassifier(BagClassifier):
    """Takes **kwargs, so both Trainers pass num_items_in_batch: the loss is a sum over the
    accumulation window's labels, counted unshifted (a classifier's first label is a target)."""

    def forward(self, input_ids, attention_mask=None, labels=None, **kwargs):
        out = super().forward(input_ids, attention_mask)
        if labels is not None:
            loss = nn.functional.cross_entropy(out["logits"], labels, reduction="sum")
            out["loss"] = loss / kwargs.get("num_items_in_batch", len(labels))
        return out


def regression_rows(n=22, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    y = 2.0 * x + 3.0 + 0.1 * torch.randn(n, generator=g)
    return [{"input_x": x[i], "labels": y[i]} for i in range(n)]


def classifier_rows(n=26, seed=2):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(3, 9, (1,), generator=g))
        ids = torch.randint(1, VOCAB, (length,), generator=g).tolist()
        rows.append({"input_ids": ids, "label": int(sum(i < VOCAB // 2 for i in ids) * 2 > length)})
    return rows


def wordlevel_tokenizer():
    vocab = {"<pad>": 0, **{f"t{i}": i for i in range(1, VOCAB)}}
    backend = BackendTokenizer(WordLevel(vocab, unk_token="<pad>"))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>")


def accuracy(eval_pred):
    predictions, labels = eval_pred
    return {"accuracy": float((predictions.argmax(-1) == labels).mean())}


def run_pair(tmp_path, make_model, rows, eval_rows, our_collator=None, ref_collator=None,
             compute_metrics=None, our_report_to="none", **overrides):
    """Train and evaluate the same model with both Trainers; return (ours, ref). our_report_to:
    nanosft's reporting callbacks ("nanosft": throughput and the ledger, which step aside)."""
    args = {**COMMON, **overrides}
    ref = transformers.Trainer(model=make_model(),
                               args=transformers.TrainingArguments(str(tmp_path / "ref"), **args),
                               train_dataset=rows, eval_dataset=eval_rows,
                               data_collator=ref_collator, compute_metrics=compute_metrics)
    our_args = TrainingArguments(str(tmp_path / "ours"), **{**args, "report_to": our_report_to})
    ours = Trainer(make_model(), our_args,
                   train_dataset=rows, eval_dataset=eval_rows, data_collator=our_collator,
                   compute_metrics=compute_metrics)
    for trainer in (ref, ours):
        trainer.train()
        trainer.final_eval = trainer.evaluate()
    return ours, ref


def step_logs(trainer):
    return [h for h in trainer.state.log_history if "loss" in h]


def assert_same_run(ours, ref, min_steps):
    our_logs, ref_logs = step_logs(ours), step_logs(ref)
    assert len(our_logs) == len(ref_logs) >= min_steps
    for a, b in zip(our_logs, ref_logs):
        assert a["step"] == b["step"]
        for key in ("loss", "grad_norm", "learning_rate"):
            torch.testing.assert_close(a[key], b[key], **TOL, msg=f"step {a['step']} {key}")
    ref_params = dict(ref.model.named_parameters())
    for name, p in ours.model.named_parameters():
        torch.testing.assert_close(p, ref_params[name], **TOL, msg=name)
    torch.testing.assert_close(ours.final_eval["eval_loss"], ref.final_eval["eval_loss"], **TOL)


@pytest.mark.parametrize("return_dict", [False, True], ids=["tuple", "dict"])
def test_regression_model_trains_as_transformers(tmp_path, capsys, return_dict):
    ours, ref = run_pair(tmp_path, lambda: RegressionModel(return_dict=return_dict),
                         regression_rows(), regression_rows(8, seed=5), our_report_to="nanosft")
    assert_same_run(ours, ref, min_steps=9)  # 22 rows / 4 -> 6 micro-batches: 3 steps an epoch
    assert ours.state.global_step == ref.state.global_step == 9
    assert ours.state.total_flos == ref.state.total_flos == 0  # no floating_point_ops to count
    # evaluate() reports what transformers' does (no perplexity: not a language model's loss)
    assert set(ours.final_eval) <= set(ref.final_eval)
    out = capsys.readouterr().out
    # the causal-LM reporters step aside, each saying so once
    assert out.count("ThroughputCallback steps aside: RegressionModel is not a causal LM") == 1
    assert out.count("memory ledger steps aside") == 1


CLASSIFIERS = {"mean_loss": (BagClassifier, 0.0), "label_smoothing": (BagClassifier, 0.1),
               "num_items_in_batch": (SummedLossClassifier, 0.0)}


@pytest.mark.parametrize("case", CLASSIFIERS)
def test_text_classifier_with_padding_collator_trains_as_transformers(tmp_path, case):
    make_model, label_smoothing_factor = CLASSIFIERS[case]
    ours, ref = run_pair(tmp_path, make_model, classifier_rows(), classifier_rows(10, seed=9),
                         our_collator=DataCollatorWithPadding(pad_token_id=0),
                         ref_collator=transformers.DataCollatorWithPadding(wordlevel_tokenizer()),
                         compute_metrics=accuracy, label_smoothing_factor=label_smoothing_factor)
    assert_same_run(ours, ref, min_steps=12)
    assert ours.final_eval["eval_accuracy"] == ref.final_eval["eval_accuracy"]


def test_checkpoint_and_resume_equal_the_uninterrupted_run(tmp_path):
    rows, eval_rows = regression_rows(), regression_rows(8, seed=5)
    saving = {"save_strategy": "steps", "save_steps": 4}
    ours, ref = run_pair(tmp_path, RegressionModel, rows, eval_rows, **saving)
    assert_same_run(ours, ref, min_steps=9)
    # a new process-worth of objects: a fresh model, resumed from step 4 of the first run
    resumed = Trainer(RegressionModel(a=9.0, b=9.0),
                      TrainingArguments(str(tmp_path / "ours"), **{**COMMON, **saving}),
                      train_dataset=rows, eval_dataset=eval_rows)
    resumed.train(resume_from_checkpoint=str(tmp_path / "ours" / "checkpoint-4"))
    uninterrupted = {h["step"]: h for h in step_logs(ours)}
    # log_history: steps 1-4 restored from the checkpoint's trainer_state.json, 5-9 trained now
    later = step_logs(resumed)
    assert [h["step"] for h in later] == list(range(1, 10))
    for h in later:
        torch.testing.assert_close(h["loss"], uninterrupted[h["step"]]["loss"], rtol=0, atol=0)
    for name, p in resumed.model.named_parameters():
        torch.testing.assert_close(p, dict(ours.model.named_parameters())[name], rtol=0, atol=0)
    torch.testing.assert_close(resumed.evaluate()["eval_loss"], ours.final_eval["eval_loss"],
                               rtol=0, atol=0)
    # the final save of a plain module: its state dict as model.safetensors, transformers' keys
    ours.save_model(str(tmp_path / "ours_final"))
    ref.save_model(str(tmp_path / "ref_final"))
    ours_file = load_file(tmp_path / "ours_final" / "model.safetensors")
    ref_file = load_file(tmp_path / "ref_final" / "model.safetensors")
    assert sorted(ours_file) == sorted(ref_file) == ["a", "b"]
    for key in ref_file:
        torch.testing.assert_close(ours_file[key], ref_file[key], **TOL)

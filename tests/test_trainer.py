"""Trainer loop invariants: derived counts, num_items_in_batch, the sync rule, nan filter (without
a host read per micro-batch), GradScaler skips, gradient accumulation == one big batch, and a
resumed run bitwise equal to an uninterrupted one.

Hermetic: a tiny nanosft CausalLM (hidden 32, vocab 64, 2 layers) and random token rows made in-
process, CPU, one thread, fixed seeds; expected values come from transformers Trainer's
formulas, written out here.
Run: python -m pytest -q tests/test_trainer.py
"""

import json
import math
import os
import shutil
import sys
import types

import pytest
import torch
from tiny import TINY_LLAMA, one_thread, tiny_model  # noqa: F401 (one_thread: an autouse fixture)

from nanosft import trainer as trainer_module
from nanosft.args import TrainingArguments
from nanosft.collator import DataCollatorForLanguageModeling
from nanosft.monitoring.callbacks import NonFiniteTrainingError
from nanosft.trainer import Trainer
from nanosft.trainer_callback import TrainerState

VOCAB = TINY_LLAMA["vocab_size"]


def rows(n, seed=1, min_len=4, max_len=12):
    """Random ids, the first third a prompt (label -100): supervised counts differ per row."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(min_len, max_len, (1,), generator=g))
        ids = torch.randint(1, VOCAB, (length,), generator=g).tolist()
        out.append(
            {
                "input_ids": ids,
                "labels": [t if j >= length // 3 else -100 for j, t in enumerate(ids)],
            }
        )
    return out


def make_trainer(tmp_path, n_rows=10, model=None, **overrides):
    kwargs = {
        "output_dir": str(tmp_path),
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 3,
        "num_train_epochs": 1,
        "learning_rate": 1e-3,
        "logging_steps": 1,
        "save_strategy": "no",
        "use_cpu": True,
        "optim": "adamw_torch",
        "disable_tqdm": True,
        "seed": 3,
        "report_to": "nanosft",  # tokens/s, metrics.jsonl (report_to="none" leaves them out)
    }
    kwargs.update(overrides)
    return Trainer(model or tiny_model(), TrainingArguments(**kwargs), train_dataset=rows(n_rows),
                   data_collator=DataCollatorForLanguageModeling(pad_token_id=0))


# (N, batch, GA, epochs, max_steps, drop_last) -> (epochs, update steps/epoch, max_steps, samples,
# total batch, steps_in_epoch)
# Trainer.set_initial_training_values: len = ceil(N/bs) (floor with drop_last); nupe = ceil(len/GA);
# max_steps =
# ceil(epochs*nupe); step-based epochs = ceil(max_steps/nupe), samples = max_steps*total.
CASES = [
    ((10, 2, 2, 3, -1, False), (3, 3, 9, 30, 4, 5)),       # 5 micro-batches, last window has 1
    ((10, 2, 2, 2.5, -1, False), (3, 3, 8, 25, 4, 5)),     # fractional epochs: ceil(2.5 * 3)
    ((10, 2, 2, 3, 7, False), (3, 3, 7, 28, 4, 5)),        # max_steps wins over epochs
    # fewer micro-batches than GA: still one update
    ((10, 3, 4, 1, -1, False), (1, 1, 1, 10, 12, 4)),
    ((10, 3, 1, 2, -1, True), (2, 3, 6, 20, 3, 3)),        # drop_last drops the short 4th batch
    # 4 micro-batches, GA 3 -> 2 updates/epoch
    ((7, 2, 3, 1, 10, False), (5, 2, 10, 60, 6, 4)),
]


@pytest.mark.parametrize("case,expected", CASES)
def test_set_initial_training_values(tmp_path, case, expected):
    n, bs, ga, epochs, max_steps, drop_last = case
    trainer = make_trainer(
        tmp_path,
        n_rows=n,
        per_device_train_batch_size=bs,
        gradient_accumulation_steps=ga,
        num_train_epochs=epochs,
        max_steps=max_steps,
        dataloader_drop_last=drop_last,
    )
    dl = trainer.get_train_dataloader()
    got = trainer.set_initial_training_values(trainer.args, dl)
    (
        num_train_epochs,
        nupe,
        num_examples,
        num_train_samples,
        total_bs,
        steps_in_epoch,
        got_max_steps,
    ) = got
    assert (
        num_train_epochs,
        nupe,
        got_max_steps,
        num_train_samples,
        total_bs,
        steps_in_epoch,
    ) == expected
    assert num_examples == n


def test_data_order_is_randperm_of_seed_plus_epoch(tmp_path):
    trainer = make_trainer(tmp_path, n_rows=9, per_device_train_batch_size=4)
    dl = trainer.get_train_dataloader()
    for epoch in (0, 1):
        dl.batch_sampler.set_epoch(epoch)
        perm = torch.randperm(9, generator=torch.Generator().manual_seed(3 + epoch)).tolist()
        assert list(dl.batch_sampler) == [perm[0:4], perm[4:8], perm[8:9]]


def test_get_batch_samples_counts_shifted_labels(tmp_path):
    trainer = make_trainer(tmp_path)
    a = {"input_ids": torch.ones(2, 5, dtype=torch.long),
         "labels": torch.tensor([[1, 2, -100, 3, 4], [-100, -100, 5, 6, -100]])}
    b = {"input_ids": torch.ones(1, 4, dtype=torch.long), "labels": torch.tensor([[7, -100, 8, 9]])}
    batches, num_items = trainer.get_batch_samples(iter([a, b]), 3, torch.device("cpu"))
    assert len(batches) == 2  # asked for 3, the iterator had 2: stops early
    # shifted: row a0 [2,-100,3,4] -> 3, a1 [-100,5,6,-100] -> 2, b [-100,8,9] -> 2
    assert num_items.dtype == torch.float32 and num_items.dim() == 0 and num_items.item() == 7
    unshifted = sum(int((x["labels"] != -100).sum()) for x in (a, b))
    assert unshifted == 9 != num_items.item()  # negative control: counting position 0 over-counts


def test_sync_steps_and_short_last_window(tmp_path):
    # 10 rows / batch 2 = 5 micro-batches, GA 3 -> windows of 3 and 2; optimizer steps after micro-
    # steps 3 and 5
    trainer = make_trainer(tmp_path, n_rows=10, num_train_epochs=2)
    seen = []
    original = trainer.training_step

    def recording_step(model, inputs, num_items_in_batch=None):
        seen.append(
            (
                trainer.state.global_step,
                trainer.current_gradient_accumulation_steps,
                num_items_in_batch,
            )
        )
        return original(model, inputs, num_items_in_batch)

    trainer.training_step = recording_step
    trainer.train()
    assert [s[1] for s in seen] == [3, 3, 3, 2, 2] * 2
    # global_step moves only at sync steps
    assert [s[0] for s in seen] == [0, 0, 0, 1, 1, 2, 2, 2, 3, 3]
    assert trainer.state.global_step == 4
    assert [h["epoch"] for h in trainer.state.log_history if "loss" in h] == [0.6, 1.0, 1.6, 2.0]
    with open(tmp_path / "metrics.jsonl", encoding="utf-8") as f:
        lines = [json.loads(line) for line in f]
    train_lines = [r for r in lines if "loss" in r]
    assert [r["step"] for r in train_lines] == [1, 2, 3, 4] and all(
        r["train_tokens_per_second"] > 0 for r in train_lines
    )


def test_nan_inf_filter_adds_running_average(tmp_path):
    losses = iter([2.0, float("nan"), 4.0, float("inf")])
    for use_filter in (True, False):
        trainer = make_trainer(tmp_path, n_rows=8, gradient_accumulation_steps=1, logging_steps=2,
                               max_steps=2, logging_nan_inf_filter=use_filter)
        trainer.training_step = lambda model, inputs, n=None: torch.tensor(next(losses))
        trainer.train()
        logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        if use_filter:
            # nan replaced by tr_loss / (1 + steps since last log)
            assert logged == [(2.0 + 2.0 / 2) / 2]
        else:
            assert math.isinf(logged[0])  # negative control: the bad value reaches the log


def test_nonfinite_guard_stops_training(tmp_path):
    trainer = make_trainer(tmp_path, n_rows=20, gradient_accumulation_steps=1, max_steps=10)

    def nan_step(model, inputs, n=None):  # a nan loss backpropagates nan gradients
        for p in model.parameters():
            p.grad = torch.full_like(p, float("nan")) if p.requires_grad else None
        return torch.tensor(float("nan"))

    trainer.training_step = nan_step
    with pytest.raises(NonFiniteTrainingError, match="lower learning_rate"):
        trainer.train()
    assert trainer.state.global_step == 1  # the first nan update stops the run


def test_micro_batch_loop_reads_no_tensor_value_between_logs(tmp_path, monkeypatch):
    # A Python `if` on a loss tensor (or .item()) waits for the device on every micro-batch; the
    # loop and the
    # training step may only read values when they log. Negative control: the nan filter's isfinite,
    # read as a bool.
    reads = []

    def counting(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args):
            caller = sys._getframe(1).f_code
            if caller.co_filename.endswith(os.path.join("nanosft", "trainer.py")):
                reads.append(caller.co_name)
            return original(self, *args)
        return read
    for name in ("__bool__", "item", "tolist", "__float__", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, counting(name))
    make_trainer(tmp_path, n_rows=12, max_steps=2, logging_steps=100).train()
    assert "_inner_training_loop" not in reads and "training_step" not in reads
    assert reads  # the final log and the train_loss do read: the probe sees trainer.py
    # negative control: the old `if not torch.isfinite(tr_loss_step)` in the loop is caught
    def old_filter(loss):
        return not torch.isfinite(loss)

    as_if_in_loop = old_filter.__code__.replace(
        co_filename=trainer_module.__file__, co_name="_inner_training_loop"
    )
    reads.clear()
    assert types.FunctionType(as_if_in_loop, globals())(torch.tensor(1.0)) is False
    assert reads == ["_inner_training_loop"]


def test_gradscaler_inf_grad_skips_optimizer_and_scheduler(tmp_path):
    trainer = make_trainer(
        tmp_path, n_rows=6, gradient_accumulation_steps=1, max_steps=3, warmup_steps=0
    )
    # fp16 autocast needs CUDA in nanosft's args; the scaler path itself runs on CPU
    trainer.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    weight = trainer.model.lm_head.weight
    snapshots, lrs = [], []
    original = trainer.training_step

    def step_with_inf_on_second(model, inputs, n=None):
        snapshots.append(weight.detach().clone())
        lrs.append(trainer.lr_scheduler.last_epoch)
        handle = (
            weight.register_hook(lambda g: g * float("inf"))
            if trainer.state.global_step == 1
            else None
        )
        out = original(model, inputs, n)
        if handle:
            handle.remove()
        return out

    trainer.training_step = step_with_inf_on_second
    trainer.train()
    snapshots.append(weight.detach().clone())
    assert not torch.equal(snapshots[0], snapshots[1])  # step 1 updated
    assert torch.equal(snapshots[1], snapshots[2])  # step 2 (inf grads) skipped the update ...
    assert lrs == [0, 1, 1]  # ... and the scheduler did not step either
    assert not torch.equal(snapshots[2], snapshots[3])  # step 3 updates again
    assert trainer.scaler.get_scale() == 2.0**7  # the skip halved the scale


def _microbatch_grads(trainer, batches):
    model = trainer.model
    model.zero_grad()
    _, num_items = trainer.get_batch_samples(iter(batches), len(batches), torch.device("cpu"))
    trainer.current_gradient_accumulation_steps = len(batches)
    for b in batches:
        trainer.training_step(model, b, num_items)
    return [p.grad.clone() for p in model.parameters()]


def test_accumulated_gradient_equals_one_big_batch(tmp_path):
    trainer = make_trainer(tmp_path)
    collate = DataCollatorForLanguageModeling(pad_token_id=0)
    data = rows(6, seed=5, min_len=3, max_len=14)
    micro = [collate(data[0:1]), collate(data[1:4]), collate(data[4:6])]
    counts = [int((m["labels"][:, 1:] != -100).sum()) for m in micro]
    assert len(set(counts)) == 3  # the micro-batches supervise different numbers of tokens
    accumulated = _microbatch_grads(trainer, micro)
    model = trainer.model
    model.zero_grad()
    model(**collate(data)).loss.backward()  # one batch: mean over all its supervised tokens
    big = [p.grad.clone() for p in model.parameters()]
    for a, b in zip(accumulated, big):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    # negative control: averaging per-micro-batch means (the classic GA bug) gives another gradient
    model.zero_grad()
    for m in micro:
        (model(**m).loss / len(micro)).backward()
    diff = max((p.grad - b).abs().max().item() for p, b in zip(model.parameters(), big))
    assert diff > 1e-4


def _params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_resume_mid_epoch_is_bitwise_equal(tmp_path):
    pytest.importorskip("nanosft.run.checkpoint")
    common = {"n_rows": 14, "num_train_epochs": 2, "save_strategy": "steps", "save_steps": 2,
              "weight_decay": 0.1, "warmup_steps": 1}
    # 14 rows / 2 = 7 micro-batches, GA 3 -> 3 updates per epoch; checkpoint-2 sits mid-epoch 0 (6
    # batches seen)
    full = make_trainer(tmp_path / "full", **common)
    full.train()
    kept = tmp_path / "resumed"
    kept.mkdir()
    shutil.copytree(tmp_path / "full" / "checkpoint-2", kept / "checkpoint-2")
    # other init: all must come from the checkpoint
    resumed = make_trainer(kept, model=tiny_model(seed=123), **common)
    out = resumed.train(resume_from_checkpoint=True)
    assert out.global_step == full.state.global_step == 6
    for key, value in _params(full.model).items():
        assert torch.equal(value, resumed.model.state_dict()[key]), key
    steps = lambda t: [(h["step"], h["loss"], h["grad_norm"], h["learning_rate"])
                       for h in t.state.log_history if "loss" in h]
    assert steps(resumed) == steps(full)
    assert os.path.isfile(kept / "metrics.jsonl")


def test_trainer_state_round_trip():
    state = TrainerState(
        global_step=5, epoch=1.25, log_history=[{"loss": 1.0, "step": 5}], best_metric=0.5
    )
    assert TrainerState.from_dict({**state.to_dict(), "unknown_key": 1}) == state


def test_evaluate_weights_batch_losses_by_size(tmp_path):
    eval_rows = rows(5, seed=9)
    trainer = make_trainer(tmp_path, per_device_eval_batch_size=2)
    metrics = trainer.evaluate(eval_rows)
    collate = DataCollatorForLanguageModeling(pad_token_id=0)
    total = 0.0
    with torch.no_grad():
        # dataset order, batches of 2
        for chunk in (eval_rows[0:2], eval_rows[2:4], eval_rows[4:5]):
            batch = collate(chunk)
            out = trainer.model(**batch)
            total += out.loss.item() * len(chunk)
    assert math.isclose(metrics["eval_loss"], total / 5, rel_tol=1e-6)
    assert math.isclose(metrics["eval_perplexity"], math.exp(total / 5), rel_tol=1e-6)
    # token accuracy is TRL's, reported by SFTTrainer (tests/test_sft.py); not a Trainer metric
    assert "eval_mean_token_accuracy" not in metrics
    assert trainer.state.log_history[-1]["eval_loss"] == metrics["eval_loss"]


def test_load_best_model_at_end_restores_best_checkpoint(tmp_path):
    from safetensors.torch import load_file

    trainer = make_trainer(
        tmp_path,
        n_rows=8,
        gradient_accumulation_steps=1,
        max_steps=4,
        learning_rate=0.05,
        eval_strategy="steps",
        eval_steps=1,
        save_strategy="steps",
        save_steps=1,
        load_best_model_at_end=True,
        save_total_limit=2,
    )
    trainer.eval_dataset = rows(4, seed=8)
    trainer.train()
    eval_losses = {h["step"]: h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h}
    best_step = min(eval_losses, key=eval_losses.get)
    assert trainer.state.best_metric == eval_losses[best_step]
    assert trainer.state.best_model_checkpoint == str(tmp_path / f"checkpoint-{best_step}")
    saved = load_file(os.path.join(trainer.state.best_model_checkpoint, "model.safetensors"))
    for key, value in saved.items():
        assert torch.equal(trainer.model.state_dict()[key], value), key
    kept = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("checkpoint-"))
    assert len(kept) <= 2 and f"checkpoint-{best_step}" in kept  # rotation never deletes the best


def test_bf16_autocast_on_cpu(tmp_path):
    seen = []
    fp32 = make_trainer(tmp_path / "fp32", max_steps=1)
    fp32.train()
    bf16 = make_trainer(tmp_path / "bf16", max_steps=1, bf16=True)
    bf16.model.lm_head.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    bf16.train()
    assert seen and set(seen) == {torch.bfloat16}  # the forward ran under autocast
    # master weights stay fp32
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())
    loss32, loss16 = (t.state.log_history[0]["loss"] for t in (fp32, bf16))
    assert loss16 != loss32 and abs(loss16 - loss32) < 0.05  # bf16 rounding, same training


def test_label_smoothing_formula(tmp_path):
    from nanosft.trainer import label_smoothed_loss

    logits = torch.randn(2, 5, 7)
    labels = torch.tensor([[1, 2, -100, 3, 4], [-100, 5, 6, -100, 0]])
    eps = 0.1
    lp = torch.log_softmax(logits[:, :-1], -1)
    target, mask = labels[:, 1:], labels[:, 1:] != -100
    nll = -(lp.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1) * mask).sum() / mask.sum()
    # cross-entropy against the uniform distribution
    uniform = -(lp.mean(-1) * mask).sum() / mask.sum()
    expected = (1 - eps) * nll + eps * uniform
    torch.testing.assert_close(
        label_smoothed_loss(logits, labels, eps), expected, rtol=0, atol=1e-6
    )
    torch.testing.assert_close(
        label_smoothed_loss(logits, labels, 0.0, num_items_in_batch=torch.tensor(4.0)),
        nll * mask.sum() / 4,
        rtol=0,
        atol=1e-6,
    )


def test_resume_without_data_skip_differs(tmp_path):
    # negative control for the resume test: replaying the epoch from its start is a different run
    common = {"n_rows": 14, "num_train_epochs": 2, "save_strategy": "steps", "save_steps": 2}
    full = make_trainer(tmp_path / "full", **common)
    full.train()
    (tmp_path / "again").mkdir()
    shutil.copytree(tmp_path / "full" / "checkpoint-2", tmp_path / "again" / "checkpoint-2")
    again = make_trainer(tmp_path / "again", ignore_data_skip=True, **common)
    again.train(resume_from_checkpoint=str(tmp_path / "again" / "checkpoint-2"))
    assert not torch.equal(full.model.lm_head.weight, again.model.lm_head.weight)


def test_compute_loss_func_gets_window_count_and_is_not_divided_by_ga(tmp_path):
    calls = []

    def token_sum_loss(outputs, labels, num_items_in_batch=None):
        calls.append((labels.shape, num_items_in_batch))
        logits, target = outputs.logits[:, :-1], labels[:, 1:]
        return (
            torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), target.flatten(), reduction="sum"
            )
            / num_items_in_batch
        )

    trainer = make_trainer(tmp_path, max_steps=1)
    trainer.compute_loss_func = token_sum_loss
    # a model without loss kwargs: the count still reaches the function
    trainer.model_accepts_loss_kwargs = False
    trainer.train()
    batches = list(trainer.get_train_dataloader())[:3]
    expected_count = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
    assert [c[1].item() for c in calls] == [expected_count] * 3
    # the window's loss is the token mean over all 3 micro-batches: no extra division by GA
    model = tiny_model()
    with torch.no_grad():
        total = sum(
            torch.nn.functional.cross_entropy(
                model(**b).logits[:, :-1].flatten(0, 1),
                b["labels"][:, 1:].flatten(),
                reduction="sum",
            )
            for b in batches
        )
    assert math.isclose(
        trainer.state.log_history[0]["loss"], (total / expected_count).item(), rel_tol=1e-5
    )


def test_eval_on_start_evaluates_before_the_first_step(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=1, eval_on_start=True)
    trainer.eval_dataset = rows(3, seed=6)
    trainer.train()
    first = trainer.state.log_history[0]
    assert "eval_loss" in first and first["step"] == 0


def test_logs_carry_samples_tokens_per_second_and_step_time(tmp_path):
    # 10 rows / batch 2 = 5 micro-batches, GA 3 -> windows of 3 and 2; logging every step. The
    # rates share one clock, so their ratios are exact counts: samples and tokens per step.
    trainer = make_trainer(tmp_path, n_rows=10, num_train_epochs=2)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    batches = list(trainer.get_train_dataloader())
    windows = [batches[0:3], batches[3:5]] * 2  # every epoch has the same sizes (order differs)
    for h, window in zip(logs, windows):
        assert h["train_step_time"] == pytest.approx(1 / h["train_steps_per_second"], rel=2e-2)
        samples = h["train_samples_per_second"] / h["train_steps_per_second"]
        assert samples == pytest.approx(sum(len(b["input_ids"]) for b in window), rel=2e-2)
    # tokens per sample over the whole run: attention-mask ones, not padded positions
    seen_tokens = sum(int(b["attention_mask"].sum()) for b in batches) * 2
    from_rates = sum(h["train_tokens_per_second"] / h["train_samples_per_second"]
                     * sum(len(b["input_ids"]) for b in window) for h, window in zip(logs, windows))
    assert from_rates == pytest.approx(seen_tokens, rel=2e-2)
    padded = sum(b["input_ids"].numel() for b in batches) * 2
    assert padded > seen_tokens * 1.05  # negative control: counting padding is another number
    final = trainer.state.log_history[-1]  # transformers' speed_metrics names for the whole run
    assert {"train_runtime", "train_samples_per_second", "train_steps_per_second"} <= set(final)


def test_tensorboard_events_are_written_during_training(tmp_path):
    pytest.importorskip("tensorboard")  # an optional extra (nanosft[tensorboard]), not a reference
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer = make_trainer(tmp_path, n_rows=12, gradient_accumulation_steps=1, max_steps=3,
                           report_to="tensorboard")
    seen_mid_run = []
    original = trainer.training_step

    def read_events_then_step(model, inputs, num_items_in_batch=None):
        if trainer.state.global_step == 2:  # steps 1 and 2 were logged; step 3 not yet run
            events = EventAccumulator(str(tmp_path / "runs"))
            events.Reload()
            seen_mid_run.extend(e.step for e in events.Scalars("train/loss"))
        return original(model, inputs, num_items_in_batch)

    trainer.training_step = read_events_then_step
    trainer.train()
    assert seen_mid_run == [1, 2]  # on disk while training, not written afterwards
    events = EventAccumulator(str(tmp_path / "runs"))
    events.Reload()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    torch.testing.assert_close([e.value for e in events.Scalars("train/loss")], losses,
                               rtol=1e-6, atol=0)  # TensorBoard stores float32
    assert "train/train_samples_per_second" in events.Tags()["scalars"]

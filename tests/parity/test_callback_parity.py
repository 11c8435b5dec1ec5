"""One user callback under transformers Trainer and nanosft Trainer: same events, same state.

The callback body (RecorderBody) is written once and mixed into each library's TrainerCallback. It
records every event with state.global_step and state.epoch, reads state.log_history at on_log, and
sets control.should_training_stop at step 5 of a 6-step run (10 rows, batch 2 x GA 2: 3 updates
per epoch, the last one a 1-micro-batch window; 2 epochs), with logging_steps=1, eval and save
every 2 steps. Compared: the event sequences, the final TrainerState, the losses in log_history
(1e-5, fp32, identical weights) and the checkpoint folders. A second test runs the handler API
(add_callback with a class and an instance, pop_callback, remove_callback) on both trainers.
Only the user callback's view is compared: the libraries' own default callbacks differ by design
(transformers adds PrinterCallback after the user's callbacks, nanosft its reporting callbacks
before them), so callback lists keep DefaultFlowCallback and the test's classes only, and
log_history keys are cut to those both libraries log.
Hermetic: a tiny LlamaForCausalLM built in-process, weights copied into nanosft CausalLM; CPU.
Run: python -m pytest -q tests/parity/test_callback_parity.py
"""

import datasets
import pytest
import torch
import transformers
from tiny import one_thread  # noqa: F401 (an autouse fixture)

from nanosft.args import TrainingArguments
from nanosft.collator import DataCollatorForLanguageModeling
from nanosft.model import CausalLM, ModelConfig
from nanosft.trainer import Trainer
from nanosft.trainer_callback import DefaultFlowCallback, TrainerCallback

VOCAB = 64
CONFIG = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
          "pad_token_id": 0}
COMMON = {"per_device_train_batch_size": 2, "per_device_eval_batch_size": 2,
          "gradient_accumulation_steps": 2, "num_train_epochs": 2, "learning_rate": 1e-3,
          "logging_steps": 1, "eval_strategy": "steps", "eval_steps": 2, "save_strategy": "steps",
          "save_steps": 2, "use_cpu": True, "bf16": False, "fp16": False, "optim": "adamw_torch",
          "seed": 5, "report_to": "none", "disable_tqdm": True}
STOP_AT = 5  # of max_steps 6
SHARED_LOG_KEYS = {"loss", "grad_norm", "learning_rate", "epoch", "step", "eval_loss",
                   "train_loss", "train_runtime", "eval_runtime"}
LOSS_KEYS = ("loss", "grad_norm", "learning_rate", "epoch", "eval_loss", "train_loss")


class RecorderBody:
    """Records (event, global_step, epoch) per event, the log_history view at on_log, and stops
    training at global_step == stop_at."""

    def __init__(self, stop_at=None):
        self.stop_at = stop_at
        self.events = []

    def _record(self, event, state, *extra):
        self.events.append((event, state.global_step, round(state.epoch, 4), *extra))

    def on_init_end(self, args, state, control, **kwargs):
        self._record("on_init_end", state)

    def on_train_begin(self, args, state, control, **kwargs):
        self._record("on_train_begin", state, state.max_steps, state.num_train_epochs)

    def on_epoch_begin(self, args, state, control, **kwargs):
        self._record("on_epoch_begin", state)

    def on_step_begin(self, args, state, control, **kwargs):
        self._record("on_step_begin", state)

    def on_substep_end(self, args, state, control, **kwargs):
        self._record("on_substep_end", state)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._record("on_pre_optimizer_step", state)

    def on_optimizer_step(self, args, state, control, **kwargs):
        self._record("on_optimizer_step", state)

    def on_step_end(self, args, state, control, **kwargs):
        # the flags DefaultFlowCallback (earlier in the list) set for this step
        self._record("on_step_end", state, control.should_log, control.should_evaluate,
                     control.should_save)
        if state.global_step == self.stop_at:
            control.should_training_stop = True

    def on_evaluate(self, args, state, control, **kwargs):
        self._record("on_evaluate", state, "eval_loss" in kwargs["metrics"])

    def on_log(self, args, state, control, **kwargs):
        last = state.log_history[-1]
        self._record("on_log", state, len(state.log_history),
                     tuple(sorted(SHARED_LOG_KEYS & set(last))),
                     tuple(sorted(SHARED_LOG_KEYS & set(kwargs["logs"]))))

    def on_save(self, args, state, control, **kwargs):
        self._record("on_save", state)

    def on_epoch_end(self, args, state, control, **kwargs):
        self._record("on_epoch_end", state)

    def on_train_end(self, args, state, control, **kwargs):
        self._record("on_train_end", state)


class RefRecorder(RecorderBody, transformers.TrainerCallback):
    pass


class OurRecorder(RecorderBody, TrainerCallback):
    pass


def make_rows(n, seed):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(5, 12, (1,), generator=g))
        ids = torch.randint(2, VOCAB, (length,), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": [-100, -100] + ids[2:]})
    return rows


def make_trainers(tmp_path, ref_callbacks=None, our_callbacks=None):
    """transformers and nanosft Trainers on one tiny Llama's weights and the same rows."""
    torch.manual_seed(0)
    ref_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    our_model = CausalLM(ModelConfig(**CONFIG))
    our_model.load_state_dict(ref_model.state_dict())
    train_rows, eval_rows = make_rows(10, seed=1), make_rows(4, seed=2)
    collator = DataCollatorForLanguageModeling(pad_token_id=0)
    ref = transformers.Trainer(
        model=ref_model, args=transformers.TrainingArguments(str(tmp_path / "ref"), **COMMON),
        train_dataset=datasets.Dataset.from_list(train_rows),
        eval_dataset=datasets.Dataset.from_list(eval_rows), data_collator=collator,
        callbacks=ref_callbacks)
    ours = Trainer(our_model, TrainingArguments(str(tmp_path / "ours"), **COMMON),
                   train_dataset=train_rows, eval_dataset=eval_rows, data_collator=collator,
                   callbacks=our_callbacks)
    return ref, ours


def checkpoints(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("checkpoint-"))


def test_callback_sees_the_same_events_and_state(tmp_path):
    ref_cb, our_cb = RefRecorder(stop_at=STOP_AT), OurRecorder(stop_at=STOP_AT)
    ref, ours = make_trainers(tmp_path, [ref_cb], [our_cb])
    ref.train()
    ours.train()

    assert our_cb.events == ref_cb.events
    names = [e[0] for e in ref_cb.events]
    assert names.count("on_substep_end") == 4  # steps 1, 2, 4, 5; 3 ends epoch 0 on 1 batch
    assert names.count("on_evaluate") == 2 and names.count("on_save") == 2  # steps 2 and 4
    assert ref_cb.events[-1][:2] == ("on_train_end", STOP_AT)
    for field in ("global_step", "max_steps", "num_train_epochs", "epoch"):
        assert getattr(ours.state, field) == pytest.approx(getattr(ref.state, field), abs=1e-9)
    assert len(ours.state.log_history) == len(ref.state.log_history)
    for a, b in zip(ours.state.log_history, ref.state.log_history):
        assert a["step"] == b["step"]
        for key in LOSS_KEYS:
            assert (key in a) == (key in b), f"step {a['step']}: {key}"
            if key in a:
                torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-5,
                                           msg=f"step {a['step']} {key}")
    assert checkpoints(tmp_path / "ours") == checkpoints(tmp_path / "ref")
    assert checkpoints(tmp_path / "ref") == ["checkpoint-2", "checkpoint-4"]


def user_view(trainer, classes):
    """Names of the callbacks that are DefaultFlowCallback or one of the test's classes."""
    return [type(cb).__name__ for cb in trainer.callback_handler.callbacks
            if type(cb).__name__ in {"DefaultFlowCallback", *classes}]


def test_add_pop_remove_callback_match_transformers(tmp_path):
    ref, ours = make_trainers(tmp_path)

    class RefMarker(transformers.TrainerCallback):
        pass

    class OurMarker(TrainerCallback):
        pass

    def run(trainer, recorder, marker, flow):
        """The same operations on one trainer; returns the user view after each."""
        names = {recorder.__name__, marker.__name__}
        rename = {recorder.__name__: "Recorder", marker.__name__: "Marker"}
        views = []

        def snap(result=None):
            view = [rename.get(n, n) for n in user_view(trainer, names)]
            views.append((view, rename.get(type(result).__name__, type(result).__name__)))

        snap()
        trainer.add_callback(recorder)  # a class: instantiated by the handler
        snap()
        instance = marker()
        trainer.add_callback(instance)
        snap()
        trainer.add_callback(recorder)  # a second one (transformers warns, adds it)
        snap()
        snap(trainer.pop_callback(recorder))  # the first of the class
        popped = trainer.pop_callback(instance)
        snap(popped)
        assert popped is instance
        snap(trainer.pop_callback(marker))  # absent: None
        trainer.remove_callback(recorder)
        snap()
        trainer.remove_callback(recorder)  # absent class: nothing
        snap()
        trainer.remove_callback(flow)
        snap()
        with pytest.raises(ValueError):  # an absent instance: list.remove's error
            trainer.remove_callback(instance)
        return views

    ref_views = run(ref, RefRecorder, RefMarker, transformers.DefaultFlowCallback)
    our_views = run(ours, OurRecorder, OurMarker, DefaultFlowCallback)
    assert our_views == ref_views
    assert ref_views[3][0] == ["DefaultFlowCallback", "Recorder", "Marker", "Recorder"]
    assert ref_views[-1][0] == []

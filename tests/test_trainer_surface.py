"""transformers' public Trainer surface in nanosft: the names (top level and their modules),
TrainerState / TrainerControl / ExportableState, the CallbackHandler warnings, EarlyStopping,
stateful callbacks through a checkpoint, predict, the optimizer / scheduler methods, streamed
(length-less) datasets, label smoothing and the JIT (SIGTERM) checkpoint.

Compared: against formulas written out here (a linear model y = a x + b whose predictions and
losses are known), against transformers' classes where it is installed (importorskip), and
each behaviour with a negative control. Hermetic, CPU, about 20 s.
Run: python -m pytest -q tests/test_trainer_surface.py
"""

import json
import logging
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from torch import nn

import nanosft
from nanosft.args import TrainingArguments
from nanosft.trainer import DEFAULT_CALLBACKS, TRAINER_STATE_NAME, Trainer
from nanosft.trainer_callback import (CallbackHandler, DefaultFlowCallback, EarlyStoppingCallback,
                                      ExportableState, PrinterCallback, ProgressCallback,
                                      TrainerCallback, TrainerControl, TrainerState)
from nanosft.trainer_utils import PredictionOutput


# ----------------------------------------------------------------------------- tiny model + data
class Linear(nn.Module):
    """y = a x + b; (mse loss, y) with labels, (y,) without; `twice` returns y twice."""

    def __init__(self, a=0.0, b=0.0, twice=False):
        super().__init__()
        self.a = nn.Parameter(torch.tensor(float(a)))
        self.b = nn.Parameter(torch.tensor(float(b)))
        self.twice = twice

    def forward(self, x, labels=None, **kwargs):
        y = x * self.a + self.b
        outputs = (y, y) if self.twice else (y,)
        return outputs if labels is None else (nn.functional.mse_loss(y, labels), *outputs)


def rows(n=32, seed=0, extra=False):
    g = np.random.default_rng(seed)
    x = g.normal(size=n).astype(np.float32)
    y = (2 * x + 3 + g.normal(scale=0.1, size=n)).astype(np.float32)
    return [{"x": x[i], "labels": y[i], **({"labels_2": -y[i]} if extra else {})}
            for i in range(n)]


def args(tmp_path, **kw):
    kw.setdefault("report_to", "none")
    kw.setdefault("disable_tqdm", True)
    return TrainingArguments(str(tmp_path / "out"), use_cpu=True, **kw)


# ----------------------------------------------------------------------------- names
SURFACE = ["TrainerState", "TrainerControl", "CallbackHandler", "DefaultFlowCallback",
           "ProgressCallback", "PrinterCallback", "EarlyStoppingCallback", "ExportableState",
           "IntervalStrategy", "EvalPrediction", "PredictionOutput", "TrainOutput", "set_seed",
           "default_data_collator", "DataCollatorWithPadding", "get_scheduler",
           "get_linear_schedule_with_warmup", "get_polynomial_decay_schedule_with_warmup"]


@pytest.mark.parametrize("name", SURFACE)
def test_public_name_is_the_defining_modules_object(name):
    module = sys.modules[nanosft._LAZY_NAMES[name]] if nanosft._LAZY_NAMES[name] in sys.modules \
        else __import__(nanosft._LAZY_NAMES[name], fromlist=[name])
    assert getattr(nanosft, name) is getattr(module, name)


def test_import_nanosft_still_imports_no_torch():
    code = "import sys, nanosft; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_default_callbacks_and_printer_when_tqdm_is_off(tmp_path):
    assert DEFAULT_CALLBACKS == [DefaultFlowCallback]
    names = {type(cb).__name__ for cb in
             Trainer(Linear(), args(tmp_path)).callback_handler.callbacks}
    assert "PrinterCallback" in names and "ProgressCallback" not in names  # disable_tqdm=True
    names = {type(cb).__name__ for cb in
             Trainer(Linear(), args(tmp_path, disable_tqdm=False)).callback_handler.callbacks}
    assert "ProgressCallback" in names and "PrinterCallback" not in names


# ----------------------------------------------------------------------------- state and control
def test_trainer_state_json_round_trip(tmp_path):
    state = TrainerState(epoch=1.5, global_step=100, max_steps=200, best_metric=0.95)
    state.log_history.append({"loss": 1.0, "step": 1})
    path = tmp_path / "state.json"
    state.save_to_json(str(path))
    assert json.loads(path.read_text())["global_step"] == 100
    assert TrainerState.load_from_json(str(path)) == state


def test_stateful_callbacks_list_becomes_a_dict_of_states():
    early = EarlyStoppingCallback(early_stopping_patience=4)
    state = TrainerState(stateful_callbacks=[early, TrainerControl(should_save=True)])
    assert state.stateful_callbacks["EarlyStoppingCallback"]["args"]["early_stopping_patience"] == 4
    assert state.stateful_callbacks["TrainerControl"]["args"]["should_save"] is True
    assert TrainerState().stateful_callbacks == {}
    with pytest.raises(TypeError, match="ExportableState"):
        TrainerState(stateful_callbacks=[PrinterCallback()])  # not exportable


def test_exportable_state_rebuilds_args_and_attributes():
    early = EarlyStoppingCallback(early_stopping_patience=5, early_stopping_threshold=0.1)
    early.early_stopping_patience_counter = 3
    back = EarlyStoppingCallback.from_state(early.state())
    assert vars(back) == vars(early)
    control = TrainerControl(should_training_stop=True)
    assert TrainerControl.from_state(control.state()) == control
    with pytest.raises(NotImplementedError):
        ExportableState().state()


def test_handler_warns_about_a_duplicate_and_a_missing_flow_callback(caplog):
    with caplog.at_level(logging.WARNING, logger="nanosft.trainer_callback"):
        CallbackHandler([DefaultFlowCallback(), ProgressCallback, ProgressCallback], None, None,
                        None, None)
    assert len(caplog.records) == 1 and "ProgressCallback" in caplog.records[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="nanosft.trainer_callback"):
        CallbackHandler([ProgressCallback()], None, None, None, None)
    assert "DefaultFlowCallback" in caplog.records[0].getMessage()


# ----------------------------------------------------------------------------- early stopping
def test_early_stopping_counter_against_best_metric():
    class Args:
        greater_is_better = True

    cb = EarlyStoppingCallback(early_stopping_patience=2, early_stopping_threshold=0.1)
    state, control = TrainerState(best_metric=0.8), TrainerControl()
    cb.check_metric_value(Args(), state, control, 0.85)  # better, but by less than the threshold
    assert cb.early_stopping_patience_counter == 1
    cb.check_metric_value(Args(), state, control, 0.95)  # better by more: reset
    assert cb.early_stopping_patience_counter == 0


def test_early_stopping_stops_a_run_whose_metric_stalls(tmp_path):
    # lr 0: eval_loss never improves after the first evaluation, so patience 2 stops at step 3
    kw = dict(eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1,
              load_best_model_at_end=True, learning_rate=0.0, max_steps=10,
              per_device_train_batch_size=4)
    trainer = Trainer(Linear(), args(tmp_path, **kw), train_dataset=rows(), eval_dataset=rows(8),
                      callbacks=[EarlyStoppingCallback(early_stopping_patience=2)])
    trainer.train()
    assert trainer.state.global_step == 3
    control = Trainer(Linear(), args(tmp_path / "b", **kw), train_dataset=rows(),
                      eval_dataset=rows(8))  # negative control: no callback, all 10 steps
    control.train()
    assert control.state.global_step == 10


# ----------------------------------------------------------------------------- stateful callbacks
class Counter(TrainerCallback, ExportableState):
    def __init__(self, name="default"):
        self.name = name
        self.steps = 0

    def on_step_end(self, args, state, control, **kwargs):
        self.steps += 1

    def state(self):
        return {"args": {"name": self.name}, "attributes": {"steps": self.steps}}


def test_stateful_callbacks_go_through_a_checkpoint(tmp_path, caplog):
    kw = dict(max_steps=2, save_strategy="steps", save_steps=2, per_device_train_batch_size=4)
    Trainer(Linear(), args(tmp_path, **kw), train_dataset=rows(),
            callbacks=[Counter("first"), Counter("second")]).train()
    checkpoint = tmp_path / "out" / "checkpoint-2"
    saved = json.loads((checkpoint / TRAINER_STATE_NAME).read_text())["stateful_callbacks"]
    assert [s["args"]["name"] for s in saved["Counter"]][:2] == ["first", "second"]

    kw["max_steps"] = 3
    resumed = Trainer(Linear(), args(tmp_path, restore_callback_states_from_checkpoint=True, **kw),
                      train_dataset=rows(), callbacks=[Counter(), Counter()])
    resumed.train(resume_from_checkpoint=str(checkpoint))
    counters = [cb for cb in resumed.callback_handler.callbacks if isinstance(cb, Counter)]
    assert [(c.name, c.steps) for c in counters] == [("first", 3), ("second", 3)]  # 2 + 1 step

    # negative control: without the flag the fresh callbacks stay; a saved one the run lacks warns
    plain = Trainer(Linear(), args(tmp_path, **kw), train_dataset=rows(), callbacks=[Counter()])
    plain.train(resume_from_checkpoint=str(checkpoint))
    assert [cb.name for cb in plain.callback_handler.callbacks if isinstance(cb, Counter)] == \
        ["default"]
    lacking = Trainer(Linear(), args(tmp_path, restore_callback_states_from_checkpoint=True, **kw),
                      train_dataset=rows())
    with caplog.at_level(logging.WARNING, logger="nanosft.trainer"):
        lacking.train(resume_from_checkpoint=str(checkpoint))
    assert any("Counter" in r.getMessage() for r in caplog.records)


def test_control_state_is_restored(tmp_path):
    kw = dict(max_steps=2, save_strategy="steps", save_steps=2, per_device_train_batch_size=4)
    Trainer(Linear(), args(tmp_path, **kw), train_dataset=rows()).train()
    trainer = Trainer(Linear(), args(tmp_path, restore_callback_states_from_checkpoint=True, **kw),
                      train_dataset=rows())
    path = tmp_path / "out" / "checkpoint-2" / TRAINER_STATE_NAME
    trainer.state = TrainerState.load_from_json(str(path))
    assert not trainer.control.should_training_stop
    trainer._load_callback_state()
    assert trainer.control.should_training_stop  # the run had reached max_steps


# ----------------------------------------------------------------------------- predict
def test_predict_returns_the_models_outputs_and_labels(tmp_path):
    data = rows(10, extra=True)
    x = np.array([r["x"] for r in data])
    trainer = Trainer(Linear(1.5, 2.5), args(tmp_path, per_device_eval_batch_size=4))
    out = trainer.predict(data)
    assert isinstance(out, PredictionOutput)
    np.testing.assert_allclose(out.predictions, 1.5 * x + 2.5, rtol=1e-6)
    y = np.array([r["labels"] for r in data])
    np.testing.assert_array_equal(out.label_ids, y)
    assert out.metrics["test_loss"] == pytest.approx(((1.5 * x + 2.5 - y) ** 2).mean(), rel=1e-5)

    two = Trainer(Linear(1.5, 2.5, twice=True),
                  args(tmp_path, per_device_eval_batch_size=4, label_names=["labels", "labels_2"]))
    out = two.predict(data)
    assert len(out.predictions) == 2 and len(out.label_ids) == 2
    np.testing.assert_array_equal(out.label_ids[1], -y)


def test_predict_pads_rows_of_another_width_with_minus_100(tmp_path):
    data = [{"x": np.ones(n, np.float32), "labels": np.zeros(n, np.float32)} for n in (2, 2, 5, 5)]
    out = Trainer(Linear(2.0, 1.0), args(tmp_path, per_device_eval_batch_size=2)).predict(data)
    assert out.predictions.shape == (4, 5)
    np.testing.assert_array_equal(out.predictions[0], [3, 3, -100, -100, -100])


# ----------------------------------------------------------------------------- optimizer methods
def test_optimizer_methods(tmp_path):
    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    trainer = Trainer(model, args(tmp_path, learning_rate=1e-3, warmup_steps=2))
    with pytest.raises(ValueError, match="optimizer is None"):
        trainer.get_optimizer_group()
    with pytest.raises(ValueError, match="optimizer is None"):
        trainer.get_learning_rates()
    trainer.create_optimizer_and_scheduler(num_training_steps=10)
    assert len(trainer.get_optimizer_group()) == 2  # decayed, not decayed
    assert trainer.get_optimizer_group(model[0].weight)["weight_decay"] == trainer.args.weight_decay
    assert trainer.get_optimizer_group(model[1].weight)["weight_decay"] == 0.0
    assert trainer.get_learning_rates() == [0.0, 0.0]  # warmup starts at 0
    optimizer = trainer.optimizer
    assert trainer.create_optimizer() is optimizer  # kept once made


# ----------------------------------------------------------------------------- streamed data
class Stream(torch.utils.data.IterableDataset):
    """Rows without __len__; counts how many were read."""

    def __init__(self, n=10**9):
        self.n, self.read = n, 0

    def __iter__(self):
        for i in range(self.n):
            self.read += 1
            yield {"x": np.float32(i % 7), "labels": np.float32(2 * (i % 7) + 3), "extra": "s"}


def test_iterable_dataset_trains_max_steps_reading_only_those_rows(tmp_path):
    stream = Stream()
    trainer = Trainer(Linear(), args(tmp_path, max_steps=3, per_device_train_batch_size=4,
                                     save_strategy="no"), train_dataset=stream)
    trainer.train()
    assert trainer.state.global_step == 3
    assert stream.read <= 3 * 4 + 4  # streamed: a batch ahead at most, never read whole
    with pytest.raises(ValueError, match="max_steps must be set to a positive value"):
        Trainer(Linear(), args(tmp_path, save_strategy="no"), train_dataset=Stream(8)).train()


def test_short_stream_is_read_again_until_max_steps(tmp_path):
    stream = Stream(n=8)  # two batches of 4 per pass
    trainer = Trainer(Linear(), args(tmp_path, max_steps=5, per_device_train_batch_size=4,
                                     save_strategy="no"), train_dataset=stream)
    trainer.train()
    assert trainer.state.global_step == 5


# ----------------------------------------------------------------------------- label smoothing
def test_label_smoother_equals_the_formula():
    from nanosft.trainer_pt_utils import LabelSmoother

    logits, labels = torch.randn(2, 3, 5), torch.randint(0, 5, (2, 3))
    labels[0, 1] = -100
    logp = torch.log_softmax(logits, -1)
    keep = labels != -100
    nll = -logp.gather(-1, labels.clamp(min=0)[..., None])[..., 0][keep].mean()
    smooth = -logp[keep].mean()
    expected = 0.9 * nll + 0.1 * smooth
    torch.testing.assert_close(LabelSmoother(0.1)({"logits": logits}, labels), expected)


def test_label_smoothing_is_refused_for_multi_label_with_a_warning(tmp_path):
    model = Linear()
    model.config = type("Config", (), {"problem_type": "multi_label_classification"})()
    with pytest.warns(UserWarning, match="not compatible with multi-label classification"):
        trainer = Trainer(model, args(tmp_path, label_smoothing_factor=0.1))
    assert trainer.label_smoother is None
    assert Trainer(Linear(), args(tmp_path, label_smoothing_factor=0.1)).label_smoother is not None


# ----------------------------------------------------------------------------- JIT checkpoint
def test_sigterm_saves_a_checkpoint_and_stops(tmp_path):
    from nanosft.run.jit_checkpoint import JITCheckpointCallback

    kw = dict(max_steps=50, per_device_train_batch_size=4, save_strategy="no",
              enable_jit_checkpoint=True)
    trainer = Trainer(Linear(), args(tmp_path, **kw), train_dataset=rows())
    jit = next(cb for cb in trainer.callback_handler.callbacks
               if isinstance(cb, JITCheckpointCallback))
    jit.jit_manager.kill_wait = 0

    class Sigterm(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 3:
                os.kill(os.getpid(), signal.SIGTERM)
                deadline = time.time() + 5
                while not jit.jit_manager.is_checkpoint_requested and time.time() < deadline:
                    time.sleep(0.01)

    trainer.add_callback(Sigterm())
    trainer.train()
    # the save ran at the next event (step 4's start, weights of step 3); that step finished
    assert trainer.state.global_step == 4
    saved = json.loads((tmp_path / "out" / "checkpoint-3" / TRAINER_STATE_NAME).read_text())
    assert saved["global_step"] == 3
    assert signal.getsignal(signal.SIGTERM) == jit.jit_manager._original_sigterm_handler
    # negative control: enable_jit_checkpoint off installs nothing
    off = Trainer(Linear(), args(tmp_path / "b", max_steps=1), train_dataset=rows())
    assert not any(isinstance(cb, JITCheckpointCallback) for cb in off.callback_handler.callbacks)


# ----------------------------------------------------------------------------- checkpoints
class WithConfig(Linear):
    """Linear with a config that saves itself, as a PreTrainedModel's does."""

    class Config:
        def save_pretrained(self, folder):
            with open(os.path.join(folder, "config.json"), "w") as f:
                json.dump({"model_type": "linear"}, f)

    def __init__(self):
        super().__init__()
        self.config = self.Config()


def test_checkpoint_holds_transformers_files_and_reads_json_args(tmp_path):
    kw = dict(max_steps=2, save_strategy="steps", save_steps=2, per_device_train_batch_size=4)
    Trainer(WithConfig(), args(tmp_path, **kw), train_dataset=rows()).train()
    folder = tmp_path / "out" / "checkpoint-2"
    for name in ("model.safetensors", "config.json", "optimizer.pt", "scheduler.pt",
                 "trainer_state.json", "training_args.json", "training_args.bin"):
        assert (folder / name).is_file(), name
    # the pickle is never read back: a resume works with it unreadable
    (folder / "training_args.bin").write_bytes(b"not a pickle")
    kw["max_steps"] = 3
    resumed = Trainer(WithConfig(), args(tmp_path, **kw), train_dataset=rows())
    resumed.train(resume_from_checkpoint=str(folder))
    assert resumed.state.global_step == 3


def test_resume_from_a_sharded_checkpoint_equals_the_single_file(tmp_path):
    from safetensors.torch import load_file, save_file

    kw = dict(max_steps=4, save_strategy="steps", save_steps=2, per_device_train_batch_size=4,
              learning_rate=0.1)
    whole = Trainer(Linear(), args(tmp_path, **kw), train_dataset=rows())
    whole.train()
    folder = tmp_path / "out" / "checkpoint-2"
    state = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    weight_map = {}
    for i, name in enumerate(sorted(state)):
        shard = f"model-{i + 1:05d}-of-{len(state):05d}.safetensors"
        save_file({name: state[name]}, str(folder / shard))
        weight_map[name] = shard
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    resumed = Trainer(Linear(), args(tmp_path, **kw), train_dataset=rows())
    resumed.train(resume_from_checkpoint=str(folder))
    assert (resumed.model.a.item(), resumed.model.b.item()) == \
        (whole.model.a.item(), whole.model.b.item())


def test_save_strategy_best_needs_a_metric_and_no_eval_reads_none(tmp_path):
    with pytest.raises(ValueError, match="`args.metric_for_best_model` must be provided"):
        args(tmp_path, save_strategy="best", eval_strategy="epoch")
    # no evaluation ever runs, so a metric compute_metrics would give is not checked
    trainer = Trainer(Linear(), args(tmp_path, max_steps=1, metric_for_best_model="accuracy",
                                     save_strategy="no"), train_dataset=rows())
    trainer.train()
    assert trainer.state.best_metric is None


def test_script_flags_are_accepted_and_inert(tmp_path):
    a = args(tmp_path, do_train=True, do_eval=True, do_predict=True, eval_use_gather_object=True)
    assert (a.do_train, a.do_eval, a.do_predict) == (True, True, True)


# ----------------------------------------------------------------------------- dataloaders
def test_eval_dataloader_drop_last_and_named_sets(tmp_path):
    a = args(tmp_path, per_device_eval_batch_size=4, dataloader_drop_last=True)
    trainer = Trainer(Linear(), a, eval_dataset={"first": rows(10), "second": rows(6)})
    assert len(trainer.get_eval_dataloader("first")) == 2  # 10 // 4, the last 2 dropped
    assert trainer.get_eval_dataloader("second").dataset is trainer.eval_dataset["second"]
    assert trainer.get_eval_dataloader("first").total_batch_size == 4


def test_remove_columns_collator_logs_the_dropped_keys_once():
    from nanosft.trainer_utils import RemoveColumnsCollator

    class Log:
        def __init__(self):
            self.messages = []

        def info(self, message):
            self.messages.append(message)

    log = Log()
    collate = RemoveColumnsCollator(lambda features: features, ["a"], log, "Model", "training")
    assert collate([{"a": 1, "b": 2}]) == [{"a": 1}]
    collate([{"a": 1, "b": 2}])
    assert len(log.messages) == 1 and "b" in log.messages[0] and "Model.forward" in log.messages[0]


def test_a_dataloader_without_dataset_attribute_trains(tmp_path):
    class Twice(Trainer):  # a dataloader of another kind: no .dataset, a length
        def get_train_dataloader(self):
            loaders = [super().get_train_dataloader(), super().get_train_dataloader()]

            class Chain:
                def __len__(self):
                    return sum(len(d) for d in loaders)

                def __iter__(self):
                    for d in loaders:
                        yield from d

            return Chain()

    trainer = Twice(Linear(), args(tmp_path, per_device_train_batch_size=8, num_train_epochs=1,
                                   save_strategy="no"), train_dataset=rows(16))
    trainer.train()
    assert trainer.state.global_step == 4  # 2 batches x 2 loaders


# ----------------------------------------------------------------------------- samplers
def test_shard_samplers_split_batches_round_robin():
    from nanosft.trainer_pt_utils import IterableDatasetShard, ShardSampler

    shards = [list(ShardSampler(list(range(10)), batch_size=2, num_processes=2, process_index=i))
              for i in range(2)]
    assert shards == [[0, 1, 4, 5, 8, 9], [2, 3, 6, 7, 0, 1]]  # the last batch loops to the start
    streamed = [list(IterableDatasetShard(list(range(10)), batch_size=2, num_processes=2,
                                          process_index=i)) for i in range(2)]
    assert streamed == shards
    dropped = list(ShardSampler(list(range(10)), batch_size=2, drop_last=True, num_processes=2))
    assert dropped == [0, 1, 4, 5]


def test_length_grouped_sampler_puts_the_longest_first():
    from nanosft.trainer_pt_utils import LengthGroupedSampler

    lengths = [3, 9, 1, 50, 7, 2, 8, 4]
    generator = torch.Generator().manual_seed(0)
    order = list(LengthGroupedSampler(2, lengths=lengths, generator=generator))
    assert sorted(order) == list(range(8)) and lengths[order[0]] == 50
    data = [{"input_ids": [0] * n} for n in lengths]
    assert lengths[next(iter(LengthGroupedSampler(2, dataset=data)))] == 50


def test_eval_loop_container_pads_and_concatenates():
    from nanosft.trainer_pt_utils import EvalLoopContainer

    box = EvalLoopContainer(padding_index=-100)
    box.add((torch.ones(2, 3), {"loss": torch.tensor(1.0)}))
    box.add((torch.ones(1, 5), {"loss": torch.tensor(2.0)}))
    logits, extra = box.get_arrays()
    assert logits.shape == (3, 5) and (logits[:2, 3:] == -100).all()
    np.testing.assert_array_equal(extra["loss"], [1.0, 2.0])


# ----------------------------------------------------------------------------- resume messages
def test_resume_errors_use_transformers_words(tmp_path):
    trainer = Trainer(Linear(), args(tmp_path, max_steps=1), train_dataset=rows())
    with pytest.raises(ValueError, match="Can't find a valid checkpoint at .*checkpoint-9"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-9"))
    with pytest.raises(ValueError, match="No valid checkpoint found in output directory"):
        trainer.train(resume_from_checkpoint=True)


def test_resume_warns_about_args_that_differ_from_the_checkpoint(tmp_path, caplog):
    kw = dict(max_steps=2, save_strategy="steps", save_steps=2, per_device_train_batch_size=4)
    Trainer(Linear(), args(tmp_path, **kw), train_dataset=rows()).train()
    checkpoint = str(tmp_path / "out" / "checkpoint-2")
    same = Trainer(Linear(), args(tmp_path, **{**kw, "max_steps": 3}), train_dataset=rows())
    with caplog.at_level(logging.WARNING, logger="nanosft.trainer_utils"):
        same.train(resume_from_checkpoint=checkpoint)
    assert not caplog.records  # negative control: the same args
    other = Trainer(Linear(), args(tmp_path, **{**kw, "max_steps": 3, "save_steps": 3,
                                               "per_device_train_batch_size": 8}),
                    train_dataset=rows())
    with caplog.at_level(logging.WARNING, logger="nanosft.trainer_utils"):
        other.train(resume_from_checkpoint=checkpoint)
    text = caplog.records[-1].getMessage()
    assert "save_steps: 3 (from args) != 2 (from trainer_state.json)" in text
    assert "per_device_train_batch_size: 8 (from args) != 4 (from trainer_state.json)" in text


def test_auto_find_batch_size_resumes_with_the_batch_size_it_found(tmp_path):
    class OutOfMemoryAbove(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.train_batch_size > 12:
                raise RuntimeError("CUDA out of memory.")

    kw = dict(max_steps=2, save_strategy="steps", save_steps=1, per_device_train_batch_size=16,
              auto_find_batch_size=True)
    first = Trainer(Linear(), args(tmp_path, **kw), train_dataset=rows(64),
                    callbacks=[OutOfMemoryAbove()])
    first.train()
    assert first._train_batch_size == 12  # 16 -> 14 -> 12
    kw["max_steps"] = 3
    resumed = Trainer(Linear(), args(tmp_path, **kw), train_dataset=rows(64))
    assert resumed._train_batch_size == 16
    resumed.train(resume_from_checkpoint=True)
    assert resumed._train_batch_size == 12


def test_best_checkpoint_is_the_saved_one_of_the_best_step(tmp_path):
    # eval at each epoch end, a save at every step: the best step's checkpoint was saved before
    # its evaluation, and becomes best_model_checkpoint at the next save
    from nanosft.trainer_utils import PREFIX_CHECKPOINT_DIR

    class FirstEpochBest(Trainer):
        scores = iter([0.9, 0.5, 0.4])

        def _evaluate(self):
            metrics = {"eval_accuracy": next(self.scores)}
            self._determine_best_metric(metrics)
            return metrics

    kw = dict(eval_strategy="epoch", save_strategy="steps", save_steps=1, num_train_epochs=3,
              metric_for_best_model="accuracy", per_device_train_batch_size=8)
    trainer = FirstEpochBest(Linear(), args(tmp_path, **kw), train_dataset=rows(16),
                             eval_dataset=rows(4), compute_metrics=lambda p: {"accuracy": 0.0})
    trainer.train()
    assert trainer.state.best_global_step == 2
    assert trainer.state.best_model_checkpoint == \
        os.path.join(str(tmp_path / "out"), f"{PREFIX_CHECKPOINT_DIR}-2")


def test_eval_delay_skips_the_first_evaluations(tmp_path):
    class Evals(TrainerCallback):
        steps = []

        def on_evaluate(self, args, state, control, **kwargs):
            self.steps.append(state.global_step)

    for delay, expected in ((0, [1, 2, 3, 4]), (3, [3, 4])):
        Evals.steps = []
        trainer = Trainer(Linear(), args(tmp_path / str(delay), eval_strategy="steps",
                                         eval_steps=1, eval_delay=delay, max_steps=4,
                                         save_strategy="no", per_device_train_batch_size=4),
                          train_dataset=rows(), eval_dataset=rows(4), callbacks=[Evals()])
        trainer.train()
        assert Evals.steps == expected


def test_dataloader_arguments_reach_the_dataloader(tmp_path):
    a = args(tmp_path, dataloader_num_workers=2, dataloader_persistent_workers=True,
             dataloader_prefetch_factor=3)
    loader = Trainer(Linear(), a, train_dataset=rows()).get_train_dataloader()
    assert (loader.num_workers, loader.persistent_workers, loader.prefetch_factor) == (2, True, 3)
    assert loader.pin_memory is False  # use_cpu: nothing to pin for (transformers sets it False)
    plain = Trainer(Linear(), args(tmp_path), train_dataset=rows()).get_train_dataloader()
    assert (plain.num_workers, plain.persistent_workers) == (0, False)
    with pytest.raises(ValueError, match="act on worker processes"):
        args(tmp_path, dataloader_persistent_workers=True)


def test_optimizer_cls_and_kwargs_takes_a_class_or_a_factory(tmp_path):
    from nanosft.optim import is_optimizer_factory

    trainer = Trainer(Linear(), args(tmp_path),
                      optimizer_cls_and_kwargs=(torch.optim.SGD, {"lr": 0.5}))
    optimizer = trainer.create_optimizer()
    assert isinstance(optimizer, torch.optim.SGD) and len(optimizer.param_groups) == 2

    seen = []

    class Factory:  # builds its own groups from the whole model (Muon / Dion style)
        def __call__(self, model, **kwargs):
            seen.append(model)
            return torch.optim.SGD(model.parameters(), **kwargs)

    assert is_optimizer_factory(Factory) and not is_optimizer_factory(torch.optim.SGD)
    trainer = Trainer(Linear(), args(tmp_path), optimizer_cls_and_kwargs=(Factory, {"lr": 0.5}))
    optimizer = trainer.create_optimizer()
    assert seen == [trainer.model] and len(optimizer.param_groups) == 1


def test_batch_eval_metrics_report_at_a_streams_last_batch(tmp_path):
    calls = []

    def metrics(prediction, compute_result):
        calls.append(compute_result)
        return {"batches": len(calls)} if compute_result else None

    trainer = Trainer(Linear(2.0, 3.0), args(tmp_path, per_device_eval_batch_size=4,
                                             batch_eval_metrics=True), compute_metrics=metrics)
    result = trainer.evaluate(Stream(10))  # no __len__: 3 batches, the last known by lookahead
    assert calls == [False, False, True] and result["eval_batches"] == 3

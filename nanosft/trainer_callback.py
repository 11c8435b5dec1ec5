"""Callbacks: the Trainer's seam to everything that watches or steers training, as transformers.

`TrainerState` (what a checkpoint carries), `TrainerControl` (the flags a callback sets),
`TrainerCallback` (one no-op method per event, each `(args, state, control, **kwargs)`),
`CallbackHandler` (calls every callback, in order) and `DefaultFlowCallback` (when to log, evaluate
and save), `ProgressCallback` (the progress bar and printed logs). metrics.jsonl, TensorBoard,
throughput / MFU, the memory ledger and stop-on-non-finite are callbacks of the product layer
(nanosft.monitoring.callbacks), which the Trainer installs outside reference mode as
args.report_to asks; this module imports none of them. `ExportableState` is the protocol of a
callback whose state a checkpoint carries (trainer_state.json's "stateful_callbacks"),
`EarlyStoppingCallback` the stock one that uses it.
Mirrors transformers' trainer_callback.py.
"""

import json
import logging
import math
from dataclasses import asdict, dataclass, field, fields

logger = logging.getLogger(__name__)


class ExportableState:
    """A callback (or TrainerControl) whose state() a checkpoint saves and from_state() rebuilds:
    {"args": what __init__ takes, "attributes": what changed since}.
    Mirrors: transformers ExportableState"""

    def state(self) -> dict:
        raise NotImplementedError("You must implement a `state` function to utilize this class.")

    @classmethod
    def from_state(cls, state):
        instance = cls(**state["args"])
        for key, value in state["attributes"].items():
            setattr(instance, key, value)
        return instance


def stateful_callbacks_dict(callbacks) -> dict:
    """{class name: state()} of the ExportableState callbacks; a list of states for a class that
    occurs more than once. Mirrors: TrainerState.__post_init__ (stateful_callbacks)"""
    states = {}
    for callback in callbacks:
        if not isinstance(callback, ExportableState):
            raise TypeError("All callbacks passed to be saved must inherit `ExportableState`, but "
                            f"received {type(callback)}")
        name = type(callback).__name__
        if name in states:
            if not isinstance(states[name], list):
                states[name] = [states[name]]
            states[name].append(callback.state())
        else:
            states[name] = callback.state()
    return states


@dataclass
class TrainerState:
    """Progress that a checkpoint must carry: step, epoch, log history, best metric, intervals.
    Mirrors: transformers TrainerState (to_dict/from_dict: save/load_from_json)"""

    epoch: float = 0.0
    global_step: int = 0
    max_steps: int = 0
    num_train_epochs: int = 0
    train_batch_size: int | None = None
    total_flos: float = 0.0  # 6 x input_ids elements x parameters, summed over steps and ranks
    num_input_tokens_seen: int = 0  # args.include_num_input_tokens_seen's count, all data shards
    logging_steps: int = 500
    eval_steps: int = 500
    save_steps: int = 500
    log_history: list = field(default_factory=list)
    best_metric: float | None = None
    best_global_step: int | None = None
    best_model_checkpoint: str | None = None
    is_local_process_zero: bool = True
    is_world_process_zero: bool = True
    # {class name: state()} of the ExportableState callbacks and TrainerControl (a list of the
    # ExportableState objects is turned into that dict)
    stateful_callbacks: dict | list | None = None

    def __post_init__(self):
        if self.log_history is None:
            self.log_history = []
        if self.stateful_callbacks is None:
            self.stateful_callbacks = {}
        elif not isinstance(self.stateful_callbacks, dict):
            self.stateful_callbacks = stateful_callbacks_dict(self.stateful_callbacks)

    def compute_steps(self, args, max_steps: int) -> None:
        """Logging/eval/save steps given as a ratio (< 1) of max_steps become step counts.
        Mirrors: TrainerState.compute_steps"""
        for kind in ("logging", "eval", "save"):
            value = getattr(args, f"{kind}_steps")
            if value is not None:
                steps = math.ceil(max_steps * value) if value < 1 else int(value)
                setattr(self, f"{kind}_steps", steps)

    def to_dict(self) -> dict:
        """A JSON-ready dict (trainer_state.json). Mirrors: TrainerState.save_to_json"""
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "TrainerState":
        """Rebuild from to_dict() output, ignoring unknown keys.
        Mirrors: TrainerState.load_from_json"""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})

    def save_to_json(self, json_path: str) -> None:
        """Write the state as indented, key-sorted JSON. Mirrors: TrainerState.save_to_json"""
        with open(json_path, "w", encoding="utf-8") as f:
            f.write(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def load_from_json(cls, json_path: str) -> "TrainerState":
        """Read what save_to_json wrote. Mirrors: TrainerState.load_from_json"""
        with open(json_path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))


@dataclass
class TrainerControl(ExportableState):
    """Flags set by callbacks after each step / epoch, cleared once acted on; a checkpoint saves
    them (a run that had stopped resumes stopped). Mirrors: transformers TrainerControl"""

    should_training_stop: bool = False
    should_epoch_stop: bool = False
    should_save: bool = False
    should_evaluate: bool = False
    should_log: bool = False

    def _new_training(self):
        self.should_training_stop = False

    def _new_epoch(self):
        self.should_epoch_stop = False

    def _new_step(self):
        self.should_save = False
        self.should_evaluate = False
        self.should_log = False

    def state(self) -> dict:
        return {"args": asdict(self), "attributes": {}}


class TrainerCallback:
    """Hooks into the training loop; every event gets (args, state, control, **kwargs) with kwargs
    model, processing_class, optimizer, lr_scheduler, train_dataloader, eval_dataloader (and
    logs / metrics where the event has them). Return a TrainerControl, or None to keep it.
    Mirrors: transformers TrainerCallback
    Differs: on_step_begin also gets the window's micro-batches (batch_samples=...)."""

    def on_init_end(self, args, state, control, **kwargs):
        pass

    def on_train_begin(self, args, state, control, **kwargs):
        pass

    def on_train_end(self, args, state, control, **kwargs):
        pass

    def on_epoch_begin(self, args, state, control, **kwargs):
        pass

    def on_epoch_end(self, args, state, control, **kwargs):
        pass

    def on_step_begin(self, args, state, control, **kwargs):
        pass

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        pass

    def on_optimizer_step(self, args, state, control, **kwargs):
        pass

    def on_substep_end(self, args, state, control, **kwargs):
        pass

    def on_step_end(self, args, state, control, **kwargs):
        pass

    def on_evaluate(self, args, state, control, **kwargs):
        pass

    def on_save(self, args, state, control, **kwargs):
        pass

    def on_log(self, args, state, control, **kwargs):
        pass

    def on_prediction_step(self, args, state, control, **kwargs):
        pass

    def on_predict(self, args, state, control, metrics, **kwargs):
        pass

    def on_push_begin(self, args, state, control, **kwargs):
        pass


class CallbackHandler(TrainerCallback):
    """Calls each callback's method of an event, in order, and threads `control` through them.
    Mirrors: transformers CallbackHandler"""

    def __init__(self, callbacks, model, processing_class, optimizer, lr_scheduler):
        self.callbacks = []
        for cb in callbacks:
            self.add_callback(cb)
        self.model = model
        self.processing_class = processing_class
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.train_dataloader = None
        self.eval_dataloader = None
        if not any(isinstance(cb, DefaultFlowCallback) for cb in self.callbacks):
            logger.warning("The Trainer will not work properly if you don't have a "
                           "`DefaultFlowCallback` in its callbacks. You should add one before "
                           "training with `trainer.add_callback(DefaultFlowCallback)`. The current "
                           "list of callbacks is:\n" + self.callback_list)

    def add_callback(self, callback):
        """Add a callback instance, or a class (instantiated here); a second one of a class is
        added with a warning. Mirrors: add_callback"""
        cb = callback() if isinstance(callback, type) else callback
        cb_class = callback if isinstance(callback, type) else type(callback)
        if cb_class in [type(c) for c in self.callbacks]:
            logger.warning(f"You are adding a {cb_class.__name__} to the callbacks of this "
                           "Trainer, but there is already one. The current list of callbacks is:\n"
                           + self.callback_list)
        self.callbacks.append(cb)

    def pop_callback(self, callback):
        """Remove and return the first callback of this class (or this instance), else None."""
        for cb in self.callbacks:
            if cb is callback or (isinstance(callback, type) and isinstance(cb, callback)):
                self.callbacks.remove(cb)
                return cb
        return None

    def remove_callback(self, callback):
        """Remove the first callback of this class, or this instance (ValueError when the instance
        is absent, as list.remove). Mirrors: remove_callback"""
        if isinstance(callback, type):
            self.pop_callback(callback)
        else:
            self.callbacks.remove(callback)

    @property
    def callback_list(self):
        return "\n".join(type(cb).__name__ for cb in self.callbacks)

    def on_init_end(self, args, state, control):
        return self.call_event("on_init_end", args, state, control)

    def on_train_begin(self, args, state, control):
        control.should_training_stop = False
        return self.call_event("on_train_begin", args, state, control)

    def on_train_end(self, args, state, control):
        return self.call_event("on_train_end", args, state, control)

    def on_epoch_begin(self, args, state, control):
        control.should_epoch_stop = False
        return self.call_event("on_epoch_begin", args, state, control)

    def on_epoch_end(self, args, state, control):
        return self.call_event("on_epoch_end", args, state, control)

    def on_step_begin(self, args, state, control, **kwargs):
        control.should_log = False
        control.should_evaluate = False
        control.should_save = False
        return self.call_event("on_step_begin", args, state, control, **kwargs)

    def on_pre_optimizer_step(self, args, state, control):
        return self.call_event("on_pre_optimizer_step", args, state, control)

    def on_optimizer_step(self, args, state, control):
        return self.call_event("on_optimizer_step", args, state, control)

    def on_substep_end(self, args, state, control):
        return self.call_event("on_substep_end", args, state, control)

    def on_step_end(self, args, state, control):
        return self.call_event("on_step_end", args, state, control)

    def on_evaluate(self, args, state, control, metrics):
        control.should_evaluate = False
        return self.call_event("on_evaluate", args, state, control, metrics=metrics)

    def on_save(self, args, state, control):
        control.should_save = False
        return self.call_event("on_save", args, state, control)

    def on_log(self, args, state, control, logs):
        control.should_log = False
        return self.call_event("on_log", args, state, control, logs=logs)

    def on_prediction_step(self, args, state, control):
        return self.call_event("on_prediction_step", args, state, control)

    def on_predict(self, args, state, control, metrics):
        return self.call_event("on_predict", args, state, control, metrics=metrics)

    def on_push_begin(self, args, state, control, **kwargs):
        return self.call_event("on_push_begin", args, state, control, **kwargs)

    def call_event(self, event, args, state, control, **kwargs):
        for callback in self.callbacks:
            result = getattr(callback, event)(
                args, state, control, model=self.model, processing_class=self.processing_class,
                optimizer=self.optimizer, lr_scheduler=self.lr_scheduler,
                train_dataloader=self.train_dataloader, eval_dataloader=self.eval_dataloader,
                **kwargs)
            if result is not None:  # a callback may leave control as it is
                control = result
        return control


class DefaultFlowCallback(TrainerCallback):
    """Sets should_log / should_evaluate / should_save / should_training_stop from the strategies.
    `_maybe_log_save_evaluate` acts on these flags. Mirrors: DefaultFlowCallback"""

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step
        if step == 1 and args.logging_first_step:
            control.should_log = True
        if args.logging_strategy == "steps" and step % state.logging_steps == 0:
            control.should_log = True
        if (args.eval_strategy == "steps" and step % state.eval_steps == 0
                and args.eval_delay <= step):
            control.should_evaluate = True
        if args.save_strategy == "steps" and state.save_steps > 0 and step % state.save_steps == 0:
            control.should_save = True
        if step >= state.max_steps:
            control.should_training_stop = True
            # the last step is evaluated too (once: it may be an eval step already)
            control.should_evaluate |= args.eval_strategy == "steps" and args.eval_delay <= step
            control.should_save = control.should_save or args.save_strategy == "steps"
        return control

    def on_epoch_end(self, args, state, control, **kwargs):
        control.should_log |= args.logging_strategy == "epoch"
        control.should_evaluate |= args.eval_strategy == "epoch" and args.eval_delay <= state.epoch
        control.should_save |= args.save_strategy == "epoch"
        return control


class ProgressCallback(TrainerCallback):
    """A tqdm bar over the optimizer steps with loss / lr / grad_norm (and tokens/s, MFU when the
    throughput callback adds them), and each log printed as a dict (rank 0).
    Mirrors: transformers ProgressCallback, PrinterCallback"""

    def __init__(self):
        self.bar = None

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=state.max_steps, initial=state.global_step, dynamic_ncols=True,
                            disable=bool(args.disable_tqdm))

    def on_step_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.update(1)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero:
            return
        if self.bar is not None and "loss" in logs:
            speed = {"tok_s": logs.get("train_tokens_per_second"), "mfu": logs.get("mfu")}
            self.bar.set_postfix(loss=f"{logs['loss']:.4f}", lr=f"{logs['learning_rate']:.2e}",
                                 grad_norm=f"{logs.get('grad_norm', float('nan')):.3f}",
                                 **{k: v for k, v in speed.items() if v is not None})
        from tqdm.auto import tqdm

        tqdm.write(str({k: round(v, 6) if isinstance(v, float) else v for k, v in logs.items()}))

    def on_train_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class PrinterCallback(TrainerCallback):
    """Prints each log as a dict (rank 0): the progress callback when disable_tqdm=True.
    Mirrors: transformers PrinterCallback"""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs is not None:
            print({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in logs.items()
                   if k != "total_flos"})


class EarlyStoppingCallback(TrainerCallback, ExportableState):
    """Stops training once metric_for_best_model has failed to improve (by more than
    early_stopping_threshold) on `early_stopping_patience` evaluations in a row; its counter is
    saved in checkpoints. Mirrors: transformers EarlyStoppingCallback

    Args:
        early_stopping_patience: evaluations without improvement before training stops.
        early_stopping_threshold: how much better than state.best_metric counts as improving."""

    def __init__(self, early_stopping_patience: int = 1, early_stopping_threshold: float = 0.0):
        self.early_stopping_patience = early_stopping_patience
        self.early_stopping_threshold = early_stopping_threshold
        self.early_stopping_patience_counter = 0  # evaluations in a row without improvement

    def check_metric_value(self, args, state, control, metric_value):
        better = (metric_value > state.best_metric if args.greater_is_better
                  else metric_value < state.best_metric) if state.best_metric is not None else True
        if state.best_metric is None or (
                better and abs(metric_value - state.best_metric) > self.early_stopping_threshold):
            self.early_stopping_patience_counter = 0
        else:
            self.early_stopping_patience_counter += 1

    def on_train_begin(self, args, state, control, **kwargs):
        if not args.load_best_model_at_end:
            logger.warning("Using EarlyStoppingCallback without load_best_model_at_end=True. Once "
                           "training is finished, the best model will not be loaded automatically.")
        if args.metric_for_best_model is None:
            raise ValueError("EarlyStoppingCallback requires metric_for_best_model to be defined")
        if args.eval_strategy == "no":
            raise ValueError("EarlyStoppingCallback requires IntervalStrategy of steps or epoch")

    def on_evaluate(self, args, state, control, metrics, **kwargs):
        metric_to_check = args.metric_for_best_model
        if not metric_to_check.startswith("eval_"):
            metric_to_check = f"eval_{metric_to_check}"
        metric_value = metrics.get(metric_to_check)
        if metric_value is None:
            logger.warning(f"early stopping required metric_for_best_model, but did not find "
                           f"{metric_to_check} so early stopping is disabled")
            return
        self.check_metric_value(args, state, control, metric_value)
        if self.early_stopping_patience_counter >= self.early_stopping_patience:
            control.should_training_stop = True

    def state(self) -> dict:
        return {"args": {"early_stopping_patience": self.early_stopping_patience,
                         "early_stopping_threshold": self.early_stopping_threshold},
                "attributes": {"early_stopping_patience_counter":
                               self.early_stopping_patience_counter}}


def progress_callback(args) -> TrainerCallback:
    """The bar (ProgressCallback), or PrinterCallback when args.disable_tqdm, as transformers
    picks. Mirrors: Trainer.__init__ (DEFAULT_PROGRESS_CALLBACK)"""
    return PrinterCallback() if args.disable_tqdm else ProgressCallback()

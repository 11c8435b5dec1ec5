"""Callbacks: the Trainer's seam to everything that watches or steers training, as transformers.

`TrainerState` (what a checkpoint carries), `TrainerControl` (the flags a callback sets),
`TrainerCallback` (one no-op method per event, each `(args, state, control, **kwargs)`),
`CallbackHandler` (calls every callback, in order) and `DefaultFlowCallback` (when to log, evaluate
and save), `ProgressCallback` (the progress bar and printed logs). metrics.jsonl, TensorBoard,
throughput / MFU, the memory ledger and stop-on-non-finite are callbacks of the product layer
(nanosft.monitoring.callbacks), which the Trainer installs outside reference mode as
args.report_to asks; this module imports none of them.
Mirrors transformers' trainer_callback.py.
"""

import math
from dataclasses import asdict, dataclass, field, fields

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
    logging_steps: int = 500
    eval_steps: int = 500
    save_steps: int = 500
    log_history: list = field(default_factory=list)
    best_metric: float | None = None
    best_global_step: int | None = None
    best_model_checkpoint: str | None = None
    is_world_process_zero: bool = True

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


@dataclass
class TrainerControl:
    """Flags set by callbacks after each step / epoch, cleared once acted on.
    Mirrors: transformers TrainerControl"""

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

    def add_callback(self, callback):
        """Add a callback instance, or a class (instantiated here). Mirrors: add_callback"""
        cb = callback() if isinstance(callback, type) else callback
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
        if args.eval_strategy == "steps" and step % state.eval_steps == 0:
            control.should_evaluate = True
        if args.save_strategy == "steps" and state.save_steps > 0 and step % state.save_steps == 0:
            control.should_save = True
        if step >= state.max_steps:
            control.should_training_stop = True
            control.should_evaluate = control.should_evaluate or args.eval_strategy == "steps"
            control.should_save = control.should_save or args.save_strategy == "steps"
        return control

    def on_epoch_end(self, args, state, control, **kwargs):
        control.should_log |= args.logging_strategy == "epoch"
        control.should_evaluate |= args.eval_strategy == "epoch"
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

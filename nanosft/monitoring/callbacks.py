"""The callbacks that report on a run: tokens seen, throughput and MFU, stop on non-finite losses,
the memory ledger and peak, metrics.jsonl and live TensorBoard events.

Outside reference mode the Trainer adds `reporting_callbacks(args)` after DefaultFlowCallback, as
args.report_to asks: "none" keeps the progress bar (nanosft.trainer_callback) and the non-finite
guard; "nanosft" adds throughput / MFU, the memory ledger and metrics.jsonl; "tensorboard" adds
throughput and TensorBoard events; "all" both; include_num_input_tokens_seen adds the token count.
Each can be taken off with `trainer.remove_callback(cls)`. The counters come first: they add their
numbers to the logs (and to the entry already in state.log_history) before the callbacks after them
print or write them. Counts are summed over the data-parallel ranks only.
Mirrors transformers TensorBoardCallback; the rest is nanosft's.
"""

import json
import math
import os

import torch

from nanosft import distributed
from nanosft.monitoring.flops import (LogWindow, attention_shape, calibrate_matmul_flops,
                                      compute_dtype, matmul_parameters, model_flops, model_width,
                                      non_embedding_parameters, not_a_causal_lm)
from nanosft.trainer_callback import TrainerCallback, progress_callback


def _update_logs(state, logs, values):
    # the logs the later callbacks see, and the entry Trainer.log already appended to log_history
    logs.update(values)
    if state.log_history:
        state.log_history[-1].update(values)


class ThroughputCallback(TrainerCallback):
    """Tokens/s, samples/s, step time, model FLOP/s and MFU of each logging window, transformers'
    state.total_flos, and the final train_model_flops_per_second / mfu. Without args.peak_flops the
    MFU denominator is a matmul calibration at train start (only while this callback is on),
    raised to any window's model FLOP/s above it: a calibration taken while other work held the
    cores reads low, and MFU stays in (0, 100%].
    A model that is not a causal LM, or batches without input_ids: it steps aside, saying so once
    (state.total_flos stays 0, as transformers' for a model without floating_point_ops)."""

    def __init__(self):
        self.window = LogWindow()
        self.peak_flops = None
        self.peak_raised = False  # the calibration read lower than a window achieved
        self.model_flos = 0.0  # model FLOPs of this train() call, all ranks
        self.last_logged_step = 0
        self.aside = None  # why it reports nothing in this run, once it stepped aside

    def step_aside(self, state, reason) -> None:
        """Stop reporting for this run; rank 0 says why, once."""
        if self.aside is None and state.is_world_process_zero:
            print(f"ThroughputCallback steps aside: {reason}; tokens/s, model FLOP/s and MFU are "
                  "not reported (train()'s runtime and samples/s still are).")
        self.aside = reason

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.window = LogWindow()
        self.model_flos = 0.0
        self.last_logged_step = state.global_step
        self.peak_flops = args.peak_flops
        self.peak_raised = False
        self.aside = None
        reason = None if model is None else not_a_causal_lm(model)
        if reason is not None:
            self.step_aside(state, reason)
        elif self.peak_flops is None and model is not None:
            width, dtype = model_width(model), compute_dtype(model, args)
            self.peak_flops = calibrate_matmul_flops(width, dtype, args.device)

    def on_epoch_begin(self, args, state, control, **kwargs):
        if state.global_step == self.last_logged_step and self.window.samples == 0:
            # the first window's clock starts here, after the calibration above and the other
            # callbacks' start-up (the ledger, TensorBoard's writer), as every later window's does
            self.window = LogWindow()

    def on_step_begin(self, args, state, control, batch_samples=(), model=None, **kwargs):
        for inputs in batch_samples if self.aside is None else ():
            reason = not_a_causal_lm(model, inputs) if model is not None else None
            if reason is not None:
                self.step_aside(state, reason)
                return
            self.window.add(inputs)

    def store_flos(self, args, state, model) -> float:
        """Add the window's 6 x input_ids x non-embedding parameters to state.total_flos; return the
        window's model FLOPs; both summed over the data-parallel ranks (the tensor-parallel ranks of
        one data shard each count the whole model on the same rows: once).
        Mirrors: Trainer.store_flos"""
        window = self.window
        flos = [6 * window.input_ids * non_embedding_parameters(model),
                model_flops(*matmul_parameters(model), *attention_shape(model), window.seq_lengths)]
        if args.world_size > 1:  # float64: exact far past fp32's 2^24
            summed = torch.tensor(flos, dtype=torch.float64, device=args.device)
            flos = distributed.all_reduce_data_parallel(summed, args).tolist()
        state.total_flos += float(flos[0])
        self.model_flos += float(flos[1])
        self.window = LogWindow()  # stored: never counted twice
        return float(flos[1])

    def on_log(self, args, state, control, logs=None, model=None, **kwargs):
        if self.aside is not None:
            if "train_runtime" in logs:
                _update_logs(state, logs, {"total_flos": state.total_flos})
            return
        if "loss" in logs and "train_runtime" not in logs:  # a training window
            steps = state.global_step - self.last_logged_step
            window = self.window
            flos = self.store_flos(args, state, model)
            dp = distributed.data_parallel(args)[0]
            speed = window.speed(dp, steps, flos)
            self._raise_peak(args, speed["train_model_flops_per_second"])
            _update_logs(state, logs, window.speed(dp, steps, flos, self.peak_flops,
                                                   args.world_size))
            self.last_logged_step = state.global_step
        elif "train_runtime" in logs:  # the final metrics of train()
            self.store_flos(args, state, model)
            achieved = self.model_flos / max(logs["train_runtime"], 1e-9)
            final = {"total_flos": state.total_flos,
                     "train_model_flops_per_second": round(achieved, 1)}
            self._raise_peak(args, achieved)
            if self.peak_flops:
                final["mfu"] = achieved / (self.peak_flops * args.world_size)
            _update_logs(state, logs, final)

    def _raise_peak(self, args, achieved) -> None:
        """A calibrated peak below what the model achieved (all ranks) was measured under load:
        the achieved rate is the better lower bound of the machine's peak."""
        if args.peak_flops is None and self.peak_flops and \
                achieved > self.peak_flops * args.world_size:
            self.peak_flops = achieved / args.world_size
            self.peak_raised = True

    def speed_summary(self, args, metrics: dict) -> str:
        """The final summary's speed line: model GFLOP/s and MFU against the peak it used."""
        line = f"speed: {metrics['train_model_flops_per_second'] / 1e9:.2f} GFLOP/s of model FLOPs"
        if metrics.get("mfu") is not None:
            source = ("peak_flops" if args.peak_flops is not None
                      else "the training's own best rate: the matmul calibration at train start "
                      "read lower, under load" if self.peak_raised
                      else "a matmul calibration at train start")
            ranks = f" x {args.world_size} ranks" if args.world_size > 1 else ""
            line += (f", MFU {100 * metrics['mfu']:.1f}% of {self.peak_flops / 1e9:.1f} GFLOP/s"
                     f"{ranks} ({source})")
        return line


def input_tokens(inputs: dict, which: str) -> int:
    """The tokens of one micro-batch include_num_input_tokens_seen counts: "all" every input_ids
    element, "non_padding" the attention_mask ones (every element without a mask); 0 without
    input_ids."""
    if "input_ids" not in inputs:
        return 0
    mask = inputs.get("attention_mask")
    if which == "non_padding" and mask is not None:
        return int(mask.sum())
    return inputs["input_ids"].numel()


class TokensSeenCallback(TrainerCallback):
    """state.num_input_tokens_seen, added to every log, as args.include_num_input_tokens_seen
    asks ("all" or "non_padding"): each window's micro-batches counted once per data shard (summed
    over the data-parallel ranks; the tensor-parallel ranks of a shard read the same rows). Kept
    in trainer_state.json, so a resumed run counts on.
    Mirrors: transformers Trainer._track_num_input_tokens and Trainer.log
    Differs: one all-reduce per optimizer step, not per micro-batch."""

    def on_step_begin(self, args, state, control, batch_samples=(), **kwargs):
        which = args.include_num_input_tokens_seen
        count = sum(input_tokens(inputs, which) for inputs in batch_samples)
        count = torch.tensor(count, dtype=torch.int64, device=args.device)
        state.num_input_tokens_seen += int(distributed.all_reduce_data_parallel(count, args))

    def on_log(self, args, state, control, logs=None, **kwargs):
        _update_logs(state, logs, {"num_input_tokens_seen": state.num_input_tokens_seen})


class NonFiniteTrainingError(ValueError):
    """A run whose trainable weights became nan/inf: StopOnNonFiniteCallback raises it, so train()
    returns no such model and the caller's final save never runs (a ValueError: the command line
    prints its one paragraph and exits with status 2)."""


def nonfinite_parameters(model) -> dict:
    """{name: count} of the trainable parameters holding nan/inf; sharded (DTensor) parameters
    count every rank's shard, so each rank must call it."""
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if not trainable:
        return {}
    local = [p.to_local() if distributed.is_dtensor(p) else p for _, p in trainable]
    # a nan/inf makes its tensor's sum nan/inf: one fast pass, exact counts only when one is
    sums = torch.stack([t.detach().sum(dtype=torch.float32) for t in local])
    counts = torch.zeros_like(sums)
    if not torch.isfinite(sums).all():
        counts = torch.stack([(~torch.isfinite(t.detach())).sum() for t in local]).float()
    if any(distributed.is_dtensor(p) for _, p in trainable):
        counts = distributed.all_reduce_sum(counts)
    return {name: int(n) for (name, _), n in zip(trainable, counts.tolist()) if n}


def nonfinite_message(args, step, logs, bad_parameters) -> str:
    """What went nan/inf at `step`, what was (not) saved, and what to change."""
    seen = [f"{key} {logs[key]:.4g}" for key in ("loss", "grad_norm") if key in (logs or {})]
    what = [f"the logged {', '.join(seen)}"] if seen else []
    if bad_parameters:
        named = ", ".join(f"{name!r} ({n:,})" for name, n in list(bad_parameters.items())[:3])
        named += f" and {len(bad_parameters) - 3} more" if len(bad_parameters) > 3 else ""
        tensors = "tensor holds" if len(bad_parameters) == 1 else "tensors hold"
        what.append(f"{len(bad_parameters)} trainable {tensors} nan/inf values: {named}")
    fixes = [f"a lower learning_rate (now {args.learning_rate})"]
    if args.fp16:
        fixes.append("bf16 instead of fp16 (fp16 overflows above 65504)")
    fixes.append(f"max_grad_norm=1.0 to clip gradients (now {args.max_grad_norm})"
                 if not 0 < args.max_grad_norm <= 1.0 else
                 f"a smaller max_grad_norm (now {args.max_grad_norm})")
    fixes.append("a look at the data (rows that are empty, huge or broken)")
    from nanosft.run.output_folder import get_last_checkpoint

    last = get_last_checkpoint(args.output_dir)
    kept = (f"; {last} was saved before, with finite weights" if last is not None else "")
    return (f"Training diverged at step {step}: {'; '.join(what)}. Stopped: nothing was saved as "
            f"a result{kept}. Try {', '.join(fixes[:-1])}, and {fixes[-1]}.")


class StopOnNonFiniteCallback(TrainerCallback):
    """Raise NonFiniteTrainingError when a trainable weight holds nan/inf: checked at each
    logging window, before each checkpoint or evaluation, and at train end, so no nan/inf weights
    reach a checkpoint or a saved result. A nan/inf loss or grad_norm over finite weights (a step
    the fp16 GradScaler skipped, a micro-batch with no trained token) gets one printed line.
    Mirrors: nothing (transformers trains on)"""

    def check(self, args, state, model, logs=None):
        """Raise when a trainable weight of `model` holds nan/inf."""
        bad_parameters = nonfinite_parameters(model) if model is not None else {}
        if bad_parameters:
            raise NonFiniteTrainingError(nonfinite_message(args, state.global_step, logs,
                                                           bad_parameters))

    def on_log(self, args, state, control, logs=None, model=None, **kwargs):
        if "loss" not in logs or "train_runtime" in logs:  # not a training window
            return
        self.check(args, state, model, logs)
        if not math.isfinite(logs["loss"]) and state.is_world_process_zero:
            print(f"Step {state.global_step}: the logged loss is {logs['loss']} but the weights "
                  "are finite (an fp16 step the GradScaler skipped, or a micro-batch with no "
                  "trained token); training goes on.")

    def on_step_end(self, args, state, control, model=None, **kwargs):
        # a checkpoint or an evaluation comes next; a log first would check in on_log
        if (control.should_save or control.should_evaluate) and not control.should_log:
            self.check(args, state, model)

    def on_epoch_end(self, args, state, control, model=None, **kwargs):
        self.on_step_end(args, state, control, model=model)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self.check(args, state, model)  # what train() returns and the caller saves


class MemoryCallback(TrainerCallback):
    """Rank 0 prints the memory ledger's prediction at train start and the measured peak beside it
    at the end (nanosft.memory)."""

    def __init__(self):
        self.ledger = None
        self.peak = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        from nanosft import memory

        self.ledger = None
        if state.is_world_process_zero:
            self.ledger = memory.predict_for_trainer(model, args)
            if self.ledger is not None:
                print(memory.summary_line(self.ledger))
            elif model is not None and not_a_causal_lm(model) is not None:
                print(f"MemoryCallback: the memory ledger steps aside: {not_a_causal_lm(model)}; "
                      "only the measured peak is reported.")
        self.peak = memory.PeakMemory(args.device.type).start()

    def on_train_end(self, args, state, control, **kwargs):
        from nanosft import memory

        if self.peak is not None and state.is_world_process_zero:
            print(memory.peak_line(self.peak.stop(), self.ledger))
        self.peak = None


class MetricsFileCallback(TrainerCallback):
    """Appends each log, with its step, as one JSON line to output_dir/metrics.jsonl (rank 0)."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero:
            return
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, "metrics.jsonl"), "a", encoding="utf-8") as f:
            f.write(json.dumps({**logs, "step": state.global_step}) + "\n")  # appends: no temp file


def tensorboard_tag(key: str) -> str:
    """eval_loss -> eval/loss, loss -> train/loss. Mirrors: transformers rewrite_logs"""
    return "eval/" + key.removeprefix("eval_") if key.startswith("eval_") else "train/" + key


def open_tensorboard(log_dir):
    """A torch SummaryWriter on `log_dir`, or None (with one printed line) when tensorboard is not
    installed. Mirrors: transformers TensorBoardCallback._init_summary_writer"""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        print('report_to="tensorboard": tensorboard is not installed, so no events are written; '
              'pip install "nanosft[tensorboard]"')
        return None
    return SummaryWriter(log_dir=log_dir)


class TensorBoardCallback(TrainerCallback):
    """Scalars of every log to output_dir/runs, flushed as they come, so a live `tensorboard
    --logdir` shows them (rank 0). Mirrors: transformers TensorBoardCallback
    Differs: events go to output_dir/runs, not runs/<date>_<host>."""

    def __init__(self):
        self.tb_writer = None

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero and self.tb_writer is None:
            self.tb_writer = open_tensorboard(os.path.join(args.output_dir, "runs"))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.tb_writer is None:
            return
        for key, value in logs.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.tb_writer.add_scalar(tensorboard_tag(key), value, state.global_step)
        self.tb_writer.flush()

    def on_train_end(self, args, state, control, **kwargs):
        if self.tb_writer is not None:
            self.tb_writer.close()
            self.tb_writer = None


def report_targets(args) -> set:
    """args.report_to as a set of names ("all" spelled out): {"nanosft", "tensorboard"} or less."""
    names = {args.report_to} if isinstance(args.report_to, str) else set(args.report_to or ())
    return {"nanosft", "tensorboard"} if "all" in names else names - {"none"}


class HoldDequantizedCallback(TrainerCallback):
    """nf4_dequantize="per_step": from each optimizer step's first micro-batch to its end, every
    4-bit weight is dequantized once and reused by the window's forwards and backwards
    (nanosft.fast.nf4.hold_dequantized); evaluation and saving, after on_step_end, hold nothing."""

    def __init__(self):
        self._hold = None

    def _release(self):
        if self._hold is not None:
            self._hold.__exit__(None, None, None)
            self._hold = None

    def on_step_begin(self, args, state, control, **kwargs):
        from nanosft.fast.nf4 import hold_dequantized

        self._release()
        self._hold = hold_dequantized()
        self._hold.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        self._release()

    def on_train_end(self, args, state, control, **kwargs):
        self._release()


def reporting_callbacks(args) -> list:
    """The progress bar and the callbacks args.report_to asks for, in the order they must run:
    throughput first (its numbers reach the bar and the files), the non-finite guard last; and
    the product layer's one speed callback, nf4_dequantize="per_step" (HoldDequantizedCallback)."""
    targets = report_targets(args)
    callbacks = [TokensSeenCallback()] if args.include_num_input_tokens_seen != "no" else []
    callbacks += [ThroughputCallback()] if targets else []
    if getattr(args, "nf4_dequantize", "per_call") == "per_step":
        callbacks.append(HoldDequantizedCallback())
    if "nanosft" in targets:
        callbacks.append(MemoryCallback())
    callbacks.append(progress_callback(args))
    if "nanosft" in targets:
        callbacks.append(MetricsFileCallback())
    if "tensorboard" in targets:
        callbacks.append(TensorBoardCallback())
    # last: the diverged window is printed and written before it raises
    return callbacks + [StopOnNonFiniteCallback()]


def speed_summary(trainer, metrics: dict) -> str:
    """The throughput callback's final speed line for `metrics` (train()'s), or "" without it."""
    throughput = find_callback(trainer, ThroughputCallback)
    if throughput is None or throughput.aside:
        return ""
    return throughput.speed_summary(trainer.args, metrics)


def find_callback(trainer, cls):
    """The trainer's first callback of class `cls`, or None."""
    return next((cb for cb in trainer.callback_handler.callbacks if isinstance(cb, cls)), None)

"""What the Trainer does between optimizer steps: when to log, evaluate and save, which checkpoint
is best, where the logs go (progress bar, printed line, metrics.jsonl, live TensorBoard events),
and the bodies of its log / evaluate / save steps.

Walkthrough 2.3 (`_maybe_log_save_evaluate`); guide: monitoring (样本/秒, tokens/s, step time,
TensorBoard). transformers keeps these in trainer_callback.py (DefaultFlowCallback,
ProgressCallback, PrinterCallback), integrations (TensorBoardCallback) and Trainer methods. They
live here so that trainer.py holds the walkthrough's loop (Trainer -> training_step ->
compute_loss) and stays one screen per level; the Trainer methods of the same names call these.
"""

import json
import math
import os
import time

import torch
from tqdm.auto import tqdm

from nanosft import checkpoint, distributed, output_folder
from nanosft.trainer_utils import LogWindow, evaluation_loop, speed_metrics


def on_step_end(args, state, control) -> None:
    """Set should_log / should_evaluate / should_save / should_training_stop after an update step.
    Walkthrough 2.3 | Mirrors: transformers DefaultFlowCallback.on_step_end"""
    step = state.global_step
    control.should_log = ((step == 1 and args.logging_first_step)
                          or (args.logging_strategy == "steps" and step % state.logging_steps == 0))
    control.should_evaluate = args.eval_strategy == "steps" and step % state.eval_steps == 0
    control.should_save = (args.save_strategy == "steps" and state.save_steps > 0
                           and step % state.save_steps == 0)
    if step >= state.max_steps:
        control.should_training_stop = True
        control.should_evaluate = control.should_evaluate or args.eval_strategy == "steps"
        control.should_save = control.should_save or args.save_strategy == "steps"


def on_epoch_end(args, control) -> None:
    """The "epoch" strategies. Mirrors: transformers DefaultFlowCallback.on_epoch_end"""
    control.should_log |= args.logging_strategy == "epoch"
    control.should_evaluate |= args.eval_strategy == "epoch"
    control.should_save |= args.save_strategy == "epoch"


def determine_best_metric(args, state, metrics: dict) -> bool:
    """Track state.best_metric for metric_for_best_model; True when `metrics` set a new best.
    Mirrors: transformers Trainer._determine_best_metric"""
    name = args.metric_for_best_model
    if name is None:
        return False
    key = name if name.startswith("eval_") else f"eval_{name}"
    if key not in metrics:
        raise KeyError(f"metric_for_best_model={name!r}: {key!r} is not among the eval metrics "
                       f"{sorted(metrics)}.")
    value, best = metrics[key], state.best_metric
    if best is not None and not (value > best if args.greater_is_better else value < best):
        return False
    state.best_metric = value
    state.best_global_step = state.global_step
    return True


def tensorboard_tag(key: str) -> str:
    """eval_loss -> eval/loss, loss -> train/loss. Mirrors: transformers rewrite_logs"""
    return "eval/" + key.removeprefix("eval_") if key.startswith("eval_") else "train/" + key


class Reporter:
    """Where the logs of rank 0 go: the progress bar, a printed line, output_dir/metrics.jsonl, and
    TensorBoard events (output_dir/runs) written as they happen when report_to has "tensorboard".
    Mirrors: transformers ProgressCallback, PrinterCallback, TensorBoardCallback.on_log
    Differs: metrics.jsonl is nanosft's; events go to output_dir/runs, not runs/<date>_<host>."""

    def __init__(self, args, main_process: bool = True):
        self.args = args
        self.main_process = main_process
        self.bar = None
        self.tb_writer = None
        self.nonfinite_logs = 0  # logging windows in a row with a nan/inf loss or grad_norm

    def on_train_begin(self, max_steps: int, initial_step: int) -> None:
        """Open the progress bar and, if asked for and installed, the TensorBoard writer."""
        self.nonfinite_logs = 0
        if not self.main_process:
            return
        self.bar = tqdm(total=max_steps, initial=initial_step, dynamic_ncols=True,
                        disable=bool(self.args.disable_tqdm))
        if "tensorboard" in self.args.report_to:
            self.tb_writer = open_tensorboard(os.path.join(self.args.output_dir, "runs"))

    def on_step(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def on_log(self, logs: dict, step: int) -> None:
        """Print the logs, append them to metrics.jsonl, add them to TensorBoard (rank 0 only)."""
        if not self.main_process:
            return
        record = {**logs, "step": step}
        if self.bar is not None and "loss" in logs:
            self.bar.set_postfix(loss=f"{logs['loss']:.4f}", lr=f"{logs['learning_rate']:.2e}",
                                 grad_norm=f"{logs.get('grad_norm', float('nan')):.3f}",
                                 tok_s=logs.get("train_tokens_per_second"))
        shown = {k: round(v, 6) if isinstance(v, float) else v for k, v in logs.items()}
        tqdm.write(str(shown))
        os.makedirs(self.args.output_dir, exist_ok=True)
        with open(os.path.join(self.args.output_dir, "metrics.jsonl"), "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")  # one line per log: appending needs no temp file
        if self.tb_writer is not None:
            for key, value in logs.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.tb_writer.add_scalar(tensorboard_tag(key), value, step)
            self.tb_writer.flush()  # on disk now, so a live `tensorboard --logdir` shows it

    def check_finite(self, logs: dict, nonfinite: bool, state, control, max_windows: int) -> None:
        """Stop after `max_windows` logging windows in a row with a nan/inf loss or grad_norm.
        Guide: troubleshooting | Mirrors: nothing (transformers trains on)"""
        values = (logs.get(k, 0.0) for k in ("loss", "grad_norm"))
        bad = nonfinite or not all(math.isfinite(v) for v in values)
        self.nonfinite_logs = self.nonfinite_logs + 1 if bad else 0
        if self.nonfinite_logs >= max_windows:
            control.should_training_stop = True
            print(f"Stopping at step {state.global_step}: the loss or grad_norm was nan/inf in "
                  f"{self.nonfinite_logs} logging windows in a row. Try a lower learning_rate "
                  f"(now {self.args.learning_rate}), bf16 instead of fp16, or max_grad_norm=1.0 "
                  "to clip gradients.")

    def on_train_end(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.tb_writer is not None:
            self.tb_writer.close()
            self.tb_writer = None


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


# ----------------------------------------------------------------------------- the trainer's
# between-step work: the bodies of Trainer._maybe_log_save_evaluate, evaluate, _save_checkpoint
def log_save_evaluate(trainer, tr_loss, grad_norm, learning_rate=None) -> None:
    """Log the window's mean loss and throughput, evaluate, track the best metric, save a
    checkpoint, as trainer.control says. Walkthrough 2.3
    Mirrors: transformers Trainer._maybe_log_save_evaluate, Trainer._determine_best_metric"""
    args, state, control = trainer.args, trainer.state, trainer.control
    if control.should_log and state.global_step > trainer._globalstep_last_logged:
        # mean over ranks of the summed step losses; the nan flag rides along, so every rank
        # stops together
        flag = torch.as_tensor(trainer._window.nonfinite, dtype=torch.float32,
                               device=tr_loss.device)
        summed = distributed.all_reduce_sum(torch.stack([tr_loss.detach(), flag]))
        tr_loss_scalar = summed[0].item() / args.world_size
        tr_loss -= tr_loss  # "reset tr_loss to zero", in place: the loop's tensor
        steps = state.global_step - trainer._globalstep_last_logged
        logs = {"loss": tr_loss_scalar / steps}
        if grad_norm is not None:
            logs["grad_norm"] = grad_norm.item() if torch.is_tensor(grad_norm) else grad_norm
        if learning_rate is None:
            learning_rate = trainer._get_learning_rate()
        logs["learning_rate"] = learning_rate
        logs.update(trainer._window.speed(args.world_size, steps))  # tokens/s, samples/s, ...
        trainer._total_loss_scalar += tr_loss_scalar
        trainer._globalstep_last_logged = state.global_step
        trainer.reporter.check_finite(logs, summed[1].item() > 0, state, control,
                                      trainer.max_nonfinite_logs)
        trainer._window = LogWindow()
        trainer.log(logs)
    control.should_log = False
    if control.should_evaluate:
        metrics = trainer._evaluate()
        if determine_best_metric(args, state, metrics) and args.save_strategy == "best":
            control.should_save = True
        control.should_evaluate = False
    if control.should_save:
        trainer._save_checkpoint()
        control.should_save = False


def evaluate(trainer, eval_dataset=None, metric_key_prefix="eval") -> dict:
    """Mean eval loss (each batch's loss weighted by its size), perplexity and speed, logged.
    Mirrors: transformers Trainer.evaluate (the body of nanosft's Trainer.evaluate)"""
    start_time = time.time()
    model = trainer.model
    was_training = model.training
    model.eval()
    eval_loss, examples, batches = evaluation_loop(
        model, trainer.get_eval_dataloader(eval_dataset), trainer.compute_loss,
        trainer._prepare_inputs, trainer.args.device)
    metrics = {f"{metric_key_prefix}_loss": eval_loss,
               f"{metric_key_prefix}_perplexity": math.exp(min(eval_loss, 700.0)),
               **speed_metrics(metric_key_prefix, start_time, examples, batches)}
    trainer.log(metrics)  # still in eval mode, so SFTTrainer.log adds its eval_ metrics
    model.train(was_training)
    return metrics


def evaluate_and_step_plateau(trainer) -> dict:
    """trainer.evaluate(), then ReduceLROnPlateau steps on metric_for_best_model (not for
    eval_on_start). Mirrors: transformers Trainer._evaluate"""
    metrics = trainer.evaluate()
    if trainer._is_plateau() and trainer.state.global_step > 0:
        name = trainer.args.metric_for_best_model.removeprefix("eval_")
        trainer.lr_scheduler.step(metrics[f"eval_{name}"])
    return metrics


def save_checkpoint(trainer) -> None:
    """Write output_dir/checkpoint-<step> (every rank takes part), then rank 0 rotates old ones.
    Mirrors: transformers Trainer._save_checkpoint"""
    args, state = trainer.args, trainer.state
    folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
    if state.best_global_step == state.global_step:
        state.best_model_checkpoint = folder
    checkpoint.save_checkpoint(folder, model=trainer.model, optimizer=trainer.optimizer,
                               lr_scheduler=trainer.lr_scheduler, scaler=trainer.scaler,
                               trainer_state=state.to_dict(), args=args.to_dict(),
                               rank=distributed.get_rank(), world_size=args.world_size)
    if distributed.is_main_process():
        output_folder.rotate_checkpoints(args.output_dir, args.save_total_limit,
                                         state.best_model_checkpoint)


def print_train_banner(args, model, num_examples, num_train_epochs, num_update_steps_per_epoch,
                       total_train_batch_size, max_steps, resumed_from=None, epochs_trained=0,
                       global_step=0) -> None:
    """The "***** Running training *****" lines transformers logs at the start of training.
    Walkthrough 2.3 (# Train!) | Mirrors: the logger.info lines of Trainer._inner_training_loop"""
    print("***** Running training *****")
    print(f"  Num examples = {num_examples:,}")
    print(f"  Num Epochs = {num_train_epochs:,}")
    print(f"  Num update steps per epoch = {num_update_steps_per_epoch:,}")
    print(f"  Instantaneous batch size per device = {args.per_device_train_batch_size:,}")
    print("  Total train batch size (w. parallel, distributed & accumulation) = "
          f"{total_train_batch_size:,}")
    print(f"  Gradient Accumulation steps = {args.gradient_accumulation_steps}")
    print(f"  Total optimization steps = {max_steps:,}")
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"  Number of trainable parameters = {trainable:,}")
    if resumed_from is not None:
        print(f"  Resuming training from {resumed_from} with epoch {epochs_trained} and global "
              f"step {global_step}")

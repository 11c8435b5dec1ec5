"""What the Trainer does between optimizer steps: when to log, evaluate and save, which checkpoint
is best, where the logs go (progress bar, printed line, metrics.jsonl, live TensorBoard events),
the bodies of its log / evaluate / save steps, and the FLOPs it reports (total_flos, model FLOP/s,
mfu against a peak passed or calibrated at train start).

Walkthrough 2.3 (`_maybe_log_save_evaluate`); guide: monitoring (样本/秒, tokens/s, step time,
TensorBoard), performance (MFU). transformers keeps these in trainer_callback.py
(DefaultFlowCallback, ProgressCallback, PrinterCallback), integrations (TensorBoardCallback) and
Trainer methods. They live here so that trainer.py holds the walkthrough's loop (Trainer ->
training_step -> compute_loss) and stays one screen per level; the Trainer methods of the same
names call these.
"""

import json
import math
import os
import time

import torch
from tqdm.auto import tqdm

from nanosft import distributed
from nanosft.io import checkpoint
from nanosft.io import output_folder
from nanosft.nf4 import Linear4bit
from nanosft.trainer_utils import LogWindow, evaluation_loop, model_flops, speed_metrics


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
        self.peak_flops = args.peak_flops  # the denominator of mfu, per device
        self.model_flos = 0.0  # model FLOPs of this train() call, all ranks (model_flops)

    def on_train_begin(self, max_steps: int, initial_step: int, model=None) -> None:
        """Open the progress bar and, if asked for and installed, the TensorBoard writer; without
        args.peak_flops, calibrate this device's matmul rate at the model's width (every rank)."""
        self.nonfinite_logs = 0
        self.model_flos = 0.0
        if self.args.peak_flops is None and model is not None:
            dtype = compute_dtype(model, self.args)
            self.peak_flops = calibrate_matmul_flops(model_width(model), dtype, self.args.device)
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
                                 tok_s=logs.get("train_tokens_per_second"), mfu=logs.get("mfu"))
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

    def speed_summary(self, metrics: dict) -> str:
        """The final summary's speed line: the model GFLOP/s train() achieved and its MFU against
        the peak it used. Guide: performance | Mirrors: the mfu nanoGPT's train.py prints"""
        line = f"speed: {metrics['train_model_flops_per_second'] / 1e9:.2f} GFLOP/s of model FLOPs"
        if metrics.get("mfu") is not None:
            source = ("peak_flops" if self.args.peak_flops is not None
                      else "a matmul calibration at train start")
            ranks = f" x {self.args.world_size} ranks" if self.args.world_size > 1 else ""
            line += (f", MFU {100 * metrics['mfu']:.1f}% of {self.peak_flops / 1e9:.1f} GFLOP/s"
                     f"{ranks} ({source})")
        return line

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


# ----------------------------------------------------------------------------- FLOPs: transformers'
# total_flos, the model FLOPs of trainer_utils.model_flops, and the peak that mfu divides by
def matmul_parameters(model) -> tuple:
    """(weights, trainable weights) that multiply activations, the N of 6N: every nn.Linear (the
    base layers, lm_head once even when tied, LoRA's A and B) and 4-bit linear at in x out.
    Guide: performance | Differs: DoRA's weight norm and prompt tuning's encoder are left out."""
    total = trainable = 0
    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, Linear4bit)):
            total += module.in_features * module.out_features
            trainable += module.in_features * module.out_features * module.weight.requires_grad
    return total, trainable


def non_embedding_parameters(model) -> int:
    """Parameters of the base model (LoRA included, a PEFT wrapper's prompt encoder not) less its
    nn.Embedding weights, a packed 4-bit byte as 2: the N of transformers' total_flos.
    Mirrors: transformers ModuleUtilsMixin.num_parameters(exclude_embeddings=True)"""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    embeddings = {id(m.weight) for m in base.modules() if isinstance(m, torch.nn.Embedding)}
    return sum(p.numel() * (2 * p.element_size() if p.dtype == torch.uint8 else 1)
               for p in base.parameters() if id(p) not in embeddings)


def attention_shape(model) -> tuple:
    """(heads x head_dim, layers) of the model's config; (0, 0) for a model without one."""
    config = getattr(model, "config", None)
    if config is None:
        return 0, 0
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_attention_heads * head_dim, config.num_hidden_layers


def store_flos(trainer) -> float:
    """Add the window's 6 x input_ids elements x non_embedding_parameters to state.total_flos and
    return the window's model FLOPs (trainer_utils.model_flops), both summed over ranks.
    Mirrors: transformers Trainer.store_flos, Trainer.floating_point_ops (per micro-batch)"""
    model, window = trainer.model, trainer._window
    flos = [6 * window.input_ids * non_embedding_parameters(model),
            model_flops(*matmul_parameters(model), *attention_shape(model), window.seq_lengths)]
    if trainer.args.world_size > 1:  # float64: exact far past fp32's 2^24
        summed = torch.tensor(flos, dtype=torch.float64, device=trainer.args.device)
        flos = distributed.all_reduce_sum(summed).tolist()
    trainer.state.total_flos += float(flos[0])
    trainer.reporter.model_flos += float(flos[1])
    return float(flos[1])


def flos_metrics(trainer, metrics: dict) -> dict:
    """total_flos once the last window is stored, then nanosft's own: this train() call's model
    FLOP/s over metrics["train_runtime"] (all ranks) and its mfu (per device).
    Mirrors: transformers Trainer._finalize_training (store_flos, metrics["total_flos"])"""
    store_flos(trainer)
    trainer._window = LogWindow()  # stored: never counted twice
    achieved = trainer.reporter.model_flos / max(metrics["train_runtime"], 1e-9)
    out = {"total_flos": trainer.state.total_flos,
           "train_model_flops_per_second": round(achieved, 1)}
    if trainer.reporter.peak_flops:
        out["mfu"] = achieved / (trainer.reporter.peak_flops * trainer.args.world_size)
    return out


def compute_dtype(model, args) -> torch.dtype:
    """The dtype the matmuls run in: autocast's (bf16 / fp16), else the first float parameter's."""
    if args.bf16 or args.fp16:
        return torch.bfloat16 if args.bf16 else torch.float16
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def model_width(model) -> int:
    """config.hidden_size, else the in_features of the model's first linear layer."""
    width = getattr(getattr(model, "config", None), "hidden_size", None)
    if width is None:
        width = next(m.in_features for m in model.modules() if isinstance(m, torch.nn.Linear))
    return width


def calibrate_matmul_flops(width, dtype=torch.float32, device="cpu", budget_s=0.2) -> float:
    """Best FLOP/s of torch.mm at (M, width) x (width, width): M doubles from a ~16 MFLOP product
    while a product takes under budget_s / 4, up to ~2 GFLOP (at most 4096 rows), then repeats,
    stopping after about budget_s or 3 products at the largest M. Guide: performance
    Mirrors: nothing in transformers (it reports no MFU)"""
    device = torch.device(device)
    max_rows = max(1, min(4096, 2**30 // width**2))
    rows = max(1, min(max_rows, 2**23 // width**2))
    generator = torch.Generator(device).manual_seed(0)  # the global RNG is the run's: untouched
    a = torch.randn(max_rows, width, generator=generator, device=device, dtype=dtype)
    b = torch.randn(width, width, generator=generator, device=device, dtype=dtype)
    best, spent, at_max = 0.0, 0.0, 0
    # a slow kernel (bf16 on a CPU without bf16 units) stops the growth early: it costs < 1 s
    while spent < budget_s and at_max < 3:
        start = time.perf_counter()
        torch.mm(a[:rows], b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        spent += seconds
        best = max(best, 2 * rows * width * width / max(seconds, 1e-9))
        at_max += rows == max_rows
        if seconds < budget_s / 4:
            rows = min(max_rows, 2 * rows)
    return best


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
        model_flos = store_flos(trainer)  # state.total_flos as transformers; + the model FLOPs
        # tokens/s, samples/s, ..., model FLOP/s and mfu
        logs.update(trainer._window.speed(args.world_size, steps, model_flos,
                                          trainer.reporter.peak_flops))
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

"""Trainer: the training loop of transformers 5.23, small enough to read beside walkthrough 2.2-2.5.

Trainer.train -> _inner_training_loop (2.3: dataloader, derived counts, epoch / update /
micro-batch loops) -> training_step (2.4) -> compute_loss (2.5; SFTTrainer.compute_loss in sft.py
on the SFT path); the guide's accumulation, clipping, autocast, fp16 GradScaler, DDP no_sync.
log_history matches transformers Trainer step by step. This file holds the loop; what happens
between steps (log, evaluate, save) is trainer_callback.py, the output_dir output_folder.py.
"""

import contextlib
import math
import time

import torch
from torch.utils.data import DataLoader

from nanosft import distributed, trainer_callback
from nanosft.io import checkpoint
from nanosft.parallel import fsdp
from nanosft import memory
from nanosft.args import TrainingArguments
from nanosft.collator import default_data_collator
from nanosft.optim import create_optimizer, create_scheduler
from nanosft.trainer_utils import (IGNORE_INDEX, LogWindow, TrainerControl,  # noqa: F401
                                   TrainerState, TrainOutput, build_dataloader,
                                   convert_outputs_to_fp32, count_num_items_in_batch,
                                   find_executable_batch_size,  # auto_find_batch_size
                                   autocast_context,
                                   label_smoothed_loss, model_accepts_loss_kwargs, no_sync,
                                   prepare_model, select_columns, set_seed, signature_columns,
                                   skip_first_batches, speed_metrics)


class Trainer:
    """Training loop for a causal LM (or its PEFT wrapper): train, evaluate, save, resume.
    Walkthrough 2.2 - 2.5 | Mirrors: transformers Trainer (5.23), accelerate DDP/autocast/scaler
    Differs: no callbacks, hyperparameter search, DeepSpeed, DataParallel, apex; causal LMs only."""

    max_nonfinite_logs = 3  # Differs: stop after this many nan/inf logging windows in a row

    def __init__(self, model, args=None, data_collator=None, train_dataset=None,
                 eval_dataset=None, processing_class=None, compute_loss_func=None,
                 optimizers=(None, None)):
        self.args = args if args is not None else TrainingArguments()
        self._memory_tracker = memory.MemoryTracker(self.args.skip_memory_metrics)
        self._memory_tracker.start("init")  # "memory metrics - must set up as early as possible"
        set_seed(self.args.seed)  # Trainer.__init__ seeds before anything draws from the RNG
        distributed.init_distributed(self.args)
        self.model = model.to(self.args.device)
        self.data_collator = data_collator if data_collator is not None else default_data_collator
        self.train_dataset = train_dataset
        self.eval_dataset = eval_dataset
        self.processing_class = processing_class
        self.compute_loss_func = compute_loss_func
        self.optimizer, self.lr_scheduler = optimizers
        self.model_accepts_loss_kwargs = model_accepts_loss_kwargs(self.model)
        # fp16 needs loss scaling; bf16 has fp32's exponent range (guide: mixed precision)
        self.scaler = torch.amp.GradScaler(self.args.device.type) if self.args.fp16 else None
        self.state = TrainerState()
        self.control = TrainerControl()
        self.reporter = trainer_callback.Reporter(self.args, distributed.is_main_process())
        self.current_gradient_accumulation_steps = 1
        # "Effective batch size; may be reduced by find_executable_batch_size"
        self._train_batch_size = self.args.train_batch_size
        self._signature_columns = None
        self._memory_tracker.stop_and_update_metrics("init")

    # ----- data -----
    def _collate(self, features):
        """Drop the keys the model cannot take (remove_unused_columns), then the data_collator."""
        if self._signature_columns is None and self.args.remove_unused_columns:
            self._signature_columns = signature_columns(self.model)
        keep = self._signature_columns if self.args.remove_unused_columns else None
        return select_columns(features, self.data_collator, keep)

    def get_train_dataloader(self) -> DataLoader:
        """Micro-batches of per_device_train_batch_size in the seeded train_sampling_strategy order.
        Walkthrough 2.3 | Mirrors: Trainer.get_train_dataloader (random or group_by_length)"""
        return build_dataloader(self.train_dataset, self._train_batch_size, self.args,
                                self._collate, shuffle=True,
                                drop_last=self.args.dataloader_drop_last)

    def get_eval_dataloader(self, eval_dataset=None) -> DataLoader:
        """Eval batches in dataset order, split over ranks. Mirrors: Trainer.get_eval_dataloader
        Differs: under DDP the last round repeats a few examples (accelerate's even batches)."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        return build_dataloader(dataset, self.args.eval_batch_size, self.args, self._collate,
                                shuffle=False, drop_last=False)

    def set_initial_training_values(self, args, dataloader):
        """Epochs, update steps per epoch, examples, samples, total batch, micro-batches, max_steps.
        Walkthrough 2.3 | Mirrors: Trainer.set_initial_training_values (5.23)
        Differs: the walkthrough passes total_train_batch_size in and gets epoch_based and
        len_dataloader back; 5.23 computes the first here and returns it and steps_in_epoch."""
        # "total_train_batch_size = self._train_batch_size * args.gradient_accumulation_steps * ..."
        total_train_batch_size = (self._train_batch_size * args.gradient_accumulation_steps
                                  * args.world_size)
        steps_in_epoch = len(dataloader)  # micro-batches of this rank
        # the last, partial accumulation window still makes one optimizer step
        num_update_steps_per_epoch = math.ceil(steps_in_epoch / args.gradient_accumulation_steps)
        num_update_steps_per_epoch = max(num_update_steps_per_epoch, 1)
        num_examples = len(dataloader.dataset)
        if args.max_steps > 0:
            max_steps = args.max_steps
            num_train_epochs = math.ceil(max_steps / num_update_steps_per_epoch)
            num_train_samples = max_steps * total_train_batch_size
        else:
            # "if max_steps is not set, max_steps == num_train_epochs * num_update_steps_per_epoch"
            max_steps = math.ceil(args.num_train_epochs * num_update_steps_per_epoch)
            num_train_epochs = math.ceil(args.num_train_epochs)
            num_train_samples = num_examples * args.num_train_epochs
        return (num_train_epochs, num_update_steps_per_epoch, num_examples, num_train_samples,
                total_train_batch_size, steps_in_epoch, max_steps)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """Prefetch up to `num_batches` micro-batches and count their supervised tokens: a float32
        0-d tensor, summed over ranks when average_tokens_across_devices.
        Walkthrough 2.3 | Mirrors: Trainer.get_batch_samples, Trainer._get_num_items_in_batch"""
        batch_samples = []
        for _ in range(num_batches):
            try:
                batch_samples.append(next(epoch_iterator))
            except StopIteration:
                break
        if not (batch_samples and "labels" in batch_samples[0]
                and (self.model_accepts_loss_kwargs or self.compute_loss_func is not None)):
            return batch_samples, None
        num_items_in_batch = count_num_items_in_batch(batch_samples).to(device)
        if self.args.average_tokens_across_devices and self.args.world_size > 1:
            num_items_in_batch = distributed.all_reduce_sum(num_items_in_batch)
        return batch_samples, num_items_in_batch / 1  # int64 -> float32, as transformers

    # ----- train() and the loop of walkthrough 2.3 -----
    def train(self, resume_from_checkpoint=None) -> TrainOutput:
        """Main training entry point: resolve the checkpoint, check output_dir, enable activation
        checkpointing, then the inner loop. Walkthrough 2.2 | Mirrors: Trainer.train
        Differs: a fresh run refuses an output_dir holding another run (check_output_dir)."""
        args = self.args
        self._memory_tracker.start("train")
        resume_from_checkpoint = checkpoint.resolve_and_check(  # also: output_dir, set-up
            args, self.model, resume_from_checkpoint or args.resume_from_checkpoint)
        if args.gradient_checkpointing:
            self.model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs)
        if not args.auto_find_batch_size:
            return self._inner_training_loop(args, resume_from_checkpoint)
        # "inner_training_loop = find_executable_batch_size(self._inner_training_loop, ...)": on
        # out-of-memory the whole loop restarts with a smaller batch (a new schedule length too)
        lr_scheduler = self.lr_scheduler  # the caller's, or None for one made per attempt

        def inner_training_loop(batch_size):
            self._train_batch_size = batch_size  # Trainer._update_auto_batch_size
            self.lr_scheduler = lr_scheduler
            return self._inner_training_loop(args, resume_from_checkpoint)

        return find_executable_batch_size(inner_training_loop, self._train_batch_size)

    def _prepare_for_training(self, max_steps):
        """Optimizer, FSDP / DDP / compile wrapping, then the scheduler (the optimizer is final).
        Walkthrough 2.3 | Mirrors: Trainer._prepare_for_training"""
        if self.args.fsdp:  # fully_shard swaps in sharded parameters: before the optimizer
            fsdp.apply_fsdp(self.model, self.args.fsdp_config, self.args.device)
        if self.optimizer is None:
            self.optimizer = create_optimizer(self.model, self.args)
        model = prepare_model(self.model, self.args)  # DDP / torch.compile, or self.model
        if self.lr_scheduler is None:
            self.lr_scheduler = create_scheduler(self.args, self.optimizer, max_steps)
        return model

    def _inner_training_loop(self, args, resume_from_checkpoint=None) -> TrainOutput:
        """Epochs -> update steps -> micro-batches: accumulate, clip, step, schedule, log, save.
        Walkthrough 2.3 | Mirrors: Trainer._inner_training_loop + _run_epoch + _finalize_training
        Differs: 5.23 moved the epoch body into `_run_epoch`; it stays inline, as the walkthrough
        prints it. tr_loss is a local, as in the walkthrough (5.23: self._tr_loss)."""
        # Data loader and number of training steps
        train_dataloader = self.get_train_dataloader()
        # Setting up training control variables (num_train_epochs, ..., max_steps)
        (num_train_epochs, num_update_steps_per_epoch, num_examples, num_train_samples,
         total_train_batch_size, steps_in_epoch, max_steps) = self.set_initial_training_values(
            args, train_dataloader)
        model = self._prepare_for_training(max_steps)
        # 5.23's _init_training_state: a fresh TrainerState, or the checkpoint's (all restored)
        self.state, epochs_trained, steps_trained_in_current_epoch = checkpoint.init_training_state(
            args, self.model, self.optimizer, self.lr_scheduler, self.scaler, max_steps,
            num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint)
        self.state.train_batch_size = self._train_batch_size  # what auto_find_batch_size settled on

        # Train!  (rank 0 prints the lines transformers logs: "***** Running training *****")
        if distributed.is_main_process():
            trainer_callback.print_train_banner(
                args, self.model, num_examples, num_train_epochs, num_update_steps_per_epoch,
                total_train_batch_size, max_steps, resume_from_checkpoint, epochs_trained,
                self.state.global_step)
            self._memory_ledger = memory.predict_for_trainer(self.model, args)
            if self._memory_ledger is not None:  # guide: memory (nanosft/memory/__init__.py)
                print(memory.summary_line(self._memory_ledger))
        self.reporter.on_train_begin(max_steps, self.state.global_step, self.model)  # mfu's peak
        self._peak_memory = memory.PeakMemory(args.device.type).start()
        start_time = time.time()
        self._initial_global_step = self.state.global_step
        # "tr_loss is a tensor to avoid synchronization of TPUs through .item()"
        tr_loss = torch.tensor(0.0, device=args.device)
        # "_total_loss_scalar is updated everytime .item() has to be called on tr_loss"
        self._total_loss_scalar = 0.0
        self._globalstep_last_logged = self.state.global_step
        self._window = LogWindow()
        self.control = TrainerControl()
        model.zero_grad()
        grad_norm = None
        learning_rate = None

        if args.eval_on_start:
            self._evaluate()

        for epoch in range(epochs_trained, num_train_epochs):
            step = -1
            num_update_steps_trained = 0
            train_dataloader.batch_sampler.set_epoch(epoch)  # order = randperm(seed + epoch)
            epoch_dataloader = train_dataloader
            if epoch == epochs_trained and steps_trained_in_current_epoch > 0:
                # resume mid-epoch: the same order, less the micro-batches already trained on
                epoch_dataloader = skip_first_batches(train_dataloader,
                                                      steps_trained_in_current_epoch)
                step = steps_trained_in_current_epoch - 1  # Differs: replaces steps_skipped
                num_update_steps_trained = (steps_trained_in_current_epoch
                                            // args.gradient_accumulation_steps)
            epoch_iterator = iter(epoch_dataloader)

            # "We chunkify the epoch iterator into gradient accumulation steps `n` batches"
            # Differs: the walkthrough takes num_examples % GA and counts total_updates; 5.23
            # (and this) the micro-batches, over range(num_update_steps_trained, ..._per_epoch)
            remainder = steps_in_epoch % args.gradient_accumulation_steps
            if remainder == 0:
                remainder = args.gradient_accumulation_steps
            for update_step in range(num_update_steps_trained, num_update_steps_per_epoch):
                num_batches = (args.gradient_accumulation_steps
                               if update_step != num_update_steps_per_epoch - 1 else remainder)
                batch_samples, num_items_in_batch = self.get_batch_samples(
                    epoch_iterator, num_batches, args.device)
                # the divisor of a loss NOT normalised by num_items_in_batch (short last window)
                self.current_gradient_accumulation_steps = len(batch_samples)

                for i, inputs in enumerate(batch_samples):
                    step += 1
                    do_sync_step = ((step + 1) % args.gradient_accumulation_steps == 0
                                    or (step + 1) == steps_in_epoch)
                    # DDP all-reduces gradients only on the window's last micro-batch
                    last = i == len(batch_samples) - 1
                    sync = contextlib.nullcontext() if last else no_sync(model)
                    with sync:
                        tr_loss_step = self.training_step(model, inputs, num_items_in_batch)

                    if args.logging_nan_inf_filter:
                        # "if loss is nan or inf simply add the average of previous logged
                        # losses"; torch.where, not a Python `if`: no host sync per micro-batch
                        finite = torch.isfinite(tr_loss_step)
                        average = tr_loss / (1 + self.state.global_step
                                             - self._globalstep_last_logged)
                        tr_loss = tr_loss + torch.where(finite, tr_loss_step, average)
                        self._window.nonfinite = self._window.nonfinite | ~finite
                    else:
                        tr_loss = tr_loss + tr_loss_step
                    self._window.add(inputs)

                    if do_sync_step:
                        grad_norm = self._clip_grad_norm(model)
                        if self.scaler is not None:
                            # fp16: the GradScaler skips the step when the grads hold inf/nan,
                            # then lowers the scale, which is how a skip shows
                            scale_before = self.scaler.get_scale()
                            self.scaler.step(self.optimizer)
                            self.scaler.update()
                            optimizer_step_was_skipped = self.scaler.get_scale() < scale_before
                        else:
                            self.optimizer.step()
                            optimizer_step_was_skipped = False
                        # "get leaning rate before update": the lr this optimizer step used
                        learning_rate = self._get_learning_rate()
                        # not after a skipped step; ReduceLROnPlateau steps in _evaluate
                        if not optimizer_step_was_skipped and not self._is_plateau():
                            self.lr_scheduler.step()
                        model.zero_grad()
                        self.state.global_step += 1
                        self.state.epoch = epoch + (step + 1) / steps_in_epoch
                        self.reporter.on_step()
                        self._on_step_end()
                        self._maybe_log_save_evaluate(tr_loss, grad_norm, learning_rate)
                    if self.control.should_training_stop:
                        break
                if self.control.should_training_stop:
                    break

            if step < 0:
                print(f"Warning: epoch {epoch} yielded no batch; stopping at step "
                      f"{self.state.global_step}.")
                self.control.should_training_stop = True
            self._on_epoch_end()
            self._maybe_log_save_evaluate(tr_loss, grad_norm, learning_rate)
            if self.control.should_training_stop:
                break

        self.reporter.on_train_end()
        return self._finalize_training(tr_loss, num_train_samples, start_time)

    def _finalize_training(self, tr_loss, num_train_samples, start_time) -> TrainOutput:
        """Mean per-step loss of this call, speed metrics, then the best model reload.
        Mirrors: Trainer._finalize_training (5.23)
        Differs: the walkthrough reloads the best model first and divides by global_step; 5.23
        (and this) divides by the steps of this call (a resumed run) and logs before reloading."""
        # "add remaining tr_loss"
        self._total_loss_scalar += tr_loss.item()
        steps = self.state.global_step - self._initial_global_step
        train_loss = self._total_loss_scalar / max(steps, 0.001)
        # num_train_samples covers the whole schedule: count the share of the steps run here
        samples = num_train_samples * steps / max(self.state.max_steps, 1)
        metrics = speed_metrics("train", start_time, num_samples=samples, num_steps=steps)
        metrics.update(trainer_callback.flos_metrics(self, metrics), train_loss=train_loss)
        self._memory_tracker.stop_and_update_metrics("train", metrics)
        if distributed.is_main_process():
            print(memory.peak_line(self._peak_memory.stop(), getattr(self, "_memory_ledger", None)))
        self.log(metrics)
        if self.args.load_best_model_at_end and self.state.best_model_checkpoint is not None:
            self._load_best_model()
        return TrainOutput(self.state.global_step, train_loss, metrics)

    # ----- one micro-batch: walkthrough 2.4 and 2.5 -----
    def _prepare_inputs(self, inputs: dict) -> dict:
        """A new dict with every tensor on args.device. Mirrors: Trainer._prepare_inputs"""
        return {k: v.to(self.args.device) if torch.is_tensor(v) else v for k, v in inputs.items()}

    def compute_loss_context_manager(self):
        """bf16 / fp16 autocast around the forward (CPU or CUDA), else nothing.
        Mirrors: Trainer.compute_loss_context_manager + accelerate's autocast of the forward"""
        return autocast_context(self.args)

    def training_step(self, model, inputs: dict, num_items_in_batch=None) -> torch.Tensor:
        """Forward, loss, backward of one micro-batch; returns the (GA-scaled) loss, detached.
        Walkthrough 2.4 | Mirrors: Trainer.training_step (5.23)
        Differs: no `loss.mean()` for n_gpu > 1 (no DataParallel) and no apex branch; a loss not
        normalised by num_items_in_batch is divided by the window's real size (5.23)."""
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()  # schedule-free optimizers switch their weights to train mode
        inputs = self._prepare_inputs(inputs)
        loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        # "Finally we need to normalize the loss for reporting": a loss not already divided by
        # the window's token count is a per-micro-batch mean: divide by the window's batches
        loss_is_scaled_for_ga = ((self.model_accepts_loss_kwargs and num_items_in_batch is not None)
                                 or self.compute_loss_func is not None)
        if not loss_is_scaled_for_ga:
            loss = loss / self.current_gradient_accumulation_steps
        if self.scaler is not None:
            self.scaler.scale(loss).backward()  # fp16: scale up so small grads survive
        else:
            loss.backward()  # accelerator.backward(loss)
        return loss.detach()

    def compute_loss(self, model, inputs: dict, return_outputs=False, num_items_in_batch=None):
        """The model's own loss, or compute_loss_func / label smoothing on its logits.
        Walkthrough 2.5 | Mirrors: Trainer.compute_loss. On the SFT path SFTTrainer.compute_loss
        (sft.py) overrides it. Differs: compute_loss_func is called without labels too (5.23;
        the walkthrough calls it only when labels were popped)."""
        if ((self.args.label_smoothing_factor != 0 or self.compute_loss_func is not None)
                and "labels" in inputs):
            labels = inputs.pop("labels")
        else:
            labels = None
        if self.model_accepts_loss_kwargs and num_items_in_batch is not None:
            inputs = {**inputs, "num_items_in_batch": num_items_in_batch}
        with self.compute_loss_context_manager():
            outputs = model(**inputs)
        outputs = convert_outputs_to_fp32(outputs)
        if self.compute_loss_func is not None:  # "User-defined compute_loss function"
            loss = self.compute_loss_func(outputs, labels, num_items_in_batch=num_items_in_batch)
        elif labels is not None:
            loss = label_smoothed_loss(outputs["logits"], labels, self.args.label_smoothing_factor,
                                       num_items_in_batch)
        else:
            if outputs["loss"] is None:
                raise ValueError(f"The model returned no loss; the batch has keys "
                                 f"{sorted(inputs)}. Add `labels` to the batch (a collator such "
                                 "as DataCollatorForLanguageModeling does).")
            loss = outputs["loss"]
        if (self.args.average_tokens_across_devices and num_items_in_batch is not None
                and (self.model_accepts_loss_kwargs or self.compute_loss_func is not None)):
            # num_items_in_batch counts every rank's tokens and DDP averages: undo the average
            loss = loss * self.args.world_size
        return (loss, outputs) if return_outputs else loss

    # ----- the sync step: clip (the optimizer step itself is inline in the loop) -----
    def _clip_grad_norm(self, model) -> torch.Tensor:
        """Pre-clip global 2-norm of the gradients; clips to max_grad_norm when it is > 0.
        Guide: gradient clipping | Mirrors: Trainer._clip_grad_norm, accelerate clip_grad_norm_"""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
        max_norm = self.args.max_grad_norm if self.args.max_grad_norm > 0 else float("inf")
        # under FSDP the norm of sharded gradients is a DTensor: to_full gives one number
        return distributed.to_full(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))

    def _is_plateau(self) -> bool:
        return isinstance(self.lr_scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)

    def _get_learning_rate(self) -> float:
        """Learning rate of param group 0. Mirrors: Trainer._get_learning_rate"""
        if self._is_plateau():
            return self.optimizer.param_groups[0]["lr"]
        return self.lr_scheduler.get_last_lr()[0]

    # ----- logging, evaluation, saving (the flags and the reporting: trainer_callback.py) -----
    def _on_step_end(self) -> None:
        """Set the log / evaluate / save / stop flags. Mirrors: DefaultFlowCallback.on_step_end"""
        trainer_callback.on_step_end(self.args, self.state, self.control)

    def _on_epoch_end(self) -> None:
        """The "epoch" strategies. Mirrors: DefaultFlowCallback.on_epoch_end"""
        trainer_callback.on_epoch_end(self.args, self.control)

    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, learning_rate=None) -> None:
        """Log the window's mean loss and throughput, evaluate, track the best, save a checkpoint,
        as self.control says. Walkthrough 2.3 | Mirrors: Trainer._maybe_log_save_evaluate
        Differs: no model / trial / epoch / start_time arguments; body in trainer_callback.py."""
        trainer_callback.log_save_evaluate(self, tr_loss, grad_norm, learning_rate)

    def log(self, logs: dict) -> None:
        """Add epoch, append to state.log_history; rank 0 reports it (trainer_callback.Reporter).
        Mirrors: Trainer.log | Differs: no start_time argument; the throughput is in the logs."""
        logs["epoch"] = self.state.epoch
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self.reporter.on_log(logs, self.state.global_step)

    def evaluate(self, eval_dataset=None, metric_key_prefix="eval") -> dict:
        """Mean eval loss (each batch's loss weighted by its size), perplexity, speed; logged.
        Mirrors: Trainer.evaluate | Differs: adds perplexity, no compute_metrics; SFTTrainer.log
        adds TRL's eval_mean_token_accuracy. Body: trainer_callback.evaluate."""
        return trainer_callback.evaluate(self, eval_dataset, metric_key_prefix)

    def _evaluate(self) -> dict:
        """evaluate(), then a ReduceLROnPlateau step on its metric. Mirrors: Trainer._evaluate"""
        return trainer_callback.evaluate_and_step_plateau(self)

    def _save_checkpoint(self) -> None:
        """Write output_dir/checkpoint-<step>, rotate old ones. Mirrors: Trainer._save_checkpoint"""
        trainer_callback.save_checkpoint(self)

    def _load_best_model(self) -> None:
        """Reload the weights of state.best_model_checkpoint. Mirrors: Trainer._load_best_model"""
        checkpoint.load_model_weights(self.model, self.state.best_model_checkpoint)

    def save_model(self, output_dir=None) -> None:
        """Save the model (a PEFT model: its adapter only) and the tokenizer; every rank calls it
        (FSDP gathers the shards), rank 0 writes.
        Mirrors: transformers Trainer.save_model | Differs: no training_args.bin."""
        checkpoint.save_model(self.model, self.processing_class, output_dir or self.args.output_dir)

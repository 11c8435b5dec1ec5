"""Trainer: the training loop of transformers 5.23, small enough to read beside walkthrough 2.2 - 2.5.

Trainer.train -> _inner_training_loop (walkthrough 2.3: dataloader, derived counts, the epoch / update /
micro-batch loops) -> training_step (2.4) -> compute_loss (2.5). Also the guide's gradient accumulation,
clipping, mixed precision (autocast, fp16 GradScaler), DDP no_sync, logging, evaluation and checkpoints.
Numerics follow shared/reference/hf-reference.md section 1: the same data order, num_items_in_batch,
loss scaling, grad_norm and logged learning rate, so log_history matches transformers step by step.
"""

import contextlib
import inspect
import json
import math
import os
import time

import torch
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from nanosft import checkpoint, distributed
from nanosft.args import TrainingArguments
from nanosft.collator import default_data_collator
from nanosft.optim import create_optimizer, get_scheduler
from nanosft.trainer_utils import (
    IGNORE_INDEX,
    LogWindow,
    SeedableBatchSampler,
    TrainerControl,
    TrainerState,
    TrainOutput,
    label_smoothed_loss,
    model_accepts_loss_kwargs,
    select_columns,
    set_seed,
    skip_first_batches,
)


class Trainer:
    """Full-featured training loop for a causal LM (or its PEFT wrapper): train, evaluate, save, resume.
    Walkthrough 2.2 - 2.5 | Mirrors: transformers Trainer (5.23) with accelerate's DDP / autocast / GradScaler parts
    Differs: no callbacks, hyper-parameter search, DeepSpeed/FSDP, DataParallel or TP; only causal LMs (labels shift)."""

    max_nonfinite_logs = 3  # stop after this many logging windows in a row with a nan/inf loss or grad_norm

    def __init__(self, model, args=None, data_collator=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, compute_loss_func=None, optimizers=(None, None)):
        self.args = args if args is not None else TrainingArguments()
        set_seed(self.args.seed)  # "Trainer.__init__ calls set_seed(args.seed)" (hf-reference 1.3)
        distributed.init_distributed(self.args)
        self.model = model.to(self.args.device)
        self.model_wrapped = self.model
        self.data_collator = data_collator if data_collator is not None else default_data_collator
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.processing_class, self.compute_loss_func = processing_class, compute_loss_func
        self.optimizer, self.lr_scheduler = optimizers
        self.model_accepts_loss_kwargs = model_accepts_loss_kwargs(self.model)
        # fp16 needs loss scaling; bf16 has fp32's exponent range and does not (guide: mixed precision)
        self.scaler = torch.amp.GradScaler(self.args.device.type) if self.args.fp16 else None
        self.state, self.control = TrainerState(), TrainerControl()
        self.current_gradient_accumulation_steps = 1
        self._signature_columns = None

    # ----- data -----
    def _columns_to_keep(self):
        if not self.args.remove_unused_columns:
            return None
        if self._signature_columns is None:
            params = inspect.signature(self.model.forward).parameters
            self._signature_columns = set(params) | {"labels", "label", "label_ids"}
        return set(self._signature_columns)

    def _dataloader(self, dataset, batch_size, shuffle, drop_last):
        sampler = SeedableBatchSampler(
            len(dataset), batch_size, seed=self.args.data_seed if self.args.data_seed is not None else self.args.seed,
            shuffle=shuffle, drop_last=drop_last, num_replicas=distributed.get_world_size(), rank=distributed.get_rank())
        collate = lambda feats: select_columns(feats, self.data_collator, self._columns_to_keep())
        # its own generator: iter() must not draw from the global RNG, or a resumed run's dropout would differ
        return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate,
                          num_workers=self.args.dataloader_num_workers, generator=torch.Generator())

    def get_train_dataloader(self) -> DataLoader:
        """Micro-batches of per_device_train_batch_size in the seeded random order. Walkthrough 2.3 | Mirrors: Trainer.get_train_dataloader"""
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset; pass Trainer(..., train_dataset=...).")
        return self._dataloader(self.train_dataset, self.args.train_batch_size, True, self.args.dataloader_drop_last)

    def get_eval_dataloader(self, eval_dataset=None) -> DataLoader:
        """Eval batches in dataset order, split over ranks. Mirrors: Trainer.get_eval_dataloader
        Differs: under DDP the last round repeats a few examples (accelerate's even batches); transformers drops them."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("Trainer: evaluation requires an eval_dataset; pass Trainer(..., eval_dataset=...).")
        return self._dataloader(dataset, self.args.eval_batch_size, False, False)

    def set_initial_training_values(self, args, dataloader):
        """Epochs, update steps per epoch, examples, samples, total batch size, micro-batches per epoch, max_steps.
        Walkthrough 2.3 "Setting up training control variables" | Mirrors: Trainer.set_initial_training_values"""
        # "total_train_batch_size = self._train_batch_size * args.gradient_accumulation_steps * args.world_size"
        total_train_batch_size = args.train_batch_size * args.gradient_accumulation_steps * args.world_size
        steps_in_epoch = len(dataloader)  # micro-batches of this rank
        # the last, partial accumulation window still makes one optimizer step
        num_update_steps_per_epoch = max(math.ceil(steps_in_epoch / args.gradient_accumulation_steps), 1)
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
        """Prefetch up to `num_batches` micro-batches and count their supervised tokens.
        Walkthrough 2.3 | Mirrors: Trainer.get_batch_samples, Trainer._get_num_items_in_batch
        num_items_in_batch = sum over the window of (labels[..., 1:] != -100): the model shifts labels, so position 0
        is never a target. A float32 0-d tensor, summed over ranks when average_tokens_across_devices."""
        batch_samples = []
        for _ in range(num_batches):
            try:
                batch_samples.append(next(epoch_iterator))
            except StopIteration:
                break
        count = (batch_samples and "labels" in batch_samples[0]
                 and (self.model_accepts_loss_kwargs or self.compute_loss_func is not None))
        if not count:
            return batch_samples, None
        num_items_in_batch = sum(
            (b["shift_labels"] if "shift_labels" in b else b["labels"][..., 1:]).ne(IGNORE_INDEX).sum()
            for b in batch_samples)
        num_items_in_batch = num_items_in_batch.to(device)
        if self.args.average_tokens_across_devices and self.args.world_size > 1:
            num_items_in_batch = distributed.all_reduce_sum(num_items_in_batch)
        return batch_samples, num_items_in_batch / 1  # true division: int64 -> float32, as transformers

    # ----- train() and the loop of walkthrough 2.3 -----
    def train(self, resume_from_checkpoint=None) -> TrainOutput:
        """Main training entry point: optional activation checkpointing and resume, then the inner loop.
        Walkthrough 2.2 | Mirrors: Trainer.train"""
        args = self.args
        resume_from_checkpoint = checkpoint.resolve_resume_checkpoint(
            resume_from_checkpoint or args.resume_from_checkpoint, args.output_dir)
        if args.gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs)
        return self._inner_training_loop(args, resume_from_checkpoint)

    def _prepare_for_training(self, max_steps):
        """Optimizer, DDP / compile wrapping, then the scheduler (created after the optimizer is final).
        Walkthrough 2.3 | Mirrors: Trainer._prepare_for_training, accelerate Accelerator.prepare_model"""
        if self.args.fsdp:  # fully_shard swaps in sharded parameters, so it comes before the optimizer
            distributed.apply_fsdp(self.model, self.args.fsdp_config, self.args.device)
        if self.optimizer is None:
            self.optimizer = create_optimizer(self.model, self.args)
        model = self.model
        if self.args.world_size > 1 and not self.args.fsdp:
            device_ids = [self.args.local_process_index] if self.args.device.type == "cuda" else None
            model = torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
        if self.args.torch_compile:
            model = torch.compile(model)  # shares parameters with self.model; checkpoints save self.model
        if self.lr_scheduler is None:
            self.lr_scheduler = get_scheduler(
                self.args.lr_scheduler_type, self.optimizer, num_warmup_steps=self.args.get_warmup_steps(max_steps),
                num_training_steps=max_steps, scheduler_specific_kwargs=self.args.lr_scheduler_kwargs)
        self.model_wrapped = model
        return model

    def _init_training_state(self, max_steps, num_train_epochs, num_update_steps_per_epoch, resume_from_checkpoint):
        """A fresh TrainerState, or the checkpoint's (with model/optimizer/scheduler/scaler/RNG restored).
        Mirrors: Trainer._init_training_state, Trainer._load_optimizer_and_scheduler, Trainer._load_rng_state
        Differs: RNG is restored here, not after skipping batches: our data order never draws from the global RNG."""
        self.state = TrainerState(max_steps=max_steps, num_train_epochs=num_train_epochs,
                                  train_batch_size=self.args.train_batch_size)
        self.state.compute_steps(self.args, max_steps)
        if resume_from_checkpoint is None:
            return 0, 0
        saved = checkpoint.load_checkpoint(resume_from_checkpoint, model=self.model, optimizer=self.optimizer,
                                           lr_scheduler=self.lr_scheduler, scaler=self.scaler,
                                           rank=distributed.get_rank(), world_size=self.args.world_size)
        self.state = TrainerState.from_dict(saved)
        epochs_trained = self.state.global_step // num_update_steps_per_epoch
        steps_trained_in_current_epoch = 0
        if not self.args.ignore_data_skip:
            # micro-batches already consumed in the interrupted epoch
            steps_trained_in_current_epoch = (self.state.global_step % num_update_steps_per_epoch
                                              * self.args.gradient_accumulation_steps)
        return epochs_trained, steps_trained_in_current_epoch

    def _inner_training_loop(self, args, resume_from_checkpoint=None) -> TrainOutput:
        """Epochs -> update steps -> micro-batches: accumulate, clip, step, schedule, log, evaluate, save.
        Walkthrough 2.3 | Mirrors: Trainer._inner_training_loop + Trainer._run_epoch + Trainer._finalize_training
        Differs: transformers 5.23 moved the epoch body into `_run_epoch`; it stays inline here as the walkthrough prints it."""
        # Data loader and number of training steps
        train_dataloader = self.get_train_dataloader()
        # Setting up training control variables: num_train_epochs, num_update_steps_per_epoch, max_steps
        (num_train_epochs, num_update_steps_per_epoch, num_examples, num_train_samples,
         total_train_batch_size, steps_in_epoch, max_steps) = self.set_initial_training_values(args, train_dataloader)
        model = self._prepare_for_training(max_steps)
        epochs_trained, steps_trained_in_current_epoch = self._init_training_state(
            max_steps, num_train_epochs, num_update_steps_per_epoch, resume_from_checkpoint)
        ga = args.gradient_accumulation_steps

        # Train!  (the lines transformers logs, printed by rank 0)
        if distributed.is_main_process():
            print("***** Running training *****")
            print(f"  Num examples = {num_examples:,}")
            print(f"  Num Epochs = {num_train_epochs:,}")
            print(f"  Num update steps per epoch = {num_update_steps_per_epoch:,}")
            print(f"  Instantaneous batch size per device = {args.per_device_train_batch_size:,}")
            print(f"  Total train batch size (w. parallel, distributed & accumulation) = {total_train_batch_size:,}")
            print(f"  Gradient Accumulation steps = {args.gradient_accumulation_steps}")
            print(f"  Total optimization steps = {max_steps:,}")
            trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
            print(f"  Number of trainable parameters = {trainable:,}")
        start_time = time.time()
        self._initial_global_step = self.state.global_step
        # "tr_loss is a tensor to avoid synchronization of TPUs through .item()"
        self._tr_loss = torch.tensor(0.0, device=args.device)
        # "_total_loss_scalar is updated everytime .item() has to be called on tr_loss"
        self._total_loss_scalar = 0.0
        self._globalstep_last_logged = self.state.global_step
        self._window = LogWindow()
        self._nonfinite_logs, self._speed = 0, None
        self.control = TrainerControl()
        model.zero_grad()
        grad_norm, learning_rate = None, None
        self._progress = tqdm(total=max_steps, initial=self.state.global_step, dynamic_ncols=True,
                              disable=bool(args.disable_tqdm) or not distributed.is_main_process())

        if args.eval_on_start:
            self._evaluate()

        for epoch in range(epochs_trained, num_train_epochs):
            step = -1
            num_update_steps_trained = 0
            train_dataloader.batch_sampler.set_epoch(epoch)  # order = randperm(seed + epoch)
            epoch_dataloader = train_dataloader
            if epoch == epochs_trained and steps_trained_in_current_epoch > 0:
                # resume mid-epoch: the same order, less the micro-batches already trained on
                epoch_dataloader = skip_first_batches(train_dataloader, steps_trained_in_current_epoch)
                step = steps_trained_in_current_epoch - 1
                num_update_steps_trained = steps_trained_in_current_epoch // ga
            epoch_iterator = iter(epoch_dataloader)

            # "We chunkify the epoch iterator into gradient accumulation steps `n` batches"
            # Differs: the walkthrough takes num_examples % GA; 5.23 takes the micro-batch count, as here.
            remainder = steps_in_epoch % ga or ga
            for update_step in range(num_update_steps_trained, num_update_steps_per_epoch):
                num_batches = ga if update_step != num_update_steps_per_epoch - 1 else remainder
                batch_samples, num_items_in_batch = self.get_batch_samples(epoch_iterator, num_batches, args.device)
                # divisor of the loss when it is NOT normalised by num_items_in_batch (short last window included)
                self.current_gradient_accumulation_steps = len(batch_samples)

                for i, inputs in enumerate(batch_samples):
                    step += 1
                    do_sync_step = (step + 1) % ga == 0 or (step + 1) == steps_in_epoch
                    # DDP all-reduces gradients only on the window's last micro-batch
                    sync = contextlib.nullcontext() if i == len(batch_samples) - 1 else self._no_sync(model)
                    with sync:
                        tr_loss_step = self.training_step(model, inputs, num_items_in_batch)

                    if args.logging_nan_inf_filter:
                        # "if loss is nan or inf simply add the average of previous logged losses"; a
                        # torch.where, not a Python `if`, so no host sync per micro-batch
                        finite = torch.isfinite(tr_loss_step)
                        average = self._tr_loss / (1 + self.state.global_step - self._globalstep_last_logged)
                        self._tr_loss += torch.where(finite, tr_loss_step, average)
                        self._window.nonfinite = self._window.nonfinite | ~finite
                    else:
                        self._tr_loss += tr_loss_step
                    self._window.add(inputs)

                    if do_sync_step:
                        grad_norm = self._clip_grad_norm(model)
                        optimizer_step_was_skipped = self._optimizer_step()
                        # "get leaning rate before update": the lr this optimizer step used
                        learning_rate = self._get_learning_rate()
                        # not after a step the fp16 GradScaler skipped (inf/nan grads); plateau steps in _evaluate
                        if not optimizer_step_was_skipped and not self._is_plateau():
                            self.lr_scheduler.step()
                        model.zero_grad()
                        self.state.global_step += 1
                        self.state.epoch = epoch + (step + 1) / steps_in_epoch
                        self._progress.update(1)
                        self._on_step_end()
                        self._maybe_log_save_evaluate(self._tr_loss, grad_norm, model, start_time, learning_rate)
                    if self.control.should_training_stop:
                        break
                if self.control.should_training_stop:
                    break

            if step < 0:
                print(f"Warning: epoch {epoch} yielded no batch; stopping at step {self.state.global_step}.")
                self.control.should_training_stop = True
            self._on_epoch_end()
            self._maybe_log_save_evaluate(self._tr_loss, grad_norm, model, start_time, learning_rate)
            if self.control.should_training_stop:
                break

        self._progress.close()
        return self._finalize_training(num_train_samples, start_time)

    def _finalize_training(self, num_train_samples, start_time) -> TrainOutput:
        """Mean per-step loss of this call, speed metrics, best model reload. Mirrors: Trainer._finalize_training"""
        # "add remaining tr_loss"
        self._total_loss_scalar += self._tr_loss.item()
        steps = self.state.global_step - self._initial_global_step
        train_loss = self._total_loss_scalar / max(steps, 0.001)
        runtime = time.time() - start_time
        samples = num_train_samples * steps / max(self.state.max_steps, 1)
        metrics = {"train_runtime": round(runtime, 4), "train_samples_per_second": round(samples / runtime, 3),
                   "train_steps_per_second": round(steps / runtime, 3), "train_loss": train_loss}
        self.log(metrics)
        if self.args.load_best_model_at_end and self.state.best_model_checkpoint is not None:
            self._load_best_model()
        return TrainOutput(self.state.global_step, train_loss, metrics)

    # ----- one micro-batch: walkthrough 2.4 and 2.5 -----
    def _prepare_inputs(self, inputs: dict) -> dict:
        """A new dict with every tensor on args.device. Mirrors: Trainer._prepare_inputs"""
        return {k: v.to(self.args.device) if torch.is_tensor(v) else v for k, v in inputs.items()}

    def _autocast(self):
        """bf16 / fp16 autocast around the forward (CPU or CUDA), else nothing. Mirrors: accelerate autocast wrapper"""
        if not (self.args.bf16 or self.args.fp16):
            return contextlib.nullcontext()
        return torch.autocast(self.args.device.type, dtype=torch.bfloat16 if self.args.bf16 else torch.float16)

    def _forward(self, model, inputs: dict):
        """model(**inputs) under autocast, half-precision logits returned as fp32. Mirrors: accelerate convert_outputs_to_fp32"""
        with self._autocast():
            outputs = model(**inputs)
        logits = getattr(outputs, "logits", None)
        if logits is not None and logits.dtype in (torch.float16, torch.bfloat16):
            outputs.logits = logits.float()
        return outputs

    def _no_sync(self, model):
        """DDP's no_sync (skip the gradient all-reduce) or nothing for one process. Mirrors: accelerate Accelerator.no_sync"""
        inner = getattr(model, "_orig_mod", model)  # torch.compile wraps the DDP module
        if distributed.is_fsdp(inner):  # FSDP2: no reduce-scatter until the window's last micro-batch
            return distributed.fsdp_no_sync(inner)
        return inner.no_sync() if isinstance(inner, torch.nn.parallel.DistributedDataParallel) else contextlib.nullcontext()

    def training_step(self, model, inputs: dict, num_items_in_batch=None) -> torch.Tensor:
        """Forward, loss, backward of one micro-batch; returns the (GA-scaled) loss, detached.
        Walkthrough 2.4 | Mirrors: Trainer.training_step
        Differs: the walkthrough divides by args.gradient_accumulation_steps whenever the model takes no loss kwargs;
        5.23 (and this code) divides by the real window size and only when num_items_in_batch did not normalise."""
        model.train()
        inputs = self._prepare_inputs(inputs)
        loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        # "Finally we need to normalize the loss for reporting": a loss already divided by the whole window's
        # token count (model takes loss kwargs, or compute_loss_func) must not be divided by GA again; a
        # per-micro-batch mean is divided by the number of micro-batches in this window.
        loss_is_scaled_for_ga = ((self.model_accepts_loss_kwargs and num_items_in_batch is not None)
                                 or self.compute_loss_func is not None)
        if not loss_is_scaled_for_ga:
            loss = loss / self.current_gradient_accumulation_steps
        if self.scaler is not None:
            self.scaler.scale(loss).backward()  # fp16: scale up so small grads do not flush to zero
        else:
            loss.backward()
        return loss.detach()

    def compute_loss(self, model, inputs: dict, return_outputs=False, num_items_in_batch=None):
        """The model's own loss, or compute_loss_func / label smoothing on its logits; x world_size under DDP.
        Walkthrough 2.5 | Mirrors: Trainer.compute_loss"""
        labels = None
        if (self.args.label_smoothing_factor != 0 or self.compute_loss_func is not None) and "labels" in inputs:
            labels = inputs.pop("labels")
        if self.model_accepts_loss_kwargs and num_items_in_batch is not None:
            inputs = {**inputs, "num_items_in_batch": num_items_in_batch}
        outputs = self._forward(model, inputs)
        if self.compute_loss_func is not None:  # "User-defined compute_loss function"
            loss = self.compute_loss_func(outputs, labels, num_items_in_batch=num_items_in_batch)
        elif labels is not None:
            loss = label_smoothed_loss(outputs["logits"], labels, self.args.label_smoothing_factor, num_items_in_batch)
        else:
            if outputs["loss"] is None:
                raise ValueError(f"The model returned no loss; the batch has keys {sorted(inputs)}. Add `labels` "
                                 "to the batch (a collator such as DataCollatorForLanguageModeling does).")
            loss = outputs["loss"]
        if (self.args.average_tokens_across_devices and num_items_in_batch is not None
                and (self.model_accepts_loss_kwargs or self.compute_loss_func is not None)):
            # num_items_in_batch counts every rank's tokens and DDP averages gradients: undo the average
            loss = loss * self.args.world_size
        return (loss, outputs) if return_outputs else loss

    # ----- the sync step: clip, optimizer, scheduler -----
    def _clip_grad_norm(self, model) -> torch.Tensor:
        """Pre-clip global 2-norm of the gradients; clips to max_grad_norm when it is > 0.
        Guide: gradient clipping | Mirrors: Trainer._clip_grad_norm, accelerate Accelerator.clip_grad_norm_"""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
        max_norm = self.args.max_grad_norm if self.args.max_grad_norm > 0 else float("inf")  # inf: measure only
        # under FSDP the norm of sharded gradients is a DTensor: to_full gives the one-process number
        return distributed.to_full(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))

    def _optimizer_step(self) -> bool:
        """optimizer.step() (through the GradScaler under fp16); True when the step was skipped.
        Walkthrough 2.3 | Mirrors: accelerate AcceleratedOptimizer.step, optimizer_step_was_skipped"""
        if self.scaler is None:
            self.optimizer.step()
            return False
        scale_before = self.scaler.get_scale()
        self.scaler.step(self.optimizer)  # skips the update when the grads hold inf/nan
        self.scaler.update()  # ... and then lowers the scale, which is how a skip is detected
        return self.scaler.get_scale() < scale_before

    def _is_plateau(self) -> bool:
        return isinstance(self.lr_scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)

    def _get_learning_rate(self) -> float:
        """Learning rate of param group 0. Mirrors: Trainer._get_learning_rate"""
        return self.optimizer.param_groups[0]["lr"] if self._is_plateau() else self.lr_scheduler.get_last_lr()[0]

    # ----- logging, evaluation, saving -----
    def _on_step_end(self) -> None:
        """Set should_log / should_evaluate / should_save / should_training_stop. Mirrors: DefaultFlowCallback.on_step_end"""
        args, state, control = self.args, self.state, self.control
        step = state.global_step
        control.should_log = ((step == 1 and args.logging_first_step)
                              or (args.logging_strategy == "steps" and step % state.logging_steps == 0))
        control.should_evaluate = args.eval_strategy == "steps" and step % state.eval_steps == 0
        control.should_save = args.save_strategy == "steps" and state.save_steps > 0 and step % state.save_steps == 0
        if step >= state.max_steps:
            control.should_training_stop = True
            control.should_evaluate = control.should_evaluate or args.eval_strategy == "steps"
            control.should_save = control.should_save or args.save_strategy == "steps"

    def _on_epoch_end(self) -> None:
        """The "epoch" strategies. Mirrors: DefaultFlowCallback.on_epoch_end"""
        self.control.should_log |= self.args.logging_strategy == "epoch"
        self.control.should_evaluate |= self.args.eval_strategy == "epoch"
        self.control.should_save |= self.args.save_strategy == "epoch"

    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, model, start_time, learning_rate=None) -> None:
        """Log the window's mean loss, evaluate, track the best metric, save a checkpoint, as the flags say.
        Walkthrough 2.3 | Mirrors: Trainer._maybe_log_save_evaluate, Trainer._determine_best_metric"""
        control = self.control
        if control.should_log and self.state.global_step > self._globalstep_last_logged:
            # mean over ranks of the summed step losses; the nan flag travels along so every rank stops together
            flag = torch.as_tensor(self._window.nonfinite, dtype=torch.float32, device=tr_loss.device)
            summed = distributed.all_reduce_sum(torch.stack([tr_loss.detach(), flag]))
            tr_loss_scalar, nonfinite = summed[0].item() / self.args.world_size, summed[1].item() > 0
            tr_loss -= tr_loss  # reset in place
            logs = {"loss": tr_loss_scalar / (self.state.global_step - self._globalstep_last_logged)}
            if grad_norm is not None:
                logs["grad_norm"] = grad_norm.item() if torch.is_tensor(grad_norm) else grad_norm
            logs["learning_rate"] = learning_rate if learning_rate is not None else self._get_learning_rate()
            self._total_loss_scalar += tr_loss_scalar
            self._globalstep_last_logged = self.state.global_step
            self._check_finite(logs, nonfinite)
            self._speed, self._window = self._window.speed(self.args.world_size), LogWindow()
            self.log(logs)
        control.should_log = False
        if control.should_evaluate:
            metrics = self._evaluate()
            if self._is_new_best(metrics) and self.args.save_strategy == "best":
                control.should_save = True
            control.should_evaluate = False
        if control.should_save:
            self._save_checkpoint()
            control.should_save = False

    def _check_finite(self, logs: dict, nonfinite: bool) -> None:
        """Stop after max_nonfinite_logs windows in a row with a nan/inf loss or grad_norm. Guide: troubleshooting"""
        bad = nonfinite or not all(math.isfinite(logs.get(k, 0.0)) for k in ("loss", "grad_norm"))
        self._nonfinite_logs = self._nonfinite_logs + 1 if bad else 0
        if self._nonfinite_logs >= self.max_nonfinite_logs:
            self.control.should_training_stop = True
            print(f"Stopping at step {self.state.global_step}: the loss or grad_norm was nan/inf in "
                  f"{self._nonfinite_logs} logging windows in a row. Try a lower learning_rate "
                  f"(now {self.args.learning_rate}), bf16 instead of fp16, or max_grad_norm=1.0 to clip gradients.")

    def log(self, logs: dict, start_time=None) -> None:
        """Add epoch, append to state.log_history; rank 0 prints and appends a line to output_dir/metrics.jsonl.
        Mirrors: Trainer.log, ProgressCallback.on_log | Differs: tokens/s and samples/s go to metrics.jsonl and the bar only."""
        logs["epoch"] = self.state.epoch
        self.state.log_history.append({**logs, "step": self.state.global_step})
        if not distributed.is_main_process():
            return
        record = {**logs, "step": self.state.global_step}
        if "loss" in logs and getattr(self, "_speed", None):
            record.update(self._speed)
            self._progress.set_postfix(loss=f"{logs['loss']:.4f}", lr=f"{logs['learning_rate']:.2e}",
                                       grad_norm=f"{logs.get('grad_norm', float('nan')):.3f}",
                                       tok_s=self._speed["tokens_per_second"])
        tqdm.write(str({k: round(v, 6) if isinstance(v, float) else v for k, v in logs.items()}))
        os.makedirs(self.args.output_dir, exist_ok=True)
        with open(os.path.join(self.args.output_dir, "metrics.jsonl"), "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")  # one line per log: appending is safe without a temp file

    def evaluate(self, eval_dataset=None, metric_key_prefix="eval") -> dict:
        """Mean loss over the eval set (per-batch losses weighted by batch size), perplexity, token accuracy.
        Mirrors: Trainer.evaluate, Trainer.evaluation_loop | Differs: accuracy/perplexity computed here, no compute_metrics."""
        start = time.time()
        model = self.model
        was_training = model.training
        model.eval()
        # [sum of batch loss * batch size, examples, correct next-token guesses, supervised tokens]
        totals = torch.zeros(4, dtype=torch.float64, device=self.args.device)
        with torch.no_grad():
            for batch in self.get_eval_dataloader(eval_dataset):
                inputs = self._prepare_inputs(batch)
                labels = inputs.get("labels")
                loss, outputs = self.compute_loss(model, dict(inputs), return_outputs=True)
                size = len(inputs["input_ids"])
                totals[0] += loss.double() * size
                totals[1] += size
                logits = getattr(outputs, "logits", None)
                if labels is not None and logits is not None:
                    target, supervised = labels[..., 1:], labels[..., 1:] != IGNORE_INDEX
                    totals[2] += (logits[..., :-1, :].argmax(-1).eq(target) & supervised).sum()
                    totals[3] += supervised.sum()
        totals = distributed.all_reduce_sum(totals)
        eval_loss = (totals[0] / totals[1].clamp(min=1)).item()
        runtime = time.time() - start
        metrics = {f"{metric_key_prefix}_loss": eval_loss,
                   f"{metric_key_prefix}_perplexity": math.exp(min(eval_loss, 700.0)),
                   f"{metric_key_prefix}_mean_token_accuracy": (totals[2] / totals[3].clamp(min=1)).item(),
                   f"{metric_key_prefix}_runtime": round(runtime, 4),
                   f"{metric_key_prefix}_samples_per_second": round(totals[1].item() / runtime, 3)}
        self.log(metrics)  # still in eval mode, so SFTTrainer.log adds its eval_ metrics
        model.train(was_training)
        return metrics

    def _evaluate(self) -> dict:
        metrics = self.evaluate()
        if self._is_plateau() and self.state.global_step > 0:  # not for eval_on_start (skip_scheduler)
            self.lr_scheduler.step(metrics[f"eval_{self.args.metric_for_best_model.removeprefix('eval_')}"])
        return metrics

    def _is_new_best(self, metrics: dict) -> bool:
        """Track state.best_metric for metric_for_best_model. Mirrors: Trainer._determine_best_metric"""
        name = self.args.metric_for_best_model
        if name is None:
            return False
        key = name if name.startswith("eval_") else f"eval_{name}"
        if key not in metrics:
            raise KeyError(f"metric_for_best_model={name!r}: {key!r} is not among the eval metrics {sorted(metrics)}.")
        value, best = metrics[key], self.state.best_metric
        if best is not None and not (value > best if self.args.greater_is_better else value < best):
            return False
        self.state.best_metric, self.state.best_global_step = value, self.state.global_step
        return True

    def _save_checkpoint(self) -> None:
        """Write output_dir/checkpoint-<step> (all ranks take part) and rotate old ones. Mirrors: Trainer._save_checkpoint"""
        folder = os.path.join(self.args.output_dir, f"checkpoint-{self.state.global_step}")
        if self.state.best_global_step == self.state.global_step:
            self.state.best_model_checkpoint = folder
        checkpoint.save_checkpoint(folder, model=self.model, optimizer=self.optimizer,
                                   lr_scheduler=self.lr_scheduler, scaler=self.scaler,
                                   trainer_state=self.state.to_dict(), args=self.args.to_dict(),
                                   rank=distributed.get_rank(), world_size=self.args.world_size)
        if distributed.is_main_process():
            checkpoint.rotate_checkpoints(self.args.output_dir, self.args.save_total_limit,
                                          self.state.best_model_checkpoint)

    def _load_best_model(self) -> None:
        """Reload the weights of state.best_model_checkpoint. Mirrors: Trainer._load_best_model"""
        checkpoint.load_model_weights(self.model, self.state.best_model_checkpoint)

    def save_model(self, output_dir=None) -> None:
        """Save the model (a PEFT model: its adapter only) and the tokenizer; the main process writes.
        Mirrors: transformers Trainer.save_model | Differs: no training_args.bin."""
        output_dir = output_dir or self.args.output_dir
        if not distributed.is_main_process():
            return
        os.makedirs(output_dir, exist_ok=True)
        self.model.save_pretrained(output_dir)
        if hasattr(self.processing_class, "save_pretrained"):
            self.processing_class.save_pretrained(output_dir)

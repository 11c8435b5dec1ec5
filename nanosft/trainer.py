"""Trainer: transformers 5.23's training loop, small enough to read beside walkthrough 1, 2.2-2.5.

Trainer.train (2.2) -> _inner_training_loop (1, 2.3: dataloader, derived counts, the "Running
training" banner, epoch / update / micro-batch loops) -> training_step (2.4) -> compute_loss
(2.5; SFTTrainer.compute_loss in sft.py on the SFT path), with the guide's accumulation, clipping,
autocast, fp16 GradScaler and DDP/FSDP no_sync inline. Everything else reaches the loop through
callbacks (trainer_callback.py; the reporting ones in nanosft.monitoring), the one model-wrapping
entry point (nanosft.parallel.wrap_model) and the checkpoint files (nanosft.run.checkpoint).
"""

import contextlib
import logging
import math
import sys
import time
import warnings

import numpy as np
import torch
from torch.utils.data import DataLoader

from nanosft import distributed
from nanosft.args import PUSH_NEEDS_NETWORK, TrainingArguments
from nanosft.collator import default_data_collator
from nanosft.model import CausalLMOutput
from nanosft.optim import (create_optimizer, create_scheduler, get_parameter_groups,
                           is_optimizer_factory)
from nanosft.reference import reference_mode_enabled
from nanosft.trainer_callback import (CallbackHandler, DefaultFlowCallback, ExportableState,
                                      ProgressCallback, TrainerControl, TrainerState)
from nanosft.trainer_pt_utils import EvalLoopContainer, LabelSmoother
from nanosft.trainer_utils import (IGNORE_INDEX, MemoryTracker, TrainOutput,  # noqa: F401
                                   EvalLoopOutput, EvalPrediction, PredictionOutput,
                                   RemoveColumnsCollator, autocast_context, build_dataloader,
                                   check_trainer_arguments, checked_metrics,
                                   compare_trainer_and_checkpoint_args,
                                   convert_outputs_to_fp32, count_num_items_in_batch,
                                   denumpify_detensorize, evaluation_loop, find_batch_size,
                                   find_executable_batch_size, has_length, label_smoothed_loss,
                                   label_smoothing_unsupported, loss_shifts_labels,
                                   model_accepts_loss_kwargs, no_sync,
                                   set_seed, signature_columns, skip_first_batches,
                                   speed_metrics, with_last)

logger = logging.getLogger(__name__)

# transformers' DEFAULT_CALLBACKS; default_callbacks adds the progress callback and, outside
# reference mode, the reporting ones
DEFAULT_CALLBACKS = [DefaultFlowCallback]
TRAINER_STATE_NAME = "trainer_state.json"  # in each checkpoint folder (nanosft.run.checkpoint)


def default_callbacks(args) -> list:
    """DefaultFlowCallback and the progress bar (all that reference mode keeps: the banner of
    start_reference_mode names them), then, outside reference mode, the product layer's
    reporting callbacks as args.report_to asks (nanosft.monitoring.callbacks.reporting_callbacks):
    the Trainer assembles them, so the callback protocol module imports none of them.
    Mirrors: transformers DEFAULT_CALLBACKS + get_reporting_integration_callbacks(report_to)"""
    if reference_mode_enabled():
        return [DefaultFlowCallback(), ProgressCallback()]
    from nanosft.monitoring.callbacks import reporting_callbacks  # product layer: imported on use

    return [DefaultFlowCallback(), *reporting_callbacks(args)]


class Trainer:
    """Training loop for any nn.Module whose forward returns a loss (a causal LM, its PEFT wrapper,
    a classifier, ...): train, evaluate, save, resume.
    Walkthrough 1, 2.2 - 2.5 | Mirrors: transformers Trainer (5.23), accelerate DDP/autocast/scaler
    Differs: no hyperparameter search, DeepSpeed, DataParallel, apex."""

    def __init__(self, model=None, args=None, data_collator=None, train_dataset=None,
                 eval_dataset=None, processing_class=None, model_init=None,
                 compute_loss_func=None, compute_metrics=None, callbacks=None,
                 optimizers=(None, None), optimizer_cls_and_kwargs=None,
                 preprocess_logits_for_metrics=None):
        """Args (transformers 5.23's, in its order): model; args (TrainingArguments); data_collator
        (features -> batch); train_dataset / eval_dataset (eval: one set or a dict of named sets);
        processing_class (saved with the model); model_init (refused: hyperparameter search);
        compute_loss_func(outputs, labels, num_items_in_batch); compute_metrics(EvalPrediction);
        callbacks; optimizers (optimizer, scheduler); optimizer_cls_and_kwargs (class, kwargs);
        preprocess_logits_for_metrics(logits, labels)."""
        check_trainer_arguments(model, model_init, optimizers, optimizer_cls_and_kwargs,
                                compute_metrics, args, callbacks)
        self.args = args if args is not None else TrainingArguments()
        self._memory_tracker = MemoryTracker(self.args.skip_memory_metrics)
        self._memory_tracker.start("init")  # "memory metrics - must set up as early as possible"
        set_seed(self.args.seed)  # Trainer.__init__ seeds before anything draws from the RNG
        distributed.init_distributed(self.args)
        self.model = model.to(self.args.device)
        self.data_collator = data_collator if data_collator is not None else default_data_collator
        self.train_dataset = train_dataset
        self.eval_dataset = eval_dataset
        self.processing_class = processing_class
        self.compute_loss_func = compute_loss_func
        self.compute_metrics = compute_metrics
        self.preprocess_logits_for_metrics = preprocess_logits_for_metrics
        self.optimizer, self.lr_scheduler = optimizers
        self.optimizer_cls_and_kwargs = optimizer_cls_and_kwargs
        # "label_smoother" (transformers' LabelSmoother); None when off or multi-label
        self.label_smoother = None
        if self.args.label_smoothing_factor != 0 and not label_smoothing_unsupported(self.model):
            self.label_smoother = LabelSmoother(epsilon=self.args.label_smoothing_factor)
        self.label_names = self.args.label_names or ["labels"]
        self.model_accepts_loss_kwargs = model_accepts_loss_kwargs(self.model)
        # a causal LM's labels shift: its first label is never a target (num_items_in_batch)
        self._loss_shifts_labels = loss_shifts_labels(self.model)
        # fp16 needs loss scaling; bf16 has fp32's exponent range (guide: mixed precision)
        self.scaler = torch.amp.GradScaler(self.args.device.type) if self.args.fp16 else None
        # DefaultFlowCallback, the progress bar, the reporting report_to asks for (not in reference
        # mode), then the caller's
        callbacks = default_callbacks(self.args) + list(callbacks or [])
        if self.args.enable_jit_checkpoint:  # SIGTERM: save a checkpoint, then stop
            from nanosft.run.jit_checkpoint import JITCheckpointCallback

            callbacks.append(JITCheckpointCallback(self))
        self.callback_handler = CallbackHandler(callbacks, self.model, self.processing_class,
                                                self.optimizer, self.lr_scheduler)
        self.state = TrainerState(is_world_process_zero=distributed.is_main_process())
        self.control = TrainerControl()
        self.current_gradient_accumulation_steps = 1
        # "Effective batch size; may be reduced by find_executable_batch_size"
        self._train_batch_size = self.args.train_batch_size
        self._signature_columns = None
        self._memory_tracker.stop_and_update_metrics("init")
        self.control = self.callback_handler.on_init_end(self.args, self.state, self.control)

    def add_callback(self, callback):
        """Add a callback (an instance or a class). Mirrors: Trainer.add_callback"""
        self.callback_handler.add_callback(callback)

    def pop_callback(self, callback):
        """Remove and return a callback (a class or an instance). Mirrors: Trainer.pop_callback"""
        return self.callback_handler.pop_callback(callback)

    def remove_callback(self, callback):
        """Remove a callback (a class or an instance). Mirrors: Trainer.remove_callback"""
        self.callback_handler.remove_callback(callback)

    # ----- data -----
    def _get_collator_with_removed_columns(self, data_collator, description=None):
        """The data_collator behind RemoveColumnsCollator, which drops the keys the model's forward
        cannot take (remove_unused_columns). Mirrors: Trainer._get_collator_with_removed_columns"""
        if not self.args.remove_unused_columns:
            return data_collator
        if self._signature_columns is None:  # "Inspect model forward signature to keep only..."
            self._signature_columns = signature_columns(self.model) | set(self.label_names)
        return RemoveColumnsCollator(data_collator, self._signature_columns, logger,
                                     type(self.model).__name__, description)

    def get_train_dataloader(self) -> DataLoader:
        """Micro-batches of per_device_train_batch_size in the seeded train_sampling_strategy order
        (a dataset without a length: streamed in its own order).
        What 2.3's `self.get_train_dataloader()` call runs.
        Mirrors: Trainer.get_train_dataloader (random or group_by_length)"""
        collate = self._get_collator_with_removed_columns(self.data_collator, "training")
        return build_dataloader(self.train_dataset, self._train_batch_size, self.args, collate,
                                shuffle=True, drop_last=self.args.dataloader_drop_last)

    def get_eval_dataloader(self, eval_dataset=None) -> DataLoader:
        """Eval batches in dataset order, split over ranks; `eval_dataset` may name one set of a
        dict of eval sets. Mirrors: Trainer.get_eval_dataloader
        Differs: under DDP the last round repeats a few examples (accelerate's even batches)."""
        if isinstance(eval_dataset, str):
            dataset = self.eval_dataset[eval_dataset]
        else:
            dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        collate = self._get_collator_with_removed_columns(self.data_collator, "evaluation")
        return build_dataloader(dataset, self.args.eval_batch_size, self.args, collate,
                                shuffle=False, drop_last=self.args.dataloader_drop_last)

    def set_initial_training_values(self, args, dataloader):
        """Epochs, update steps per epoch, examples, samples, total batch, micro-batches, max_steps.
        Walkthrough 2.3 | Mirrors: Trainer.set_initial_training_values (5.23)
        Differs: the walkthrough passes total_train_batch_size in and gets epoch_based and
        len_dataloader back; 5.23 computes the first here and returns it and steps_in_epoch."""
        # "total_train_batch_size = self._train_batch_size * args.gradient_accumulation_steps * ..."
        # (5.23: the data-parallel ranks, dp_world_size; tensor-parallel ranks share their rows)
        total_train_batch_size = (self._train_batch_size * args.gradient_accumulation_steps
                                  * distributed.data_parallel(args)[0])
        if not has_length(dataloader):  # a stream: max_steps alone sets the schedule
            return self._streamed_training_values(args, total_train_batch_size)
        steps_in_epoch = len(dataloader)  # micro-batches of this rank
        # the last, partial accumulation window still makes one optimizer step
        num_update_steps_per_epoch = math.ceil(steps_in_epoch / args.gradient_accumulation_steps)
        num_update_steps_per_epoch = max(num_update_steps_per_epoch, 1)
        num_examples = self.num_examples(dataloader)
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

    def num_examples(self, dataloader) -> int:
        """Examples behind `dataloader`: len(dataloader.dataset), else (a dataloader of another
        kind, with no .dataset) its batches x the batch size. Mirrors: Trainer.num_examples"""
        try:
            return len(dataloader.dataset)
        except (AttributeError, TypeError):
            return len(dataloader) * self.args.per_device_train_batch_size

    def _streamed_training_values(self, args, total_train_batch_size):
        """set_initial_training_values of a dataloader without a length (an IterableDataset):
        max_steps update steps in one "epoch" that ends when the stream or max_steps does.
        Mirrors: Trainer.set_initial_training_values ("Rely on max_steps when dataloader does
        not have a working size")"""
        if args.max_steps <= 0:
            raise ValueError("args.max_steps must be set to a positive value if dataloader does "
                             f"not have a length, was {args.max_steps}")
        max_steps = args.max_steps
        num_examples = num_train_samples = max_steps * total_train_batch_size
        # "Setting a very large number of epochs so we go as many times as necessary over the
        # iterator."
        return (sys.maxsize, max_steps, num_examples, num_train_samples, total_train_batch_size,
                max_steps * args.gradient_accumulation_steps, max_steps)

    def _check_ranks_agree(self, num_examples, num_update_steps_per_epoch, num_train_epochs,
                           max_steps) -> None:
        """Under torchrun: every rank stops with one ValueError naming the ranks that differ,
        unless all hold the same tokenized examples and step plan (else they would wait in
        different collectives until ddp_timeout). Differs: transformers does not check."""
        if distributed.get_world_size() <= 1:
            return
        distributed.check_ranks_agree({
            "num_examples": num_examples,
            "examples_fingerprint": distributed.fingerprint_examples(self.train_dataset),
            "num_update_steps_per_epoch": num_update_steps_per_epoch,
            "num_train_epochs": num_train_epochs,
            "max_steps": max_steps,
            "gradient_accumulation_steps": self.args.gradient_accumulation_steps,
            "per_device_train_batch_size": self._train_batch_size,
        })

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """Prefetch up to `num_batches` micro-batches and count their supervised tokens: a float32
        0-d tensor, summed over ranks when average_tokens_across_devices.
        What section 1's `self.get_batch_samples(...)` call runs. Guide: gradient accumulation |
        Mirrors: Trainer.get_batch_samples, Trainer._get_num_items_in_batch"""
        batch_samples = []
        for _ in range(num_batches):
            try:
                batch_samples.append(next(epoch_iterator))
            except StopIteration:
                break
        if not (batch_samples and "labels" in batch_samples[0]
                and (self.model_accepts_loss_kwargs or self.compute_loss_func is not None)):
            return batch_samples, None
        try:
            num_items_in_batch = count_num_items_in_batch(batch_samples,
                                                          self._loss_shifts_labels).to(device)
        except (TypeError, AttributeError):  # labels that are not a tensor: nothing to count
            warnings.warn("get_batch_samples: the batch's labels are not a tensor, so "
                          "num_items_in_batch is not counted; each micro-batch's loss is the "
                          "model's own (as transformers does).")
            return batch_samples, None
        dp_world_size, _, dp_group = distributed.data_parallel(self.args)
        if self.args.average_tokens_across_devices and dp_world_size > 1:
            # over the ranks reading different rows: tensor-parallel ranks count theirs once
            num_items_in_batch = distributed.all_reduce_sum(num_items_in_batch, dp_group)
        return batch_samples, num_items_in_batch / 1  # int64 -> float32, as transformers

    # ----- train() and the loop of walkthrough 2.3 -----
    def train(self, resume_from_checkpoint=None) -> TrainOutput:
        """Main training entry point: resolve the checkpoint, check output_dir, enable activation
        checkpointing, then the inner loop. Walkthrough 2.2 | Mirrors: Trainer.train
        Differs: a fresh run refuses an output_dir holding another run (check_output_dir); what
        the run needs at its end is checked first (nanosft.run.preflight, output_folder)."""
        from nanosft.run.preflight import guarded_run

        args = self.args
        self._memory_tracker.start("train")
        resume_from_checkpoint = resume_from_checkpoint or args.resume_from_checkpoint
        # checked before any step (nanosft.run): the data, the metric, output_dir (this run's alone,
        # locked), the checkpoint resolved; a collective stuck past ddp_timeout ends with a message
        with guarded_run(self, resume_from_checkpoint) as resume_from_checkpoint:
            if args.gradient_checkpointing:
                self.model.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs)
            if not args.auto_find_batch_size:
                return self._inner_training_loop(args, resume_from_checkpoint)
            # "inner_training_loop = find_executable_batch_size(self._inner_training_loop, ...)": on
            # out-of-memory the whole loop restarts with a smaller batch (a new schedule length too)
            lr_scheduler = self.lr_scheduler  # the caller's, or None for one made per attempt
            if resume_from_checkpoint is not None:  # the batch size the resumed run settled on
                self._train_batch_size = self._checkpoint_batch_size(resume_from_checkpoint)

            def inner_training_loop(batch_size):
                self._train_batch_size = batch_size  # Trainer._update_auto_batch_size
                self.lr_scheduler = lr_scheduler
                return self._inner_training_loop(args, resume_from_checkpoint)

            return find_executable_batch_size(inner_training_loop, self._train_batch_size,
                                              args.auto_find_batch_size)()

    def _checkpoint_batch_size(self, checkpoint) -> int:
        """The train_batch_size a checkpoint's trainer_state.json holds (what auto_find_batch_size
        settled on), else this run's. Mirrors: Trainer.train (auto_find_batch_size resume)"""
        import os

        state = TrainerState.load_from_json(os.path.join(checkpoint, TRAINER_STATE_NAME))
        return state.train_batch_size or self._train_batch_size

    def _prepare_for_training(self, max_steps):
        """FSDP / DDP / compile wrapping (nanosft.parallel), the optimizer, then the scheduler.
        Mirrors: Trainer._prepare_for_training"""
        from nanosft.parallel import wrap_model

        model = wrap_model(self.model, self.args)  # FSDP2 shards self.model in place
        self.model_wrapped = model  # transformers' name: the outermost model (DDP, compile)
        self.create_optimizer_and_scheduler(num_training_steps=max_steps)
        return model

    # ----- optimizer and scheduler (guide: optimizers and schedulers) -----
    def create_optimizer_and_scheduler(self, num_training_steps: int) -> None:
        """The optimizer, then the scheduler over num_training_steps; either is kept when given.
        Mirrors: Trainer.create_optimizer_and_scheduler"""
        self.create_optimizer()
        self.create_scheduler(num_training_steps=num_training_steps, optimizer=self.optimizer)

    def create_optimizer(self):
        """args.optim (or optimizer_cls_and_kwargs) over the two weight-decay groups, unless an
        optimizer was passed in; returns it. Mirrors: Trainer.create_optimizer"""
        if self.optimizer is None and self.optimizer_cls_and_kwargs is not None:
            optimizer_cls, optimizer_kwargs = self.optimizer_cls_and_kwargs
            if is_optimizer_factory(optimizer_cls):  # "Factories are instantiated first, then
                self.optimizer = optimizer_cls()(self.model, **optimizer_kwargs)  # called"
            else:  # an Optimizer class over the two decay groups
                groups = get_parameter_groups(self.model, self.args.weight_decay)
                self.optimizer = optimizer_cls(groups, **optimizer_kwargs)
        elif self.optimizer is None:
            self.optimizer = create_optimizer(self.model, self.args)
        self.callback_handler.optimizer = self.optimizer
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        """args.lr_scheduler_type over num_training_steps, unless a scheduler was passed in;
        returns it. Mirrors: Trainer.create_scheduler"""
        if self.lr_scheduler is None:
            optimizer = self.optimizer if optimizer is None else optimizer
            self.lr_scheduler = create_scheduler(self.args, optimizer, num_training_steps)
        self.callback_handler.lr_scheduler = self.lr_scheduler
        return self.lr_scheduler

    def get_optimizer_group(self, param=None):
        """The param group holding `param`, or every group's params. Mirrors: get_optimizer_group"""
        if self.optimizer is None:
            raise ValueError("Trainer optimizer is None, please make sure you have setup the "
                             "optimizer before.")
        if param is not None:
            for group in self.optimizer.param_groups:
                if any(p is param for p in group["params"]):
                    return group
        return [group["params"] for group in self.optimizer.param_groups]

    def get_learning_rates(self) -> list:
        """The learning rate of each param group. Mirrors: Trainer.get_learning_rates"""
        if self.optimizer is None:
            raise ValueError("Trainer optimizer is None, please make sure you have setup the "
                             "optimizer before.")
        return [group["lr"] for group in self.optimizer.param_groups]

    def _init_training_state(self, max_steps, num_update_steps_per_epoch, num_train_epochs,
                             resume_from_checkpoint):
        """A fresh TrainerState, or the checkpoint's with model, optimizer, scheduler, scaler and
        RNG restored; plus epochs_trained and steps_trained_in_current_epoch.
        Mirrors: Trainer._init_training_state + _load_from_checkpoint (nanosft.run.checkpoint)"""
        from nanosft.run.checkpoint import init_training_state

        state, epochs_trained, steps_trained_in_current_epoch = init_training_state(
            self.args, self.model, self.optimizer, self.lr_scheduler, self.scaler, max_steps,
            num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint)
        if resume_from_checkpoint is not None:
            compare_trainer_and_checkpoint_args(self.args, state)
        state.train_batch_size = self._train_batch_size  # what auto_find_batch_size settled on
        state.is_world_process_zero = distributed.is_main_process()
        self.state = state
        if resume_from_checkpoint is None:  # the callbacks whose state checkpoints carry
            state.stateful_callbacks = self._stateful_callbacks()
        else:
            self._load_callback_state()
        return self.state, epochs_trained, steps_trained_in_current_epoch

    def _stateful_callbacks(self) -> dict:
        """{class name: state()} of the ExportableState callbacks and of self.control."""
        from nanosft.trainer_callback import stateful_callbacks_dict

        return stateful_callbacks_dict(cb for cb in self.callback_handler.callbacks + [self.control]
                                       if isinstance(cb, ExportableState))

    def _load_callback_state(self) -> None:
        """With args.restore_callback_states_from_checkpoint: rebuild each callback (and
        self.control) from state.stateful_callbacks, warning about saved ones this run lacks.
        Mirrors: Trainer._load_callback_state"""
        if not self.args.restore_callback_states_from_checkpoint:
            return
        not_found, new_callbacks = [], []
        original = self.callback_handler.callbacks + [self.control]
        for name, data in self.state.stateful_callbacks.items():
            same = [cb for cb in original if type(cb).__name__ == name]
            if not same:
                not_found.append(name)
                continue
            for callback, saved in zip(same, data if isinstance(data, list) else [data]):
                restored = type(callback).from_state({"args": saved.get("args", {}),
                                                      "attributes": saved.get("attributes", {})})
                if isinstance(callback, TrainerControl):
                    self.control = restored
                else:
                    new_callbacks.append(restored)
                    self.callback_handler.remove_callback(callback)
        if not_found:
            logger.warning("Checkpoint included callbacks not included in current configuration. "
                           f"Ignoring. ({', '.join(not_found)})")
        for callback in new_callbacks:
            self.callback_handler.add_callback(callback)

    def _inner_training_loop(self, args, resume_from_checkpoint=None) -> TrainOutput:
        """Epochs -> update steps -> micro-batches: accumulate, clip, step, schedule, log, save.
        Walkthrough 1, 2.3 | Mirrors: Trainer._inner_training_loop + _run_epoch + _finalize_training
        Differs: 5.23 moved the epoch body into `_run_epoch`; it stays inline, as the walkthrough
        prints it. tr_loss is a local, as in the walkthrough (5.23: self._tr_loss)."""
        # Data loader and number of training steps
        train_dataloader = self.get_train_dataloader()
        # Setting up training control variables (num_train_epochs, ..., max_steps)
        (num_train_epochs, num_update_steps_per_epoch, num_examples, num_train_samples,
         total_train_batch_size, steps_in_epoch, max_steps) = self.set_initial_training_values(
            args, train_dataloader)
        # under torchrun: all ranks hold the same data and step plan, or all stop here, named
        self._check_ranks_agree(num_examples, num_update_steps_per_epoch, num_train_epochs,
                                max_steps)
        model = self._prepare_for_training(max_steps)
        self.state, epochs_trained, steps_trained_in_current_epoch = self._init_training_state(
            max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint)
        self.callback_handler.model = self.model
        self.callback_handler.train_dataloader = train_dataloader

        # Train!
        if self.state.is_world_process_zero:  # rank 0 prints what transformers logs
            print("***** Running training *****")
            print(f"  Num examples = {num_examples:,}")
            print(f"  Num Epochs = {num_train_epochs:,}")
            print(f"  Num update steps per epoch = {num_update_steps_per_epoch:,}")
            print(f"  Instantaneous batch size per device = {args.per_device_train_batch_size:,}")
            print("  Total train batch size (w. parallel, distributed & accumulation) = "
                  f"{total_train_batch_size:,}")
            print(f"  Gradient Accumulation steps = {args.gradient_accumulation_steps}")
            print(f"  Total optimization steps = {max_steps:,}")
            trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
            print(f"  Number of trainable parameters = {trainable:,}")
            if resume_from_checkpoint is not None:
                print(f"  Resuming training from {resume_from_checkpoint} with epoch "
                      f"{epochs_trained} and global step {self.state.global_step}")

        start_time = time.time()
        self._initial_global_step = self.state.global_step
        # "tr_loss is a tensor to avoid synchronization of TPUs through .item()"
        tr_loss = torch.tensor(0.0, device=args.device)
        # "_total_loss_scalar is updated everytime .item() has to be called on tr_loss"
        self._total_loss_scalar = 0.0
        self._globalstep_last_logged = self.state.global_step
        model.zero_grad()
        grad_norm = None
        learning_rate = None
        self._callback("on_train_begin")

        if args.eval_on_start:
            self._evaluate()

        for epoch in range(epochs_trained, num_train_epochs):
            self._callback("on_epoch_begin")
            epoch_dataloader = train_dataloader
            if hasattr(getattr(train_dataloader, "batch_sampler", None), "set_epoch"):
                train_dataloader.batch_sampler.set_epoch(epoch)  # order = randperm(seed + epoch)
            step = -1
            num_update_steps_trained = 0
            if epoch == epochs_trained and steps_trained_in_current_epoch > 0:  # resumed run
                epoch_dataloader, step, num_update_steps_trained = self._resume_mid_epoch(
                    train_dataloader, steps_trained_in_current_epoch)
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
                if not batch_samples:  # a stream ran out before the epoch's step count
                    break
                # the divisor of a loss NOT normalised by num_items_in_batch (short last window)
                self.current_gradient_accumulation_steps = len(batch_samples)
                self._callback("on_step_begin", batch_samples=batch_samples)

                for i, inputs in enumerate(batch_samples):
                    step += 1
                    do_sync_step = ((step + 1) % args.gradient_accumulation_steps == 0
                                    or (step + 1) == steps_in_epoch)
                    # guide: DDP all-reduces gradients only on the window's last micro-batch
                    last = i == len(batch_samples) - 1
                    with contextlib.nullcontext() if last else no_sync(model):
                        tr_loss_step = self.training_step(model, inputs, num_items_in_batch)

                    if args.logging_nan_inf_filter and not reference_mode_enabled():
                        # speed path: the same filter as one torch.where, no host sync
                        tr_loss = self._nan_inf_filtered_sum(tr_loss, tr_loss_step)
                    elif args.logging_nan_inf_filter and (torch.isnan(tr_loss_step)
                                                          or torch.isinf(tr_loss_step)):
                        # "if loss is nan or inf simply add the average of previous logged losses"
                        tr_loss = tr_loss + tr_loss / (1 + self.state.global_step
                                                       - self._globalstep_last_logged)
                    else:
                        tr_loss = tr_loss + tr_loss_step

                    if do_sync_step:
                        grad_norm = self._clip_grad_norm(model)  # guide: clipping (fp16: unscaled)
                        self._callback("on_pre_optimizer_step")
                        if self.scaler is None:
                            self.optimizer.step()
                        optimizer_step_was_skipped = self._scaler_step()  # guide: fp16 GradScaler
                        self._callback("on_optimizer_step")
                        # "get leaning rate before update"
                        learning_rate = self._get_learning_rate()
                        if not optimizer_step_was_skipped and not self._is_plateau():
                            self.lr_scheduler.step()
                        model.zero_grad()
                        self.state.global_step += 1
                        self.state.epoch = epoch + (step + 1) / steps_in_epoch
                        self._callback("on_step_end")
                        self._maybe_log_save_evaluate(tr_loss, grad_norm, learning_rate)
                    else:
                        self._callback("on_substep_end")
                    if self.control.should_epoch_stop or self.control.should_training_stop:
                        break
                if self.control.should_epoch_stop or self.control.should_training_stop:
                    break

            if step < 0:
                print(f"Warning: epoch {epoch} yielded no batch; stopping at step "
                      f"{self.state.global_step}.")
                self.control.should_training_stop = True
            self._callback("on_epoch_end")
            self._maybe_log_save_evaluate(tr_loss, grad_norm, learning_rate)
            if self.control.should_training_stop:
                break

        return self._finalize_training(tr_loss, num_train_samples, start_time)

    def _callback(self, event: str, **kwargs) -> None:
        """`self.control = self.callback_handler.<event>(args, self.state, self.control)`, the
        line transformers writes out at each event of the loop. Mirrors: the on_* calls"""
        handler = getattr(self.callback_handler, event)
        self.control = handler(self.args, self.state, self.control, **kwargs)

    def _resume_mid_epoch(self, train_dataloader, steps_trained_in_current_epoch):
        """(epoch_dataloader, step, num_update_steps_trained) of a run resumed mid-epoch: the same
        order less the micro-batches already trained on. Mirrors: the resume branch of
        Trainer._inner_training_loop | Differs: step starts past them (5.23: steps_skipped)."""
        epoch_dataloader = skip_first_batches(train_dataloader, steps_trained_in_current_epoch)
        num_update_steps_trained = (steps_trained_in_current_epoch
                                    // self.args.gradient_accumulation_steps)
        return epoch_dataloader, steps_trained_in_current_epoch - 1, num_update_steps_trained

    def _scaler_step(self) -> bool:
        """fp16: the GradScaler's step and update (the loop stepped the optimizer itself when
        there is no scaler); True when it skipped the step. It skips when the grads hold inf/nan,
        then lowers the scale, which is how a skip shows.
        Guide: mixed precision | Mirrors: accelerate optimizer_step_was_skipped"""
        if self.scaler is None:
            return False
        scale_before = self.scaler.get_scale()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return self.scaler.get_scale() < scale_before

    def _nan_inf_filtered_sum(self, tr_loss, tr_loss_step):
        """tr_loss + tr_loss_step, or + the average of the previous logged losses where the step
        loss is nan/inf: the walkthrough's filter as one torch.where (no host sync)."""
        average = tr_loss / (1 + self.state.global_step - self._globalstep_last_logged)
        return tr_loss + torch.where(torch.isfinite(tr_loss_step), tr_loss_step, average)

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
        metrics["train_loss"] = train_loss
        self._memory_tracker.stop_and_update_metrics("train", metrics)
        self.log(metrics)  # the throughput callback adds total_flos and the model FLOP/s
        if self.args.load_best_model_at_end and self.state.best_model_checkpoint is not None:
            self._load_best_model()
        self.control = self.callback_handler.on_train_end(self.args, self.state, self.control)
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
        if ((self.label_smoother is not None or self.compute_loss_func is not None)
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
            # LabelSmoother reads the logits by key, or first in a tuple; a causal LM's shift
            keyed = isinstance(outputs, (dict, CausalLMOutput))
            logits = outputs["logits"] if keyed else outputs[0]
            loss = label_smoothed_loss(logits, labels, self.args.label_smoothing_factor,
                                       num_items_in_batch, shift_labels=self._loss_shifts_labels)
        else:
            if isinstance(outputs, dict) and "loss" not in outputs:
                raise ValueError(
                    "The model did not return a loss from the inputs, only the following keys: "
                    f"{','.join(outputs.keys())}. For reference, the inputs it received are "
                    f"{','.join(inputs.keys())}.")
            # "We don't use .loss here since the model may return tuples instead of ModelOutput."
            # (nanosft's CausalLMOutput is read by key, as a ModelOutput is)
            loss = outputs["loss"] if isinstance(outputs, (dict, CausalLMOutput)) else outputs[0]
            if loss is None:
                raise ValueError(f"The model returned no loss; the batch has keys "
                                 f"{sorted(inputs)}. Add `labels` to the batch (a collator such "
                                 "as DataCollatorForLanguageModeling does).")
        if (self.args.average_tokens_across_devices and num_items_in_batch is not None
                and (self.model_accepts_loss_kwargs or self.compute_loss_func is not None)):
            # num_items_in_batch counts every data-parallel rank's tokens and DDP / FSDP average
            # their gradients: undo the average
            loss = loss * distributed.data_parallel(self.args)[0]
        return (loss, outputs) if return_outputs else loss

    # ----- the sync step: clip (the optimizer step itself is inline in the loop) -----
    def _clip_grad_norm(self, model) -> torch.Tensor:
        """Pre-clip global 2-norm of the gradients; clips to max_grad_norm when it is > 0.
        Guide: gradient clipping | Mirrors: Trainer._clip_grad_norm, accelerate clip_grad_norm_"""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
        max_norm = self.args.max_grad_norm if self.args.max_grad_norm > 0 else float("inf")
        if self.args.parallelism_config is not None:  # DTensor grads on several meshes
            from nanosft.parallel import clip_grad_norm_

            return clip_grad_norm_(model.parameters(), max_norm)
        # under FSDP the norm of sharded gradients is a DTensor: to_full gives one number
        return distributed.to_full(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))

    def _is_plateau(self) -> bool:
        return isinstance(self.lr_scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)

    def _get_learning_rate(self) -> float:
        """Learning rate of param group 0. Mirrors: Trainer._get_learning_rate"""
        if self._is_plateau():
            return self.optimizer.param_groups[0]["lr"]
        return self.lr_scheduler.get_last_lr()[0]

    # ----- logging, evaluation, saving: what the callbacks' flags ask for -----
    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, learning_rate=None) -> None:
        """Log the window's mean loss, evaluate, track the best metric, save a checkpoint, as
        self.control says; section 1 calls it after each optimizer step.
        Guide: monitoring | Mirrors: Trainer._maybe_log_save_evaluate
        Differs: no model / trial / epoch / start_time arguments."""
        args, state, control = self.args, self.state, self.control
        if control.should_log and state.global_step > self._globalstep_last_logged:
            logs = {}
            # mean over ranks of the summed step losses ("all_gather + mean()")
            tr_loss_scalar = distributed.all_reduce_sum(tr_loss.detach()).item() / args.world_size
            tr_loss -= tr_loss  # "reset tr_loss to zero", in place: the loop's tensor
            logs["loss"] = tr_loss_scalar / (state.global_step - self._globalstep_last_logged)
            if grad_norm is not None:
                logs["grad_norm"] = grad_norm.item() if torch.is_tensor(grad_norm) else grad_norm
            if learning_rate is not None:
                logs["learning_rate"] = learning_rate
            else:
                logs["learning_rate"] = self._get_learning_rate()
            self._total_loss_scalar += tr_loss_scalar
            self._globalstep_last_logged = state.global_step
            self.log(logs)
        if control.should_evaluate:
            metrics = self._evaluate()
            if self._determine_best_metric(metrics) and args.save_strategy == "best":
                control.should_save = True
        if control.should_save:
            self._save_checkpoint()
            self.control = self.callback_handler.on_save(args, state, self.control)

    def _determine_best_metric(self, metrics: dict) -> bool:
        """Track state.best_metric for metric_for_best_model; True when `metrics` set a new best.
        Mirrors: transformers Trainer._determine_best_metric"""
        from nanosft.run.preflight import metric_value  # its error names the keys there are

        name = self.args.metric_for_best_model
        if name is None:
            return False
        value, best = metric_value(metrics, name), self.state.best_metric
        if best is not None and not (value > best if self.args.greater_is_better else value < best):
            return False
        self.state.best_metric = value
        self.state.best_global_step = self.state.global_step
        return True

    @classmethod
    def _logged_eval_metrics(cls):
        """The eval_ keys log() adds to evaluate()'s own (none here), or None where this class
        overrides evaluate or log and may add any key: preflight checks metric_for_best_model
        against them before the run."""
        return () if cls.evaluate is Trainer.evaluate and cls.log is Trainer.log else None

    def log(self, logs: dict) -> None:
        """Add epoch, append to state.log_history, then the callbacks' on_log (rank 0 prints and
        writes it). Mirrors: Trainer.log | Differs: no start_time argument."""
        logs["epoch"] = self.state.epoch
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self.control = self.callback_handler.on_log(self.args, self.state, self.control, logs)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval") -> dict:
        """Mean eval loss (each batch's loss weighted by its size), compute_metrics' metrics,
        perplexity, speed; logged. A dict of named sets: one evaluation each, eval_<name>_loss.
        Mirrors: Trainer.evaluate | Differs: adds perplexity (causal LMs); SFTTrainer.log adds TRL's
        eval_mean_token_accuracy. ignore_keys: output keys left out of the predictions."""
        eval_dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if isinstance(eval_dataset, dict):
            metrics = {}
            for name, dataset in eval_dataset.items():
                metrics.update(self.evaluate(dataset, ignore_keys, f"{metric_key_prefix}_{name}"))
            return metrics
        start_time = time.time()
        model = self.model
        was_training = model.training
        model.eval()
        dataloader = self.get_eval_dataloader(eval_dataset)
        self.callback_handler.eval_dataloader = dataloader
        if self.compute_metrics is None:  # the loss alone: no logits kept
            eval_loss, examples, batches = evaluation_loop(
                model, dataloader, self.compute_loss, self._prepare_inputs, self.args,
                on_step=lambda: self._callback("on_prediction_step"))
            metrics = {f"{metric_key_prefix}_loss": eval_loss}
        else:
            output = self.evaluation_loop(dataloader, "Evaluation", ignore_keys=ignore_keys,
                                          metric_key_prefix=metric_key_prefix)
            metrics, examples, batches = output.metrics, output.num_samples, output.num_batches
            eval_loss = metrics[f"{metric_key_prefix}_loss"]
        if self._loss_shifts_labels:  # a language model's loss: per-token cross-entropy
            metrics[f"{metric_key_prefix}_perplexity"] = math.exp(min(eval_loss, 700.0))
        metrics.update(speed_metrics(metric_key_prefix, start_time, examples, batches))
        self.log(metrics)  # still in eval mode, so SFTTrainer.log adds its eval_ metrics
        model.train(was_training)
        self._callback("on_evaluate", metrics=metrics)
        return metrics

    def predict(self, test_dataset, ignore_keys=None, metric_key_prefix="test") -> PredictionOutput:
        """Predictions (the model's outputs but the loss, batches concatenated and padded with
        -100), label_ids and metrics (test_loss, compute_metrics', speed) over `test_dataset`.
        Mirrors: Trainer.predict"""
        start_time = time.time()
        model = self.model
        was_training = model.training
        model.eval()
        dataloader = self.get_test_dataloader(test_dataset)
        output = self.evaluation_loop(dataloader, "Prediction", ignore_keys=ignore_keys,
                                      metric_key_prefix=metric_key_prefix)
        model.train(was_training)
        output.metrics.update(speed_metrics(metric_key_prefix, start_time, output.num_samples,
                                            output.num_batches))
        self._callback("on_predict", metrics=output.metrics)
        return PredictionOutput(output.predictions, output.label_ids, output.metrics)

    def get_test_dataloader(self, test_dataset) -> DataLoader:
        """Batches of per_device_eval_batch_size in dataset order.
        Mirrors: Trainer.get_test_dataloader"""
        return self.get_eval_dataloader(test_dataset)

    def evaluation_loop(self, dataloader, description="Evaluation", prediction_loss_only=None,
                        ignore_keys=None, metric_key_prefix="eval") -> EvalLoopOutput:
        """predictions, label_ids (each batch's, concatenated; rows padded with -100), the
        size-weighted mean loss and compute_metrics' metrics over them.
        Mirrors: Trainer.evaluation_loop (preprocess_logits_for_metrics, include_for_metrics,
        eval_accumulation_steps, batch_eval_metrics) | Differs: one process only."""
        args = self.args
        if args.world_size > 1:
            raise ValueError("compute_metrics and predict under torchrun are not supported: "
                             "nanosft does not gather predictions across ranks; run them on one "
                             "process.")
        kept = {key: EvalLoopContainer(padding_index=IGNORE_INDEX)
                for key in ("predictions", "label_ids", "inputs", "losses")}
        metrics, examples, batches = None, 0, 0
        keep_all = not args.batch_eval_metrics or description == "Prediction"
        for step, (inputs, last) in enumerate(with_last(dataloader)):
            loss, logits, labels = self.prediction_step(self.model, inputs, prediction_loss_only,
                                                        ignore_keys=ignore_keys)
            size = find_batch_size(inputs)
            examples += size
            batches += 1
            if logits is not None and self.preprocess_logits_for_metrics is not None:
                logits = self.preprocess_logits_for_metrics(logits, labels)
            main_input = inputs.get(getattr(self.model, "main_input_name", "input_ids"))
            batch = {"predictions": logits, "label_ids": labels, "inputs": main_input,
                     "losses": None if loss is None else loss.repeat(size)}  # one per example
            for key in ("predictions", "label_ids", "inputs", "losses"):
                if batch[key] is not None and (keep_all or key == "losses"):
                    kept[key].add(batch[key])
            self._callback("on_prediction_step")
            if args.batch_eval_metrics:  # compute_metrics keeps running sums; the last reports
                if self.compute_metrics is not None and logits is not None and labels is not None:
                    metrics = self.compute_metrics(self._eval_prediction(batch),
                                                   compute_result=last)
            elif args.eval_accumulation_steps and (step + 1) % args.eval_accumulation_steps == 0:
                for container in kept.values():  # "put them back on the CPU" as numpy
                    container.to_cpu_and_numpy()
        arrays = {key: container.get_arrays() for key, container in kept.items()}
        if (not args.batch_eval_metrics and self.compute_metrics is not None
                and arrays["predictions"] is not None and arrays["label_ids"] is not None):
            metrics = self.compute_metrics(self._eval_prediction(arrays))
        called = self.compute_metrics is not None and (args.batch_eval_metrics or (
            arrays["predictions"] is not None and arrays["label_ids"] is not None))
        metrics = denumpify_detensorize(checked_metrics(metrics, metric_key_prefix)) if called \
            else {}
        losses = arrays["losses"]
        if losses is not None and len(losses):
            finite = np.isfinite(losses)
            if args.logging_nan_inf_filter and finite.any():
                losses = losses[finite]
            metrics[f"{metric_key_prefix}_loss"] = losses.mean().item()
        # "Prefix all keys with metric_key_prefix + '_'"
        metrics = {key if key.startswith(f"{metric_key_prefix}_") else f"{metric_key_prefix}_{key}":
                   value for key, value in metrics.items()}
        return EvalLoopOutput(arrays["predictions"], arrays["label_ids"], metrics, examples,
                              batches)

    def _eval_prediction(self, batch: dict) -> EvalPrediction:
        """EvalPrediction of predictions and label_ids, with inputs / losses when
        args.include_for_metrics names "inputs" / "loss"."""
        include = self.args.include_for_metrics
        return EvalPrediction(batch["predictions"], batch["label_ids"],
                              inputs=batch["inputs"] if "inputs" in include else None,
                              losses=batch["losses"] if "loss" in include else None)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """(loss, logits, labels) of one eval batch, without gradients; labels are the batch's
        args.label_names (a tuple when there are several), logits every output but the loss.
        Mirrors: Trainer.prediction_step (num_items_in_batch = the batch's supervised tokens)"""
        batch = self._prepare_inputs(inputs)
        has_labels = all(batch.get(name) is not None for name in self.label_names)
        labels = None
        if has_labels:
            labels = tuple(batch[name].detach() if torch.is_tensor(batch[name]) else batch[name]
                           for name in self.label_names)
            labels = labels[0] if len(labels) == 1 else labels
        num_items_in_batch = None
        if "labels" in batch and (self.model_accepts_loss_kwargs
                                  or self.compute_loss_func is not None):
            num_items_in_batch = count_num_items_in_batch(
                [batch], self._loss_shifts_labels).to(self.args.device) / 1
        with torch.no_grad():
            if has_labels or "labels" in batch:
                loss, outputs = self.compute_loss(model, batch, return_outputs=True,
                                                  num_items_in_batch=num_items_in_batch)
                loss = loss.detach()
            else:  # no labels: the forward alone, no loss
                loss = None
                with self.compute_loss_context_manager():
                    outputs = model(**batch)
        if prediction_loss_only is None:
            prediction_loss_only = self.args.prediction_loss_only
        if prediction_loss_only:
            return (loss, None, None)
        # every output but the loss: a ModelOutput's other values, a tuple's tail
        ignore = set(ignore_keys or ()) | {"loss", "past_key_values"}
        if isinstance(outputs, CausalLMOutput):
            logits = (outputs.logits,)
        elif isinstance(outputs, dict):
            logits = tuple(v for k, v in outputs.items() if k not in ignore)
        elif torch.is_tensor(outputs):
            logits = (outputs,)
        else:
            logits = tuple(outputs[1:] if loss is not None else outputs)
        logits = tuple(t.detach() for t in logits)
        return (loss, logits[0] if len(logits) == 1 else logits, labels)

    def _evaluate(self) -> dict:
        """evaluate(), then ReduceLROnPlateau steps on metric_for_best_model (not for
        eval_on_start). Mirrors: Trainer._evaluate"""
        metrics = self.evaluate()
        if self._is_plateau() and self.state.global_step > 0:
            from nanosft.run.preflight import metric_value

            self.lr_scheduler.step(metric_value(metrics, self.args.metric_for_best_model))
        return metrics

    def _get_output_dir(self, trial=None) -> str:
        """Where checkpoints go: args.output_dir. Mirrors: Trainer._get_output_dir (no trials)"""
        return self.args.output_dir

    def _save_checkpoint(self, model=None, trial=None) -> None:
        """Write output_dir/checkpoint-<step> (every rank takes part), then rank 0 rotates old ones.
        Mirrors: Trainer._save_checkpoint (files: nanosft.run.checkpoint)
        Differs: saves self.model whatever `model` is (transformers' argument); no trials."""
        import os

        from nanosft.run import checkpoint, output_folder

        args, state = self.args, self.state
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        # "Determine the new best metric / best model checkpoint": this one, or the saved one of
        # the best step (an eval after that step's save, as eval_strategy="epoch" with steps)
        if state.best_global_step:
            best = os.path.join(args.output_dir, f"checkpoint-{state.best_global_step}")
            if state.best_global_step == state.global_step or os.path.exists(best):
                state.best_model_checkpoint = best
        # "Update ExportableState callbacks and TrainerControl state to where we are currently"
        # Differs: several callbacks of a class replace their list (transformers appends to it,
        # so a resume restores the states of train start, the first ones in the list)
        state.stateful_callbacks.update(self._stateful_callbacks())
        checkpoint.save_checkpoint(folder, model=self.model, optimizer=self.optimizer,
                                   lr_scheduler=self.lr_scheduler, scaler=self.scaler,
                                   trainer_state=state.to_dict(), args=args,
                                   rank=distributed.get_rank(), world_size=args.world_size)
        if distributed.is_main_process():
            output_folder.rotate_checkpoints(args.output_dir, args.save_total_limit,
                                             state.best_model_checkpoint)

    def _load_best_model(self) -> None:
        """Reload the weights of state.best_model_checkpoint. Mirrors: Trainer._load_best_model"""
        from nanosft.run.checkpoint import load_model_weights

        load_model_weights(self.model, self.state.best_model_checkpoint)

    def save_model(self, output_dir=None) -> None:
        """Save the model (a PEFT model: its adapter only) and the tokenizer; every rank calls it
        (FSDP gathers the shards), rank 0 writes.
        Mirrors: transformers Trainer.save_model | Differs: no training_args.bin."""
        from nanosft.run.checkpoint import save_model

        save_model(self.model, self.processing_class, output_dir or self.args.output_dir,
                   checkpoints_dir=self.args.output_dir)  # a failed save names the last one

    def push_to_hub(self, commit_message="End of training", blocking=True, token=None,
                    revision=None, **kwargs):
        """Refused: pushing needs the network and nanosft never pushes (save_model, then upload
        output_dir yourself). Mirrors: transformers Trainer.push_to_hub (its signature only)"""
        raise RuntimeError(f"Trainer.push_to_hub: {PUSH_NEEDS_NETWORK}")

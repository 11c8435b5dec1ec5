"""Just-in-time checkpoints: on SIGTERM (a scheduler preempting the job) save a checkpoint at the
next step boundary and stop, so the run resumes from where it was killed instead of from the last
save_steps checkpoint. `TrainingArguments(enable_jit_checkpoint=True)` installs it.

Mirrors transformers' trainer_jit_checkpoint.py: the SIGTERM handler only raises a flag (after
kill_wait seconds, the grace period that tells a SIGTERM followed by SIGKILL from a lone SIGTERM),
and the callback saves with the Trainer's own `_save_checkpoint` (atomic, nanosft.run.checkpoint)
at the next callback event of the loop.
"""

import logging
import os
import signal
import threading

from nanosft.trainer_utils import PREFIX_CHECKPOINT_DIR
from nanosft.trainer_callback import TrainerCallback

logger = logging.getLogger(__name__)


class CheckpointManager:
    """The SIGTERM handler and the save it asks for.
    Mirrors: transformers trainer_jit_checkpoint.CheckpointManager

    Args:
        trainer: the Trainer whose _save_checkpoint writes the checkpoint.
        kill_wait: seconds between SIGTERM and the checkpoint request."""

    def __init__(self, trainer, kill_wait: int = 3):
        self.trainer = trainer
        self.is_checkpoint_requested = False
        self._original_sigterm_handler = None
        self.kill_wait = kill_wait

    def setup_signal_handler(self):
        """Install the SIGTERM handler (the previous one is kept to restore at train end)."""
        self._original_sigterm_handler = signal.signal(signal.SIGTERM, self._sigterm_handler)

    def _sigterm_handler(self, signum, frame):
        if self.is_checkpoint_requested:
            return
        logger.info(f"SIGTERM received, will request JIT checkpoint after {self.kill_wait}s")
        threading.Timer(self.kill_wait, self._enable_checkpoint).start()

    def _enable_checkpoint(self):
        self.is_checkpoint_requested = True

    def execute_jit_checkpoint(self):
        """Save output_dir/checkpoint-<global_step> now; the flag is cleared first, so a failed
        save is not retried by the next event."""
        self.is_checkpoint_requested = False
        step = self.trainer.state.global_step
        logger.warning(f"SIGTERM: saving a just-in-time checkpoint at step {step}")
        self.trainer._save_checkpoint(self.trainer.model, trial=None)
        folder = os.path.join(self.trainer.args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")
        logger.warning(f"SIGTERM: checkpoint saved in {folder}; training stops")


class JITCheckpointCallback(TrainerCallback):
    """At the first event after a SIGTERM's grace period: save a checkpoint and stop training.
    Mirrors: transformers trainer_jit_checkpoint.JITCheckpointCallback
    Differs: set_trainer may be given at construction (the Trainer does)."""

    def __init__(self, trainer=None):
        self.trainer = None
        self.jit_manager = None
        if trainer is not None:
            self.set_trainer(trainer)

    def set_trainer(self, trainer):
        self.trainer = trainer
        if trainer.args.enable_jit_checkpoint:
            self.jit_manager = CheckpointManager(trainer=trainer)
            self.jit_manager.setup_signal_handler()

    def _requested(self):
        return self.jit_manager is not None and self.jit_manager.is_checkpoint_requested

    def _save_and_stop(self, control, cancel_save=False):
        control.should_training_stop = True
        if cancel_save:  # this save is the one the step would have made
            control.should_save = False
        self.jit_manager.execute_jit_checkpoint()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self._requested():
            self._save_and_stop(control)

    def on_step_begin(self, args, state, control, **kwargs):
        if self._requested():
            self._save_and_stop(control)

    def on_step_end(self, args, state, control, **kwargs):
        if self._requested():
            self._save_and_stop(control, cancel_save=True)

    def on_epoch_end(self, args, state, control, **kwargs):
        if self._requested():
            self._save_and_stop(control, cancel_save=True)

    def on_train_end(self, args, state, control, **kwargs):
        if self.jit_manager is not None and self.jit_manager._original_sigterm_handler is not None:
            signal.signal(signal.SIGTERM, self.jit_manager._original_sigterm_handler)

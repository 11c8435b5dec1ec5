"""nanosft.monitoring.trace: silent unless enabled; attach() traces one optimizer step through
callbacks and hooks, replacing no method, then leaves no hook behind.

Compared: printed lines (none when off); the trainer's, model's, optimizer's and scheduler's
instance attributes that shadow a method of their class, while the first step runs (a callback
added after attach looks) and after; forward, gradient and optimizer step hooks after the run; the
trace's pre-clip grad_norm against the one the loop logged. Hermetic: the tiny default model in
nanosft/cli/assets/default and four in-memory chat examples; CPU only.
Run: python -m pytest -q tests/test_trace.py
"""

import re

import pytest

from nanosft.cli import demo
from nanosft.monitoring import trace
from nanosft.reference import reference_mode, reference_mode_enabled
from nanosft.args import SFTConfig
from nanosft.model import CausalLM
from nanosft.peft import LoraConfig
from nanosft.sft import SFTTrainer
from nanosft.tokenizer import Tokenizer
from nanosft.trainer_callback import TrainerCallback

CHATS = [{"messages": [{"role": "user", "content": f"What is {a} plus 2?"},
                       {"role": "assistant", "content": str(a + 2)}]} for a in range(4)]


@pytest.fixture
def tracing():
    trace.enable_trace()
    yield
    trace.enable_trace(False)


def make_trainer(tmp_path):
    args = SFTConfig(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=2,
        save_strategy="no",
        gradient_checkpointing=False,
        bf16=False,
        disable_tqdm=True,
        learning_rate=1e-3,
        logging_steps=1,  # step 1 logs the grad_norm the trace's is checked against
    )
    return SFTTrainer(CausalLM.from_pretrained(demo.DEFAULT_DIR), args=args, train_dataset=CHATS,
                      processing_class=Tokenizer.from_pretrained(demo.DEFAULT_DIR),
                      peft_config=LoraConfig(target_modules=["q_proj", "v_proj"]))


def hook_counts(model):
    modules = [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()]
    return modules + [len(p._post_accumulate_grad_hooks or ()) for p in model.parameters()]


def shadowed_methods(obj) -> set:
    """Names of methods of obj's class that an attribute of the instance replaces."""
    return {name for name, value in vars(obj).items()
            if callable(value) and callable(getattr(type(obj), name, None))}


def replaced_methods(trainer) -> dict:
    """The shadowed methods of the trainer, each module of its model, its optimizer, scheduler."""
    objects = {"trainer": trainer, "optimizer": trainer.optimizer,
               "lr_scheduler": trainer.lr_scheduler,
               **{f"model.{name}": m for name, m in trainer.model.named_modules()}}
    return {key: shadowed_methods(obj) for key, obj in objects.items() if obj is not None}


class MethodProbe(TrainerCallback):
    """Added after attach: records replaced_methods while the traced first step runs, and whether
    `trainer.training_step` is the class's own function (what a debugger's `s` steps into)."""

    def __init__(self, trainer):
        self.trainer, self.seen = trainer, []

    def look(self, *args, **kwargs):
        self.seen.append((replaced_methods(self.trainer),
                          self.trainer.training_step.__func__ is type(self.trainer).training_step))

    on_substep_end = on_pre_optimizer_step = on_optimizer_step = look


def test_trace_prints_nothing_and_attach_does_nothing_when_off(tmp_path, capsys):
    trace.trace("2.3", "do_sync_step", do_sync_step=True)
    trainer = make_trainer(tmp_path)
    assert trace.attach(trainer) is None
    assert "train" not in vars(trainer)  # no instance wrapper
    trainer.train()
    assert trace.PREFIX not in capsys.readouterr().out


@pytest.mark.parametrize("mode", ["reference", "fast"])
def test_attach_traces_one_step_replacing_no_method_then_removes_every_hook(
    mode, tracing, tmp_path, capsys
):
    trainer = make_trainer(tmp_path)
    before = hook_counts(trainer.model)
    callbacks_before = len(trainer.callback_handler.callbacks)
    handle = trace.attach(trainer)
    assert not shadowed_methods(trainer)  # a callback, no instance wrapper
    probe = MethodProbe(trainer)
    trainer.add_callback(probe)
    assert reference_mode_enabled()  # enable_trace() switched reference mode on
    with reference_mode(mode == "reference"):
        trainer.train()
    out = capsys.readouterr().out
    # while the traced step ran, nothing shadowed a method (the optimizer's `step` is torch's own
    # LRScheduler wrapper, there with or without the trace) and training_step was the class's
    assert len(probe.seen) >= 2 and all(is_class_step for _, is_class_step in probe.seen)
    after = replaced_methods(trainer)
    assert all(seen == after for seen, _ in probe.seen)
    assert not any(names for key, names in after.items() if key != "optimizer")
    # 2 steps run, 1 traced
    assert out.count("training_step(model, inputs, num_items_in_batch)") == 1
    # an SFTTrainer: the trace shows the loss that runs, Trainer.compute_loss's outputs["loss"]
    # in reference mode, the fused head when the speed paths are on
    fused = ["SFTTrainer.compute_loss overrides Trainer.compute_loss",
             "loss = outputs.loss  (the model's -log_probs.sum() / num_items_in_batch;"]
    reference = ["SFTTrainer.compute_loss -> Trainer.compute_loss (reference mode)",
                 'loss = outputs["loss"]']
    shown, hidden = (reference, fused) if mode == "reference" else (fused, reference)
    assert all(line in out for line in shown) and not any(line in out for line in hidden)
    assert "mean_token_accuracy=" in out
    # the pre-clip norm the gradient hooks saw is the one _clip_grad_norm returned and logged
    traced = float(re.search(r"clip gradients  grad_norm=(\S+)", out).group(1))
    assert traced == pytest.approx(trainer.state.log_history[0]["grad_norm"], rel=1e-5)
    assert handle.done
    trainer.remove_callback(probe)
    assert len(trainer.callback_handler.callbacks) == callbacks_before  # its callback is gone
    assert not trainer.optimizer._optimizer_step_pre_hooks
    assert hook_counts(trainer.model) == before

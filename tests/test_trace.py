"""nanosft.monitoring.trace: silent unless enabled; attach() traces one optimizer step, then
leaves no wrapper
or hook behind.

Compared: printed lines (none when off), the trainer's / model's / optimizer's instance state
before and after a traced run (instance attributes shadowing methods, forward hooks, optimizer
step hooks). Hermetic: the tiny default model in nanosft/cli/assets/default and four in-memory chat
examples; CPU only.
Run: python -m pytest -q tests/test_trace.py
"""

import pytest

from nanosft.cli import demo
from nanosft.monitoring import trace
from nanosft.reference import reference_mode, reference_mode_enabled
from nanosft.args import SFTConfig
from nanosft.model import CausalLM
from nanosft.peft import LoraConfig
from nanosft.sft import SFTTrainer
from nanosft.tokenizer import Tokenizer

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
    )
    return SFTTrainer(CausalLM.from_pretrained(demo.DEFAULT_DIR), args=args, train_dataset=CHATS,
                      processing_class=Tokenizer.from_pretrained(demo.DEFAULT_DIR),
                      peft_config=LoraConfig(target_modules=["q_proj", "v_proj"]))


def hook_counts(model):
    return [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()]


def test_trace_prints_nothing_and_attach_does_nothing_when_off(tmp_path, capsys):
    trace.trace("2.3", "do_sync_step", do_sync_step=True)
    trainer = make_trainer(tmp_path)
    assert trace.attach(trainer) is None
    assert "train" not in vars(trainer)  # no instance wrapper
    trainer.train()
    assert trace.PREFIX not in capsys.readouterr().out


@pytest.mark.parametrize("mode", ["reference", "fast"])
def test_attach_traces_one_step_then_removes_every_wrapper_and_hook(
    mode, tracing, tmp_path, capsys
):
    trainer = make_trainer(tmp_path)
    before = hook_counts(trainer.model)
    callbacks_before = len(trainer.callback_handler.callbacks)
    handle = trace.attach(trainer)
    assert "training_step" in vars(trainer)  # wrapped on this instance only
    assert reference_mode_enabled()  # enable_trace() switched reference mode on
    with reference_mode(mode == "reference"):
        trainer.train()
    out = capsys.readouterr().out
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
    assert handle.done
    wrapped = {
        "train",
        "_inner_training_loop",
        "get_train_dataloader",
        "set_initial_training_values",
        "_prepare_for_training",
        "get_batch_samples",
        "training_step",
        "compute_loss",
        "_clip_grad_norm",
    }
    assert not wrapped & set(vars(trainer))  # the class methods show through again
    assert len(trainer.callback_handler.callbacks) == callbacks_before  # its callback is gone
    assert "step" not in vars(trainer.lr_scheduler) and "zero_grad" not in vars(trainer.model)
    assert not trainer.optimizer._optimizer_step_pre_hooks
    assert hook_counts(trainer.model) == before

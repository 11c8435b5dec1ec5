"""Runs tutorials/03_train.py as a user would and checks what Trainer.train() is shown to do before the loop.

Compared: exit code 0 (the script asserts train() calls _inner_training_loop once with the args and
resume_from_checkpoint, checkpointing is on by then, checkpointed gradients equal plain ones, a resumed run
equals an uninterrupted one, and transformers' training_loss when installed) and the printed lines behind them.
Hermetic: a tiny CausalLM and hand-written rows; checkpoints go to temp folders; no network.
Run: python -m pytest -q tests/test_tutorial_03.py
"""

import re

from run_tutorial import run_tutorial


def test_tutorial_03_train_entry_point():
    out = run_tutorial("03_train.py")
    assert "before train(): model.is_gradient_checkpointing = False" in out
    assert "train() -> _inner_training_loop(args, resume_from_checkpoint=None)" in out
    assert "when the loop starts: model.is_gradient_checkpointing = True" in out
    assert "interrupted run wrote: ['checkpoint-1', 'checkpoint-2'" in out
    assert "resume_from_checkpoint=True resolved to checkpoint-2; resumed global_step 4" in out
    assert "no checkpoint-* folder" in out
    full = re.search(r"uninterrupted (\[.*\])", out).group(1)
    resumed = re.search(r"resumed\s+(\[.*\])", out).group(1)
    assert full == resumed and full.count(",") == 3  # 4 logged steps, identical after resuming at step 2
    assert "OK: walkthrough 2.2 checked" in out

"""Runs tutorials/03_train.py as a user would and checks what Trainer.train() is shown to do before
the loop.

Compared: exit code 0 (the script asserts train() calls _inner_training_loop once with the args and
resume_from_checkpoint, checkpointing is on by then, checkpointed gradients equal plain ones, a
resumed run equals an uninterrupted one, and transformers' training_loss) and the printed lines
behind them: the bytes saved for backward per decoder layer (counted with saved_tensors_hooks) are >
0 without checkpointing and 0 with it, the total at least halves, the gradients agree, and the
transformers comparison ran. Hermetic: a tiny CausalLM and hand-written rows; temp folders; no
network.
Run: python -m pytest -q tests/test_tutorial_03.py
"""

import json
import re

from run_tutorial import assert_reference_ran, run_tutorial


def test_tutorial_03_train_entry_point():
    out = run_tutorial("03_train.py")
    assert "before train(): model.is_gradient_checkpointing = False" in out
    assert "train() -> _inner_training_loop(args, resume_from_checkpoint=None)" in out
    assert "when the loop starts: model.is_gradient_checkpointing = True" in out
    # gradient checkpointing's memory claim, measured with saved_tensors_hooks in the script
    saved = {
        flag: (json.loads(layers), int(total))
        for flag, layers, total in re.findall(
            r"checkpointing=(True|False)\s*: bytes saved for backward per decoder layer "
            r"(\[[\d, ]+\]), "
            r"outside the layers \d+, total (\d+)",
            out,
        )
    }
    assert len(saved["False"][0]) == len(saved["True"][0]) == 2  # two decoder layers
    assert all(b > 0 for b in saved["False"][0]) and saved["True"][0] == [0, 0]
    assert saved["True"][1] < saved["False"][1] / 2
    grad_gap = re.search(r"max \|grad with checkpointing - grad without\| = ([0-9.e+-]+)", out)
    assert float(grad_gap.group(1)) < 1e-6
    assert "interrupted run wrote: ['checkpoint-1', 'checkpoint-2'" in out
    assert "resume_from_checkpoint=True resolved to checkpoint-2; resumed global_step 4" in out
    assert "resume_from_checkpoint=True in an empty output_dir -> ValueError: " in out
    assert "no valid checkpoint to resume" in out
    full = re.search(r"uninterrupted (\[.*\])", out).group(1)
    resumed = re.search(r"resumed\s+(\[.*\])", out).group(1)
    assert (
        full == resumed and full.count(",") == 3
    )  # 4 logged steps, identical after resuming at step 2
    assert_reference_ran(out, "transformers Trainer.train")
    assert "OK: walkthrough 2.2 checked" in out

"""Runs tutorials/14_troubleshooting.py as a user would and checks each troubleshooting story.

Compared: exit code 0 (the script asserts each claim) and the printed lines: the logged loss is nan
only with logging_nan_inf_filter off and the default num_items_in_batch path has no nan; clipping at
the printed threshold binds at the bad step only while the unclipped run's later losses stay huge;
the plain deep stack's first/last gradient ratio vanishes and the residual one's does not; a missing
zero_grad doubles the gradient; the cross-rank checksum finds step 2; the hung all_reduce ends after
the 3 s timeout; the mean max/min ratio of padded tokens per step across two simulated ranks
falls from above 1.5 (random order) to below 1.2 with group_by_length, whose worst step stays
under 1.5; both transformers comparisons ran (the zero-token loss, the grouped order). The
tutorial's recorder (its set-up cells, run in-process) replaces no method of the trainer instance
while training and records each micro-batch, the bad one's loss 10^4 times the same batch's.
Hermetic: a tiny CausalLM and hand-made rows in-process, two gloo ranks on localhost; no network.
Run: python -m pytest -q tests/test_tutorial_14.py
"""

import math
import re
from pathlib import Path

import torch
from run_tutorial import assert_reference_ran, run_tutorial

from nanosft.trainer_callback import TrainerCallback

TUTORIAL = Path(__file__).resolve().parents[1] / "tutorials" / "14_troubleshooting.py"


def test_tutorial_14_nan_filter_and_clipping():
    out = run_tutorial("14_troubleshooting.py")
    filtered = out.split("logging_nan_inf_filter=True:")[1].split("logging_nan_inf_filter=False:")[
        0
    ]
    unfiltered = out.split("logging_nan_inf_filter=False:")[1].split("weights after training")[0]
    assert (
        "0 -> nan" in filtered and "0 -> nan" in unfiltered
    )  # the empty micro-batch's per-batch mean
    logged_on = filtered.split("logged (step, loss, grad_norm):")[1]
    logged_off = unfiltered.split("logged (step, loss, grad_norm):")[1]
    assert "nan" not in logged_on and "(2, nan," in logged_off
    assert "weights after training equal with and without the filter: True" in out
    fix = out.split("fix, num_items_in_batch:")[1].splitlines()[0]
    assert "nan" not in fix and "0 -> 0.0000" in fix
    # B: clipping at a threshold above every ordinary grad_norm binds at the bad step only
    threshold = float(re.search(r"max_grad_norm=([0-9.]+) binds at steps \[3\] only", out).group(1))
    clip = out.split(f"max_grad_norm={threshold} (clipping):")[1].split("binds at")[0]
    norms = [float(x) for x in re.findall(r"grad_norm\s+([0-9.]+)", clip)]
    assert len(norms) == 10 and [i + 1 for i, x in enumerate(norms) if x > threshold] == [3]
    no_clip = out.split("max_grad_norm=0.0 (no clipping):")[1].split("max_grad_norm=")[0]
    losses = [float(x) for x in re.findall(r"loss\s+([0-9.na]+)", no_clip)]
    assert all(not x < 100 for x in losses[3:])  # unclipped: ruined after the bad batch (or nan)
    # C: vanishing gradients in the plain stack, carried by the residual one
    ratios = re.search(
        r"first / last layer grad norm: plain ([0-9.e+-]+), residual ([0-9.e+-]+)", out
    )
    assert float(ratios.group(1)) < 1e-6 and float(ratios.group(2)) > 0.1
    # D: no zero_grad doubles the gradient
    assert "max |grad - 2 g| = 0.0e+00" in out or re.search(
        r"max \|grad - 2 g\| = \d\.\de-0[7-9]", out
    )
    # E, F: the checksum names the first step a rank skipped; the hung collective ended by the
    # timeout
    assert "first step out of sync: 2" in out
    waited = float(re.search(r"hung peer returned after ([0-9.]+) s", out).group(1))
    assert 2.5 < waited < 30
    # G: grouping by length evens out the padded tokens the two ranks compute in each step
    imbalance = re.search(r"load imbalance \(mean max/min ratio\) ([0-9.]+) -> ([0-9.]+) with "
                          r"group_by_length", out)
    before, after = float(imbalance.group(1)), float(imbalance.group(2))
    assert after < 1.2 < 1.5 < before
    grouped = out.split("group_by_length:\n")[1]
    worst = float(re.search(r"mean [0-9.]+, worst ([0-9.]+)", grouped).group(1))
    assert worst < 1.5  # no step in which one rank computes half as much as the other
    assert_reference_ran(out, "transformers Trainer (zero-token micro-batch)",
                         "transformers get_length_grouped_indices (group_by_length order)")
    assert "OK: troubleshooting checked" in out


def shadowed_methods(obj) -> set:
    """Names of methods of obj's class that an attribute of the instance replaces."""
    return {name for name, value in vars(obj).items()
            if callable(value) and callable(getattr(type(obj), name, None))}


def test_tutorial_14_recorder_replaces_no_trainer_method():
    # the tutorial's set-up cells (imports, its trainer, train(), run()), before story A
    prelude = TUTORIAL.read_text().split("# %% [markdown]\n# ## A)")[0]
    tutorial = {"__name__": "tutorial_14_setup"}
    threads = torch.get_num_threads()
    exec(compile(prelude, str(TUTORIAL), "exec"), tutorial)
    torch.set_num_threads(threads)  # the tutorial sets 1 for itself

    seen = []

    class Probe(TrainerCallback):  # looks at the trainer after each micro-batch's training_step
        def on_substep_end(self, args, state, control, **kwargs):
            seen.append((shadowed_methods(trainer),
                         trainer.training_step.__func__ is type(trainer).training_step))

        on_pre_optimizer_step = on_substep_end

    rows = [{"input_ids": [5, 17, 42, 8, 9], "labels": [-100, 17, 42, 8, 9]},
            {"input_ids": [7, 33, 12], "labels": [-100, 33, 12]}] * 2
    steps = {}
    for bad in (None, 1):
        trainer = tutorial["train"](rows, max_steps=2)
        trainer.add_callback(Probe())
        _, steps[bad] = tutorial["run"](trainer, bad_micro_batch=bad)
    assert len(seen) == 8 and all(not names and own_step for names, own_step in seen)
    # every micro-batch recorded as (supervised tokens, tr_loss_step); micro-batch 1 precedes the
    # first optimizer step, so the bad run's loss there is the same batch's times 10^4
    tokens = [n for n, _ in steps[None]]
    assert [n for n, _ in steps[1]] == tokens and sorted(tokens) == [2, 2, 4, 4]
    assert steps[1][0] == steps[None][0]
    assert math.isclose(steps[1][1][1], 1e4 * steps[None][1][1], rel_tol=1e-6)

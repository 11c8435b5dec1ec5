"""Runs tutorials/05_training_step.py as a user would and checks the GA division table it prints.

Compared: exit code 0 (the script asserts every loss against the formula written out beside it, the
gradient against autograd of a hand-made loss, and transformers' training_step when installed) and
the printed table: token-normalised losses are not divided by the window, per-batch means are
divided by the real window size, and the two kinds differ on this input (so a rule applied to the
wrong case would show). Hermetic: a tiny CausalLM and two hand-written rows built in-process; no
network.
Run: python -m pytest -q tests/test_tutorial_05.py
"""

import re

from run_tutorial import assert_reference_ran, run_tutorial


def test_tutorial_05_training_step_rules():
    out = run_tutorial("05_training_step.py")
    assert "model.training: False -> True" in out
    assert "requires_grad=False  grad_fn=None" in out
    assert_reference_ran(out, "transformers Trainer.training_step")
    assert "OK: walkthrough 2.4 training_step checked" in out
    rows = {}
    for line in out.splitlines():
        m = re.match(
            r"(.+?)\s+\| (True|False)\s+\| (\S+)\s+\|\s+(\d)\s+\| (no|/ \d)\s+\| "
            r"([0-9.]+)\s+\| ([0-9.]+)",
            line,
        )
        if m:
            rows[m.group(1).strip()] = (m.group(5), float(m.group(6)), float(m.group(7)))
    assert rows["model takes num_items_in_batch"][0] == "no"
    assert rows["compute_loss_func given"][0] == "no"
    assert rows["no count (num_items_in_batch=None)"][0] == "/ 4"
    assert rows["model without loss kwargs"][0] == "/ 4"
    assert rows["... in a short last window of 3"][0] == "/ 3"
    assert all(abs(got - hand) < 1e-5 for _, got, hand in rows.values())
    assert (
        abs(rows["model takes num_items_in_batch"][1] - rows["model without loss kwargs"][1]) > 0.1
    )

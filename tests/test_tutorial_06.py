"""Runs tutorials/06_compute_loss.py as a user would and checks the losses it prints agree.

Compared: exit code 0 (the script asserts each loss against a formula written out beside it: mean
and sum / num_items_in_batch shifted cross-entropy, label smoothing, a compute_loss_func, and an
online tiled log-softmax; and against transformers ForCausalLMLoss / LabelSmoother and trl
ChunkedLogProbFunction when installed) and the printed numbers: the token-normalised loss differs
from the mean, the smoothed loss from the unsmoothed, and the chunked SFT loss equals
Trainer.compute_loss. Hermetic: a tiny CausalLM, a tiny trained tokenizer and two hand-written rows,
in-process; no network.
Run: python -m pytest -q tests/test_tutorial_06.py
"""

import re

from run_tutorial import assert_reference_ran, run_tutorial


def test_tutorial_06_compute_loss_pieces():
    out = run_tutorial("06_compute_loss.py")
    assert (
        "'1:17->42'" in out and "'5:2->-100'" in out
    )  # the shift: position t predicts labels[t+1]
    mean = float(re.search(r"mean of -log p\(target\) by hand = ([0-9.]+)", out).group(1))
    m = re.search(
        r"compute_loss\(num_items_in_batch=20\) ([0-9.]+)\s+sum by hand / 20 ([0-9.]+)", out
    )
    normalised, by_hand = float(m.group(1)), float(m.group(2))
    assert (
        abs(normalised - by_hand) < 1e-5 and abs(normalised - mean * 7 / 20) < 1e-5
    )  # 7 targets of 20
    m = re.search(r"label_smoothing_factor=0.1: compute_loss ([0-9.]+)\s+by hand ([0-9.]+)", out)
    assert abs(float(m.group(1)) - float(m.group(2))) < 1e-5 and float(m.group(1)) != mean
    assert "ValueError: The model returned no loss" in out
    m = re.search(
        r"SFTTrainer.compute_loss ([0-9.]+)\s+chunked by hand ([0-9.]+)\s+"
        r"Trainer.compute_loss ([0-9.]+)",
        out,
    )
    assert (
        abs(float(m.group(1)) - float(m.group(3))) < 1e-5
        and abs(float(m.group(2)) - float(m.group(3))) < 1e-5
    )
    assert "trl ChunkedLogProbFunction (fp32, tiles of 64)" in out
    assert_reference_ran(
        out,
        "transformers ForCausalLMLoss",
        "transformers LabelSmoother",
        "trl ChunkedLogProbFunction",
    )
    assert "OK: walkthrough 2.5 compute_loss checked" in out

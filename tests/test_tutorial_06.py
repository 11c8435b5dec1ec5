"""Runs tutorials/06_compute_loss.py as a user would and checks the losses, gradients and bytes it
prints.

Compared: exit code 0 (the script asserts each loss against a formula written out beside it: mean
and sum / num_items_in_batch shifted cross-entropy, label smoothing, a compute_loss_func; the fused
head's d log p / dh = w_y - E_p[w] by hand against autograd and TileLogProbs; SFTTrainer's fast
path against reference mode; and transformers ForCausalLMLoss / LabelSmoother and trl
ChunkedLogProbFunction) and the printed lines: the reference-mode banner first; the
token-normalised loss differs from the mean, the smoothed loss from the unsmoothed; the derivation
and fast-path differences under 1e-6; the byte counts equal to their formulas, written out here,
and the tiled path saving fewer bytes for backward than the full logits. Hermetic: a tiny CausalLM,
a tiny trained tokenizer and two hand-written rows, in-process; no network.
Run: python -m pytest -q tests/test_tutorial_06.py
"""

import re

import pytest
from run_tutorial import assert_reference_ran, run_tutorial

from nanosft.fast.lm_head import LOSS_CHUNK_SIZE
from nanosft.reference import REFERENCE_BANNER

NUMBER = r"([0-9.]+(?:e[+-]\d+)?)"
BYTES = r"([0-9,]+) bytes"


@pytest.fixture(scope="module")
def out():
    """The tutorial's stdout, run once for the three tests (about 7 s)."""
    return run_tutorial("06_compute_loss.py")


def test_tutorial_06_compute_loss_pieces(out):
    assert out.splitlines()[0] == REFERENCE_BANNER
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
        r"SFTTrainer.compute_loss ([0-9.]+)\s+tiled by hand ([0-9.]+)\s+"
        r"Trainer.compute_loss ([0-9.]+)",
        out,
    )
    assert (
        abs(float(m.group(1)) - float(m.group(3))) < 1e-5
        and abs(float(m.group(2)) - float(m.group(3))) < 1e-5
        and abs(float(m.group(3)) - normalised) < 1e-5
    )
    assert "trl ChunkedLogProbFunction (fp32, vocabulary tiles of 64)" in out
    assert_reference_ran(
        out,
        "transformers ForCausalLMLoss",
        "transformers LabelSmoother",
        "trl ChunkedLogProbFunction",
    )
    assert "OK: walkthrough 2.5 compute_loss checked" in out


def test_tutorial_06_fused_head_gradient_and_fast_path(out):
    # the derivation: d log p / dh = w_y - E_p[w] by hand on 3 tiles, against autograd and nanosft
    m = re.search(
        r"7 supervised tokens in 3 tiles of <= 3: max \|log p by hand - log_softmax\| = "
        rf"{NUMBER}; max \|d log p / dh by hand - autograd\| = {NUMBER} \(fp32, atol 1e-6\)",
        out,
    )
    assert float(m.group(1)) < 1e-5 and float(m.group(2)) < 1e-6
    m = re.search(
        rf"TileLogProbs on the same tiles: max \|log p - by hand\| = {NUMBER}; "
        rf"max \|grad h - by hand\| = {NUMBER}",
        out,
    )
    assert float(m.group(1)) < 1e-5 and float(m.group(2)) < 1e-6  # log p ~ 6: rtol 1e-6
    # SFTTrainer.compute_loss on the speed paths equals reference mode, both TileLogProbs branches
    for head, n_params in (("frozen ", 20), ("trained", 21)):
        m = re.search(
            rf"lm_head {head}: loss reference {NUMBER} fast {NUMBER}; max \|fast - reference\|: "
            rf"loss {NUMBER}, grad h {NUMBER}, grads of (\d+) params {NUMBER}",
            out,
        )
        assert m, head
        assert abs(float(m.group(1)) - float(m.group(2))) < 1e-6
        assert max(float(m.group(i)) for i in (3, 4, 6)) < 1e-6
        assert int(m.group(5)) == n_params  # the head's weight is in the trained case only
    assert "outputs.logits: reference (2, 6, 300) (B, T, V), fast None" in out


def test_tutorial_06_memory_bytes(out):
    n_tokens, vocab, hidden, fp32 = 8 * 1024, 128_256, 4096, 4
    full = int(re.search(rf"full logits path: logits \+ log-softmax, 2 x \(n, V\) = {BYTES}", out)
               .group(1).replace(",", ""))
    m = re.search(rf"tiled path: 2 x \((\d+), V\) tile buffers = {BYTES} .*\(n, C\) = {BYTES}", out)
    tiles = int(m.group(2).replace(",", ""))
    direction = int(m.group(3).replace(",", ""))
    assert full == 2 * n_tokens * vocab * fp32
    assert int(m.group(1)) == LOSS_CHUNK_SIZE  # the tile nanosft uses
    assert tiles == 2 * LOSS_CHUNK_SIZE * vocab * fp32
    assert direction == n_tokens * hidden * fp32
    assert tiles + direction < full
    # measured: the full path saves the (B*T, V) = (12, 300) fp32 log-softmax; the tiled path less
    m = re.search(
        rf"saved for backward on this batch \(lm_head frozen\): full logits path {BYTES} "
        rf"\(largest \(12, 300\)\), tiled path {BYTES}",
        out,
    )
    full_saved = int(m.group(1).replace(",", ""))
    tiled_saved = int(m.group(2).replace(",", ""))
    assert full_saved >= 2 * 6 * 300 * fp32
    assert tiled_saved < full_saved

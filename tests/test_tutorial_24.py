"""Runs tutorials/24_text_classifier.py as a script and checks what it prints (the generic Trainer).

Compared: exit code 0 (the script asserts DataCollatorWithPadding equals transformers', every
logged training loss and the final eval_loss equal transformers.Trainer's within 1e-5, the same
eval_accuracy before and after, and accuracy >= 0.9 after training); then the printed table: one
row per logging window of the run its arguments give (160 sentences / batch 8 x 4 epochs, logged
every 8 steps), each row's two losses within 1e-5 plus print rounding; the two causal-LM
reporters saying once that they step aside; the comparison with transformers ran.
Hermetic: sentences from a fixed seed, a tokenizer trained in-process; no network.
Run: python -m pytest -q tests/test_tutorial_24.py
"""

import re

from run_tutorial import assert_reference_ran, run_tutorial

ROW = re.compile(r"^\s*(\d+) \| ([0-9.]+) \| ([0-9.]+)$", re.MULTILINE)


def test_tutorial_24_trains_a_classifier_as_transformers_does():
    out = run_tutorial("24_text_classifier.py")
    assert_reference_ran(out, "transformers")
    rows = ROW.findall(out)
    steps = 160 // 8 * 4
    assert [int(step) for step, _, _ in rows] == list(range(8, steps + 1, 8))
    for _, ours, theirs in rows:
        assert abs(float(ours) - float(theirs)) <= 1e-5 + 1e-6  # printed to 6 decimals
    assert out.count("ThroughputCallback steps aside: TextClassifier is not a causal LM") == 1
    assert out.count("the memory ledger steps aside") == 1
    before = float(re.search(r"before: ([0-9.]+)", out).group(1))
    after = float(re.search(r"after: +([0-9.]+)", out).group(1))
    assert after >= 0.9 > before
    assert out.rstrip().endswith("OK: a text classifier trained with the generic Trainer")

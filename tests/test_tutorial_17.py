"""Runs tutorials/17_tensor_parallel.py as a reader does (it spawns its 2 gloo processes) and checks
its claims.

Compared: exit code 0 (the script asserts the by-hand column/row-parallel MLP equals the whole one
only after the all-reduce, heads split 2 + 1 per rank, exactly 2 all-reduces per decoder layer in a
forward, logits and gradients equal to one process, and the refusal of sizes that do not divide) and
the printed numbers.
Hermetic: localhost gloo on CPU, a tiny model saved to a temp folder; no network.
Run: python -m pytest -q tests/test_tutorial_17.py
"""

import re

from run_tutorial import run_tutorial


def test_tutorial_17_tensor_parallel():
    out = run_tutorial("17_tensor_parallel.py", timeout=300)
    hand = re.findall(
        r"max \|partial - whole\| = ([0-9.]+); after the all-reduce: ([0-9.e+-]+)", out
    )
    assert len(hand) == 2 and all(float(a) > 1e-2 and float(b) < 1e-6 for a, b in hand)
    assert out.count("2 of 4 query heads, 1 of 2 KV heads") == 2
    assert out.count("collectives in one forward: {'all_reduce': 4}") == 2
    diffs = re.findall(
        r"max \|logits - one process\| = ([0-9.e+-]+); max \|grad - one process\| = ([0-9.e+-]+)",
        out,
    )
    assert len(diffs) == 2 and all(float(a) < 1e-5 and float(b) < 1e-5 for a, b in diffs)
    assert "num_key_value_heads=3 is not" in out
    assert "OK: tensor parallel checked" in out

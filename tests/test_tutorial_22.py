"""Runs tutorials/22_mixture_of_experts.py as a user would and checks what it prints (MoE).

Compared: exit code 0 (the script asserts each hand-built step against the tensors transformers
and nanosft compute inside their forwards: router logits, renormalised top-k weights, the
combined block output, the auxiliary loss, the output with LoRA'd experts), then the printed
figures against rules worked out here: every "by hand vs transformers, vs nanosft" line <= 1e-5;
each token's two experts are its two largest probabilities and its weights their renormalised
values; "expert e gets tokens" lists exactly the tokens that picked e; f_e is those counts over
the tokens and sums to k; LoRA's A rows and B columns for expert e follow peft's layout (A (r E,
C), B (2 I, r E), rank doubled on the fused gate_up_proj).
Hermetic: a tiny random Qwen3-MoE built in-process, saved to a temporary folder; CPU, no network.
Run: python -m pytest -q tests/test_tutorial_22.py
"""

import re

import pytest
from run_tutorial import run_tutorial

pytest.importorskip("transformers")
pytest.importorskip("peft")

E, K, C, I, R = 4, 2, 64, 32, 2
TOKENS = [5, 17, 42, 7, 99, 23]
NUMBER = r"([0-9.]+e[+-][0-9]+)"


@pytest.fixture(scope="module")
def out():
    return run_tutorial("22_mixture_of_experts.py")


def test_tutorial_22_every_step_equals_transformers_and_nanosft(out):
    found = dict((label, (float(a), float(b))) for label, a, b in re.findall(
        rf"^(.+): by hand vs transformers {NUMBER}, vs nanosft {NUMBER}$", out, flags=re.M))
    assert sorted(found) == sorted(["router logits", "top-k weights", "combined MoE output",
                                    "aux_loss", "MoE output with LoRA'd experts"])
    assert all(max(diffs) <= 1e-5 for diffs in found.values())
    diff = float(re.search(rf"max \|logits - peft\| = {NUMBER}", out)[1])
    assert diff <= 1e-5
    assert out.rstrip().endswith("OK: one MoE batch checked against transformers and peft")


def test_tutorial_22_routing_table_follows_top_k_and_dispatch(out):
    rows = re.findall(r"^ *(\d+)  ([0-9. ]+?)   \[(\d+), (\d+)\]   \[([0-9.]+), ([0-9.]+)\]$",
                      out, flags=re.M)
    assert [int(r[0]) for r in rows] == TOKENS
    picked = {e: [] for e in range(E)}
    for token, probs, e1, e2, w1, w2 in rows:
        p = [float(v) for v in probs.split()]
        top = sorted(range(E), key=lambda e: -p[e])[:K]
        assert [int(e1), int(e2)] == top
        assert abs(float(w1) - p[top[0]] / (p[top[0]] + p[top[1]])) < 2e-3  # printed to 3 places
        assert abs(float(w1) + float(w2) - 1) < 2e-3
        picked[int(e1)].append(int(token))
        picked[int(e2)].append(int(token))
    for e in range(E):
        got = re.search(rf"expert {e} gets tokens \[([0-9, ]*)\]", out)[1]
        assert [int(t) for t in got.split(",") if t.strip()] == [t for t in TOKENS
                                                                 if t in picked[e]]
    f = [float(v) for v in re.search(r"f_e = \[([0-9., ]+)\]", out)[1].split(",")]
    assert abs(sum(f) - K) < 1e-2


def test_tutorial_22_expert_lora_layout_is_peft_s(out):
    r = 2 * R  # gate and up fused: peft's rank_pattern doubles the rank
    assert (f"lora_A ({r * E}, {C}) = (r x E, C), lora_B ({2 * I}, {r * E}) = (2 I, r x E)"
            in out)
    assert f"expert 1: A rows {r}..{2 * r - 1}, B columns {[i * E + 1 for i in range(r)]}" in out
    assert "== nanosft's factors: True" in out
    assert "target_parameters ['down_proj', 'gate.weight', 'gate_up_proj']" in out

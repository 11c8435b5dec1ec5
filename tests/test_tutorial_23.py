"""Runs tutorials/23_linear_attention.py as a user would and checks what it prints (linear
attention, the delta rule, the gated delta rule, Qwen3.5's Gated DeltaNet layer).

Compared: exit code 0 (the script asserts each step's two forms equal within 1e-5: softmax by hand
vs SDPA, linear attention's (T, T) form vs its (D, D) state, the delta rule's correction form vs
its product form, the gated rule's token loop vs its chunked form by hand (a triangular solve per
chunk) vs nanosft's recurrent form vs transformers' torch
implementations, recurrent vs chunked for chunk sizes 2, 4, 8, Qwen3.5's layer vs transformers', a
packed row vs its documents alone), then the printed figures: every "max difference" line at most
1e-5 and each expected one present; the sequential-step counts T / C worked out here; the delta
rule reading back its value while linear attention does not (a negative control); the cache
shapes worked out from the tutorial's config.
Hermetic: toy tensors and a tiny random model built in-process; CPU, no network.
Run: python -m pytest -q tests/test_tutorial_23.py
"""

import re

import pytest
from run_tutorial import run_tutorial

pytest.importorskip("transformers")

T, D = 8, 4  # the toy batch: tokens, head dim
# the tutorial's Qwen3.5 config: kernel 4, 2 key heads and 4 value heads of 8, batch 2
K, HK, HV, DK, B = 4, 2, 4, 8, 2


@pytest.fixture(scope="module")
def out():
    return run_tutorial("23_linear_attention.py")


def test_tutorial_23_every_step_matches(out):
    found = dict(re.findall(r"^(.+): max difference ([0-9.e+-]+)$", out, flags=re.M))
    expected = ["by hand vs F.scaled_dot_product_attention",
                "(Q K^T * causal) V vs the state S updated once a token",
                "correction form vs (I - beta k k^T) S + beta k v^T",
                "by hand vs nanosft recurrent_gated_delta_rule",
                f"by hand: recurrent ({T} steps) vs chunked ({T // 4} steps of 4)",
                "nanosft recurrent vs transformers torch_recurrent_gated_delta_rule",
                "nanosft chunked vs transformers torch_chunk_gated_delta_rule",
                "Qwen3.5 linear_attn layer: nanosft vs transformers",
                "packed row of 4 + 6 tokens vs each document alone (transformers)"]
    expected += [f"chunk_size {c}: {T} sequential steps -> {T // c}; recurrent vs chunked"
                 for c in (2, 4, 8)]
    assert sorted(found) == sorted(expected)
    assert all(float(d) <= 1e-5 for d in found.values())
    for title in ("softmax attention", "linear attention", "delta rule", "gated delta rule"):
        assert f"===== {title} =====" in out
    assert out.rstrip().endswith("OK: linear attention checked against transformers")


def test_tutorial_23_the_delta_rule_reads_back_what_linear_attention_blurs(out):
    blurred = float(re.search(r"reading the last key back from S: error ([0-9.]+)", out)[1])
    exact = float(re.search(r"S\^T k_0 - v_0 = ([0-9.e+-]+)", out)[1])
    assert exact <= 1e-5 < 0.1 < blurred


def test_tutorial_23_cache_shapes(out):
    conv_dim = 2 * HK * DK + HV * DK  # q, k, v through the conv
    assert (f"cache after 12 tokens: conv window ({B}, {conv_dim}, {K - 1}), "
            f"state ({B}, {HV}, {DK}, {DK})") in out
    assert "-> layer 0 runs GatedDeltaNet" in out

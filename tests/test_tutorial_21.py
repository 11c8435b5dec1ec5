"""Runs tutorials/21_families.py as a user would and checks what it prints (model families).

Compared: exit code 0 (the script asserts each hand-built difference against the tensor
transformers computed inside its forward and against nanosft's: Qwen3's q_norm / k_norm, Gemma 3's
embedding scale (fp32 and bf16), (1 + w) RMSNorm, GeGLU, four-norm layer, attention scale and
sliding-window masks, Phi-3's fused projections, partial RoPE and attention output, and a LoRA'd
Phi-3 against peft), then the printed figures against values worked out here from the tutorial's
config: each family's class and logit difference (<= 1e-5), every "by hand vs transformers, vs
nanosft" line present and <= 1e-5, both drawn masks against the rule i - window < j <= i,
rotary_dim = head_dim x partial_rotary_factor, sqrt(1152) in bf16, and the modules and parameter
counts of LoRA's "all-linear" on fused projections.
Hermetic: tiny random models built in-process from transformers' config classes, saved to a
temporary folder and loaded back; CPU, no network. Needs the test extras (transformers, peft).
Run: python -m pytest -q tests/test_tutorial_21.py
"""

import ast
import math
import re

import pytest
import torch
from run_tutorial import run_tutorial

pytest.importorskip("transformers")
pytest.importorskip("peft")

# the tutorial's config: hidden, heads, kv heads, head dim, MLP width, layers, prompt length
C, H, KV, D, I, LAYERS, T = 64, 4, 2, 16, 128, 2, 8
WINDOW, PARTIAL_ROTARY_FACTOR, QUERY_PRE_ATTN_SCALAR, R = 3, 0.5, 24, 2
NUMBER = r"([0-9.]+e[+-][0-9]+)"


@pytest.fixture(scope="module")
def out():
    return run_tutorial("21_families.py")


def test_tutorial_21_each_family_loads_as_its_class_and_matches_transformers(out):
    rows = re.findall(r"^(\S+) +(\S+) +-> nanosft (\S+) +next token (\d+) / (\d+) +"
                      rf"max \|logits - transformers\| = {NUMBER}$", out, flags=re.M)
    classes = {"llama": ("LlamaForCausalLM", "CausalLM"),  # model.py's decoder is Llama's
               "qwen3": ("Qwen3ForCausalLM",) * 2, "gemma3_text": ("Gemma3ForCausalLM",) * 2,
               "phi3": ("Phi3ForCausalLM",) * 2}
    assert {row[0]: row[1:3] for row in rows} == classes
    for model_type, _, _, theirs, ours, diff in rows:
        assert theirs == ours, model_type  # the same greedy next token
        assert float(diff) <= 1e-5, model_type
    assert out.rstrip().endswith("OK: four families checked against transformers")


def test_tutorial_21_every_difference_by_hand_equals_transformers_and_nanosft(out):
    found = re.findall(rf"^(.+): by hand vs transformers {NUMBER}, vs nanosft {NUMBER}$", out,
                       flags=re.M)
    checks = {label: (float(a), float(b)) for label, a, b in found}
    expected = [f"q_norm over {H} heads x {D}", f"k_norm over {KV} heads x {D}",
                f"embeddings x sqrt({C}) = x {math.sqrt(C):g}", "input_layernorm (1 + w)",
                "GeGLU mlp", "layer 0 output, four norms", "fused SwiGLU mlp",
                f"cos, sin ({int(D * PARTIAL_ROTARY_FACTOR)} wide)", "partial RoPE on q and k",
                "attention output from qkv_proj"]
    assert sorted(checks) == sorted(expected)
    for label, diffs in checks.items():
        assert max(diffs) <= 1e-5, label
    # each family line is printed under the Llama line it replaces
    pairs = re.findall(r"^  Llama : .+\n  (Qwen3|Gemma|Phi-3) +: .+$", out, flags=re.M)
    assert {"Qwen3", "Gemma", "Phi-3"} <= set(pairs) and len(pairs) >= 10
    # negative controls: Llama's lines on the same weights give other numbers
    after = float(re.search(r"rms\(q_norm\(q\) / q_norm.weight\) = ([0-9.]+)", out)[1])
    assert abs(after - 1) < 1e-3
    gemma, llama = map(float, re.search(r"Gemma's line ([0-9.]+), Llama's line on the same "
                                        r"weights ([0-9.]+)", out).groups())
    assert gemma > 5 * llama  # norm weights stored around 0: w alone shrinks the output
    assert float(re.search(r"through SwiGLU: max difference ([0-9.]+)", out)[1]) > 0
    assert float(re.search(r"two-norm wiring on the same modules: max difference ([0-9.]+)",
                           out)[1]) > 0


def test_tutorial_21_gemma_scales_in_the_compute_dtype(out):
    scale = torch.tensor(math.sqrt(1152))
    rounded = scale.to(torch.bfloat16).item()
    assert rounded != scale.item()  # the reason the dtype of the multiply matters
    assert f"sqrt(1152) = {scale.item():.4f} -> bfloat16 {rounded:.4f}" in out
    assert "bf16 embeddings: by hand == transformers: True, == nanosft: True" in out
    assert "bf16 (1 + w) norm: by hand == transformers: True, == nanosft: True" in out
    scaling = QUERY_PRE_ATTN_SCALAR**-0.5
    assert f"scaling: transformers {scaling:.4f}, nanosft {scaling:.4f}" in out
    assert f"{scaling:.4f}" != f"{D**-0.5:.4f}"


def test_tutorial_21_draws_the_sliding_window_mask_by_its_rule(out):
    lines = out.splitlines()
    for i in range(T):
        full = " ".join("x" if j <= i else "." for j in range(T))
        window = " ".join("x" if i - WINDOW < j <= i else "." for j in range(T))
        assert f"{i:>5}  {full}  {window}" in lines, i
    assert ("drawn masks == transformers' masks: full True, sliding True; == nanosft's "
            "sliding_window_mask: True") in out
    assert "layer_types ['sliding_attention', 'full_attention']" in out
    # negative control: without the window, the first WINDOW positions agree and no later one
    per_position = [float(x) for x in
                    re.search(r"without the window: max logit difference per position \[(.+)\]",
                              out)[1].split()]
    assert len(per_position) == T
    assert max(per_position[:WINDOW]) == 0 and min(per_position[WINDOW:]) > 0


def test_tutorial_21_phi3_fused_projections_partial_rope_and_lora(out):
    qkv_rows = (H + 2 * KV) * D
    assert f"qkv_proj.weight ({qkv_rows}, {C})" in out
    assert f"split into q {H * D}, k {KV * D}, v {KV * D}" in out
    assert f"gate_up_proj.weight ({2 * I}, {C}) = (2 x I, C): gate {I}, up {I}" in out
    rotary_dim = int(D * PARTIAL_ROTARY_FACTOR)
    assert (f"rotary_dim = head_dim x partial_rotary_factor = {D} x {PARTIAL_ROTARY_FACTOR} = "
            f"{rotary_dim}") in out
    assert (f"dims {rotary_dim}..{D - 1} pass through unchanged: True; dims 0..{rotary_dim - 1} "
            "turned at every position > 0: True") in out
    # LoRA names modules: Phi-3 has no q_proj, and all-linear wraps the fused ones whole
    assert 'target_modules=["q_proj", "v_proj"] on Phi-3, nanosft: ValueError' in out
    assert "  and peft: NoMatchingPeftModuleError" in out
    llama = ast.literal_eval(re.search(r"Llama all-linear, layer 0: (\[.+\])", out)[1])
    phi3 = ast.literal_eval(re.search(r"Phi-3 all-linear, layer 0: (\[.+\])", out)[1])
    assert sorted(llama) == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                    "up_proj", "down_proj"])
    assert sorted(phi3) == sorted(["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])
    wrapped = len(phi3) * LAYERS
    assert f"wrapped modules: nanosft {wrapped}, peft {wrapped}, the same names: True" in out
    fused = R * (C + qkv_rows)  # one lora_A (R, C) and one lora_B (qkv_rows, R)
    separate = R * (C + H * D) + 2 * R * (C + KV * D)
    assert (f"lora_A ({R}, {C}), lora_B ({qkv_rows}, {R}): {fused} parameters (q, k, v as "
            f"three adapters of rank {R}: {separate})") in out
    diff = float(re.search(rf"the same adapter weights in peft: max \|logits - peft\| = {NUMBER}",
                           out)[1])
    assert diff <= 1e-5

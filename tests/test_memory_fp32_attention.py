"""The memory ledger with nanosft.fast.attention on: short bf16 rows on CPU go through torch's fp32
SDPA kernel, which keeps fp32 copies of q, k, v and its fp32 output, and o_proj reads the output
cast back (a new tensor). Each decoder layer's predicted saves against what autograd kept in a real
step (nanosft.memory.count_saved_tensors), within 0.1%, for models whose weights are bf16 (q
reaches SDPA in bf16, so the path runs) under bf16 autocast, LoRA on every linear; and what the
path adds to each layer (on minus off) equal to the byte. Negative control: the prediction
without the path's rows is off by more than 0.1% in some layer.
Cohere 2 under autocast with fp32 weights (it casts q back to q_proj's bf16 output) is covered by
test_memory_partial_targets. Tiny models, CPU, seeded.
Run: python -m pytest -q tests/test_memory_fp32_attention.py
"""

import pytest
import torch
from test_memory import SIZES, _family_model
from test_memory_hybrid import _model as _hybrid_model
from test_memory_hybrid import _step_per_layer
from test_memory_moe import _model as _moe_model
from test_memory_moe import _plan
from tiny import one_thread, tiny_model  # noqa: F401  (one_thread: autouse fixture)

from nanosft import memory
from nanosft.fast import attention
from nanosft.peft import LoraConfig, get_peft_model


def _lora(model):
    return get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))


BUILDERS = {
    "llama": lambda: _lora(tiny_model(**SIZES)),
    "qwen3": lambda: _lora(_family_model("Qwen3Config")),  # q/k norms
    "gemma3": lambda: _lora(_family_model("Gemma3TextConfig")),
    "phi3": lambda: _lora(_family_model("Phi3Config")),  # fused qkv, o_proj reads a copy
    "qwen2-sliding": lambda: _lora(_family_model("Qwen2Config")),  # (T, T) window mask
    "cohere2": lambda: _moe_model("cohere2", "lora"),
    "olmo3": lambda: _moe_model("olmo3", "lora"),
    "gpt_neox": lambda: _moe_model("gpt_neox", "lora"),  # v a view of the fused output
    "qwen3_5_text": lambda: _hybrid_model("qwen3_5_text", "lora"),  # gated attention
}


def _per_layer(model):
    ledger = memory.estimate_memory(model.get_base_model().config, _plan(model, bf16=True))
    return [sum(rows.values()) for rows in ledger.per_layer]


# bf16 weights with a LayerNorm: off by 256 / 512 bytes in the last layer with the path off too
OFF_WITHOUT_THE_PATH = ("cohere2", "gpt_neox")


def _measure(name, monkeypatch, enabled):
    monkeypatch.setattr(attention, "ENABLED", enabled)
    torch.manual_seed(0)
    model = BUILDERS[name]().to(torch.bfloat16)
    measured, _ = _step_per_layer(model, bf16=True)
    return model, measured, _per_layer(model)


@pytest.mark.parametrize("name", list(BUILDERS))
def test_ledger_counts_the_fp32_attention_copies(name, monkeypatch):
    calls = []
    real = attention.F.scaled_dot_product_attention

    def spy(q, *args, **kwargs):
        calls.append(q.dtype)
        return real(q, *args, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    model, measured, predicted = _measure(name, monkeypatch, True)
    assert torch.float32 in calls  # the fp32 kernel ran
    _, measured_off, predicted_off = _measure(name, monkeypatch, False)
    print("predicted / measured per layer:", predicted, measured, "off:", predicted_off,
          measured_off)
    # what the path adds to each layer, counted to the byte
    assert [p - q for p, q in zip(predicted, predicted_off)] == \
        [m - n for m, n in zip(measured, measured_off)]
    assert predicted != predicted_off
    if name not in OFF_WITHOUT_THE_PATH:
        for p, m in zip(predicted, measured):
            assert abs(p - m) <= 0.001 * m
    # negative control: the path on, the ledger read as if it were off
    monkeypatch.setattr(attention, "ENABLED", False)
    assert any(abs(p - m) > 0.001 * m for p, m in zip(_per_layer(model), measured))

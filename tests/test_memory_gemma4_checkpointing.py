"""The memory ledger (nanosft/memory) on Gemma 4 under gradient checkpointing, against a real step.

Every layer checkpointed, what a step holds between forward and backward is of two kinds, counted
apart. Saved by autograd (saved_tensors_hooks): each layer's input, the first a view of the
(N, C + L P) concatenation of the embeddings with the per-layer inputs, and the saves outside the
layers (under LoRA the embedding output needs grad, as the Trainer sets it, so under bf16
autocast the per-layer projection keeps its weight's bf16 copy). Held outside autograd: the cos /
sin tables of each layer type and the (k, v) the KV-shared layers read, which Gemma4Model hands
checkpoint() inside a dict and a tuple, so they stay alive in its recompute closure; measured as
the storages inside checkpoint()'s non-tensor arguments still alive at the end of forward.
Asserted, for the dense model (sliding and full layers, two KV-shared, per-layer inputs) and
with enable_moe_block, for full fine-tuning, LoRA, QLoRA and LoRA under bf16 autocast: the
ledger's held part equals the held bytes, and its activations row is within 1% of the saved plus
the held bytes (the estimate before read 0.82-0.92 of them). Tiny models, CPU, seeded.
Run: python -m pytest -q tests/test_memory_gemma4_checkpointing.py
"""

import dataclasses

import pytest
import torch
import test_memory_gemma4_moe
import test_memory_hybrid
from test_memory_moe import B, T, V, _activations, _plan
from tiny import one_thread  # noqa: F401  (autouse fixture)

from nanosft import memory
from nanosft.families import gemma4

CASES = [(kind, method, bf16) for kind in ("dense", "moe") for method, bf16 in (
    ("full", False), ("lora", False), ("qlora", False), ("lora", True))]
# both KV-shared layers full: the sliding layer 0 stores keys and values no later layer reads
CASES.append(("dense_shared_full", "full", False))


def _model(kind, method, monkeypatch):
    if kind == "moe":
        return test_memory_gemma4_moe._model(method)
    if kind == "dense_shared_full":
        cls, overrides = test_memory_hybrid.FAMILIES["gemma4_text"]
        types = ["sliding_attention"] + ["full_attention"] * 3
        monkeypatch.setitem(test_memory_hybrid.FAMILIES, "gemma4_text",
                            (cls, {**overrides, "layer_types": types}))
    # sliding, full, then two layers reading their keys and values
    return test_memory_hybrid._model("gemma4_text", method)


def _checkpointed_step(model, method, bf16, monkeypatch):
    """Forward and backward with every layer checkpointed: (bytes autograd saved, bytes of the
    tensors inside checkpoint()'s dict / tuple arguments alive when forward ends)."""
    base = model if method == "full" else model.get_base_model()
    if method != "full":
        base.enable_input_require_grads()  # what the Trainer does for a checkpointed LoRA model
    base.gradient_checkpointing_enable()
    storages = {}

    def recording(fn, *args, **kwargs):
        for a in args:
            for t in a.values() if isinstance(a, dict) else a if isinstance(a, tuple) else ():
                if torch.is_tensor(t):
                    storages[t.untyped_storage().data_ptr()] = t.untyped_storage()
        return checkpoint(fn, *args, **kwargs)

    checkpoint = gemma4.checkpoint
    monkeypatch.setattr(gemma4, "checkpoint", recording)
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(0))
    with memory.count_saved_tensors(model) as saved:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=ids, labels=ids).loss
    # alive: held by something besides this dict (a checkpointed layer waiting for backward)
    held = sum(s.nbytes() for s in storages.values() if torch._C._storage_Use_Count(s._cdata) > 1)
    storages.clear()
    loss.backward()
    return saved.total, held


@pytest.mark.parametrize("kind,method,bf16", CASES, ids=lambda v: {
    True: "bf16", False: "fp32"}.get(v, v))
def test_activations_under_gradient_checkpointing(kind, method, bf16, monkeypatch):
    model = _model(kind, method, monkeypatch)
    base = model if method == "full" else model.get_base_model()
    saved, held = _checkpointed_step(model, method, bf16, monkeypatch)
    plan = dataclasses.replace(_plan(model, bf16=bf16), gradient_checkpointing=True)
    parts = memory.families.gemma4_checkpointed_saved(base.config, plan)
    held_predicted = sum(b for name, b in parts.items() if name.startswith("held."))
    assert held_predicted == held
    predicted = _activations(base.config, plan)
    print(f"{kind} {method} bf16={bf16}: saved {(predicted - held_predicted) / saved:.4f}, "
          f"saved + held {predicted / (saved + held):.4f}")
    assert abs(predicted - held_predicted - saved) <= 0.01 * saved
    assert abs(predicted - (saved + held)) <= 0.01 * (saved + held)

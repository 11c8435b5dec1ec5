"""Activated LoRA (aLoRA, LoraConfig.alora_invocation_tokens): the adapter changes only the tokens
from the last occurrence of its invocation sequence onward, so the base model's cache of the
prompt before it stays valid.

`alora_offsets` finds, per row, where the invocation sequence last starts, counted back from the
end (None: not found, the row runs the base model); `LoraModel` hands the offsets to every LoRA
layer for one forward or generate call; `alora_delta` adds B A x * s to the last `offset` positions
of each row only. During decoding with a cache each step's token lies past the invocation, so the
offsets found on the prompt hold for every step.
Paper: Activated LoRA (2504.12397).
"""

import warnings

import torch


def alora_offsets(peft_config, active_adapter, input_ids, adapter_names=None):
    """Per row of `input_ids` (B, T): T minus the start of the last occurrence of its adapter's
    invocation tokens, or None (not found, "__base__", or not an aLoRA adapter).
    Mirrors: peft calculate_alora_offsets"""
    offsets = []
    for i, sequence in enumerate(input_ids):
        name = adapter_names[i] if adapter_names and i < len(adapter_names) else active_adapter
        config = peft_config.get(name) if name != "__base__" else None
        if name != "__base__" and config is None:
            warnings.warn(f"Adapter '{name}' not found in peft_config. Using base model for row "
                          f"{i}.")
        tokens = getattr(config, "alora_invocation_tokens", None)
        if tokens is None:
            offsets.append(None)
            continue
        n, T = len(tokens), len(sequence)
        invocation = torch.tensor(tokens, dtype=sequence.dtype, device=sequence.device)
        starts = [s for s in range(T - n + 1) if torch.equal(sequence[s:s + n], invocation)]
        offsets.append(T - starts[-1] if starts else None)
    return offsets


def is_alora_batch(peft_config, active_adapter, adapter_names=None):
    """Whether any row of this call uses an aLoRA adapter.
    Mirrors: peft is_alora_relevant_in_batch"""
    names = [n for n in (adapter_names or []) if n != "__base__"] or [active_adapter]
    return any(getattr(peft_config.get(n), "alora_invocation_tokens", None) for n in names)


def alora_delta(x, result, lora_A, lora_B, dropout, scaling, offsets):
    """`result` plus the adapter's update on the last offsets[i] positions of row i only (none
    where the offset is None, or when no offsets were given).
    Mirrors: peft ALoraLinearVariant.forward"""
    shape = result.shape
    B = shape[0]
    T = shape[1] if result.dim() == 3 else 1
    if offsets is None:
        mask = torch.zeros(B, T, dtype=torch.bool, device=result.device)
    else:
        last = torch.tensor([0 if o is None else min(int(o), T) for o in offsets],
                            device=result.device)
        mask = torch.arange(T, device=result.device)[None, :] >= (T - last)[:, None]  # (B, T)
    x = x.to(lora_A.weight.dtype).reshape(B * T, -1)
    result = result.clone().reshape(B * T, -1)
    rows = mask.reshape(-1)
    result[rows] += (lora_B(lora_A(dropout(x[rows]))) * scaling).to(result.dtype)
    return result.reshape(shape)

"""Short-row bf16 / fp16 attention on CPU through torch's fp32 kernel.

torch's CPU flash-attention kernel is slow in backward at half precision on short keys: one
SmolLM2-135M document of 50 tokens (9 query / 3 KV heads, head dim 64) took 1.12 ms forward and
backward in bf16 against 0.37 ms for the same inputs cast to fp32 and back (one thread, AVX-512
with AVX512-BF16); the two meet near 300 keys. fp16 (no native fp16 units on most x86 CPUs) took
5-6x the fp32 time at every length measured, 50 to 400 keys. So on CPU the half-precision inputs
go through the fp32 kernel, with autocast off inside (it would cast them back), and the output is
rounded once to the input dtype: the kernel accumulates in fp32 either way, and its output is
closer to attention in float64 than the half-precision kernel's (tested). Off in reference mode
and with NANOSFT_FP32_ATTENTION=0 (or ENABLED = False). Training (grad enabled) only: a no-grad
forward keeps transformers' bf16 logits bit for bit. The fp32 copies it saves for backward are
in the memory ledger (nanosft.memory.activations.sdpa_bytes asks `takes_fp32`).
"""

import os

import torch
import torch.nn.functional as F

ENABLED = os.environ.get("NANOSFT_FP32_ATTENTION", "1").strip() not in ("", "0")

# above this many keys torch's bf16 kernel is as fast or faster (measured crossover ~300)
BF16_MAX_KEYS = 256


def takes_fp32(dtype, keys, device_type="cpu") -> bool:
    """Whether a training SDPA of `dtype` inputs over `keys` keys runs through the fp32 kernel
    (also what the memory ledger asks, nanosft.memory.activations.sdpa_saves)."""
    if not ENABLED or device_type != "cpu":
        return False
    return dtype == torch.float16 or (dtype == torch.bfloat16 and keys <= BF16_MAX_KEYS)


def _use_fp32(q, k) -> bool:
    return torch.is_grad_enabled() and takes_fp32(q.dtype, k.shape[-2], q.device.type)


def scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal=False, scale=None,
                                 enable_gqa=False):
    """F.scaled_dot_product_attention, run in fp32 for short CPU rows in bf16 / fp16 (module
    docstring); the same arguments and the output in q's dtype."""
    if not _use_fp32(q, k):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                              scale=scale, enable_gqa=enable_gqa)
    with torch.autocast("cpu", enabled=False):
        if attn_mask is not None and attn_mask.dtype != torch.bool:
            attn_mask = attn_mask.float()
        y = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=attn_mask,
                                           is_causal=is_causal, scale=scale,
                                           enable_gqa=enable_gqa)
    return y.to(q.dtype)

"""Short half-precision attention on CPU runs torch's fp32 kernel (nanosft.fast.attention).

Against attention in float64 rounded once to the input dtype: the output and the q, k, v
gradients of the speed path are within one ulp of the input dtype at each value (fp32 arithmetic,
one rounding), for bf16 and fp16, causal and with a mask, grouped-query heads; torch's own bf16
kernel, which reference mode runs, is shown no closer to float64 than that. Past 256 keys in bf16
the speed path is torch's bf16 kernel itself (bit for bit); fp32 inputs never change path. In a
bf16 model the speed path is taken for short rows and not in reference mode (a spy on the
kernel's dtype).
Run: python -m pytest -q tests/test_fast_attention.py
"""

import pytest
import torch
import torch.nn.functional as F

from nanosft.fast import attention
from nanosft.fast.attention import BF16_MAX_KEYS, scaled_dot_product_attention
from nanosft.model import CausalLM, ModelConfig
from nanosft.reference import reference_mode


@pytest.fixture(autouse=True)
def enabled(monkeypatch):
    monkeypatch.setattr(attention, "ENABLED", True)  # opt-in (module docstring)


def _ulp(t, dtype):
    # the spacing of `dtype` values at |t| (bf16: 7 stored mantissa bits, fp16: 10)
    bits = {torch.bfloat16: 8, torch.float16: 11}[dtype]
    tiny = torch.finfo(dtype).tiny
    return torch.ldexp(torch.ones_like(t, dtype=torch.float64),
                       torch.frexp(t.abs().clamp(min=tiny)).exponent - bits)


def _inputs(dtype, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, n, T, 16, generator=g) for n in (6, 2, 2))
    grad = torch.randn(2, 6, T, 16, generator=g)
    return [t.to(dtype) for t in (q, k, v, grad)]


def _run(fn, q, k, v, grad, dtype=None, **kw):
    q, k, v, grad = (t.detach().to(dtype or t.dtype) for t in (q, k, v, grad))
    for t in (q, k, v):
        t.requires_grad_(True)
    y = fn(q, k, v, enable_gqa=True, scale=0.3, **kw)
    return (y, *torch.autograd.grad(y, (q, k, v), grad))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T, masked", [(1, False), (7, False), (50, False), (50, True),
                                       (BF16_MAX_KEYS, False)])
def test_output_and_gradients_are_float64_rounded_once(dtype, T, masked):
    q, k, v, grad = _inputs(dtype, T)
    kw = {"is_causal": True}
    if masked:  # a boolean mask hiding two keys of every row, as a padded batch's
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        mask[:, :2] = False
        mask[:2, 0] = True  # every query keeps one key
        kw = {"attn_mask": mask}
    fast = _run(scaled_dot_product_attention, q, k, v, grad, **kw)
    exact = _run(F.scaled_dot_product_attention, q, k, v, grad, dtype=torch.float64, **kw)
    torch_half = _run(F.scaled_dot_product_attention, q, k, v, grad, **kw)
    for name, f, e, h in zip(("out", "dq", "dk", "dv"), fast, exact, torch_half):
        assert f.dtype == dtype, name
        err = (f.double() - e).abs()
        # one rounding of an fp32 result: half an ulp plus the fp32 arithmetic's own error
        assert (err <= _ulp(e, dtype) + 1e-5 * e.abs().max() + 1e-6).all(), name
        if dtype == torch.bfloat16 and T > 1:  # torch's own bf16 kernel is no closer
            assert err.max() <= (h.double() - e).abs().max() * 1.001 + 1e-12, name


def test_long_bf16_rows_and_fp32_keep_torch_kernel_bit_for_bit():
    for dtype, T in ((torch.bfloat16, BF16_MAX_KEYS + 1), (torch.float32, 20)):
        q, k, v, grad = _inputs(dtype, T)
        fast = _run(scaled_dot_product_attention, q, k, v, grad, is_causal=True)
        plain = _run(F.scaled_dot_product_attention, q, k, v, grad, is_causal=True)
        for f, p in zip(fast, plain):
            assert torch.equal(f, p)


def test_the_model_takes_the_fp32_kernel_for_short_bf16_rows_only_with_speed_paths(monkeypatch):
    seen = []
    real = F.scaled_dot_product_attention

    def spy(q, *args, **kwargs):
        seen.append(q.dtype)
        return real(q, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512)
    model = CausalLM(config).to(torch.bfloat16)
    for reference, T, kernel in ((False, 12, torch.float32), (True, 12, torch.bfloat16),
                                 (False, BF16_MAX_KEYS + 4, torch.bfloat16)):
        seen.clear()
        with reference_mode(reference):
            out = model(torch.randint(1, 64, (2, T)))
        assert out.logits.dtype == torch.bfloat16
        assert seen == [kernel] * 2, (reference, T, seen)
    seen.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast must not cast the fp32 back
        model.float()(torch.randint(1, 64, (2, 12)))
    assert seen == [torch.float32] * 2

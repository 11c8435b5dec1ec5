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
    dequantize_absmax,
    dequantize_nf4,
    double_quantize,
    dynamic_code_values,
    quantize_nf4,
)

EXACT = {"rtol": 0, "atol": 0}


# ----- NF4 by hand against bitsandbytes.functional ------------------------------------------------


def _weights():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 64, generator=g)
    w[1] = 0  # an all-zero block: scales to zeros (absmax clamped only for the reciprocal)
    return {
        "whole blocks per row": torch.randn(16, 128, generator=g),
        "blocks crossing rows": torch.randn(3, 96, generator=g),  # block 1: row 0[64:], row 1[:32]
        "odd count, partial last block": torch.randn(5, 13, generator=g),
        "zero block": w,
        "zero partial last block": torch.cat([torch.randn(1, 64, generator=g), torch.zeros(1, 64)],
                                             1)[:, :100],
        "large scale": torch.randn(8, 64, generator=g) * 1e30,
        "tiny scale": torch.randn(8, 64, generator=g) * 1e-35,  # absmax near fp32's smallest normal
        "bf16 weight": torch.randn(8, 128, generator=g).bfloat16(),
    }


WEIGHTS = _weights()


@pytest.mark.parametrize("name", WEIGHTS)
def test_quantize_nf4_bytes_and_absmax_are_identical_to_bitsandbytes(name):
    w = WEIGHTS[name]
    packed, absmax = quantize_nf4(w)
    ref_packed, ref_state = bnbF.quantize_4bit(w, blocksize=64, quant_type="nf4")
    assert packed.dtype == torch.uint8 and packed.shape == ref_packed.shape
    torch.testing.assert_close(packed, ref_packed, **EXACT)
    torch.testing.assert_close(absmax, ref_state.absmax, **EXACT)


@pytest.mark.parametrize("name", WEIGHTS)
def test_dequantize_nf4_equals_bitsandbytes_where_its_cpu_decode_is_right(name):
    w = WEIGHTS[name]
    ref_packed, state = bnbF.quantize_4bit(w, blocksize=64, quant_type="nf4")
    ours = dequantize_nf4(ref_packed, state.absmax, w.shape, dtype=w.dtype)
    if w.shape[-1] % 64:
        # bnb's CPU C++ decode reshapes to (rows, cols / 2): with blocks crossing rows its AVX-512
        # path (picked at run time on such CPUs) goes wrong; odd widths take its torch.compile'd
        # fallback (seconds to build). So there, on every CPU, check the fp32 formula instead.
        code = bnbF.get_4bit_type("nf4", device="cpu")
        b = ref_packed.flatten().long()
        idx = torch.stack([b >> 4, b & 0xF], 1).flatten()[: w.numel()]
        expected = code[idx] * state.absmax[torch.arange(w.numel()) // 64]
        torch.testing.assert_close(ours, expected.reshape(w.shape).to(w.dtype), **EXACT)
        return
    torch.testing.assert_close(ours, bnbF.dequantize_4bit(ref_packed, state), **EXACT)


def bnb_torch_kernel(op, *args):
    """bnb's pure-torch kernel of `op` (registered for devices with no C++ kernel), called on CPU
    tensors by skipping its CPU kernel in the dispatcher."""
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)
    return op.default.redispatch(keys, *args)


def test_dynamic_code_values_equal_bitsandbytes_dynamic_map():
    code = dynamic_code_values()
    torch.testing.assert_close(code, bnbF.create_dynamic_map(signed=True), **EXACT)
    assert code.shape == (256,) and (code == 0).sum() == 1 and code.max() == 1.0


def _absmax_of_a_real_size_layer():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(1024, 64 * 24, generator=g) * torch.rand(1024, 1, generator=g)  # 24,576 blocks
    _, absmax = quantize_nf4(w)
    _, ref_state = bnbF.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
    return absmax, ref_state


def test_double_quantize_matches_bitsandbytes_codes_up_to_counted_near_ties():
    absmax, ref = _absmax_of_a_real_size_layer()
    codes, absmax2, offset = double_quantize(absmax)
    torch.testing.assert_close(offset, ref.offset, **EXACT)  # the mean, subtracted first
    torch.testing.assert_close(absmax2, ref.state2.absmax, **EXACT)  # one fp32 scale per 256
    assert ref.state2.blocksize == 256 and codes.dtype == torch.uint8
    # bnb's torch kernel (what it runs where no C++ kernel exists) picks the exact nearest code too
    ref_nearest, _ = bnb_torch_kernel(torch.ops.bitsandbytes.quantize_blockwise,
                                      absmax - offset, dynamic_code_values(), 256)
    torch.testing.assert_close(codes, ref_nearest, **EXACT)
    # bnb's CPU C++ kernel finds the code through BinSearch's uniform-grid lookup (Direct2): a value
    # within one grid step (2/65535 of the scaled range) of a midpoint can land on the neighbour.
    differ = codes != ref.absmax
    scaled = (absmax - offset).view(-1, 256) / absmax2[:, None]
    code = dynamic_code_values()
    ours_err = (scaled.flatten() - code[codes.long()]).abs()[differ]
    bnb_err = (scaled.flatten() - code[ref.absmax.long()]).abs()[differ]
    print(f"double quantization: {int(differ.sum())} of {codes.numel()} codes differ from bnb's "
          f"CPU kernel, each a near-tie (excess error <= {float((bnb_err - ours_err).max()):.2e})")
    assert 0 < differ.sum() < 0.005 * codes.numel()  # measured: 0.1%
    assert bool((bnb_err - ours_err <= 2 / 65535).all())  # ours is never the farther code
    assert bool((ours_err <= bnb_err).all())
    # where the codes agree, the absmax rebuilt from our state equals bnb's bit for bit
    rebuilt = dequantize_absmax(codes, absmax2, offset)
    ref_rebuilt = bnbF.dequantize_blockwise(ref.absmax, ref.state2) + ref.offset
    torch.testing.assert_close(rebuilt[~differ], ref_rebuilt[~differ], **EXACT)


def test_negative_control_double_quantization_without_the_mean_is_caught():
    absmax, ref = _absmax_of_a_real_size_layer()
    # the classic slip: quantize absmax itself (all positive: half the signed map goes unused)
    uncentred, _ = bnb_torch_kernel(torch.ops.bitsandbytes.quantize_blockwise, absmax,
                                    dynamic_code_values(), 256)
    assert (uncentred != ref.absmax).float().mean() > 0.5


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


def test_cpu_eval_output_equals_train_mode_and_bitsandbytes_train_mode():
    # bnb in eval on an AVX512-BF16 CPU repacks for a bf16 kernel (other numerics); ours keeps
    # dequantize + matmul in eval, so eval output equals both train-mode outputs bit for bit
    ours, ref = pair()
    x = torch.randn(3, 128)
    with torch.no_grad():
        train_ref = ref(x)
        torch.testing.assert_close(ours.eval()(x), train_ref, **EXACT)
        torch.testing.assert_close(ours.train()(x), train_ref, **EXACT)


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

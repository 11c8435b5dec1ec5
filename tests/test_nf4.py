"""Behaviour of nanosft.nf4: the NF4 code table, blockwise quantization by hand and through
bitsandbytes, storage cost, forward in train and eval mode, state dict, lazy import.

Compared against formulas written out here: the QLoRA normal-quantile construction, nearest-code
quantization with one absmax per 64-value block over the flattened weight (first code in the high
nibble), the double-quantization error bound, the byte count of each stored tensor, and
y = x W_deq^T + b. Hermetic: tiny random layers on CPU, no files outside pytest's tmp_path.
Linear4bit in_features are multiples of the blocksize (64): on a CPU with AVX-512, bitsandbytes'
CPU dequantize kernel decodes rows that split a block wrongly. The bf16 test runs both sides
through this CPU's own bf16 matmul (oneDNN's or torch's fallback), so it holds with either.
Run: python -m pytest -q tests/test_nf4.py
"""

import math
import subprocess
import sys

import bitsandbytes.functional as bnbF
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from nanosft.nf4 import (
    Linear4bit,
    bytes_per_parameter,
    dequantize_absmax,
    dequantize_nf4,
    double_quantize,
    dynamic_code_values,
    is_quantized,
    nf4_code_values,
    quantize_model,
    quantize_nf4,
)

EXACT = {"rtol": 0, "atol": 0}
FP32 = {"rtol": 1e-5, "atol": 1e-5}


def unpack_codes(packed, numel):
    """Two 4-bit indices per byte, the first element in the HIGH nibble (QLoRA / bnb layout)."""
    b = packed.reshape(-1).to(torch.int64)
    return torch.stack([b >> 4, b & 0xF], dim=1).reshape(-1)[:numel]


def test_nf4_code_values_follow_the_qlora_construction_and_equal_bitsandbytes():
    code = nf4_code_values()
    assert code.shape == (16,) and code.dtype == torch.float32
    assert torch.all(code[1:] > code[:-1])  # sorted, distinct
    assert code[0] == -1.0 and code[-1] == 1.0 and (code == 0).sum() == 1  # exact zero (QLoRA 3)
    assert (code > 0).sum() == 8 and (code < 0).sum() == 7  # asymmetric: one extra positive level
    torch.testing.assert_close(code, bnbF.get_4bit_type("nf4", device="cpu"), **EXACT)


def test_nf4_positive_levels_are_equal_mass_normal_quantiles():
    # QLoRA eq. 4: q_i = 1/2 (Q(i/(2^k+1)) + Q((i+1)/(2^k+1))) is the idea; bnb uses evenly
    # spaced probabilities from offset=0.9677083 to 0.5, so level k (down from 1.0) is Q(p_k)/Q(p_0)
    p = torch.linspace(0.9677083, 0.5, 9)[:-1].double()
    normal = torch.distributions.Normal(0.0, 1.0)
    expected = (normal.icdf(p) / normal.icdf(p[:1])).float().flip(0)
    torch.testing.assert_close(nf4_code_values()[8:], expected, rtol=0, atol=1e-7)


@pytest.mark.parametrize("out_features,in_features", [(8, 64), (16, 128)])
def test_quantize_is_nearest_code_with_one_absmax_per_64_block(out_features, in_features):
    w = torch.randn(out_features, in_features)
    layer = Linear4bit.from_linear(_linear(w), compress_statistics=False)
    blocks = w.reshape(-1, 64)  # contiguous blocks over the flattened row-major weight
    absmax = blocks.abs().amax(dim=1)
    torch.testing.assert_close(layer.quant_state.absmax, absmax, **EXACT)
    idx = unpack_codes(layer.weight, w.numel()).reshape(-1, 64)
    scaled = blocks / absmax[:, None]
    code = nf4_code_values()
    chosen_err = (scaled - code[idx]).abs()
    best_err = (scaled[..., None] - code).abs().amin(dim=-1)
    torch.testing.assert_close(chosen_err, best_err, rtol=0, atol=1e-6)


def test_negative_control_low_nibble_first_unpacking_does_not_reproduce_the_weight():
    w = torch.randn(4, 64)
    layer = Linear4bit.from_linear(_linear(w), compress_statistics=False)
    absmax = layer.quant_state.absmax.repeat_interleave(64)
    code = nf4_code_values()
    high_first = code[unpack_codes(layer.weight, w.numel())] * absmax
    b = layer.weight.reshape(-1).to(torch.int64)
    low_first = code[torch.stack([b & 0xF, b >> 4], 1).reshape(-1)] * absmax
    deq = layer.dequantize().reshape(-1)
    torch.testing.assert_close(deq, high_first, **EXACT)
    assert not torch.allclose(deq, low_first)


# ----- NF4 by hand ------------------------------------------------------------------------------


def test_quantize_nf4_takes_absmax_over_blocks_of_the_flattened_weight_crossing_rows():
    w = torch.randn(3, 96)  # 288 values: blocks [0:64], [64:128] (rows 0 and 1), ..., [256:288]
    packed, absmax = quantize_nf4(w)
    flat = w.flatten()
    expected = torch.stack([flat[i:i + 64].abs().max() for i in range(0, 288, 64)])
    torch.testing.assert_close(absmax, expected, **EXACT)
    assert packed.shape == (144, 1) and packed.dtype == torch.uint8
    # nearest level of value / absmax, two per byte, the first in the high nibble
    code = nf4_code_values()
    scaled = flat / absmax.repeat_interleave(64)[:288]
    idx = unpack_codes(packed, 288)
    chosen, best = (scaled - code[idx]).abs(), (scaled[:, None] - code).abs().amin(1)
    torch.testing.assert_close(chosen, best, rtol=0, atol=1e-6)


@pytest.mark.parametrize("shape", [(8, 64), (3, 96), (5, 13)])
def test_dequantize_nf4_is_within_half_a_level_gap_of_the_weight(shape):
    w = torch.randn(shape)
    packed, absmax = quantize_nf4(w)
    deq = dequantize_nf4(packed, absmax, shape)
    assert deq.shape == w.shape and deq.dtype == torch.float32
    half_gap = (nf4_code_values().diff().max() / 2).item()
    bound = half_gap * absmax.repeat_interleave(64)[: w.numel()] + 1e-7
    assert bool(((deq - w).abs().flatten() <= bound).all())


def test_an_all_zero_block_stores_absmax_zero_and_decodes_to_zeros():
    w = torch.randn(2, 64)
    w[0] = 0
    packed, absmax = quantize_nf4(w)
    assert absmax[0] == 0 and bool((unpack_codes(packed, 128)[:64] == 7).all())  # code 7 is 0.0
    torch.testing.assert_close(dequantize_nf4(packed, absmax, w.shape)[0], w[0], **EXACT)


def test_double_quantization_rebuilds_absmax_within_half_an_8bit_step():
    absmax = torch.rand(1000) * 0.1 + 0.01  # a layer's positive block scales
    codes, absmax2, offset = double_quantize(absmax)
    assert codes.dtype == torch.uint8 and codes.shape == (1000,) and absmax2.shape == (4,)
    torch.testing.assert_close(offset, absmax.mean(), **EXACT)
    rebuilt = dequantize_absmax(codes, absmax2, offset)
    # the dynamic map's widest gap is at its ends (about 0.014): half of it times the block scale
    half_gap = dynamic_code_values().diff().max() / 2
    bound = half_gap * absmax2.repeat_interleave(256)[:1000] + 1e-7
    assert bool(((rebuilt - absmax).abs() <= bound).all())


@pytest.mark.parametrize("double_quant", [False, True])
def test_dequantize_error_is_within_half_the_largest_code_gap(double_quant):
    w = torch.randn(32, 128)
    layer = Linear4bit.from_linear(_linear(w), compress_statistics=double_quant)
    absmax = w.reshape(-1, 64).abs().amax(dim=1)
    qs = layer.quant_state
    used = (
        bnbF.dequantize_blockwise(qs.absmax, qs.state2) + qs.offset if double_quant else qs.absmax
    )
    half_gap = (nf4_code_values().diff().max() / 2).item()  # worst rounding of a scaled value
    # |code*a_used - w| <= |a_used - a| (absmax error, double quant only) + half_gap * a
    bound = (used - absmax).abs() + half_gap * absmax + 1e-6
    err = (layer.dequantize() - w).reshape(-1, 64).abs()
    assert torch.all(err <= bound[:, None])
    assert layer.dequantize().dtype == w.dtype and layer.dequantize().shape == w.shape


def test_bytes_per_parameter_matches_the_format_arithmetic():
    out_f, in_f = 256, 512
    n, blocks = out_f * in_f, out_f * in_f // 64
    lin = nn.Linear(in_f, out_f)
    plain = Linear4bit.from_linear(lin, compress_statistics=False)
    double = Linear4bit.from_linear(lin, compress_statistics=True)
    # codes 0.5 B/weight; fp32 absmax per block; 16-entry fp32 code table
    expected_plain = (n / 2 + 4 * blocks + 16 * 4) / n
    # uint8 absmax per block; fp32 absmax per 256 blocks; 256-entry fp32 8-bit map; fp32 offset
    expected_double = (n / 2 + blocks + 4 * math.ceil(blocks / 256) + 16 * 4 + 256 * 4 + 4) / n
    assert bytes_per_parameter(plain) == pytest.approx(expected_plain, abs=1e-12)
    assert bytes_per_parameter(double) == pytest.approx(expected_double, abs=1e-12)
    # QLoRA 3: statistics cost 32/64 = 0.5 bit per weight, 8/64 + 32/(64*256) = 0.127 with double
    # quantization (the fixed code tables, 1092 bytes a layer, vanish for real layer sizes)
    tables = (16 * 4 + 256 * 4 + 4) / n
    assert (expected_plain - 0.5 - 16 * 4 / n) * 8 == pytest.approx(0.5, abs=1e-9)
    assert (expected_double - 0.5 - tables) * 8 == pytest.approx(8 / 64 + 32 / (64 * 256), abs=1e-9)


@pytest.mark.parametrize("bias", [True, False])
def test_forward_and_backward_equal_a_float_linear_on_the_dequantized_weight(bias):
    lin = nn.Linear(128, 16, bias=bias)
    layer = Linear4bit.from_linear(lin)
    x = torch.randn(2, 3, 128, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    w = layer.dequantize()
    y, y_ref = layer(x), F.linear(x_ref, w, layer.bias)
    torch.testing.assert_close(y, y_ref, **FP32)
    g = torch.randn_like(y)
    (y * g).sum().backward()
    (y_ref * g).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, **FP32)
    assert layer.weight.grad is None and not layer.weight.requires_grad  # frozen 4-bit weight


def test_compute_dtype_bf16_runs_the_matmul_in_bf16_and_returns_the_input_dtype():
    lin = nn.Linear(64, 8)
    layer = Linear4bit.from_linear(lin, compute_dtype=torch.bfloat16)
    x = torch.randn(4, 64, requires_grad=True)
    y = layer(x)
    assert y.dtype == torch.float32
    expected = F.linear(x.bfloat16(), layer.dequantize().bfloat16(), layer.bias.bfloat16()).float()
    torch.testing.assert_close(y, expected, **EXACT)
    assert layer.bias.dtype == torch.bfloat16  # bnb casts the stored bias in place, so do we


def test_compute_dtype_is_taken_from_the_first_input_when_unset():
    layer = Linear4bit.from_linear(nn.Linear(64, 8))
    assert layer.compute_dtype is None
    layer(torch.randn(2, 64, dtype=torch.bfloat16, requires_grad=True))
    assert layer.compute_dtype == torch.bfloat16


def test_cpu_eval_takes_dequantize_and_matmul_and_equals_train_mode():
    layer = Linear4bit.from_linear(nn.Linear(128, 32))  # 32 rows: bnb's AVX512-BF16 kernel packs
    x = torch.randn(3, 128)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    train_out = layer(x)
    with torch.no_grad():
        eval_out = layer.eval()(x)
    torch.testing.assert_close(eval_out, train_out, **EXACT)
    torch.testing.assert_close(eval_out, F.linear(x, layer.dequantize(), layer.bias), **EXACT)
    assert not getattr(layer.quant_state, "packing_format_for_cpu", False)  # nothing repacked
    for k, v in layer.state_dict().items():
        torch.testing.assert_close(v, before[k], **EXACT)


def test_state_dict_keys_and_safetensors_round_trip(tmp_path):
    layer = Linear4bit.from_linear(nn.Linear(128, 16))
    sd = layer.state_dict()
    assert list(sd) == [
        "weight",
        "bias",
        "weight.absmax",
        "weight.quant_map",
        "weight.nested_absmax",
        "weight.nested_quant_map",
        "weight.quant_state.bitsandbytes__nf4",
    ]
    assert sd["weight"].dtype == torch.uint8 and sd["weight"].shape == (128 * 16 // 2, 1)
    save_file(sd, tmp_path / "m.safetensors")
    loaded = Linear4bit(128, 16)  # random init, overwritten by the load
    loaded.load_state_dict(load_file(tmp_path / "m.safetensors"))
    for k, v in loaded.state_dict().items():
        torch.testing.assert_close(v, sd[k], **EXACT)
    x = torch.randn(2, 128)
    torch.testing.assert_close(loaded.train()(x), layer(x), **EXACT)


def test_loading_a_float_checkpoint_quantizes_it_and_a_wrong_shape_is_named():
    lin = nn.Linear(64, 8)
    layer = Linear4bit(64, 8)
    layer.load_state_dict(lin.state_dict())
    torch.testing.assert_close(layer.weight, Linear4bit.from_linear(lin).weight, **EXACT)
    with pytest.raises(ValueError, match=r"weight.*\(8, 32\).*\(8, 64\)"):
        layer.load_state_dict(nn.Linear(32, 8).state_dict())
    with pytest.raises(ValueError, match="expected"):
        Linear4bit(64, 8, weight=torch.zeros(64, 8))


def test_quantize_model_swaps_linears_except_lm_head_and_consumes_no_rng():
    model = nn.Sequential(nn.Linear(64, 64), nn.SiLU(), nn.Linear(64, 64))
    model.lm_head = nn.Linear(64, 10)
    assert not is_quantized(model)
    torch.manual_seed(3)
    quantize_model(model)
    after = torch.rand(1)
    torch.manual_seed(3)
    assert torch.equal(after, torch.rand(1))  # LoRA init after quantization stays reproducible
    assert is_quantized(model)
    assert isinstance(model[0], Linear4bit) and isinstance(model[2], Linear4bit)
    assert type(model.lm_head) is nn.Linear


def _linear(w):
    lin = nn.Linear(w.shape[1], w.shape[0])
    lin.weight.data.copy_(w)
    return lin


def test_in_features_not_made_of_whole_blocks_is_refused_on_cpu_and_skipped_by_quantize_model():
    # bnb's CPU dequantize kernel (its AVX-512 path) decodes rows that split a block wrongly
    with pytest.raises(ValueError, match="in_features=96 is not a multiple of blocksize=64"):
        Linear4bit.from_linear(nn.Linear(96, 8))
    model = nn.Sequential(nn.Linear(96, 64), nn.Linear(64, 8))
    quantize_model(model)
    assert type(model[0]) is nn.Linear and isinstance(model[1], Linear4bit)


def test_quantize_model_warns_only_for_layers_it_would_have_quantized(caplog):
    model = nn.Sequential(nn.Linear(96, 64))
    model.lm_head = nn.Linear(96, 8)  # skipped anyway: no "stays in float" for it
    with caplog.at_level("WARNING", logger="nanosft.nf4"):
        quantize_model(model)
    assert "0 stays in float" in caplog.text
    assert "lm_head" not in caplog.text


def test_eval_on_shapes_the_cpu_kernel_cannot_pack_falls_back_to_the_regular_path():
    layer = Linear4bit.from_linear(nn.Linear(64, 8))  # 8 output rows: the bf16 kernel packs 32
    x = torch.randn(2, 64)
    train_out = layer(x)
    with torch.no_grad():
        torch.testing.assert_close(layer.eval()(x), train_out, **EXACT)


def test_module_to_keeps_bytes_and_quant_state_and_casts_the_bias():
    layer = Linear4bit.from_linear(nn.Linear(64, 32))
    packed, absmax = layer.weight.clone(), layer.quant_state.absmax.clone()
    layer.to(torch.bfloat16)
    assert layer.bias.dtype == torch.bfloat16 and layer.weight.dtype == torch.uint8
    torch.testing.assert_close(layer.weight, packed, **EXACT)
    torch.testing.assert_close(layer.quant_state.absmax, absmax, **EXACT)
    assert layer.quant_state.absmax.device == layer.weight.device


def test_importing_the_library_does_not_import_bitsandbytes():
    # bitsandbytes pulls in torch._dynamo (seconds): only building or running a 4-bit layer, or an
    # 8-bit optimizer, may import it
    code = ("import sys, nanosft.model, nanosft.sft, nanosft.nf4, nanosft.optim\n"
            "assert 'bitsandbytes' not in sys.modules, 'imported at import time'\n"
            "import torch\n"
            "from nanosft.nf4 import Linear4bit\n"
            "Linear4bit(64, 8)\n"
            "assert 'bitsandbytes' in sys.modules  # control: a 4-bit layer does import it\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


# ----------------------------------------------------------------------------- the speed path


def _fwd_bwd(matmul, layer, x, autocast):
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = matmul(x, layer.weight, bias=layer.bias, quant_state=layer.quant_state)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y.dtype))
    return y, x.grad


@pytest.mark.parametrize("dtype,autocast", [(torch.float32, False), (torch.bfloat16, False),
                                            (torch.float32, True)])
def test_fast_matmul_4bit_equals_bitsandbytes_bit_for_bit(dtype, autocast):
    """nanosft.fast.nf4.matmul_4bit runs bitsandbytes' own CPU kernel into a reused buffer: the
    output and the input gradient equal bnb.matmul_4bit's exactly (fp32, bf16, under autocast)."""
    import bitsandbytes

    from nanosft.fast.nf4 import matmul_4bit

    torch.manual_seed(0)
    w = (torch.randn(192, 128) * 0.05).to(dtype)
    layer = Linear4bit(128, 192, compute_dtype=dtype, weight=w)  # double quant (the default)
    layer.bias = nn.Parameter(torch.randn(192).to(dtype), requires_grad=False)
    x = torch.randn(3, 5, 128).to(dtype)
    y_ref, g_ref = _fwd_bwd(bitsandbytes.matmul_4bit, layer, x, autocast)
    y, g = _fwd_bwd(matmul_4bit, layer, x, autocast)
    assert y.dtype == y_ref.dtype
    torch.testing.assert_close(y, y_ref, **EXACT)
    torch.testing.assert_close(g, g_ref, **EXACT)


def test_fast_matmul_4bit_dequantizes_into_one_reused_buffer_and_decodes_absmax_once(
        monkeypatch):
    """No weight-sized allocation per call (the cause of the page faults): every dequantize of
    layers of equal size lands in the same workspace; the double-quantized absmax is decoded once
    per forward and kept for backward, where bitsandbytes decodes it twice. Negative control:
    bnb's own call returns a new tensor each time, decoding the absmax each time."""
    import bitsandbytes

    from nanosft.fast import nf4 as fast_nf4

    def absmax_decodes(run):  # calls of bitsandbytes' blockwise (8-bit absmax) dequantize op
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            run()
        return sum(e.count for e in prof.key_averages()
                   if e.key == "bitsandbytes::dequantize_blockwise")

    torch.manual_seed(0)
    layers = [Linear4bit(128, 256, bias=False, weight=torch.randn(256, 128)) for _ in range(2)]
    layers.append(Linear4bit(256, 128, bias=False, weight=torch.randn(128, 256)))  # same numel
    ptrs = set()
    real_kernel = fast_nf4.dequantize_into_workspace

    def spy(*args):
        out = real_kernel(*args)
        ptrs.add(out.data_ptr())
        return out

    monkeypatch.setattr(fast_nf4, "dequantize_into_workspace", spy)
    x = torch.randn(4, 128, requires_grad=True)

    def step():
        layers[2](layers[1](torch.relu(layers[0](x)))).sum().backward()

    assert absmax_decodes(step) == 3  # one absmax decode per layer and micro-batch
    assert len(ptrs) == 1  # 3 forwards + 3 backwards, one buffer
    qs = layers[0].quant_state
    assert absmax_decodes(lambda: bitsandbytes.matmul_4bit(  # bnb: in forward and in backward
        x, layers[0].weight, quant_state=qs).sum().backward()) == 2
    a, b = (bnbF.dequantize_4bit(layers[0].weight, layers[0].quant_state) for _ in range(2))
    assert a.data_ptr() != b.data_ptr()


def test_linear4bit_fast_mode_equals_reference_mode():
    """The seam in Linear4bit.forward: the speed path on and off give the same bits."""
    from nanosft.reference import reference_mode

    torch.manual_seed(0)
    layer = Linear4bit.from_linear(nn.Linear(128, 64), compute_dtype=torch.float32)
    x = torch.randn(2, 3, 128)
    results = []
    for reference in (True, False):
        with reference_mode(reference):
            results.append(_fwd_bwd(lambda x, w, **kw: layer(x), layer, x, autocast=False))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, **EXACT)

"""Behaviour of nanosft.lora.LoraLinear on float and 4-bit bases, against formulas written out here.

Checked: identity at init; y = base(x) + B A x * alpha/r (rsLoRA alpha/sqrt(r)); DoRA
y = m/||W + sBA||_row (W + sBA) x + b with the norm detached (negative control: undetached grads
differ); DoRA equals LoRA when m is initialised to ||W + sBA||; peft's RNG order for A/B init
(init_lora_weights True, False, "gaussian"; negative control: skipping B's constructor changes A);
merge/unmerge (exact up to fp32 rounding for a float base, within the NF4 requantization bound for a
4-bit base); disable; mixed batches; gradients; clear errors; bf16 adapter products through fp32
GEMMs on a CPU without a bf16 kernel, against torch's bf16 linear (its fallback kernel on every
CPU, oneDNN's where the CPU has AVX-512 or AMX), and when that path is taken.
Hermetic: tiny random layers on CPU,
seeds fixed.
Run: python -m pytest -q tests/test_lora.py
"""

import math

import bitsandbytes.functional as bnbF
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nanosft.lora import LoraLinear, dora_weight_norm
from nanosft.nf4 import Linear4bit, nf4_code_values

EXACT = {"rtol": 0, "atol": 0}
FP32 = {"rtol": 1e-5, "atol": 1e-5}
IN, OUT, R = 128, 32, 4  # in_features a multiple of the 64-value NF4 block


def make_base(kind, double_quant=True):
    lin = nn.Linear(IN, OUT)
    if kind == "float":
        return lin
    return Linear4bit.from_linear(lin, compress_statistics=double_quant)


def float_weight(layer):
    base = layer.base_layer
    return base.dequantize() if isinstance(base, Linear4bit) else base.weight.detach()


def randomize_B(layer, name="default"):
    with torch.no_grad():
        layer.lora_B[name].weight.normal_(0, 0.1)


@pytest.mark.parametrize("kind", ["float", "4bit"])
@pytest.mark.parametrize("use_dora", [False, True])
def test_adapter_is_the_identity_at_init(kind, use_dora):
    layer = LoraLinear(make_base(kind), r=R, lora_alpha=16, use_dora=use_dora)
    x = torch.randn(2, 5, IN)
    torch.testing.assert_close(layer(x), layer.base_layer(x), **EXACT)
    assert torch.count_nonzero(layer.lora_B["default"].weight) == 0
    bound = 1 / math.sqrt(IN)  # Kaiming-uniform with a=sqrt(5) is U(-1/sqrt(in), 1/sqrt(in))
    assert layer.lora_A["default"].weight.abs().max() <= bound


def test_init_consumes_the_rng_in_peft_order():
    torch.manual_seed(7)
    layer = LoraLinear(make_base("float"), r=R)
    base = layer.base_layer
    torch.manual_seed(7)
    nn.Linear(IN, OUT)  # the base layer, built first as above
    nn.Linear(IN, R, bias=False)  # A's constructor init
    nn.Linear(R, OUT, bias=False)  # B's constructor init
    expected = torch.empty(R, IN)
    nn.init.kaiming_uniform_(expected, a=math.sqrt(5))  # A drawn again
    torch.testing.assert_close(layer.lora_A["default"].weight, expected, **EXACT)
    # negative control: forgetting B's constructor draw gives another A for the same seed
    torch.manual_seed(7)
    nn.Linear(IN, OUT)
    nn.Linear(IN, R, bias=False)
    wrong = torch.empty(R, IN)
    nn.init.kaiming_uniform_(wrong, a=math.sqrt(5))
    assert not torch.equal(wrong, expected)
    assert base.weight.requires_grad  # LoraLinear leaves freezing the base to the model wrapper


def test_init_lora_weights_false_and_gaussian_draw_as_peft():
    # False: A and B keep their nn.Linear constructor draws; "gaussian": A ~ N(0, 1/r) drawn after
    # them, B = 0
    torch.manual_seed(7)
    plain = LoraLinear(make_base("float"), r=R, init_lora_weights=False)
    torch.manual_seed(7)
    gauss = LoraLinear(make_base("float"), r=R, init_lora_weights="gaussian")
    torch.manual_seed(7)
    nn.Linear(IN, OUT)
    A, B = nn.Linear(IN, R, bias=False).weight, nn.Linear(R, OUT, bias=False).weight
    normal = torch.empty(R, IN).normal_(0, 1 / R)
    torch.testing.assert_close(plain.lora_A["default"].weight, A, **EXACT)
    torch.testing.assert_close(plain.lora_B["default"].weight, B, **EXACT)
    torch.testing.assert_close(gauss.lora_A["default"].weight, normal, **EXACT)
    assert not gauss.lora_B["default"].weight.any()
    with pytest.raises(ValueError, match="init_lora_weights='pissa' is not implemented"):
        LoraLinear(make_base("float"), r=R, init_lora_weights="pissa")


@pytest.mark.parametrize("kind", ["float", "4bit"])
@pytest.mark.parametrize("use_rslora", [False, True])
def test_lora_forward_equals_the_formula(kind, use_rslora):
    layer = LoraLinear(make_base(kind), r=R, lora_alpha=16, use_rslora=use_rslora)
    randomize_B(layer)
    scaling = 16 / math.sqrt(R) if use_rslora else 16 / R
    assert layer.scaling["default"] == scaling
    x = torch.randn(2, 5, IN)
    A, B = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    expected = F.linear(x, float_weight(layer), layer.base_layer.bias) + x @ A.T @ B.T * scaling
    torch.testing.assert_close(layer(x), expected, **FP32)


def dora_formula(x, W, b, A, B, m, s, detach_norm=True):
    V = W + s * B @ A  # (out, in)
    norm = V.norm(dim=1)
    if detach_norm:
        norm = norm.detach()
    return (m / norm) * (x @ V.T) + b


@pytest.mark.parametrize("kind", ["float", "4bit"])
def test_dora_forward_and_grads_equal_the_formula_with_a_detached_norm(kind):
    layer = LoraLinear(make_base(kind), r=R, lora_alpha=8, use_dora=True)
    randomize_B(layer)
    m = layer.lora_magnitude_vector["default"].weight
    torch.testing.assert_close(m, float_weight(layer).norm(dim=1), **FP32)  # m0 = ||W||_row
    A, B = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    x = torch.randn(3, IN)
    g = torch.randn(3, OUT)
    params = [A, B, m]
    (layer(x) * g).sum().backward()
    ours = [p.grad.clone() for p in params]
    W, b = float_weight(layer), layer.base_layer.bias.detach()
    for detach, should_match in [(True, True), (False, False)]:  # False: the classic bug
        for p in params:
            p.grad = None
        y = dora_formula(x, W, b, A, B, m, 2.0, detach_norm=detach)
        torch.testing.assert_close(layer(x), y, **FP32)  # same value either way...
        (y * g).sum().backward()
        same = all(torch.allclose(o, p.grad, rtol=1e-5, atol=1e-6) for o, p in zip(ours, params))
        assert same == should_match  # ...but only the detached norm gives DoRA's gradients


@pytest.mark.parametrize("kind", ["float", "4bit"])
def test_dora_equals_lora_when_magnitude_is_initialised_to_the_current_norm(kind):
    torch.manual_seed(1)
    lora = LoraLinear(make_base(kind), r=R, lora_alpha=8)
    dora = LoraLinear(lora.base_layer, r=R, lora_alpha=8, use_dora=True)
    with torch.no_grad():
        B = torch.randn(OUT, R) * 0.1
        for layer in (lora, dora):
            layer.lora_A["default"].weight.copy_(lora.lora_A["default"].weight)
            layer.lora_B["default"].weight.copy_(B)
        delta = B @ lora.lora_A["default"].weight
        m = dora_weight_norm(float_weight(dora), delta, dora.scaling["default"])
        dora.lora_magnitude_vector["default"].weight.copy_(m)
    x = torch.randn(2, 5, IN)
    torch.testing.assert_close(dora(x), lora(x), **FP32)


@pytest.mark.parametrize("use_dora", [False, True])
def test_float_merge_then_forward_equals_unmerged_and_unmerge_restores(use_dora):
    layer = LoraLinear(make_base("float"), r=R, lora_alpha=8, use_dora=use_dora)
    randomize_B(layer)
    w0 = layer.base_layer.weight.detach().clone()
    x = torch.randn(4, IN)
    y = layer(x)
    layer.merge()
    assert layer.merged and layer.merged_adapters == ["default"]
    torch.testing.assert_close(layer(x), y, **FP32)  # fp32 rounding of W + dW only
    torch.testing.assert_close(layer.base_layer(x), y, **FP32)  # the delta now lives in W
    layer.unmerge()
    assert not layer.merged
    torch.testing.assert_close(layer.base_layer.weight, w0, rtol=0, atol=1e-6)


def test_4bit_merge_requantizes_and_stays_within_the_nf4_rounding_bound():
    # Merging into a 4-bit base cannot be exact: W_deq + dW is quantized again to NF4 codes, so each
    # weight moves by up to half the largest gap between codes times its block's absmax.
    layer = LoraLinear(make_base("4bit", double_quant=False), r=R, lora_alpha=8)
    randomize_B(layer)
    x = torch.randn(4, IN)
    y = layer(x)
    target = float_weight(layer) + layer.get_delta_weight("default")
    layer.merge()
    requant, _ = bnbF.quantize_4bit(target, blocksize=64, quant_type="nf4")
    torch.testing.assert_close(layer.base_layer.weight.data, requant, **EXACT)
    half_gap = (nf4_code_values().diff().max() / 2).item()
    w_bound = (half_gap * target.reshape(-1, 64).abs().amax(dim=1)).repeat_interleave(64)
    w_err = (float_weight(layer) - target).reshape(-1).abs()
    assert torch.all(w_err <= w_bound + 1e-6)
    y_bound = x.abs() @ w_bound.reshape(OUT, IN).T + 1e-5  # |x (W' - W)^T| <= |x| |W' - W|^T
    assert torch.all((layer(x) - y).abs() <= y_bound)
    assert not torch.allclose(layer(x), y, atol=1e-5)  # and it really is lossy


def test_merging_several_adapters_equals_running_them_all():
    layer = LoraLinear(make_base("float"), "a", r=R, lora_alpha=8)
    layer.update_layer("b", r=2, lora_alpha=4)
    randomize_B(layer, "a")
    randomize_B(layer, "b")
    layer.set_adapter(["a", "b"])
    x = torch.randn(3, IN)
    y = layer(x)
    layer.merge()
    assert layer.merged_adapters == ["a", "b"]
    torch.testing.assert_close(layer(x), y, **FP32)


@pytest.mark.parametrize("kind", ["float", "4bit"])
def test_disable_adapters_gives_the_base_output_and_unmerges(kind):
    layer = LoraLinear(make_base(kind), r=R, lora_alpha=8)
    randomize_B(layer)
    x = torch.randn(3, IN)
    y_base = layer.base_layer(x)
    layer.disable_adapters = True
    torch.testing.assert_close(layer(x), y_base, **EXACT)
    if kind == "float":
        layer.disable_adapters = False
        layer.merge()
        layer.disable_adapters = True
        torch.testing.assert_close(layer(x), y_base, rtol=0, atol=1e-5)
        assert not layer.merged


@pytest.mark.parametrize("kind", ["float", "4bit"])
def test_mixed_batch_rows_equal_per_adapter_runs(kind):
    layer = LoraLinear(make_base(kind), "a", r=R, lora_alpha=8)
    layer.update_layer("b", r=R, lora_alpha=16)
    randomize_B(layer, "a")
    randomize_B(layer, "b")
    x = torch.randn(4, 3, IN)
    names = ["b", "__base__", "a", "b"]
    mixed = layer(x, adapter_names=names)
    expected = []
    for i, name in enumerate(names):
        if name == "__base__":
            expected.append(layer.base_layer(x[i : i + 1]))
        else:
            layer.set_adapter(name)
            expected.append(layer(x[i : i + 1]))
    torch.testing.assert_close(mixed, torch.cat(expected), **FP32)


@pytest.mark.parametrize("use_dora", [False, True])
def test_gradients_reach_input_and_adapters_but_not_the_4bit_weight(use_dora):
    layer = LoraLinear(make_base("4bit"), r=R, lora_alpha=8, use_dora=use_dora)
    randomize_B(layer)
    x = torch.randn(2, IN, requires_grad=True)
    layer(x).square().sum().backward()
    trainable = [layer.lora_A["default"].weight, layer.lora_B["default"].weight]
    if use_dora:
        trainable.append(layer.lora_magnitude_vector["default"].weight)
    for p in [x, *trainable]:
        assert p.grad is not None and p.grad.abs().sum() > 0
    assert layer.base_layer.weight.grad is None and not layer.base_layer.weight.requires_grad


def test_set_adapter_controls_which_adapters_train():
    layer = LoraLinear(make_base("float"), "a", r=R, use_dora=True)
    layer.update_layer("b", r=R, lora_alpha=8, use_dora=True)
    assert layer.active_adapters == ["a"]  # adding an adapter does not activate it (peft)
    assert not layer.lora_A["b"].weight.requires_grad
    layer.set_adapter("b")
    assert layer.lora_magnitude_vector["b"].weight.requires_grad
    assert not layer.lora_B["a"].weight.requires_grad
    layer.enable_adapters(False)
    assert layer.disable_adapters and not any(p.requires_grad for p in layer.lora_A.parameters())


def test_errors_name_the_culprit():
    for r in (0, -2):
        with pytest.raises(ValueError, match=rf"positive int, got r={r}"):
            LoraLinear(make_base("float"), r=r)
    with pytest.raises(TypeError, match="Embedding"):
        LoraLinear(nn.Embedding(4, 4))
    layer = LoraLinear(make_base("float"), r=R)
    with pytest.raises(ValueError, match=r"\(2, 7\).*in_features=128"):
        layer(torch.randn(2, 7))
    with pytest.raises(ValueError, match="3 entries.*2 rows"):
        layer(torch.randn(2, IN), adapter_names=["default"] * 3)
    with pytest.raises(TypeError, match="list"):
        layer.merge("default")
    layer.merge()
    with pytest.raises(ValueError, match="unmerge"):
        layer(torch.randn(2, IN), adapter_names=["default", "__base__"])
    dora = LoraLinear(make_base("float"), r=R, use_dora=True)
    with pytest.raises(ValueError, match="DoRA"):
        dora(torch.randn(1, IN), adapter_names=["default"])


def _bf16_ulp(t):
    # the spacing of bf16 values at |t|: 2^(exponent - 7)
    return torch.ldexp(torch.ones_like(t, dtype=torch.float32),
                       torch.frexp(t.float().abs().clamp(min=1e-30)).exponent - 8)


@pytest.mark.parametrize("shape", [(1100, 576, 16), (1100, 16, 1536), (300, 1536, 16)])
@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("onednn", [False, True], ids=["fallback_kernel", "onednn_avx512_or_amx"])
def test_bf16_linear_in_fp32_is_the_bf16_linear_up_to_summation_order(shape, autocast, onednn,
                                                                       monkeypatch):
    """Bf16LinearInFp32 against torch's own bf16 linear on QLoRA adapter shapes: outputs and both
    gradients in the same dtypes, at least 99.5% of entries bit-equal, none more than 1 bf16 ulp
    away (plus fp32 summation error where a sum cancels to near 0). autocast: fp32 input and
    weight, rounded to bf16 by autocast (native) or by the Function. Negative control: an fp32
    product left unrounded is caught by the bit-equality. Two torch kernels: its fallback, run
    with oneDNN off on every CPU (what a CPU without oneDNN bf16, e.g. AVX2 only, runs: the kernel
    the Function stands in for), and oneDNN's, which needs AVX-512 (BW, VL, DQ) or AMX."""
    from nanosft.fast.lora import Bf16LinearInFp32

    if onednn and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("oneDNN has no bf16 kernel on this CPU (needs AVX-512 BW/VL/DQ or AMX); "
                    "the fallback_kernel case compares with the kernel this CPU runs")
    n, k, m = shape
    g = torch.Generator().manual_seed(0)
    dtype = torch.float32 if autocast else torch.bfloat16
    x = torch.randn(n, k, generator=g).to(dtype)
    w = (torch.randn(m, k, generator=g) / math.sqrt(k)).to(dtype)
    grad = torch.randn(n, m, generator=g).to(torch.bfloat16)
    results = []
    for fn in (F.linear, Bf16LinearInFp32.apply):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        with monkeypatch.context() as patch:
            patch.setattr(torch.backends.mkldnn, "enabled", onednn)  # picks torch's bf16 kernel
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                y = fn(xi, wi)
            y.backward(grad)
        results.append((y, xi.grad, wi.grad))
    xb, wb, gb = (t.bfloat16().float().abs() for t in (x, w, grad))
    # fp32 summation-order error is about 2^-24 x the sum of |terms|: it shows where a sum cancels
    sums_of_terms = (xb @ wb.t(), gb @ wb, gb.t() @ xb)
    for native, ours, terms in zip(*results, sums_of_terms):
        assert native.dtype == ours.dtype
        assert (native == ours).float().mean() >= 0.995
        assert ((native.float() - ours.float()).abs() <= _bf16_ulp(native) + terms * 2**-20).all()
    unrounded = F.linear(x.bfloat16().float(), w.bfloat16().float())
    assert (unrounded == results[0][0].float()).float().mean() < 0.5


def test_adapters_use_the_fp32_gemm_only_for_bf16_on_a_cpu_without_a_bf16_kernel(monkeypatch):
    import nanosft.fast.lora as lora

    calls = []
    real_apply, real_product = lora.Bf16LinearInFp32.apply, lora._bf16_product_in_fp32
    monkeypatch.setattr(lora.Bf16LinearInFp32, "apply",
                        lambda *args: calls.append(1) or real_apply(*args))
    monkeypatch.setattr(lora, "_bf16_product_in_fp32",
                        lambda *args: calls.append(1) or real_product(*args))
    layer = LoraLinear(make_base("4bit"), r=R)
    x = torch.randn(2, 3, IN)
    # lora_A through Bf16LinearInFp32 (1); lora_B's product, its input and weight gradients
    # through fp32 GEMMs in nanosft.fast.lora.LowRankAdd (3)
    cases = ((False, torch.bfloat16, 4), (True, torch.bfloat16, 0), (False, torch.float32, 0))
    for has_kernel, adapter_dtype, expected in cases:
        monkeypatch.setattr(lora, "_has_bf16_gemm", lambda: has_kernel)
        layer.lora_A.to(adapter_dtype), layer.lora_B.to(adapter_dtype)
        calls.clear()
        layer(x).sum().backward()
        assert len(calls) == expected, (has_kernel, adapter_dtype)


# ------------------------------------------------------------------------ the adapter speed path


class SharedInput(nn.Module):
    """q/k/v over one input (as model.Attention calls them), LoRA on a 4-bit or float base."""

    def __init__(self, kind, adapter_dtype, scaling_alpha):
        super().__init__()
        torch.manual_seed(0)
        for name, out in (("q_proj", 64), ("k_proj", 32), ("v_proj", 32)):
            base = nn.Linear(IN, out)
            base = (Linear4bit.from_linear(base) if kind == "4bit" else base).requires_grad_(False)
            layer = LoraLinear(base, r=R, lora_alpha=scaling_alpha)
            randomize_B(layer)
            layer.lora_A.to(adapter_dtype), layer.lora_B.to(adapter_dtype)
            setattr(self, name, layer)

    def forward(self, x):
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)


def _run_shared(module, x, reference):
    """Outputs, x's gradient and every adapter gradient, in reference mode or with speed paths."""
    from nanosft.reference import reference_mode

    module.zero_grad()
    x = x.clone().requires_grad_()
    with reference_mode(reference):
        outs = module(x)
    g = torch.Generator().manual_seed(1)
    sum((o * torch.randn(o.shape, generator=g)).sum() for o in outs).backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    return outs, x.grad, grads


def _count_a_gemms(module, x, monkeypatch):
    import nanosft.fast.lora as fast_lora

    shapes = []
    real = fast_lora._linear
    monkeypatch.setattr(fast_lora, "_linear", lambda a, w, d: shapes.append(tuple(w.shape))
                        or real(a, w, d))
    module(x)
    return [s for s in shapes if s[1] == IN]  # A weights are (r, in)


@pytest.mark.parametrize("kind", ["float", "4bit"])
def test_shared_input_lora_a_is_one_gemm_equal_to_reference_mode_fp32(kind, monkeypatch):
    """q/k/v linked as one group: one (3r, in) A GEMM (not three (r, in) ones), and outputs, x's
    gradient and every A and B gradient equal reference mode's separate products within 1e-6 of
    each tensor's largest value (fp32: the same sums in another order). Scaling 1.5: not a power
    of two. Negative control: unlinked layers run three A GEMMs."""
    from nanosft.fast.lora import link_shared_inputs

    module = SharedInput(kind, torch.float32, scaling_alpha=6)
    x = torch.randn(2, 5, IN)
    assert _count_a_gemms(module, x, monkeypatch) == [(R, IN)] * 3
    link_shared_inputs(module)
    assert _count_a_gemms(module, x, monkeypatch) == [(3 * R, IN)]
    ref, fast = _run_shared(module, x, True), _run_shared(module, x, False)

    def close(a, b, msg=None):  # 1e-6 of the tensor's scale (gradients here reach ~10)
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6 * b.abs().max().item(), msg=msg)

    for a, b in zip(fast[0], ref[0]):
        close(a, b)
    close(fast[1], ref[1])
    assert fast[2].keys() == ref[2].keys() and len(ref[2]) == 6
    for name, g in ref[2].items():
        close(fast[2][name], g, msg=name)


@pytest.mark.parametrize("kind,alpha", [("float", 8), ("4bit", 8), ("4bit", 6)])
def test_shared_input_bf16_adapters_equal_reference_mode_to_bf16_rounding(kind, alpha,
                                                                           monkeypatch):
    """TRL's QLoRA recipe (fp32 base output, bf16 adapters, scaling 2; and 1.5, not folded): x cast
    once, one A GEMM, the scaling folded into the add, no clone. Outputs bit-equal to reference
    mode; A and B gradients within 1 bf16 ulp of each value (the bound the tests above hold
    torch's own bf16 GEMMs to); x's gradient within two bf16 roundings (2^-7) of the adapters'
    share of it, sum_i |g_i| |A_i|: the three A gradients are now summed inside one GEMM and
    rounded once, not rounded each and summed in fp32."""
    from nanosft.fast.lora import link_shared_inputs

    module = SharedInput(kind, torch.bfloat16, scaling_alpha=alpha)
    link_shared_inputs(module)
    x = torch.randn(2, 5, IN)
    assert _count_a_gemms(module, x, monkeypatch) == [(3 * R, IN)]
    ref, fast = _run_shared(module, x, True), _run_shared(module, x, False)
    for a, b in zip(fast[0], ref[0]):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, **EXACT)
    for name, g in ref[2].items():
        assert g.dtype == torch.bfloat16
        assert ((fast[2][name].float() - g.float()).abs() <= _bf16_ulp(g.float())).all(), name
    share = 0
    gen = torch.Generator().manual_seed(1)
    for layer, out in zip((module.q_proj, module.k_proj, module.v_proj), ref[0]):
        g_out = torch.randn(out.shape, generator=gen)
        g_ax = g_out.abs() @ layer.lora_B["default"].weight.float().abs() * layer.scaling["default"]
        share = share + g_ax @ layer.lora_A["default"].weight.float().abs()
    assert ((fast[1] - ref[1]).abs() <= 2**-7 * share + 1e-7).all()


def test_a_shared_product_is_taken_only_for_the_very_same_unchanged_input():
    """The parts q_proj's GEMM computed for k/v are used only if k/v get that same tensor, not
    modified since: another tensor, or the same one changed in place, runs its own A GEMM and
    gives reference mode's output. Negative control: a stale part would be the old input's."""
    from nanosft.fast.lora import link_shared_inputs
    from nanosft.reference import reference_mode

    module = SharedInput("float", torch.float32, scaling_alpha=8)
    link_shared_inputs(module)
    x, other = torch.randn(2, 5, IN), torch.randn(2, 5, IN)
    with torch.no_grad():
        with reference_mode():
            expected_other, expected_shifted = module.k_proj(other), module.v_proj(x + 1)
            stale = module.v_proj(x)
        module.q_proj(x)  # computes the k and v parts for x
        got_other = module.k_proj(other)
        x.add_(1)  # in place: x's version moves on
        got_shifted = module.v_proj(x)
    torch.testing.assert_close(got_other, expected_other, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_shifted, expected_shifted, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(got_shifted, stale)


@pytest.mark.parametrize("kind", ["float", "4bit"])
@pytest.mark.parametrize("adapter_dtype", [torch.float32, torch.bfloat16])
def test_speed_path_under_bf16_autocast_equals_reference_mode_bit_for_bit(kind, adapter_dtype):
    """bf16=True (CPU autocast) over a bf16 float base or a 4-bit base computing in fp32, with
    fp32 or bf16 adapters, one layer: output, x's gradient and the adapter gradients equal
    reference mode's exactly (the multiply's dtype is autocast's, asked before the speed path
    switches autocast off). x is an activation (not a leaf), as every layer input in a model."""
    from nanosft.reference import reference_mode

    torch.manual_seed(0)
    base = nn.Linear(IN, OUT)
    base = Linear4bit.from_linear(base) if kind == "4bit" else base.to(torch.bfloat16)
    layer = LoraLinear(base.requires_grad_(False), r=R, lora_alpha=2 * R)
    randomize_B(layer)
    layer.lora_A.to(adapter_dtype), layer.lora_B.to(adapter_dtype)
    x0, g = torch.randn(2, 5, IN), torch.randn(2, 5, OUT)
    results = []
    for reference in (True, False):
        layer.zero_grad()
        leaf = x0.clone().requires_grad_()
        with reference_mode(reference), torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(leaf * 1)
        (y.float() * g).sum().backward()
        results.append([y, leaf.grad, layer.lora_A["default"].weight.grad,
                        layer.lora_B["default"].weight.grad])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, **EXACT)


@pytest.mark.parametrize("kind", ["float", "4bit"])
@pytest.mark.parametrize("alpha", [2 * R, 6])  # scaling 2 (folded into the add) and 1.5
def test_bf16_recipe_adds_the_adapter_into_its_own_product_bit_for_bit(kind, alpha):
    """TRL's bf16 QLoRA recipe (a bf16 base output, bf16 adapters, bf16 autocast): the speed
    path writes result + s * B(A x) over B's fresh (..., out) product, so a forward makes two
    (..., out) tensors (the base output and that product), not three as the walkthrough's
    clone-free sum would; output, x's gradient and the adapter gradients equal reference mode's
    bit for bit. Negative control: reference mode makes more (its clone and the sum)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from nanosft.reference import reference_mode

    class FreshOutputs(TorchDispatchMode):
        """Counts op results of shape (..., OUT) in storage none of the op's inputs hold."""

        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = [a for a in [*args, *(kwargs or {}).values()] if isinstance(a, torch.Tensor)]
            held = {a.untyped_storage().data_ptr() for a in inputs}
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if (isinstance(t, torch.Tensor) and t.shape[-1:] == (OUT,) and t.dim() > 1
                        and t.untyped_storage().data_ptr() not in held):
                    self.count += 1
            return out

    torch.manual_seed(0)
    base = nn.Linear(IN, OUT).to(torch.bfloat16)
    if kind == "4bit":
        base = Linear4bit.from_linear(base, compute_dtype=torch.bfloat16)
    layer = LoraLinear(base.requires_grad_(False), r=R, lora_alpha=alpha)
    randomize_B(layer)
    layer.lora_A.to(torch.bfloat16), layer.lora_B.to(torch.bfloat16)
    x0, g = torch.randn(2, 5, IN, dtype=torch.bfloat16), torch.randn(2, 5, OUT)
    results, counts = [], []
    for reference in (True, False):
        layer.zero_grad()
        leaf = x0.clone().requires_grad_()
        with reference_mode(reference), torch.autocast("cpu", dtype=torch.bfloat16):
            x = leaf * 1
            with FreshOutputs() as mode:
                y = layer(x)
        counts.append(mode.count)
        assert y.dtype == torch.bfloat16
        (y.float() * g).sum().backward()
        results.append([y, leaf.grad, layer.lora_A["default"].weight.grad,
                        layer.lora_B["default"].weight.grad])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, **EXACT)
    assert counts[1] == 2 and counts[0] > 2

"""Parity of nanosft.lora.LoraLinear with peft 0.21.2's LoRA layers on the same base and adapters.

Compared: LoRA, rsLoRA and DoRA on a float base (peft.tuners.lora.layer.Linear) and on a 4-bit base
(peft.tuners.lora.bnb.Linear4bit over bitsandbytes.nn.Linear4bit holding the same NF4 bytes):
initial adapter weights bit for bit after the same torch.manual_seed; outputs and the gradients of
x and of every adapter parameter (fp32, 1e-5; measured 0), in train mode with dropout 0 and in eval
mode with dropout 0.3 (float base), plus train mode with dropout 0.3 under the same seed (float);
merge/unmerge (the requantized NF4 bytes too); mixed-adapter batches. A bf16 base with fp32
adapters (as get_peft_model leaves them): outputs and all gradients bit-identical to peft for
LoRA and DoRA on both bases, which pins peft 0.21.2's cast order (DoRA and the float base add
in fp32, then cast to bf16); a negative control shows the walkthrough's cast-then-add is caught.
TRL's QLoRA recipe (fp32 compute, bf16 adapters): bit-identical to peft with torch's bf16 kernel
and with the fp32-GEMM path nanosft takes on a CPU without one (peft then on torch's fallback
kernel, oneDNN switched off, whatever the CPU).
4-bit cases run in train mode: in eval mode bitsandbytes switches to a bf16 CPU kernel and
repacks its weight in place, so both sides would be compared on different kernels. in_features
are multiples of the 64-value block (bitsandbytes' CPU dequantize assumes rows hold whole blocks).
Hermetic: layers built in-process on CPU. Run: python -m pytest -q tests/parity/test_lora_parity.py
"""

import copy
import warnings

import bitsandbytes as bnb
import peft
import pytest
import torch
from peft.tuners.lora.bnb import Linear4bit as PeftLinear4bit
from peft.tuners.lora.layer import Linear as PeftLinear
from torch import nn

from nanosft.lora import LoraLinear
from nanosft.nf4 import Linear4bit

TOL = {"rtol": 1e-5, "atol": 1e-5}  # fp32; measured differences are 0 (same ops in the same order)
IN, OUT, R, ALPHA = 128, 48, 4, 8
KINDS = {
    "lora": {},
    "rslora": {"use_rslora": True},
    "dora": {"use_dora": True},
}


def bases(base, dtype=torch.float32):
    """The same weights twice: as nanosft's base layer and as the one peft wraps."""
    lin = nn.Linear(IN, OUT).to(dtype)
    if base == "float":
        return lin, copy.deepcopy(lin)
    ref = bnb.nn.Linear4bit(IN, OUT, quant_type="nf4", compress_statistics=True,
                            compute_dtype=dtype)
    ref.weight = bnb.nn.Params4bit(
        lin.weight.data, requires_grad=False, compress_statistics=True, quant_type="nf4", module=ref
    )
    ref.bias = nn.Parameter(lin.bias.data.clone())
    return Linear4bit.from_linear(lin, compute_dtype=dtype), ref.to("cpu")


def build(base, kind, dropout=0.0, seed=0, dtype=torch.float32):
    ob, rb = bases(base, dtype)
    kw = {"r": R, "lora_alpha": ALPHA, "lora_dropout": dropout, **KINDS[kind]}
    torch.manual_seed(seed)
    ours = LoraLinear(ob, **kw)
    torch.manual_seed(seed)
    cls = PeftLinear if base == "float" else PeftLinear4bit
    ref = cls(rb, "default", config=peft.LoraConfig(**kw), r=R, lora_alpha=ALPHA)
    return ours, ref


def trainable(layer):
    return {n: p for n, p in layer.named_parameters() if p.requires_grad and "base_layer" not in n}


def make_adapters_nonzero(ours, ref):
    """B is zero at init, which would hide every B-dependent bug: same random B and m on both."""
    with torch.no_grad():
        for name, p in trainable(ours).items():
            if "lora_B" in name:
                p.normal_(0, 0.1)
            elif "magnitude" in name:
                p.mul_(1.1)  # m no longer equals ||W + sBA||, so the DoRA scale is not 1
            trainable(ref)[name].copy_(p)


def compare(ours, ref, x, seed=None, tol=TOL):
    """Outputs, input gradients and every adapter gradient within `tol` (dtypes equal too);
    returns our output."""
    xo, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    if seed is not None:
        torch.manual_seed(seed)
    yo = ours(xo)
    if seed is not None:
        torch.manual_seed(seed)
    yr = ref(xr)
    torch.testing.assert_close(yo, yr, **tol)
    g = torch.randn_like(yo)
    (yo * g).sum().backward()
    (yr * g).sum().backward()
    torch.testing.assert_close(xo.grad, xr.grad, **tol)
    ref_params = trainable(ref)
    assert set(trainable(ours)) == set(ref_params)  # same names: lora_A.default.weight, ...
    for name, p in trainable(ours).items():
        torch.testing.assert_close(p.grad, ref_params[name].grad, **tol, msg=name)
    return yo


@pytest.mark.parametrize("base", ["float", "4bit"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_same_seed_gives_bit_identical_initial_adapters(base, kind):
    ours, ref = build(base, kind, seed=123)
    ref_params = trainable(ref)
    for name, p in trainable(ours).items():
        torch.testing.assert_close(p, ref_params[name], rtol=0, atol=0, msg=name)


def test_a_second_adapter_inits_like_peft_update_layer():
    ours, ref = build("float", "lora")
    torch.manual_seed(5)
    ours.update_layer("other", r=2, lora_alpha=4)
    torch.manual_seed(5)
    ref.update_layer("other", 2, lora_alpha=4, config=peft.LoraConfig(r=2, lora_alpha=4))
    torch.testing.assert_close(
        ours.lora_A["other"].weight, ref.lora_A["other"].weight, rtol=0, atol=0
    )
    assert ours.active_adapters == ref.active_adapters == ["default"]


@pytest.mark.parametrize("base", ["float", "4bit"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_train_mode_outputs_and_grads_match(base, kind):
    ours, ref = build(base, kind)
    make_adapters_nonzero(ours, ref)
    compare(ours, ref, torch.randn(2, 5, IN))


@pytest.mark.parametrize("kind", list(KINDS))
def test_float_eval_mode_with_dropout_matches(kind):
    ours, ref = build("float", kind, dropout=0.3)
    make_adapters_nonzero(ours, ref)
    ours.eval()
    ref.eval()
    compare(ours, ref, torch.randn(2, 5, IN))


@pytest.mark.parametrize("kind", list(KINDS))
def test_float_train_mode_with_dropout_matches_under_the_same_seed(kind):
    # DoRA with active dropout recomputes W x on the dropped input instead of reusing base_result
    ours, ref = build("float", kind, dropout=0.3)
    make_adapters_nonzero(ours, ref)
    compare(ours, ref, torch.randn(2, 5, IN), seed=99)


@pytest.mark.parametrize("base", ["float", "4bit"])
@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_merge_and_unmerge_match_peft(base, kind):
    ours, ref = build(base, kind)
    make_adapters_nonzero(ours, ref)
    x = torch.randn(3, IN, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft warns that 4-bit merging rounds
        for step in ("merge", "unmerge"):
            getattr(ours, step)()
            getattr(ref, step)()
            ob, rb = ours.base_layer, ref.base_layer
            torch.testing.assert_close(ob.weight.data, rb.weight.data, rtol=0, atol=0)
            if base == "4bit":  # requantized: same NF4 bytes and statistics
                for a, b in [(ob.quant_state.absmax, rb.weight.quant_state.absmax)]:
                    torch.testing.assert_close(a, b, rtol=0, atol=0)
            torch.testing.assert_close(ours(x), ref(x), **TOL)
            assert ours.merged == ref.merged


@pytest.mark.parametrize("base", ["float", "4bit"])
def test_mixed_batch_matches_peft(base):
    ours, ref = build(base, "lora")
    cfg = peft.LoraConfig(r=R, lora_alpha=16)
    torch.manual_seed(1)
    ours.update_layer("b", r=R, lora_alpha=16)
    torch.manual_seed(1)
    ref.update_layer("b", R, lora_alpha=16, config=cfg)
    make_adapters_nonzero(ours, ref)
    x = torch.randn(4, 3, IN)
    names = ["b", "__base__", "default", "b"]
    # no_grad: peft's 4-bit mixed batch adds rows in place into MatMul4Bit's output view, which
    # autograd refuses when the bias requires grad; nanosft clones first (as the 2.7 path does)
    with torch.no_grad():
        torch.testing.assert_close(ours(x, adapter_names=names), ref(x, adapter_names=names), **TOL)


def bf16_pair(base, kind):
    """bf16 base, fp32 adapters on both sides (peft's autocast_adapter_dtype), same B and m."""
    ours, ref = build(base, kind, dtype=torch.bfloat16)
    for layer in (ours, ref):
        for adapters in (layer.lora_A, layer.lora_B, layer.lora_magnitude_vector):
            adapters.float()
    make_adapters_nonzero(ours, ref)
    return ours, ref


@pytest.mark.parametrize("base", ["float", "4bit"])
@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_bf16_base_fp32_adapters_match_peft_bit_for_bit(base, kind):
    ours, ref = bf16_pair(base, kind)
    x = torch.randn(4, 7, IN).to(torch.bfloat16)
    xo, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    yo, yr = ours(xo), ref(xr)
    assert yo.dtype == yr.dtype == torch.bfloat16
    torch.testing.assert_close(yo, yr, rtol=0, atol=0)  # same casts in the same order: equal
    g = torch.randn_like(yo)
    (yo * g).sum().backward()
    (yr * g).sum().backward()
    torch.testing.assert_close(xo.grad, xr.grad, rtol=0, atol=0)
    ref_params = trainable(ref)
    for name, p in trainable(ours).items():
        assert p.dtype == torch.float32
        torch.testing.assert_close(p.grad, ref_params[name].grad, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("base", ["float", "4bit"])
def test_negative_control_walkthrough_cast_order_differs_from_peft_for_dora(base):
    # walkthrough 2.7 casts the fp32 DoRA term to bf16 and then adds; peft 0.21.2 adds in fp32
    # and casts once. On the same inputs the two differ by bf16 rounding, which the test above
    # would catch: it compares at tolerance 0.
    ours, ref = bf16_pair(base, "dora")
    x = torch.randn(4, 7, IN).to(torch.bfloat16)
    with torch.no_grad():
        result = ours.base_layer(x)
        term = ours.lora_magnitude_vector["default"](
            x.float(), lora_A=ours.lora_A["default"], lora_B=ours.lora_B["default"],
            scaling=ours.scaling["default"], base_layer=ours.base_layer, base_result=result)
        cast_then_add = result + term.to(torch.bfloat16)
        add_then_cast = (result + term).to(torch.bfloat16)
        expected = ref(x)
    torch.testing.assert_close(add_then_cast, expected, rtol=0, atol=0)
    assert not torch.equal(cast_then_add, expected)


@pytest.mark.parametrize("kind", ["lora", "dora"])
@pytest.mark.parametrize("bf16_gemm", [True, False])
def test_qlora_recipe_bf16_adapters_on_fp32_input_match_peft(kind, bf16_gemm, monkeypatch):
    """TRL's QLoRA: a 4-bit base computing in fp32, adapters cast to bf16 (not DoRA's magnitude).
    With torch's bf16 kernel and with the fp32-GEMM path a CPU without one takes
    (nanosft.fast.lora.Bf16LinearInFp32): outputs and gradients bit-identical to peft at these
    sizes (the sums are short; on real shapes see tests/test_lora.py: at most 1 bf16 ulp).
    bf16_gemm=False is a CPU without oneDNN bf16 (AVX2 only): oneDNN is switched off too, so on
    every CPU peft's adapters run torch's fallback kernel, the one that path stands in for.
    bf16_gemm=True: both sides run this CPU's bf16 kernel (oneDNN's with AVX-512 or AMX)."""
    import nanosft.fast.lora

    monkeypatch.setattr(nanosft.fast.lora, "_has_bf16_gemm", lambda: bf16_gemm)
    if not bf16_gemm:
        monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
    ours, ref = build("4bit", kind)
    for layer in (ours, ref):
        for name, p in trainable(layer).items():
            if "magnitude" not in name:
                p.data = p.data.to(torch.bfloat16)
    make_adapters_nonzero(ours, ref)
    y = compare(ours, ref, torch.randn(4, 7, IN), tol={"rtol": 0, "atol": 0})
    assert y.dtype == torch.float32

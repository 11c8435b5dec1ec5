"""Tutorial 08: Linear4bit.forward with LoRA and DoRA, line by line (walkthrough 2.7).

Every q_proj / v_proj of a QLoRA model is a frozen NF4 `base_layer` plus a low-rank adapter. We
quantize a weight by hand in plain PyTorch (levels, absmax per block, midpoints, nibbles, double
quantization), check the bytes against bitsandbytes, see backward dequantize again with no weight
gradient, look at codes, error and bytes per weight of a Linear4bit, then replay the forward of
walkthrough 2.7 one line at a time on a (2, 3, 64) input and check each step against
nanosft.lora.LoraLinear; peft's and bitsandbytes' numbers are printed beside ours when installed.
Run:      python tutorials/08_linear4bit_forward.py
Runtime:  a few seconds on CPU (about 10 s when peft is imported).
You should see:
  - NF4 by hand: 8 positive, 7 negative levels and one zero; bytes identical to bitsandbytes,
    its decode compared where its CPU kernel decodes right (rows of whole 64-value blocks);
  - the 16 NF4 code values, the 4-bit codes and absmax of a 2x64 weight, and its quantization error;
  - bytes per weight of a 1024x1024 layer: 0.5626 without, 0.5169 with double quantization;
  - which branch of 2.7 runs, scaling 2.0 (LoRA) / 4.0 (rsLoRA), the shapes, and the DoRA norms;
  - the DoRA dropout branch run for real: x dropped, W x recomputed, equal to peft on one mask;
  - merge: float exact to 1e-6, 4-bit off by the requantization error; eval equals train on CPU
    (bnb's eval repacks for its bf16 kernel only on a CPU with AVX512-BF16);
  - "OK: walkthrough 2.7 replayed step by step" at the end.
"""

# %%
from nanosft.reference import reference_mode, start_reference_mode

start_reference_mode()  # for reading: the walkthrough's own statements run, no speed paths

import copy
import importlib.util
import math
import warnings

import bitsandbytes as bnb
import bitsandbytes.functional as bnbF
import torch
import torch.nn.functional as F
from torch import nn

from nanosft.lora import LoraLinear, dora_weight_norm
from nanosft.nf4 import (
    Linear4bit,
    bytes_per_parameter,
    cpu_kernels_decode,
    dequantize_absmax,
    dequantize_nf4,
    double_quantize,
    nf4_code_values,
    quantize_nf4,
)

HAVE_PEFT = importlib.util.find_spec("peft") is not None
warnings.filterwarnings(
    "ignore", message=".*(merge|Merge|Unmerge).*"
)  # peft: "may get different generations"
torch.set_printoptions(precision=4, sci_mode=False)


def banner(title):
    print(f"\n{'=' * 20} {title} {'=' * 20}")


def bnb_twin(linear):
    """bitsandbytes' Linear4bit holding the same float weight (so the same NF4 bytes) as ours."""
    ref = bnb.nn.Linear4bit(linear.in_features, linear.out_features, quant_type="nf4")
    ref.weight = bnb.nn.Params4bit(
        linear.weight.data.clone(), requires_grad=False, quant_type="nf4", module=ref
    )
    ref.bias = nn.Parameter(linear.bias.data.clone())
    return ref.to("cpu")  # bnb quantizes here


def peft_twin(linear, seed, **kw):
    """peft's 4-bit LoRA layer over `bnb_twin(linear)`, adapters drawn after manual_seed(seed)."""
    import peft
    from peft.tuners.lora.bnb import Linear4bit as PeftLinear4bit

    ref = bnb_twin(linear)
    torch.manual_seed(seed)  # after bnb's constructor, which draws its own init
    return PeftLinear4bit(
        ref, "default", config=peft.LoraConfig(**kw), r=kw["r"], lora_alpha=kw["lora_alpha"]
    )


# %% [markdown]
# ## NF4: 16 levels at equal-mass quantiles of N(0, 1), scaled to [-1, 1] (QLoRA section 3)

# %%
banner("NF4 code values (QLoRA 3)")
code = nf4_code_values()
print("ours:", code)
print("bnb: ", bnbF.get_4bit_type("nf4", device="cpu"))
assert torch.equal(code, bnbF.get_4bit_type("nf4", device="cpu"))

# %% [markdown]
# ## NF4 by hand, in plain PyTorch (nanosft.nf4.quantize_nf4, dequantize_nf4, double_quantize)
# Where the 16 levels come from, absmax per 64-value block of the *flattened* weight (so a block
# may cross rows), the multiply by 1 / absmax, the nearest level via the 15 midpoints, and two codes
# a byte with the first in the high nibble. Then double quantization of the absmax itself.

# %%
banner("NF4 by hand: the levels")
# 8 positive quantiles, 7 negative and an exact 0: 16 codes with zero represented exactly. The
# probability 0.9677083 replaces quantile 1 (infinite); then everything is divided by the maximum.
p_pos = torch.linspace(0.9677083, 0.5, 9)[:-1].double()  # 8 probabilities > 0.5
p_neg = torch.linspace(0.9677083, 0.5, 8)[:-1].double()  # 7: one fewer, so one more level above 0
levels = torch.cat([-torch.special.ndtri(p_neg), torch.zeros(1, dtype=torch.float64),
                    torch.special.ndtri(p_pos)]).float().sort().values
levels = levels / levels.max()
print(f"{int((levels > 0).sum())} positive, {int((levels < 0).sum())} negative, "
      f"{int((levels == 0).sum())} exact zero; min {levels.min():.1f}, max {levels.max():.1f}")
assert torch.equal(levels, code)

banner("NF4 by hand: quantize a (2, 96) weight")
torch.manual_seed(1)
w = torch.randn(2, 96)  # 192 values = 3 blocks of 64; block 1 is row 0[64:96] + row 1[0:32]
blocks = w.flatten().view(-1, 64)  # (3, 64)
absmax = blocks.abs().amax(dim=1)  # (3,) fp32, one scale per block
scaled = blocks * (1 / absmax)[:, None]  # the reciprocal, then a multiply (bnb rounds this way)
midpoints = (code[:-1] + code[1:]) / 2  # 15 midpoints between the 16 sorted levels
idx = torch.bucketize(scaled, midpoints).flatten()  # nearest level; a tie goes to the lower one
packed = (idx[0::2] << 4 | idx[1::2]).to(torch.uint8)[:, None]  # (96, 1)
print("absmax per block      ", absmax, "| block 1 spans rows 0 and 1:",
      bool(absmax[1] == torch.cat([w[0, 64:], w[1, :32]]).abs().max()))
print("first 4 codes         ", idx[:4].tolist(), "-> first byte", f"{packed[0, 0].item():08b}",
      f"= {idx[0].item()} << 4 | {idx[1].item()}")
ref_packed, ref_state = bnbF.quantize_4bit(w, blocksize=64, quant_type="nf4")
ours_packed, ours_absmax = quantize_nf4(w)
same = torch.equal(packed, ref_packed) and torch.equal(absmax, ref_state.absmax)
print("bytes and absmax identical to bitsandbytes.functional.quantize_4bit:", same)
assert same and torch.equal(ours_packed, packed) and torch.equal(ours_absmax, absmax)
deq = dequantize_nf4(packed, absmax, w.shape)
by_hand = (code[idx] * absmax.repeat_interleave(64)).view(w.shape)  # value i: block i // 64
print(f"dequantize_nf4 == code[index] * absmax: {torch.equal(deq, by_hand)}, "
      f"max |W - deq(W)| = {(deq - w).abs().max():.4f}")
assert torch.equal(deq, by_hand)
# bnb's CPU kernel decodes row by row; on an AVX-512 CPU it is right only where rows hold whole
# blocks (nanosft.nf4.cpu_kernels_decode, the rule Linear4bit keeps). So bnb's decode is compared
# on the same 192 values as one row of 3 whole blocks: right on every CPU.
rows_decode = cpu_kernels_decode(w.shape[1], 64, w.device)
off = int((bnbF.dequantize_4bit(ref_packed, ref_state) != deq).sum())
print(f"not compared with bnb's CPU dequantize: rows of {w.shape[1]} split a 64-value block, part "
      "of which its AVX-512 kernel scales with the previous block's absmax (cpu_kernels_decode("
      f"{w.shape[1]}) = {rows_decode}; {off} of {w.numel()} values off on this CPU)")
one_row_decodes = cpu_kernels_decode(w.numel(), 64, w.device)  # (1, 192): 3 whole blocks
row_packed, row_state = bnbF.quantize_4bit(w.view(1, -1), blocksize=64, quant_type="nf4")
same = torch.equal(row_packed, packed)
same = same and torch.equal(bnbF.dequantize_4bit(row_packed, row_state), deq.view(1, -1))
print(f"as one row of {w.numel()} values (cpu_kernels_decode({w.numel()}) = {one_row_decodes}): "
      f"same bytes, bnb's dequantize == ours: {same}")
assert not rows_decode and one_row_decodes and same

banner("NF4 by hand: double quantization of absmax")
torch.manual_seed(2)
big = torch.randn(256, 512)  # 2,048 blocks -> 2,048 fp32 absmax, 8 blocks of 256 of them
_, absmax = quantize_nf4(big)
codes, absmax2, offset = double_quantize(absmax)  # subtract the mean, 8-bit dynamic-map codes
rebuilt = dequantize_absmax(codes, absmax2, offset)  # dynamic_map[code] * absmax2 + offset
_, nested = bnbF.quantize_4bit(big, blocksize=64, quant_type="nf4", compress_statistics=True)
agree = codes == nested.absmax
print(f"offset (mean absmax) {offset:.5f} == bnb {nested.offset:.5f}; absmax2 "
      f"{tuple(absmax2.shape)} equal to bnb's: {torch.equal(absmax2, nested.state2.absmax)}")
print(f"8-bit codes equal to bnb's for {int(agree.sum())} of {codes.numel()} blocks (bnb's CPU "
      "kernel takes the neighbouring code at near-ties)")
print(f"rebuilt absmax: max relative error {((rebuilt - absmax) / absmax).abs().max():.2e}; "
      f"storage 8 + 32/256 bits per block instead of 32")
ref_rebuilt = bnbF.dequantize_blockwise(nested.absmax, nested.state2) + nested.offset
assert torch.equal(rebuilt[agree], ref_rebuilt[agree]) and agree.float().mean() > 0.99

banner("NF4 by hand: backward dequantizes again, and the weight gets no gradient")
layer4 = Linear4bit.from_linear(nn.Linear(128, 2))
xb = torch.randn(4, 128, requires_grad=True)
yb = layer4(xb)
calls, dequantize_4bit = [], bnbF.dequantize_4bit
bnbF.dequantize_4bit = lambda *a, **k: calls.append(1) or dequantize_4bit(*a, **k)
try:  # MatMul4Bit.backward: grad_x = grad_y @ dequantize_4bit(W); no float W was kept
    yb.sum().backward()
finally:
    bnbF.dequantize_4bit = dequantize_4bit
print(f"backward called dequantize_4bit {len(calls)} time(s); weight.requires_grad="
      f"{layer4.weight.requires_grad}, weight.grad={layer4.weight.grad}")
assert calls and layer4.weight.grad is None
assert torch.allclose(xb.grad, torch.ones(4, 2) @ layer4.dequantize(), atol=1e-6)

# %% [markdown]
# ## Quantize a small weight: one absmax per 64 values, 4-bit index of the nearest level

# %%
banner("quantize_4bit: codes, absmax, error")
torch.manual_seed(0)
lin = nn.Linear(
    64, 8
)  # in_features 64 = one block per row (bnb's CPU kernel assumes rows hold whole blocks)
plain = Linear4bit.from_linear(lin, compress_statistics=False)
packed = plain.weight.reshape(-1)
codes = torch.stack([packed >> 4, packed & 0xF], 1).reshape(-1)  # first value in the high nibble
absmax = plain.quant_state.absmax
print("weight[0, :6]        ", lin.weight[0, :6].detach())
print(
    "packed bytes[:3]     ", [f"{b:08b}" for b in packed[:3].tolist()], "(two 4-bit codes per byte)"
)
print("4-bit codes[:6]      ", codes[:6].tolist())
print("absmax per block     ", absmax)
print("code[idx] * absmax[0]", (code[codes[:6].long()] * absmax[0]))
err = (plain.dequantize() - lin.weight).abs()
print(
    f"max |W - deq(W)| = {err.max():.5f}  (bound: half the widest gap x absmax = "
    f"{(code.diff().max() / 2 * absmax.max()):.5f})"
)
assert torch.equal(plain.dequantize()[0, :6], code[codes[:6].long()] * absmax[0])
assert err.max() <= code.diff().max() / 2 * absmax.max()

double = Linear4bit.from_linear(lin, compress_statistics=True)
qs = double.quant_state
print(
    "double quant: absmax as uint8",
    qs.absmax.tolist(),
    "| offset",
    round(qs.offset.item(), 5),
    "| nested absmax",
    qs.state2.absmax.tolist(),
)
big = nn.Linear(1024, 1024)
bpp = {
    dq: bytes_per_parameter(Linear4bit.from_linear(big, compress_statistics=dq))
    for dq in (False, True)
}
print(
    f"bytes per weight, 1024x1024: {bpp[False]:.4f} without, {bpp[True]:.4f} with double "
    "quantization (fp16 would be 2.0)"
)
assert abs(bpp[False] - (0.5 + 4 / 64 + 64 / 1024**2)) < 1e-9
assert bpp[True] < bpp[False]

# %% [markdown]
# ## The base layer: result = self.base_layer(x) (bnb Linear4bit.forward: dequantize, then F.linear)

# %%
banner("result = self.base_layer(x)")
base = Linear4bit.from_linear(lin)
x = torch.randn(2, 3, 64, requires_grad=True)  # (B, T, C)
result = base(x)
print(
    "x",
    tuple(x.shape),
    "-> result",
    tuple(result.shape),
    "| compute_dtype set from x:",
    base.compute_dtype,
)
assert torch.allclose(result, F.linear(x, base.dequantize(), base.bias), atol=1e-6)

# %% [markdown]
# ## Walkthrough 2.7, one line at a time

# %%
banner("2.7 Linear4bit.forward(x), LoRA r=4, lora_alpha=8")
torch.manual_seed(42)
layer = LoraLinear(Linear4bit.from_linear(lin), r=4, lora_alpha=8)
with torch.no_grad():
    layer.lora_B["default"].weight.normal_(0, 0.1)  # B = 0 at init would make the adapter invisible
adapter_names = None  # "adapter_names = kwargs.pop('adapter_names', None)"
layer._check_forward_args(x, adapter_names)
print("self._check_forward_args(x)          -> ok, adapter_names is", adapter_names)
# the if/elif chain of 2.7, evaluated on this layer: the last branch runs when no earlier one does
branches = {
    "if self.disable_adapters": layer.disable_adapters,
    "elif adapter_names is not None": adapter_names is not None,
    "elif self.merged": layer.merged,
}
runs = "runs" if not any(branches.values()) else "skipped"
print(" | ".join(f"{cond}: {taken}" for cond, taken in branches.items()), f"| else: {runs}")
assert runs == "runs"
result = layer.base_layer(x)
print("result = self.base_layer(x)          ->", tuple(result.shape))
try:  # why the defensive clone: the output of bnb's MatMul4Bit may not be modified in place
    result.add_(1)
except RuntimeError as e:
    print("in-place on the unclone result       -> RuntimeError:", str(e).split(".")[0])
result = result.clone()
print("result = result.clone()              -> now safe to update")
print("for active_adapter in self.active_adapters:", layer.active_adapters)
lora_A, lora_B = layer.lora_A["default"], layer.lora_B["default"]
dropout, scaling = layer.lora_dropout["default"], layer.scaling["default"]
requires_conversion = not torch.is_autocast_enabled()
with torch.autocast("cpu", dtype=torch.bfloat16):
    cpu_autocast = (torch.is_autocast_enabled(), torch.is_autocast_enabled("cpu"))
print(
    f"requires_conversion = not torch.is_autocast_enabled() -> {requires_conversion} "
    f"(inside CPU autocast: is_autocast_enabled() = {cpu_autocast[0]}, ('cpu') = {cpu_autocast[1]})"
)
expected_dtype = result.dtype
x_cast = layer._cast_input_dtype(x, lora_A.weight.dtype)
print("x = self._cast_input_dtype(x, lora_A.weight.dtype) ->", x_cast.dtype, "| dropout:", dropout)
h = lora_A(dropout(x_cast))
output = lora_B(h) * scaling
print(
    f"output = lora_B(lora_A(dropout(x))) * scaling: {tuple(x_cast.shape)} -> {tuple(h.shape)} -> "
    f"{tuple(output.shape)}, scaling = lora_alpha / r = {scaling}"
)
assert scaling == layer.lora_alpha["default"] / layer.r["default"]
result = result + output.to(expected_dtype)
print(
    "result = result + output             -> matches LoraLinear:", torch.allclose(result, layer(x))
)
assert torch.equal(result, layer(x))  # reference mode: layer(x) runs the lines above
# Default (fast) mode replaces the last three lines for fp32 adapters by one addmm that adds B's
# product into result: result + (lora_A(x) @ B^T) * scaling, no (B, T, out) multiply-and-add pass.
with reference_mode(False):
    fast = layer(x)
by_addmm = torch.addmm(
    layer.base_layer(x).flatten(0, -2), lora_A(x_cast).flatten(0, -2), lora_B.weight.t(),
    alpha=scaling,
).view(result.shape)
fast_diff = (fast - result).abs().max().item()
print(
    f"fast path (nanosft.fast.lora_addmm): result.addmm(lora_A(x), B^T, alpha=scaling), "
    f"max |fast - reference| = {fast_diff:.1e}"
)
assert torch.equal(fast, by_addmm)  # the speed path is exactly this addmm
assert torch.allclose(fast, result, rtol=1e-6, atol=1e-6)  # and the walkthrough's sum, to rounding
rs = LoraLinear(Linear4bit.from_linear(lin), r=4, lora_alpha=8, use_rslora=True)
print("rsLoRA scaling = lora_alpha / sqrt(r) =", rs.scaling["default"])
assert rs.scaling["default"] == rs.lora_alpha["default"] / math.sqrt(rs.r["default"])
if HAVE_PEFT:
    ref = peft_twin(lin, 42, r=4, lora_alpha=8)
    assert torch.equal(ref.lora_A["default"].weight, lora_A.weight)  # same seed, same init
    with torch.no_grad():
        ref.lora_B["default"].weight.copy_(lora_B.weight)
    diff = (layer(x) - ref(x)).abs().max().item()
    print(f"peft bnb.Linear4bit beside ours: max |ours - peft| = {diff:.1e}")
    assert torch.allclose(layer(x), ref(x), atol=1e-5)

# %% [markdown]
# ## The DoRA branch: m / ||W + s B A|| scales every output row; the norm is a constant for autograd

# %%
banner("2.7 DoRA branch (use_dora=True)")
torch.manual_seed(42)
dora = LoraLinear(Linear4bit.from_linear(lin), r=4, lora_alpha=8, use_dora=True)
m = dora.lora_magnitude_vector["default"].weight
W = dora.base_layer.dequantize()
print("magnitude m at init = ||W_deq||_row  ->", m.detach(), "vs", W.norm(dim=1))
with torch.no_grad():
    dora.lora_B["default"].weight.copy_(lora_B.weight)
BA = dora.lora_B["default"].weight @ dora.lora_A["default"].weight
s = dora.scaling["default"]
norm = dora_weight_norm(W, BA.detach(), s)
print("weight_norm = ||W + s B A||_row       ->", norm.detach(), f"(detached, s = {s})")
print("mag_norm_scale = m / weight_norm      ->", (m / norm).detach())
dropout = dora.lora_dropout["default"]
reuse = isinstance(dropout, nn.Identity) or not dora.training
print(f"isinstance(dropout, nn.Identity) or not self.training -> {reuse}: base_result = result")
assert reuse
expected = (m / norm) * (x @ (W + s * BA).T) + dora.base_layer.bias
same = torch.allclose(dora(x), expected, atol=1e-5)
print("DoRA output == m / ||W + sBA|| * (W + sBA) x + b:", same)
assert same
if HAVE_PEFT:
    ref_dora = peft_twin(lin, 42, r=4, lora_alpha=8, use_dora=True)
    with torch.no_grad():
        ref_dora.lora_B["default"].weight.copy_(lora_B.weight)
    diff = (dora(x) - ref_dora(x)).abs().max().item()
    print(f"peft DoRA beside ours: max |ours - peft| = {diff:.1e}")
    assert torch.allclose(dora(x), ref_dora(x), atol=1e-5)

# %% [markdown]
# ## The DoRA dropout branch: `x = dropout(x)`, `base_result = None`, so W x is recomputed
# nanosft keeps the dropped input in a local `x_dora` (peft 0.21.2 does the same inside its DoRA
# variant), so a second adapter in the loop would still see the undropped x.

# %%
banner("2.7 DoRA branch with lora_dropout=0.1, train mode")
torch.manual_seed(42)
drop = LoraLinear(Linear4bit.from_linear(lin), r=4, lora_alpha=8, lora_dropout=0.1, use_dora=True)
with torch.no_grad():
    drop.lora_B["default"].weight.copy_(lora_B.weight)
dropout = drop.lora_dropout["default"]
reuse = isinstance(dropout, nn.Identity) or not drop.training
print(f"isinstance(dropout, nn.Identity) or not self.training -> {reuse}: base_result = None")
assert not reuse
torch.manual_seed(7)
x_dora = dropout(x)  # "x = dropout(x)": zeros a tenth of x, scales the rest by 1 / 0.9
print(f"x = dropout(x)                       -> {(x_dora == 0).float().mean():.2f} of x zeroed")
# inside the magnitude module: base_result is None, so "base_result = F.linear(x, weight)"
W = drop.base_layer.dequantize()
m = drop.lora_magnitude_vector["default"].weight
s = drop.scaling["default"]
BA = drop.lora_B["default"].weight @ drop.lora_A["default"].weight
mag_norm_scale = m / dora_weight_norm(W, BA.detach(), s).detach()
dora_term = (mag_norm_scale - 1) * (x_dora @ W.T) + mag_norm_scale * (x_dora @ BA.T) * s
by_hand = drop.base_layer(x) + dora_term  # the undropped base output plus the dropped DoRA term
torch.manual_seed(7)  # the same dropout mask inside forward
ours_drop = drop(x)
print("result + DoRA term on dropped x      -> matches LoraLinear:",
      torch.allclose(ours_drop, by_hand, atol=1e-5))
assert torch.allclose(ours_drop, by_hand, atol=1e-5)
drop.eval()
reuse = isinstance(dropout, nn.Identity) or not drop.training
print(f"after eval(): ... or not self.training -> {reuse}: base_result reused, no dropout")
assert reuse and torch.allclose(drop(x), dora(x), atol=1e-5)  # same A, B, m as `dora` above
drop.train()
if HAVE_PEFT:
    ref_drop = peft_twin(lin, 42, r=4, lora_alpha=8, lora_dropout=0.1, use_dora=True)
    with torch.no_grad():
        ref_drop.lora_B["default"].weight.copy_(lora_B.weight)
    torch.manual_seed(7)
    diff = (ours_drop - ref_drop(x)).abs().max().item()
    print(f"peft DoRA with dropout, same mask: max |ours - peft| = {diff:.1e}")
    assert diff < 1e-5

# %% [markdown]
# ## merge / unmerge: fold B A * scaling into W (4-bit: dequantize, add, requantize)

# %%
banner("merge() / unmerge()")
fl = LoraLinear(copy.deepcopy(lin), r=4, lora_alpha=8)
with torch.no_grad():
    fl.lora_B["default"].weight.copy_(lora_B.weight)
before = fl(x)
fl.merge()
print(
    f"float base: merged={fl.merged}, max |merged - unmerged| = {(fl(x) - before).abs().max():.1e}"
)
assert torch.allclose(fl(x), before, atol=1e-6)
before = layer(x)
layer.merge()
q_err = (layer(x) - before).abs().max().item()
print(f"4-bit base: max |merged - unmerged| = {q_err:.4f}  (W + dW rounded to NF4 again)")
if HAVE_PEFT:
    ref.merge()
    same = torch.equal(ref.base_layer.weight.data, layer.base_layer.weight.data)
    print("peft's merged NF4 bytes identical to ours:", same)
    assert same
layer.unmerge()
print("unmerge() -> merged =", layer.merged)

# %% [markdown]
# ## disable_adapters and a mixed batch (adapter_names: one adapter per row, "__base__" = none)

# %%
banner("disable_adapters / adapter_names")
layer.disable_adapters = True
assert torch.equal(layer(x), layer.base_layer(x))
print("disable_adapters=True -> result = self.base_layer(x)")
layer.disable_adapters = False
mixed = layer(x, adapter_names=["default", "__base__"])
assert torch.allclose(mixed[1], layer.base_layer(x)[1]) and torch.allclose(mixed[0], layer(x)[0])
print("adapter_names=['default', '__base__'] -> row 0 adapted, row 1 plain base")

# %% [markdown]
# ## Eval vs train on CPU: ours keeps dequantize + matmul; bnb may switch to a bf16 kernel

# %%
banner("eval() vs train() on CPU")
xe = x.detach()
lin32 = nn.Linear(64, 32)  # bnb's bf16 kernel packs 32 output rows at a time
base32 = Linear4bit.from_linear(lin32)
train_out = base32(xe)
with torch.no_grad():
    eval_out = base32.eval()(xe)
print(f"ours Linear4bit: max |eval - train| = {(eval_out - train_out).abs().max():.1e} "
      "(dequantize + matmul in both modes)")
assert torch.equal(eval_out, train_out)
# bnb's Linear4bit repacks its weight for a bf16 kernel in eval (no grad) only where the CPU has
# AVX512-BF16; elsewhere its eval keeps dequantize + matmul, as ours does everywhere
avx512_bf16 = bool(bnbF.has_avx512bf16())
bnb32 = bnb_twin(lin32)
bnb_train = bnb32(xe)
with torch.no_grad():
    bnb_eval = bnb32.eval()(xe)
repacked = bool(getattr(bnb32.weight.quant_state, "packing_format_for_cpu", False))
print(f"this CPU has AVX512-BF16: {avx512_bf16} -> bnb Linear4bit in eval repacked its weight: "
      f"{repacked}, max |eval - train| = {(bnb_eval - bnb_train).abs().max():.4f}")
print(f"ours in eval == bnb in train: {torch.equal(eval_out, bnb_train)}")
assert torch.equal(eval_out, bnb_train) and repacked == avx512_bf16
if HAVE_PEFT:
    ref32 = peft_twin(lin32, 7, r=4, lora_alpha=8, use_dora=True)
    torch.manual_seed(7)
    ours32 = LoraLinear(Linear4bit.from_linear(lin32), r=4, lora_alpha=8, use_dora=True)
    t_ref, t_ours = ref32(xe), ours32(xe)  # train mode first, while bnb's weight is canonical
    with torch.no_grad():
        e_ref, e_ours = ref32.eval()(xe), ours32.eval()(xe)
    drift = (e_ref - t_ref).abs().max()
    if avx512_bf16:  # DoRA's weight norm dequantizes the repacked bytes as if canonical
        print(f"with AVX512-BF16: peft DoRA on bnb: max |eval - train| = {drift:.4f} (bnb "
              f"repacked its weight in place; DoRA dequantizes that layout); ours: "
              f"{(e_ours - t_ours).abs().max():.1e}")
        assert drift > 0
    else:
        print(f"without AVX512-BF16: peft DoRA on bnb: max |eval - train| = {drift:.1e} (no "
              f"repack); ours: {(e_ours - t_ours).abs().max():.1e}; max |ours - peft| in eval = "
              f"{(e_ours - e_ref).abs().max():.1e}")
        assert torch.equal(e_ref, t_ref) and torch.allclose(e_ours, e_ref, atol=1e-5)
    assert torch.equal(e_ours, t_ours)

print("\nOK: walkthrough 2.7 replayed step by step")

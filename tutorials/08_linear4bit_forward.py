"""Tutorial 08: Linear4bit.forward with LoRA and DoRA, line by line (walkthrough 2.7).

Every q_proj / v_proj of a QLoRA model is a frozen NF4 `base_layer` plus a low-rank adapter. We
quantize a small weight by hand (codes, absmax, error, bytes per weight), then replay the forward of
walkthrough 2.7 one line at a time on a (2, 3, 64) input and check each step against
nanosft.lora.LoraLinear; peft's and bitsandbytes' numbers are printed beside ours when installed.
Run:      python tutorials/08_linear4bit_forward.py
Runtime:  a few seconds on CPU (about 10 s when peft is imported).
You should see:
  - the 16 NF4 code values, the 4-bit codes and absmax of a 2x64 weight, and its quantization error;
  - bytes per weight of a 1024x1024 layer: 0.5626 without, 0.5169 with double quantization;
  - which branch of 2.7 runs, scaling 2.0 (LoRA) / 4.0 (rsLoRA), the shapes, and the DoRA norms;
  - merge: float exact to 1e-6, 4-bit off by the requantization error; eval vs train on the CPU kernel;
  - "OK: walkthrough 2.7 replayed step by step" at the end.
"""

# %%
import copy
import importlib.util
import warnings

import bitsandbytes as bnb
import bitsandbytes.functional as bnbF
import torch
import torch.nn.functional as F
from torch import nn

from nanosft.lora import LoraLinear, dora_weight_norm
from nanosft.nf4 import Linear4bit, bytes_per_parameter, nf4_code_values

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
    """peft's 4-bit LoRA layer over `bnb_twin(linear)`, its adapters drawn after torch.manual_seed(seed)."""
    import peft
    from peft.tuners.lora.bnb import Linear4bit as PeftLinear4bit

    ref = bnb_twin(linear)
    torch.manual_seed(
        seed
    )  # after bnb's constructor, which draws its own init  # after bnb's constructor, which draws its own init
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
    f"bytes per weight, 1024x1024: {bpp[False]:.4f} without, {bpp[True]:.4f} with double quantization "
    f"(fp16 would be 2.0)"
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
print("self._check_forward_args(x)          -> ok, adapter_names is None")
print(
    f"if self.disable_adapters: {layer.disable_adapters} | elif adapter_names is not None: False | "
    f"elif self.merged: {layer.merged} | else: runs"
)
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
result = result + output.to(expected_dtype)
print(
    "result = result + output             -> matches LoraLinear:", torch.allclose(result, layer(x))
)
assert torch.equal(result, layer(x))
rs = LoraLinear(Linear4bit.from_linear(lin), r=4, lora_alpha=8, use_rslora=True)
print("rsLoRA scaling = lora_alpha / sqrt(r) =", rs.scaling["default"])
assert rs.scaling["default"] == 4.0
if HAVE_PEFT:
    ref = peft_twin(lin, 42, r=4, lora_alpha=8)
    assert torch.equal(ref.lora_A["default"].weight, lora_A.weight)  # same seed, same init
    with torch.no_grad():
        ref.lora_B["default"].weight.copy_(lora_B.weight)
    print(
        f"peft bnb.Linear4bit beside ours: max |ours - peft| = {(layer(x) - ref(x)).abs().max().item():.1e}"
    )
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
norm = dora_weight_norm(W, BA.detach(), 2.0)
print("weight_norm = ||W + s B A||_row       ->", norm.detach(), "(detached)")
print("mag_norm_scale = m / weight_norm      ->", (m / norm).detach())
print(
    "isinstance(dropout, nn.Identity) or not self.training -> True: base_result = result is reused"
)
expected = (m / norm) * (x @ (W + 2.0 * BA).T) + dora.base_layer.bias
assert torch.allclose(dora(x), expected, atol=1e-5)
print("DoRA output == m / ||W + sBA|| * (W + sBA) x + b: True")
drop = LoraLinear(Linear4bit.from_linear(lin), r=4, lora_alpha=8, lora_dropout=0.1, use_dora=True)
print("with lora_dropout=0.1 in train mode   -> x = dropout(x); base_result = None, W x recomputed")
if HAVE_PEFT:
    ref_dora = peft_twin(lin, 42, r=4, lora_alpha=8, use_dora=True)
    with torch.no_grad():
        ref_dora.lora_B["default"].weight.copy_(lora_B.weight)
    print(
        f"peft DoRA beside ours: max |ours - peft| = {(dora(x) - ref_dora(x)).abs().max().item():.1e}"
    )
    assert torch.allclose(dora(x), ref_dora(x), atol=1e-5)

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
# ## Eval vs train on CPU: bnb switches to a bf16 inference kernel (hf-reference 6.9)

# %%
banner("eval() vs train() on CPU")
xe = x.detach()
lin32 = nn.Linear(64, 32)  # the bf16 kernel packs 32 output rows at a time
if bnbF.has_avx512bf16():
    base32 = Linear4bit.from_linear(lin32)
    train_out = base32(xe)
    with torch.no_grad():
        eval_out = base32.eval()(xe)
    print(
        f"ours Linear4bit: max |eval - train| = {(eval_out - train_out).abs().max():.4f} (bf16 kernel)"
    )
    assert not torch.equal(eval_out, train_out)
    bnb32 = bnb_twin(lin32)
    bnb_train = bnb32(xe)
    with torch.no_grad():
        bnb_eval = bnb32.eval()(xe)
    print(
        f"bnb Linear4bit:  max |eval - train| = {(bnb_eval - bnb_train).abs().max():.4f}, "
        f"eval ours vs bnb {(eval_out - bnb_eval).abs().max():.1e}"
    )
    assert torch.equal(eval_out, bnb_eval)
    if HAVE_PEFT:
        ref32 = peft_twin(lin32, 7, r=4, lora_alpha=8, use_dora=True)
        torch.manual_seed(7)
        ours32 = LoraLinear(Linear4bit.from_linear(lin32), r=4, lora_alpha=8, use_dora=True)
        t_ref, t_ours = ref32(xe), ours32(xe)  # train mode first, while bnb's weight is canonical
        with torch.no_grad():
            e_ref, e_ours = ref32.eval()(xe), ours32.eval()(xe)
        after = ref32.train()(xe)  # bnb's weight stays repacked, so train mode now differs as well
        print(
            f"peft DoRA on bnb: max |eval - train| = {(e_ref - t_ref).abs().max():.4f}, and back in train "
            f"mode {(after - t_ref).abs().max():.4f} (bnb repacked its weight in place; DoRA dequantizes "
            "that layout)"
        )
        print(
            f"ours DoRA:        max |eval - train| = {(e_ours - t_ours).abs().max():.4f} "
            "(the repack is a copy: DoRA still sees the real weight, train mode is unchanged)"
        )
        assert torch.equal(ours32.train()(xe), t_ours)
        assert (e_ours - t_ours).abs().max() < (e_ref - t_ref).abs().max()
else:
    print("this CPU has no AVX512-BF16: bnb's inference kernel is not used, eval equals train")

print("\nOK: walkthrough 2.7 replayed step by step")

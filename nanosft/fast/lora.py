"""Speed paths of the LoRA layer: where they apply, the same numbers as the walkthrough's lines.

`lora_addmm`: fp32 adapters add B's product into the base output with one addmm instead of a
(B, T, out) multiply and add (forward and backward). `bf16_adapter_linear`: on a CPU where torch
has no bf16 GEMM (AVX2), bf16 adapter products run as fp32 GEMMs on the bf16 values and are
rounded once, as a bf16 linear does (20-30x faster there on the adapters' shapes).
"""

import functools
import math
import threading
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from nanosft.distributed import is_dtensor


@functools.cache
def _has_bf16_gemm():
    # torch multiplies bf16 on CPU through oneDNN where the CPU has AVX512 (or AMX); elsewhere
    # (AVX2) its fallback kernel runs 20-30x slower than fp32 on the adapters' shapes
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _multiplies_in_bf16_without_kernel(x, weight):
    if x.device.type != "cpu" or _has_bf16_gemm():
        return False
    if torch.is_autocast_enabled("cpu"):
        return torch.get_autocast_dtype("cpu") == torch.bfloat16
    return x.dtype == weight.dtype == torch.bfloat16


class Bf16LinearInFp32(torch.autograd.Function):
    """x @ w^T as a bf16 linear computes it (inputs rounded to bf16, every product and sum in fp32,
    the result rounded to bf16 once), run as an fp32 GEMM; backward likewise. Only the summation
    order differs from torch's own bf16 kernel: 99.97-100% of outputs bit-equal, the rest 1 ulp."""

    @staticmethod
    def forward(ctx, x, weight):
        xb, wb = x.to(torch.bfloat16), weight.to(torch.bfloat16)  # what autocast would round
        ctx.save_for_backward(xb, wb)
        ctx.dtypes = x.dtype, weight.dtype
        with torch.autocast("cpu", enabled=False):
            return F.linear(xb.float(), wb.float()).to(torch.bfloat16)

    @staticmethod
    def backward(ctx, grad):
        xb, wb = ctx.saved_tensors
        g = grad.to(torch.bfloat16).float()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:  # (..., out) @ (out, in)
            grad_x = (g @ wb.float()).to(torch.bfloat16).to(ctx.dtypes[0])
        if ctx.needs_input_grad[1]:  # (out, N) @ (N, in)
            grad_w = g.flatten(0, -2).t() @ xb.flatten(0, -2).float()
            grad_w = grad_w.to(torch.bfloat16).to(ctx.dtypes[1])
        return grad_x, grad_w


def _fp32_throughout(x, result, lora_A, lora_B):
    # fp32 activations, base output and adapters, no autocast, B without a bias
    return (x.dtype == result.dtype == lora_A.weight.dtype == lora_B.weight.dtype == torch.float32
            and lora_B.bias is None and not torch.is_autocast_enabled(x.device.type))


def _add_low_rank(result, ax, weight_B, scaling):
    """result + (ax @ B^T) * scaling as one addmm, (B, T, out) + (B, T, r) @ (r, out).
    Saves the (B, T, out) scaling multiply and add passes, forward and backward; with a
    power-of-two scaling (alpha = 2r, alpha = r) every rounding is the unfused sum's."""
    out = torch.addmm(result.flatten(0, -2), ax.flatten(0, -2), weight_B.t(), alpha=scaling)
    return out.view(result.shape)


def bf16_adapter_linear(layer, x):
    """layer(x) through Bf16LinearInFp32 where torch would multiply in bf16 without a kernel, else
    None (the caller runs nn.Linear's own forward)."""
    if layer.bias is None and _multiplies_in_bf16_without_kernel(x, layer.weight):
        return Bf16LinearInFp32.apply(x, layer.weight)
    return None


def lora_addmm(result, x, lora_A, lora_B, dropout, scaling):
    """result + lora_B(lora_A(dropout(x))) * scaling with B's product added by one addmm, when all
    of it is fp32 without autocast; else None (the caller runs the walkthrough's line)."""
    if not _fp32_throughout(x, result, lora_A, lora_B) or is_dtensor(lora_B.weight):
        return None  # tensor parallel: B's module hooks split its output
    return _add_low_rank(result, lora_A(dropout(x)), lora_B.weight, scaling)


# ------------------------------------------------------------------------ the whole adapter sum
# q/k/v (and gate/up) read the same input: their A products run as one GEMM over the concatenated
# A weights, [A_q; A_k; A_v] (r_q + r_k + r_v, in), when the first of them is called; the others
# take their columns. Opt-in: link_shared_inputs(model) after get_peft_model names the groups (x's
# gradient then sums the members inside one GEMM: fp32 rounding, not autograd's order).
SHARED_INPUTS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
_groups = weakref.WeakKeyDictionary()  # layer -> tuple of weakrefs to its group, itself included
# .entry: (x, x._version, dtype, {id(layer): (weakref to it, its (..., r) product)})
_pending = threading.local()


def link_shared_inputs(model):
    """Record which LoRA layers of `model` read one input (SHARED_INPUTS under one parent)."""
    for module in model.modules():
        for names in SHARED_INPUTS:
            layers = [getattr(module, n, None) for n in names]
            layers = [m for m in layers if _is_lora_linear(m)]
            if len(layers) > 1:
                refs = tuple(weakref.ref(m) for m in layers)
                for m in layers:
                    _groups[m] = refs


def _is_lora_linear(module):
    # lora.LoraLinear, known by what this module reads of it: the speed paths sit below the core
    # (reference.fast_path imports them) and import nothing of it
    return (isinstance(getattr(module, "lora_A", None), nn.ModuleDict)
            and hasattr(module, "base_layer") and hasattr(module, "use_dora"))


def _single_adapter(layer):
    """The one active plain-LoRA adapter's name where `layer` can take part in a shared A GEMM."""
    names = [n for n in layer.active_adapters if n in layer.lora_A]
    if (len(names) != 1 or layer.use_dora[names[0]] or layer.merged or layer.disable_adapters
            or not isinstance(layer.lora_dropout[names[0]], nn.Identity)):
        return None
    return names[0]


def _linear(x, weight, dtype):
    """x @ weight^T in `dtype` (bf16 through fp32 GEMMs where the CPU has no bf16 kernel)."""
    x, weight = x.to(dtype), weight.to(dtype)
    if _multiplies_in_bf16_without_kernel(x, weight):
        return Bf16LinearInFp32.apply(x, weight)
    return F.linear(x, weight)


def _a_product(layer, name, x, dtype):
    """lora_A(x) in `dtype`, shape (..., r): from the pending shared GEMM if a group member already
    ran it on this very x, else one GEMM for every member of the group (this layer's part kept)."""
    entry = getattr(_pending, "entry", None)
    if entry is not None and entry[0] is x and entry[1] == x._version and entry[2] == dtype:
        owner, product = entry[3].pop(id(layer), (None, None))
        if not entry[3]:
            _pending.entry = None  # the last member took its part: let x and the graph go
        if owner is not None and owner() is layer:
            return product
    group = [ref() for ref in _groups.get(layer, ())]
    group = [m for m in group if m is not None and _single_adapter(m) == name
             and m.in_features == layer.in_features]
    if layer not in group or len(group) == 1:
        return _linear(x, layer.lora_A[name].weight, dtype)
    weight = torch.cat([m.lora_A[name].weight.to(dtype) for m in group])  # (sum r, in)
    products = _linear(x, weight, dtype).split([m.r[name] for m in group], dim=-1)
    mine = {id(m): (weakref.ref(m), p) for m, p in zip(group, products)}
    product = mine.pop(id(layer))[1]
    _pending.entry = (x, x._version, dtype, mine)
    return product


def _compute_dtype(x, weight):
    # what lora_A(x) computes in: CPU autocast's dtype, else the adapter's (x is cast to it)
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return weight.dtype


def _bf16_product_in_fp32(a, b):
    return (a.float() @ b.float()).to(torch.bfloat16)  # one rounding, as a bf16 GEMM


def _mm(a, b, dtype):
    # a @ b in `dtype` (bf16: through an fp32 GEMM where torch has no bf16 kernel on this CPU)
    if dtype == torch.bfloat16 and a.device.type == "cpu" and not _has_bf16_gemm():
        return _bf16_product_in_fp32(a, b)
    return a @ b


class LowRankAdd(torch.autograd.Function):
    """result + (ax @ B^T * scaling), B's product rounded to `dtype` as lora_B rounds it; with a
    power-of-two scaling the multiply is folded into the add (exact). Backward: the incoming
    gradient is cast to `dtype` once and the scaling applied to the small (N, r) and (out, r)
    products, so no (N, out) gradient is multiplied or cast twice; result's gradient passes."""

    @staticmethod
    def forward(ctx, result, ax, weight_B, scaling, dtype):
        wb = weight_B.to(dtype)
        term = _mm(ax, wb.t(), dtype)  # (..., out) in dtype, a fresh tensor
        exact = math.frexp(scaling)[0] == 0.5  # 2^k: term * scaling rounds exactly
        if term.dtype == result.dtype and term.shape == result.shape:
            # the sum written over B's product (the same roundings): no third (..., out) tensor
            out = (torch.add(result, term, alpha=scaling, out=term) if exact
                   else term.mul_(scaling).add_(result))
        else:
            out = torch.add(result, term, alpha=scaling) if exact else result + term * scaling
        ctx.save_for_backward(ax, wb)
        ctx.scaling, ctx.exact, ctx.dtype, ctx.weight_dtype = scaling, exact, dtype, weight_B.dtype
        return out.to(result.dtype)

    @staticmethod
    def backward(ctx, grad):
        ax, wb = ctx.saved_tensors
        s, dtype = ctx.scaling, ctx.dtype
        g = grad.to(dtype)  # the cast lora_B's output gets on the way back
        if not ctx.exact:
            g = g * s  # rounded in dtype, as the walkthrough's multiply
        grad_ax = grad_w = None
        if ctx.needs_input_grad[1]:  # (..., out) @ (out, r)
            grad_ax = _mm(g, wb, dtype)
            grad_ax = grad_ax * s if ctx.exact else grad_ax
        if ctx.needs_input_grad[2]:  # (out, N) @ (N, r)
            grad_w = _mm(g.flatten(0, -2).t(), ax.flatten(0, -2), dtype)
            grad_w = (grad_w * s if ctx.exact else grad_w).to(ctx.weight_dtype)
        return grad, grad_ax, grad_w, None, None


def _add_term(result, ax, weight_B, scaling, dtype):
    """result + (ax @ B^T * scaling).to(result.dtype) with the roundings of the walkthrough's line:
    fp32 throughout, one addmm; else B's product in `dtype` (LowRankAdd)."""
    if dtype == result.dtype == torch.float32:
        return _add_low_rank(result, ax, weight_B.to(dtype), scaling)
    return LowRankAdd.apply(result, ax, weight_B, scaling, dtype)


def add_lora(layer, x, result):
    """result + sum of the active adapters' lora_B(lora_A(dropout(x))) * scaling, what 2.7's loop
    adds for plain LoRA adapters, with no defensive clone (nothing here writes in place) and, for
    layers linked by link_shared_inputs, x cast once and their A products in one GEMM; None where
    the walkthrough's lines must run (DoRA, CUDA autocast, fp32 adapters on a bf16 base)."""
    names = [n for n in layer.active_adapters if n in layer.lora_A]
    if (not names or any(layer.use_dora[n] for n in names) or torch.is_autocast_enabled()
            or result.dtype not in (torch.float32, torch.bfloat16)):
        return None
    if any(is_dtensor(layer.lora_A[n].weight) or is_dtensor(layer.lora_B[n].weight)
           for n in names):  # tensor parallel: the modules' own hooks split and gather
        return None
    # asked before autocast is switched off below. Autocast reuses one cast of an input that is
    # a leaf requiring grad for the base and lora_A (its gradients then meet in bf16): such an x
    # keeps the walkthrough's lines; a layer's input inside a model is never one
    dtype = _compute_dtype(x, layer.lora_A[names[0]].weight)
    if (dtype not in (torch.float32, torch.bfloat16)
            or (dtype == torch.float32 and result.dtype != torch.float32)
            or (dtype != x.dtype and x.is_leaf and x.requires_grad
                and torch.is_autocast_enabled(x.device.type))):
        return None
    for name in names:
        A, B = layer.lora_A[name], layer.lora_B[name]
        if (A.bias is not None or B.bias is not None or A.weight.dtype != B.weight.dtype
                or A.weight.dtype != layer.lora_A[names[0]].weight.dtype
                or A.weight.dtype not in (torch.float32, torch.bfloat16)
                or isinstance(layer.scaling[name], torch.Tensor)):  # (nanosft.hotswap's)
            return None
    with torch.autocast(x.device.type, enabled=False):
        for name in names:
            dropout, scaling = layer.lora_dropout[name], layer.scaling[name]
            weight_A = layer.lora_A[name].weight
            if isinstance(dropout, nn.Identity) and len(names) == 1:
                ax = _a_product(layer, name, x, dtype)
            else:
                ax = _linear(dropout(x.to(weight_A.dtype)), weight_A, dtype)
            result = _add_term(result, ax, layer.lora_B[name].weight, scaling, dtype)
    return result

"""Speed paths of the LoRA layer: where they apply, the same numbers as the walkthrough's lines.

`lora_addmm`: fp32 adapters add B's product into the base output with one addmm instead of a
(B, T, out) multiply and add (forward and backward). `bf16_adapter_linear`: on a CPU where torch
has no bf16 GEMM (AVX2), bf16 adapter products run as fp32 GEMMs on the bf16 values and are
rounded once, as a bf16 linear does (20-30x faster there on the adapters' shapes).
"""

import functools

import torch
import torch.nn.functional as F


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
    if not _fp32_throughout(x, result, lora_A, lora_B):
        return None
    return _add_low_rank(result, lora_A(dropout(x)), lora_B.weight, scaling)

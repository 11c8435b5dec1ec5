"""The 4-bit base layer's matmul without a fresh weight-sized buffer per call.

bitsandbytes' `matmul_4bit` dequantizes the frozen weight into a new [out, in] tensor on every
forward and again in backward. On CPU that tensor (3.4 MiB fp32 for SmolLM2-135M's MLP) is above
glibc's mmap threshold whenever the process's malloc history left it low, so each call maps fresh
pages and faults once per 4 KiB page (865 faults a call, about 10x the kernel's own 0.1 ms): how
much of a step that costs depends on what else the process allocated, not on the kernel.
`matmul_4bit` here runs the same CPU kernel into one reused workspace per dtype (no allocation,
pages already mapped and warm), and decodes the double-quantized absmax once per forward, keeping
it for backward. Same kernel, same GEMM calls: outputs and gradients equal bitsandbytes'.
Under `hold_dequantized()` (TrainingArguments.nf4_dequantize="per_step") each weight is
dequantized once per optimizer step and kept: at SmolLM2-135M's widths 834 dequantize calls a
step (0.12 ms each, 7% of a one-thread bf16 QLoRA step on short rows) become 210.
"""

import contextlib
import ctypes
import functools
import threading

import torch
import torch.nn.functional as F

_workspace = threading.local()  # {(name, device, dtype): flat buffer}, per thread


@functools.cache
def _bnb():
    import bitsandbytes  # imported once, on the first 4-bit call
    import bitsandbytes.functional

    return bitsandbytes


@functools.cache
def _cpu_kernels():
    """bitsandbytes' CPU dequantize kernels by (quant_type, dtype), or {} without its library."""
    _bnb()  # loads the native library
    from bitsandbytes.cextension import lib

    names = {("nf4", torch.float32): "cdequantize_blockwise_cpu_nf4_fp32",
             ("nf4", torch.bfloat16): "cdequantize_blockwise_cpu_nf4_bf16",
             ("nf4", torch.float16): "cdequantize_blockwise_cpu_nf4_fp16",
             ("fp4", torch.float32): "cdequantize_blockwise_cpu_fp4_fp32",
             ("fp4", torch.bfloat16): "cdequantize_blockwise_cpu_fp4_bf16",
             ("fp4", torch.float16): "cdequantize_blockwise_cpu_fp4_fp16"}
    return {key: getattr(lib, name) for key, name in names.items() if hasattr(lib, name)}


def _avx512():
    return torch.backends.cpu.get_cpu_capability() == "AVX512"


def _kernel_for(packed, quant_state, dtype):
    """The CPU kernel bitsandbytes' dequantize_4bit would run for this weight, or None where it
    takes another route (another device, odd rows, AVX-512 with blocks >= 2048, no library)."""
    shape = quant_state.shape
    if (packed.device.type != "cpu" or packed.dtype != torch.uint8 or len(shape) != 2
            or shape[-1] % 2 or (_avx512() and quant_state.blocksize >= 2048)):
        return None
    return _cpu_kernels().get((quant_state.quant_type, dtype))


def workspace(numel, dtype, device, name="dequantize"):
    """A flat buffer of at least `numel` values, the same one on every call with this `name`
    (grown when short)."""
    key = (name, torch.device(device), dtype)
    buffers = _workspace.__dict__.setdefault("buffers", {})
    buf = buffers.get(key)
    if buf is None or buf.numel() < numel:
        buf = buffers[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel]


def decoded_absmax(quant_state):
    """fp32 absmax per block: the stored one, or decoded from its double quantization.
    Mirrors: bitsandbytes.functional.dequantize_4bit (its nested branch)"""
    if not quant_state.nested:
        return quant_state.absmax.float()
    absmax = _bnb().functional.dequantize_blockwise(quant_state.absmax, quant_state.state2)
    absmax += quant_state.offset
    return absmax.float()


def dequantize_into_workspace(packed, quant_state, absmax, dtype):
    """The [out, in] weight in `dtype`, written by bitsandbytes' CPU kernel into the workspace
    (valid until the next call); None where that kernel does not apply."""
    kernel = _kernel_for(packed, quant_state, dtype)
    if kernel is None or not absmax.is_contiguous():
        return None
    rows, cols = quant_state.shape
    out = workspace(rows * cols, dtype, packed.device).view(rows, cols)
    with torch.profiler.record_function("nanosft::dequantize_4bit"):
        kernel(ctypes.c_void_p(packed.data_ptr()), ctypes.c_void_p(absmax.data_ptr()),
               ctypes.c_void_p(out.data_ptr()), ctypes.c_longlong(quant_state.blocksize),
               ctypes.c_longlong(rows), ctypes.c_longlong(cols))
    return out


_held = threading.local()  # .weights: {(id(quant_state), dtype): (quant_state, W)} while held


@contextlib.contextmanager
def hold_dequantized():
    """Within the block each 4-bit weight is dequantized once per dtype, kept in its own tensor
    and reused by every later forward and backward (the base is frozen: the same values). A
    training step of several micro-batches dequantizes each weight once instead of twice per
    micro-batch, for the memory of every 4-bit weight in the compute dtype until the block ends
    (TrainingArguments.nf4_dequantize="per_step"). A block opened inside another starts empty
    and gives the outer one back when it ends."""
    outer, _held.weights = getattr(_held, "weights", None), {}
    try:
        yield _held.weights
    finally:
        _held.weights = outer


def held_bytes() -> int:
    """Bytes of the dequantized weights hold_dequantized() keeps now (0 outside it)."""
    held = getattr(_held, "weights", None) or {}
    return sum(w.numel() * w.element_size() for _, w in held.values())


def _dequantized(packed, quant_state, absmax, dtype):
    held = getattr(_held, "weights", None)
    if held is not None and (kept := held.get((id(quant_state), dtype))) is not None:
        return kept[1]
    if absmax is None:
        absmax = decoded_absmax(quant_state)
    out = dequantize_into_workspace(packed, quant_state, absmax, dtype)
    if out is None:  # another route: bitsandbytes' own call (a fresh tensor)
        out = _bnb().functional.dequantize_4bit(packed, quant_state).to(dtype)
    elif held is not None:  # its own copy: the workspace is rewritten by the next call
        out = out.clone()
    if held is not None:  # the state kept beside it, so its id names no other state meanwhile
        held[(id(quant_state), dtype)] = (quant_state, out)
    return out


def _is_held(quant_state, dtype) -> bool:
    held = getattr(_held, "weights", None)
    return held is not None and (id(quant_state), dtype) in held


class MatMul4bit(torch.autograd.Function):
    """x @ W^T + b with W dequantized into the workspace, forward and backward; the decoded
    absmax is kept from forward to backward. The same calls as bitsandbytes MatMul4Bit."""

    @staticmethod
    def forward(ctx, x, packed, bias, quant_state):
        # under hold_dequantized() a weight already held needs no absmax (decoded on demand)
        absmax = None if _is_held(quant_state, x.dtype) else decoded_absmax(quant_state)
        out = F.linear(x, _dequantized(packed, quant_state, absmax, x.dtype), bias)
        ctx.quant_state, ctx.absmax, ctx.packed = quant_state, absmax, packed
        return out

    @staticmethod
    def backward(ctx, grad):
        grad_x = None
        if ctx.needs_input_grad[0]:  # bnb: dequantize in the stored dtype, cast to grad's
            qs = ctx.quant_state
            weight = _dequantized(ctx.packed, qs, ctx.absmax, qs.dtype).to(grad.dtype)
            grad_x = torch.matmul(grad, weight)
        return grad_x, None, None, None


def matmul_4bit(x, packed, bias=None, quant_state=None):
    """bitsandbytes.matmul_4bit's result through MatMul4bit where its CPU kernel applies (a bias
    that trains, other devices, odd shapes: bitsandbytes' own call).
    Mirrors: bitsandbytes.matmul_4bit"""
    if (x.numel() == 0 or getattr(quant_state, "packing_format_for_cpu", False)
            or quant_state.shape[-1] != x.shape[-1] or (bias is not None and bias.requires_grad)
            or _kernel_for(packed, quant_state, x.dtype) is None
            or _kernel_for(packed, quant_state, quant_state.dtype) is None):
        return _bnb().matmul_4bit(x, packed, bias=bias, quant_state=quant_state)
    packed = packed.view(-1, 1)  # bnb's canonical [(out * in + 1) // 2, 1]
    if torch.is_grad_enabled() and x.requires_grad:
        return MatMul4bit.apply(x, packed, bias, quant_state)
    return F.linear(x, _dequantized(packed, quant_state, None, x.dtype), bias)

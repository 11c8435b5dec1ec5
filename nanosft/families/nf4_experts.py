"""NF4 expert weights, opt-in and beyond the peers (bitsandbytes' Linear4bit covers nn.Linear
only, so transformers + bitsandbytes QLoRA keeps the 3-D experts, most of an MoE model's bytes, in
the compute dtype). `quantize_experts(model)` stores each expert's (out, in) slice as its own NF4
tensor (blocks of 64 inside one expert, absmax double-quantized per expert: ~4.13 bits a weight),
dequantized only for the experts that got tokens, in forward and again in backward. gpt-oss's
transposed (in, out) slices are quantized as their transpose, Linear4bit's orientation; its
biases stay float. The 3-D names stay as zero-storage placeholders that LoRA's ParamWrapper finds
and parametrizes: expert e's weight is dequant(e) + placeholder[e]. QLoRA 2305.14314.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from nanosft.expert_lora import ParamWrapper
from nanosft.families.moe import Experts
from nanosft.nf4 import _bnb

BLOCKSIZE = 64  # NF4 values per absmax, as Linear4bit
NESTED_BLOCKSIZE = 256  # absmax values per second-level absmax (double quantization)
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


class NF4ExpertWeight:
    """One 3-D expert weight (E, out, in) as E NF4 tensors, stacked: packed codes (E, n / 2)
    uint8, two a byte; absmax (E, n / 64), uint8 codes when double-quantized, with absmax2
    (E, n / 64 / 256) fp32 and offset (E,); the NF4 and 8-bit code tables shared by all experts.
    Each expert holds the bytes bitsandbytes' quantize_4bit gives for that expert's slice alone."""

    def __init__(self, weight, compress_statistics=True):
        bnbF = _bnb().functional
        self.shape, self.dtype = tuple(weight.shape), weight.dtype
        self.nested = compress_statistics
        parts = [bnbF.quantize_4bit(w.detach().reshape(-1).contiguous(), blocksize=BLOCKSIZE,
                                    compress_statistics=compress_statistics, quant_type="nf4")
                 for w in weight]  # flattened: bnb's CPU kernel decodes 1-D for any `in`
        self.packed = torch.stack([packed.reshape(-1) for packed, _ in parts])
        self.absmax = torch.stack([state.absmax for _, state in parts])
        self.code = parts[0][1].code
        self.absmax2 = self.offset = self.code2 = None
        if compress_statistics:
            self.absmax2 = torch.stack([state.state2.absmax for _, state in parts])
            self.offset = torch.stack([state.offset for _, state in parts])
            self.code2 = parts[0][1].state2.code

    def tensors(self):
        """Every tensor the storage holds (what `nbytes` counts and `to` moves)."""
        return [t for t in (self.packed, self.absmax, self.code, self.absmax2, self.offset,
                            self.code2) if t is not None]

    def nbytes(self):
        """Bytes of codes plus quantization statistics."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def to(self, device):
        for name in ("packed", "absmax", "code", "absmax2", "offset", "code2"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.to(device))
        return self

    def quant_state(self, e):
        """bitsandbytes' QuantState of expert e (its slice of each statistic), 1-D shape."""
        bnbF = _bnb().functional
        state2 = None
        if self.nested:
            state2 = bnbF.QuantState(absmax=self.absmax2[e], code=self.code2,
                                     blocksize=NESTED_BLOCKSIZE, dtype=torch.float32)
        n = self.shape[1] * self.shape[2]
        return bnbF.QuantState(self.absmax[e], shape=torch.Size([n]), code=self.code,
                               blocksize=BLOCKSIZE, quant_type="nf4", dtype=self.dtype,
                               offset=None if self.offset is None else self.offset[e],
                               state2=state2)

    def dequantize(self, e):
        """Expert e's float weight (out, in), in the dtype it was quantized from.
        Mirrors: bitsandbytes.functional.dequantize_4bit (of that expert's codes)"""
        flat = _bnb().functional.dequantize_4bit(self.packed[e], self.quant_state(e))
        return flat.view(self.shape[1:])


def nf4_nbytes(shape, compress_statistics=True):
    """The bytes NF4ExpertWeight holds for a 3-D weight of `shape` (E, out, in), from shapes."""
    E, out, inp = shape
    blocks = math.ceil(out * inp / BLOCKSIZE)
    per_expert = math.ceil(out * inp / 2)  # two codes a byte
    shared = 16 * 4  # the NF4 code table, fp32
    if compress_statistics:  # uint8 absmax, fp32 absmax2 per 256 blocks, fp32 offset
        per_expert += blocks + 4 * math.ceil(blocks / NESTED_BLOCKSIZE) + 4
        shared += 256 * 4  # the 8-bit dynamic code table
    else:
        per_expert += 4 * blocks
    return E * per_expert + shared


class DequantizedLinear(torch.autograd.Function):
    """x @ W_e^T with W_e dequantized from NF4 in forward, and again in backward for the input's
    gradient; the frozen codes get none. Mirrors: bitsandbytes MatMul4Bit (one expert)"""

    @staticmethod
    def forward(ctx, x, weight, e):
        ctx.weight, ctx.e = weight, e
        return F.linear(x, weight.dequantize(e).to(x.dtype))

    @staticmethod
    def backward(ctx, grad):
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = grad @ ctx.weight.dequantize(ctx.e).to(grad.dtype)
        return grad_x, None, None


def placeholder(shape, dtype, device):
    """A frozen Parameter of `shape` that reads zero everywhere and holds one value (stride 0)."""
    zero = torch.zeros((), dtype=dtype, device=device)
    return nn.Parameter(zero.expand(shape), requires_grad=False)


class NF4Experts(Experts):
    """Experts whose 3-D weights live as NF4 codes (`nf4[name]`, each expert's (out, in) slice);
    `gate_up_proj` and `down_proj` are zero placeholders of the float shape and dtype, which
    LoRA's ParamWrapper parametrizes. The expert maths is the quantized module's own `expert`
    (Qwen3-MoE / GLM-4-MoE / Qwen3.5-MoE's SwiGLU, Gemma 4's GeGLU, gpt-oss's clamped one with
    its float biases).
    Differs: not in transformers or bitsandbytes (they keep 3-D experts in float).

    Args:
        experts: the float module to quantize: Experts ((E, out, in) slices, read by F.linear)
            or gpt-oss's (E, in, out) ones (`is_transposed`, x @ W[e]).
        compress_statistics: double-quantize each expert's absmax (QLoRA's double quantization).
    """

    def __init__(self, experts, compress_statistics=True):
        nn.Module.__init__(self)
        self.expert_class = type(experts)  # whose expert() this module runs
        self.is_transposed = getattr(experts, "is_transposed", False)  # ParamWrapper reads it
        for key, value in vars(experts).items():  # num_experts; gpt-oss's alpha and limit
            if not key.startswith("_") and key != "training":
                setattr(self, key, value)
        self.nf4 = {}
        for name, p in experts.named_parameters(recurse=False):  # in order: the same keys
            if name not in EXPERT_WEIGHTS:
                setattr(self, name, p)  # gpt-oss's biases stay float (and trainable)
                continue
            # gpt-oss's (in, out) slices are quantized as W[e]^T, the (out, in) slice nn.Linear
            # and Linear4bit hold: a block of 64 is one output's input weights (in % 64 == 0, as
            # gpt-oss's 2880), so its interleaved gate and up columns never share an absmax
            W = p.transpose(1, 2) if self.is_transposed else p
            self.nf4[name] = NF4ExpertWeight(W, compress_statistics)
            setattr(self, name, placeholder(p.shape, p.dtype, p.device))

    def linear(self, x, name, e):
        """x through dequant(W[e]) + D[e], D what `name` reads: the stride-0 zero placeholder
        (skipped), or a real tensor: LoRA's delta while ParamWrapper's forward parametrizes it,
        or a placeholder something materialized (deepcopy, a merge). x @ (Q + D)^T is computed as
        x @ Q^T + x @ D^T, so no float Q is kept for backward. D[e] is (in, out) for gpt-oss."""
        out = DequantizedLinear.apply(x, self.nf4[name], e)
        D = getattr(self, name)
        if any(D.stride()):  # an expanded zero has strides (0, 0, 0) and cannot be written to
            out = out + (x @ D[e] if self.is_transposed else F.linear(x, D[e]))
        return out

    def expert(self, x, e):
        """Expert e on its tokens, as the quantized module's class computes it: (n, C) -> (n, C)."""
        return self.expert_class.expert(self, x, e)

    def float_weight(self, name):
        """The dequantized 3-D weight `name` in the float module's layout and the placeholder's
        dtype (which follows model.to(dtype))."""
        weight = self.nf4[name]
        W = torch.stack([weight.dequantize(e) for e in range(self.num_experts)])
        W = W.transpose(1, 2).contiguous() if self.is_transposed else W
        return W.to(getattr(self, name).dtype)

    def dequantize(self):
        """A float module of the quantized class with the dequantized weights (for merging,
        saving in float); the other parameters (gpt-oss's biases) are shared, not copied."""
        experts = self.expert_class.__new__(self.expert_class)  # no __init__: no empty weights
        nn.Module.__init__(experts)
        for key, value in vars(self).items():
            if not key.startswith("_") and key not in ("training", "nf4", "expert_class",
                                                       "is_transposed"):
                setattr(experts, key, value)
        for name, p in self.named_parameters(recurse=False):
            if name in EXPERT_WEIGHTS:
                p = nn.Parameter(self.float_weight(name), requires_grad=False)
            setattr(experts, name, p)
        return experts

    def _apply(self, fn, recurse=True):
        # .to(device / dtype) re-expands each placeholder from its one value (converting the
        # expanded view would allocate the full shape); the NF4 tensors follow the device only;
        # the other parameters (gpt-oss's biases) move as in any module
        order = list(self._parameters)
        placeholders = {name: self._parameters.pop(name) for name in EXPERT_WEIGHTS}
        super()._apply(fn, recurse)
        for name, p in placeholders.items():
            value = fn(p.as_strided((), ()))
            self._parameters[name] = placeholder(p.shape, value.dtype, value.device)
            self.nf4[name].to(value.device)
        for name in order:  # the original order, so state-dict and parameter order are kept
            self._parameters[name] = self._parameters.pop(name)
        return self

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # the weights the forward uses, dequantized to float under the 3-D names: a saved model
        # loads in any float loader (transformers' too); quantize_experts again after loading
        super()._save_to_state_dict(destination, prefix, keep_vars)  # gpt-oss's biases
        for name in EXPERT_WEIGHTS:
            D = getattr(self, name)
            W = self.float_weight(name)
            destination[f"{prefix}{name}"] = W + D if any(D.stride()) else W

    def extra_repr(self):
        shapes = {name: w.shape for name, w in self.nf4.items()}
        return (f"{self.expert_class.__name__}, num_experts={self.num_experts}, nf4={shapes} "
                f"(out, in), blocksize={BLOCKSIZE}")


def _children(model):
    """(parent, child name, child) for every module of `model` below the top."""
    for parent in model.modules():
        for name, child in parent.named_children():
            yield parent, name, child


def quantize_experts(model, compress_statistics=True):
    """Store every Experts module's 3-D weights as NF4, per expert, in place; returns `model`.
    Call it after loading (e.g. with a 4-bit quantization_config) and before get_peft_model.
    Differs: beyond transformers + bitsandbytes, which keep 3-D experts in the compute dtype."""
    if any(isinstance(m, ParamWrapper) for m in model.modules()):
        raise ValueError("quantize_experts: the model already has LoRA on parameters "
                         "(ParamWrapper); call quantize_experts(model) before get_peft_model or "
                         "SFTTrainer(peft_config=...) wraps it")
    found = 0
    for parent, name, child in list(_children(model)):
        if not isinstance(child, Experts) or isinstance(child, NF4Experts):
            continue
        setattr(parent, name, NF4Experts(child, compress_statistics))
        found += 1
    if not found:
        raise ValueError(f"quantize_experts: {type(model).__name__} has no MoE experts to "
                         "quantize (families.moe.Experts); it applies to qwen3_moe, glm4_moe, "
                         "gpt_oss, qwen3_5_moe_text and gemma4_text with enable_moe_block")
    return model


def dequantize_experts(model):
    """Every NF4Experts back to float Experts (dequantized), in place, under any LoRA wrappers;
    returns `model`: a float model again (merge_and_unload and save_pretrained work on NF4 too)."""
    for parent, name, child in list(_children(model)):
        if isinstance(child, NF4Experts):
            setattr(parent, name, child.dequantize())
    return model


def experts_nbytes(model):
    """Bytes held by the expert weights of `model`: float parameters, or NF4 codes + statistics
    plus the placeholders' one value each."""
    total = 0
    for m in model.modules():
        if isinstance(m, NF4Experts):
            total += sum(w.nbytes() for w in m.nf4.values())
            total += sum(getattr(m, name).element_size() for name in EXPERT_WEIGHTS)
        elif isinstance(m, Experts):
            total += sum(getattr(m, name).numel() * getattr(m, name).element_size()
                         for name in EXPERT_WEIGHTS)
    return total

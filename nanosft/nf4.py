"""NF4 (4-bit NormalFloat) linear layers over the bitsandbytes kernels.

The frozen `base_layer` of walkthrough 2.7 (`result = self.base_layer(x)`): weights stored as
packed 4-bit codes with one absmax per 64-value block, optionally double-quantized, and
dequantized on the fly inside `bitsandbytes.matmul_4bit`. Paper: QLoRA (2305.14314) sections 2-3.
State-dict keys equal bitsandbytes/transformers' (`weight`, `weight.absmax`, `weight.quant_map`, ...).
"""

import copy
import logging

import bitsandbytes as bnb
import bitsandbytes.functional as bnbF
import torch
from torch import nn

logger = logging.getLogger(__name__)


def nf4_code_values(offset=0.9677083):
    """The 16 NF4 levels: normal quantiles, 8 positive and 7 negative plus an exact zero, scaled to [-1, 1].
    QLoRA 3 (NormalFloat) | Mirrors: bitsandbytes create_normal_map(use_extra_value=True)
    Differs: torch.special.ndtri instead of scipy's norm.ppf (same float64 quantiles)."""
    # quantile points are fp32 (torch.linspace), evaluated in float64, then rounded to fp32
    pos = torch.special.ndtri(torch.linspace(offset, 0.5, 9)[:-1].double())  # 8 values > 0
    neg = -torch.special.ndtri(torch.linspace(offset, 0.5, 8)[:-1].double())  # 7 values < 0
    v = torch.cat([neg, torch.zeros(1, dtype=torch.float64), pos]).float().sort().values
    return v / v.max()  # (16,) from -1.0 to 1.0


def bytes_per_parameter(layer):
    """Storage bytes per weight of a `Linear4bit`: packed codes plus every quantization statistic.
    QLoRA 3 (Double Quantization) | Mirrors: bitsandbytes QuantState.as_dict (what gets saved)"""
    qs = layer.quant_state
    tensors = [layer.weight, qs.absmax, qs.code]
    if qs.nested:  # uint8 absmax + fp32 absmax per 256 blocks + 8-bit code table + fp32 offset
        tensors += [qs.state2.absmax, qs.state2.code, qs.offset]
    total = sum(t.numel() * t.element_size() for t in tensors)
    return total / (layer.in_features * layer.out_features)


def cpu_kernels_decode(in_features, blocksize, device):
    """False where bitsandbytes' CPU dequantize kernel can decode wrongly: even rows not of whole blocks.
    hf-reference 6.4 | Mirrors: bitsandbytes backends/cpu dequantize_4bit (shape fallback)"""
    return torch.device(device).type != "cpu" or in_features % blocksize == 0 or in_features % 2 == 1


class Linear4bit(nn.Module):
    """A frozen linear layer whose weight lives as NF4 codes; forward dequantizes and matmuls.
    Walkthrough 2.7 base_layer | Mirrors: bitsandbytes.nn.Linear4bit, Params4bit
    Differs: quantizes at construction (not on `.to(device)`); the CPU eval repack is done on a copy."""

    def __init__(self, in_features, out_features, bias=True, compute_dtype=None, compress_statistics=True,
                 blocksize=64, quant_type="nf4", *, weight=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.compute_dtype, self.compute_type_is_set = compute_dtype, compute_dtype is not None
        self.compress_statistics, self.blocksize = compress_statistics, blocksize
        self.quant_type = quant_type
        init = torch.zeros(out_features) if bias else None
        if weight is None:  # nn.Linear's init, consuming the RNG as bnb's constructor does
            linear = nn.Linear(in_features, out_features, bias=bias)
            weight, init = linear.weight.data, linear.bias.data if bias else None
        if tuple(weight.shape) != (out_features, in_features):
            raise ValueError(f"Linear4bit: weight has shape {tuple(weight.shape)}, expected "
                             f"(out_features, in_features) = ({out_features}, {in_features})")
        # weight registered before bias, so state_dict order is bnb's: weight, bias, quant keys
        self.set_weight(weight)
        self.bias = nn.Parameter(init.to(weight.device)) if bias else None

    @classmethod
    def from_linear(cls, linear, compute_dtype=None, blocksize=64, compress_statistics=True):
        """Quantize an `nn.Linear` (weight and bias copied, no RNG consumed) into a new `Linear4bit`.
        Walkthrough 2.7 | Mirrors: transformers bnb loading (quantize_4bit of the checkpoint weight)"""
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, compute_dtype=compute_dtype,
                    compress_statistics=compress_statistics, blocksize=blocksize, weight=linear.weight.data)
        if linear.bias is not None:
            layer.bias = nn.Parameter(linear.bias.data.clone(), requires_grad=linear.bias.requires_grad)
        return layer

    def set_weight(self, weight):
        """Quantize a float [out, in] tensor into this layer (also used by LoRA merge to requantize).
        QLoRA 3 | Mirrors: bitsandbytes Params4bit._quantize"""
        if not cpu_kernels_decode(weight.shape[-1], self.blocksize, weight.device):
            raise ValueError(f"Linear4bit: in_features={weight.shape[-1]} is not a multiple of "
                             f"blocksize={self.blocksize}; bitsandbytes' CPU 4-bit kernels decode such rows wrongly "
                             "(blocks crossing rows). Use an in_features divisible by the blocksize, or keep this "
                             "layer in float (skip_modules).")
        packed, state = bnbF.quantize_4bit(weight.detach().contiguous(), blocksize=self.blocksize,
                                           compress_statistics=self.compress_statistics, quant_type=self.quant_type)
        # ((out*in+1)//2, 1) uint8: two 4-bit codes a byte, the first in the high nibble
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.quant_state, self._cpu_packed = state, None

    def dequantize(self):
        """Float weight [out, in] in the dtype it was quantized from (`quant_state.dtype`).
        QLoRA 3 | Mirrors: bitsandbytes.functional.dequantize_4bit"""
        return bnbF.dequantize_4bit(self.weight.data, self.quant_state)

    def _cpu_inference_weight(self):
        # bnb repacks its weight in place for an AVX512-BF16 kernel (bf16 absmax); we repack a copy
        # so dequantize(), DoRA and state_dict keep seeing the canonical layout.
        if self._cpu_packed is None:
            self._cpu_packed = bnbF._convert_weight_packed_for_cpu(self.weight.data.clone(),
                                                                   copy.deepcopy(self.quant_state))
        return self._cpu_packed

    def forward(self, x):
        """y = x W^T + b with W dequantized inside `bnb.matmul_4bit`; on CPU in eval without grad, bnb's bf16 kernel.
        Walkthrough 2.7 base_layer | Mirrors: bitsandbytes.nn.Linear4bit.forward"""
        weight, quant_state = self.weight, self.quant_state
        # CPU inference path (hf-reference 6.9): numerics differ from train mode. Its kernel packs
        # 32 output rows at a time; bnb asserts on other shapes, we keep the regular path instead.
        cpu_eval = x.device.type == "cpu" and not self.training and not x.requires_grad
        if cpu_eval and self.out_features % 32 == 0 and bnbF.has_avx512bf16():
            weight, quant_state = self._cpu_inference_weight()
        if not self.compute_type_is_set:  # first call fixes the compute dtype from the input
            if x.dtype in (torch.float32, torch.bfloat16):
                self.compute_dtype = x.dtype
            elif x.dtype == torch.float16 and self.compute_dtype in (None, torch.float32):
                logger.warning("Input type into Linear4bit is torch.float16, but compute_dtype is float32 "
                               "(default). This will lead to slow inference or training speed.")
            self.compute_type_is_set = True
        inp_dtype = x.dtype
        if self.compute_dtype is not None:
            x = x.to(self.compute_dtype)
        bias = self.bias
        if bias is not None and bias.dtype != x.dtype:
            bias.data = bias.data.to(x.dtype)  # bnb casts the stored bias in place, so do we
        return bnb.matmul_4bit(x, weight, bias=bias, quant_state=quant_state).to(inp_dtype)

    def _apply(self, fn, *args, **kwargs):
        # .to(device) moves weight and bias; the quant state's tensors must follow (bnb Params4bit.to)
        super()._apply(fn, *args, **kwargs)
        self.quant_state.to(self.weight.device)
        self._cpu_packed = None
        return self

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"quant_type={self.quant_type}, blocksize={self.blocksize}, "
                f"double_quant={self.compress_statistics}, compute_dtype={self.compute_dtype}")

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # weight (packed uint8) and bias, then the quant state under "weight.<key>" as bnb writes it
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for key, value in self.quant_state.as_dict(packed=True).items():
            destination[prefix + "weight." + key] = value if keep_vars else value.detach()

    def _load_from_state_dict(self, state_dict, prefix, *args):
        # a 4-bit checkpoint (packed weight + "weight.<quant key>"s) restores the bytes as saved; a float
        # [out, in] weight is quantized here, as bnb does when it meets a float checkpoint
        key = prefix + "weight"
        weight = state_dict.get(key)
        quant = {k[len(key) + 1 :]: v for k, v in state_dict.items() if k.startswith(key + ".")}
        if weight is not None and quant:
            self.quant_state = bnbF.QuantState.from_dict(quant, device=self.weight.device)
            self.weight = nn.Parameter(torch.empty_like(weight, device=self.weight.device), requires_grad=False)
            self._cpu_packed = None
            # torch would report the dotted quant keys as unexpected; they are consumed here
            state_dict = {k: v for k, v in state_dict.items() if not k.startswith(key + ".")}
        elif weight is not None and weight.is_floating_point():
            if tuple(weight.shape) != (self.out_features, self.in_features):
                raise ValueError(f"{key}: float checkpoint weight has shape {tuple(weight.shape)} but this "
                                 f"Linear4bit is ({self.out_features}, {self.in_features}); fix the model config")
            self.set_weight(weight.to(self.weight.device))
            # the default loader below now copies our own freshly quantized bytes
            state_dict = {**state_dict, key: self.weight.data}
        super()._load_from_state_dict(state_dict, prefix, *args)


def quantize_model(model, skip_modules=("lm_head",), compute_dtype=None, compress_statistics=True):
    """Swap every `nn.Linear` in `model` (in place) for a `Linear4bit`, except modules named in `skip_modules`.
    Walkthrough 2.1 (model loading) | Mirrors: transformers replace_with_bnb_linear"""
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            # exact type: subclasses such as MultiheadAttention's out_proj are read as .weight elsewhere
            if type(child) is not nn.Linear or child_name in skip_modules or full in skip_modules:
                continue
            if not cpu_kernels_decode(child.in_features, 64, child.weight.device):
                logger.warning("quantize_model: %s stays in float (in_features=%d, not a multiple of 64)",
                               full, child.in_features)
                continue
            setattr(module, child_name, Linear4bit.from_linear(child, compute_dtype=compute_dtype,
                                                               compress_statistics=compress_statistics))
    return model


def is_quantized(model):
    """True when any module of `model` is a `Linear4bit`.
    Walkthrough 2.1 | Mirrors: transformers `model.is_loaded_in_4bit`"""
    return any(isinstance(m, Linear4bit) for m in model.modules())

"""NF4 (4-bit NormalFloat): the format by hand in plain PyTorch; linear layers over bitsandbytes.

The frozen `base_layer` of walkthrough 2.7 (`result = self.base_layer(x)`). First the format itself,
written out: 16 levels at normal quantiles, one absmax per 64-value block, two codes a byte, the
absmax double-quantized to 8 bits (QLoRA 2305.14314, section 3). Then `Linear4bit`, which keeps
bitsandbytes' kernels for speed, `BitsAndBytesConfig` and `quantize_model`. State-dict keys equal
bitsandbytes/transformers' (`weight`, `weight.absmax`, `weight.quant_map`, ...). bitsandbytes is
imported only when a 4-bit layer is built or run: its import pulls in torch._dynamo (seconds).
"""

import dataclasses
import logging

import torch
import torch.nn.functional as F
from torch import nn

from nanosft.reference import fast_path

logger = logging.getLogger(__name__)


_bitsandbytes = None  # imported by the first 4-bit layer, then one lookup a call


def _bnb():
    global _bitsandbytes
    if _bitsandbytes is None:  # lazy: its import pulls in torch._dynamo (seconds)
        import bitsandbytes
        import bitsandbytes.functional  # noqa: F401 (bitsandbytes.functional below)

        _bitsandbytes = bitsandbytes
    return _bitsandbytes


# ----------------------------------------------------------------------------- NF4 by hand


def nf4_code_values(offset=0.9677083):
    """The 16 NF4 levels: normal quantiles, 8 positive, 7 negative and an exact zero, in [-1, 1].
    QLoRA 3 (NormalFloat) | Mirrors: bitsandbytes create_normal_map(use_extra_value=True)
    Differs: torch.special.ndtri instead of scipy's norm.ppf (same float64 quantiles)."""
    # 16 codes and a zero that must be exact: 9 quantiles on the positive side (one is the shared
    # zero) and 8 on the negative side. `offset` stands in for quantile 1, which is infinite.
    pos = torch.special.ndtri(torch.linspace(offset, 0.5, 9)[:-1].double())  # 8 values > 0
    neg = -torch.special.ndtri(torch.linspace(offset, 0.5, 8)[:-1].double())  # 7 values < 0
    v = torch.cat([neg, torch.zeros(1, dtype=torch.float64), pos]).float().sort().values
    return v / v.max()  # (16,) from -1.0 to 1.0


def dynamic_code_values():
    """bitsandbytes' signed 8-bit dynamic map: 0, 1 and, for 10^-6 .. 10^0, 2^i fraction levels
    of each sign (256 sorted values). Mirrors: bitsandbytes.functional.create_dynamic_map"""
    values = [torch.tensor([0.0, 1.0])]
    for i in range(7):  # exponent 10^(i-6); i + 1 bits are left for the fraction
        edges = torch.linspace(0.1, 1, 2**i + 1)
        mid = 10.0 ** (i - 6) * ((edges[:-1] + edges[1:]) / 2)
        values += [mid, -mid]
    return torch.cat(values).sort().values


def blockwise_scale(x, blocksize):
    """(x / absmax of its block) in [-1, 1] as (n_blocks, blocksize), and absmax (n_blocks,) fp32.
    Blocks run over the flattened tensor, so they cross rows. Mirrors: bitsandbytes quantize_4bit"""
    flat = x.detach().reshape(-1).float()
    n = flat.numel()
    blocks = F.pad(flat, (0, -n % blocksize)).view(-1, blocksize)  # zero-padded last block
    absmax = blocks.abs().amax(dim=1)
    safe = absmax.clamp(min=1e-38)  # an all-zero block scales to zeros, not NaN
    scaled = blocks * (1 / safe)[:, None]  # bnb multiplies by the reciprocal: same rounding
    if n % blocksize:  # ...but divides a last, partial block, and stores its clamped absmax
        scaled[-1], absmax[-1] = blocks[-1] / safe[-1], safe[-1]
    return scaled.clamp(-1, 1), absmax


def nearest_code(scaled, code):
    """Index of the nearest value of the sorted `code`: how many midpoints lie below (a tie goes
    to the lower one). Mirrors: bitsandbytes quantize_4bit (torch.bucketize on the midpoints)"""
    return torch.bucketize(scaled, (code[:-1] + code[1:]) / 2)


def quantize_nf4(weight, blocksize=64):
    """Blockwise NF4: (packed uint8 of shape ((n + 1) // 2, 1), absmax fp32 (n_blocks,)).
    QLoRA 3 | Mirrors: bitsandbytes.functional.quantize_4bit(quant_type="nf4") (same bytes)"""
    scaled, absmax = blockwise_scale(weight, blocksize)
    n = weight.numel()
    idx = nearest_code(scaled, nf4_code_values()).flatten()[: n + n % 2]  # odd n: pad code 7 (= 0)
    packed = idx[0::2] << 4 | idx[1::2]  # two codes a byte, the first in the high nibble
    return packed.to(torch.uint8)[:, None], absmax


def dequantize_nf4(packed, absmax, shape, blocksize=64, dtype=torch.float32):
    """code[index] * absmax of its block, in fp32, then cast to `dtype`; shape `shape`.
    QLoRA 3 | Mirrors: bitsandbytes.functional.dequantize_4bit"""
    b = packed.reshape(-1).long()
    idx = torch.stack([b >> 4, b & 0xF], dim=1).flatten()  # high nibble first
    n = torch.Size(shape).numel()
    out = nf4_code_values()[idx[:n]] * absmax.repeat_interleave(blocksize)[:n]
    return out.reshape(shape).to(dtype)


def double_quantize(absmax, blocksize=256):
    """8-bit codes of the absmax minus its mean: (codes uint8, absmax2 fp32 per 256, offset).
    QLoRA 3 (Double Quantization) | Mirrors: bitsandbytes quantize_4bit(compress_statistics=True)
    Differs: exact nearest code; bnb's CPU kernel takes the neighbour at a few near-ties."""
    offset = absmax.mean()  # absmax > 0: centring puts it in both halves of the signed map
    scaled, absmax2 = blockwise_scale(absmax - offset, blocksize)
    codes = nearest_code(scaled, dynamic_code_values()).flatten()[: absmax.numel()]
    return codes.to(torch.uint8), absmax2, offset


def dequantize_absmax(codes, absmax2, offset, blocksize=256):
    """The fp32 absmax back from its double quantization: map[code] * absmax2 + offset.
    QLoRA 3 | Mirrors: bitsandbytes dequantize_blockwise(...) + offset in dequantize_4bit"""
    scale = absmax2.repeat_interleave(blocksize)[: codes.numel()]
    return dynamic_code_values()[codes.long()] * scale + offset


# ----------------------------------------------------------------------------- the bnb layer


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
    """False where bitsandbytes' CPU dequantize kernel decodes wrongly: even rows of partial blocks.
    Mirrors: bitsandbytes backends/cpu dequantize_4bit (its reshape to (rows, cols / 2))"""
    if torch.device(device).type != "cpu":
        return True
    return in_features % blocksize == 0 or in_features % 2 == 1


class Linear4bit(nn.Module):
    """A frozen linear layer whose weight lives as NF4 codes; forward dequantizes and matmuls.
    bitsandbytes' layer: what 2.7's `self.base_layer(x)` runs. The walkthrough's
    `Linear4bit.forward` is peft's LoRA layer: lora.LoraLinear.forward.
    Mirrors: bitsandbytes.nn.Linear4bit, Params4bit
    Differs: quantizes at construction (not on `.to(device)`); on CPU, eval mode keeps dequantize +
    matmul where bnb repacks for its AVX512-BF16 kernel (other numerics than train mode)."""

    def __init__(self, in_features, out_features, bias=True, compute_dtype=None,
                 compress_statistics=True, blocksize=64, quant_type="nf4", *, weight=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.compute_dtype = compute_dtype
        self.compute_type_is_set = compute_dtype is not None
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
        """Quantize an `nn.Linear` (weight and bias copied, no RNG consumed) into a `Linear4bit`.
        Mirrors: transformers bnb loading (quantize_4bit of the weight)"""
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                    compute_dtype=compute_dtype, compress_statistics=compress_statistics,
                    blocksize=blocksize, weight=linear.weight.data)
        if linear.bias is not None:
            layer.bias = nn.Parameter(linear.bias.data.clone(),
                                      requires_grad=linear.bias.requires_grad)
        return layer

    def set_weight(self, weight):
        """Quantize a float [out, in] tensor into this layer (LoRA merge requantizes with it).
        QLoRA 3 | Mirrors: bitsandbytes Params4bit._quantize (quantize_4bit)
        Differs: in row chunks (same bytes), so loading a large weight needs little scratch."""
        if not cpu_kernels_decode(weight.shape[-1], self.blocksize, weight.device):
            raise ValueError(
                f"Linear4bit: in_features={weight.shape[-1]} is not a multiple of "
                f"blocksize={self.blocksize}; bitsandbytes' CPU 4-bit kernels decode such rows "
                "wrongly (blocks crossing rows). Use an in_features divisible by the blocksize, "
                "or keep this layer in float (skip_modules).")
        bnbF, w = _bnb().functional, weight.detach()
        # Row chunks of about 2^18 values hold whole blocks when in_features % blocksize == 0, so
        # they give one call's bytes while bnb's fp32 scratch (~26 B a value) stays a few MB.
        rows = max(1, 2**18 // w.shape[1]) if w.shape[1] % self.blocksize == 0 else len(w)
        parts = [bnbF.quantize_4bit(chunk.contiguous(), blocksize=self.blocksize,
                                    quant_type=self.quant_type) for chunk in w.split(rows)]
        absmax, offset, state2 = torch.cat([state.absmax for _, state in parts]), None, None
        if self.compress_statistics:  # double quantization, as bnb's quantize_4bit does it
            offset = absmax.mean()
            absmax, state2 = bnbF.quantize_blockwise(absmax - offset, blocksize=256)
        self.quant_state = bnbF.QuantState(
            absmax, shape=w.shape, code=parts[0][1].code, blocksize=self.blocksize,
            quant_type=self.quant_type, dtype=w.dtype, offset=offset, state2=state2)
        # ((out*in+1)//2, 1) uint8: two 4-bit codes a byte, the first in the high nibble
        self.weight = nn.Parameter(torch.cat([packed for packed, _ in parts]), requires_grad=False)

    def dequantize(self):
        """Float weight [out, in] in the dtype it was quantized from (`quant_state.dtype`).
        QLoRA 3 | Mirrors: bitsandbytes.functional.dequantize_4bit"""
        return _bnb().functional.dequantize_4bit(self.weight.data, self.quant_state)

    def forward(self, x):
        """y = x W^T + b, W dequantized inside `bnb.matmul_4bit`, in train and eval mode alike.
        What 2.7's `self.base_layer(x)` runs (2.7's forward is lora.LoraLinear.forward).
        Mirrors: bitsandbytes.nn.Linear4bit.forward
        Differs: no CPU inference repack: bnb's bf16 gemv changes the numerics against train
        mode, and without its optional `kernels` package it is slower than dequantize + matmul."""
        if not self.compute_type_is_set:  # first call fixes the compute dtype from the input
            if x.dtype in (torch.float32, torch.bfloat16):
                self.compute_dtype = x.dtype
            elif x.dtype == torch.float16 and self.compute_dtype in (None, torch.float32):
                logger.warning("Input type into Linear4bit is torch.float16, but compute_dtype is "
                               "float32 (default). This will lead to slow inference or training "
                               "speed.")
            self.compute_type_is_set = True
        inp_dtype = x.dtype
        if self.compute_dtype is not None:
            x = x.to(self.compute_dtype)
        bias = self.bias
        if bias is not None and bias.dtype != x.dtype:
            bias.data = bias.data.to(x.dtype)  # bnb casts the stored bias in place, so do we
        # speed path (nanosft.fast.nf4; off in reference mode): the same kernel, no fresh buffer
        matmul_4bit = fast_path("matmul_4bit") or _bnb().matmul_4bit
        out = matmul_4bit(x, self.weight, bias=bias, quant_state=self.quant_state)
        return out.to(inp_dtype)

    def _apply(self, fn, *args, **kwargs):
        # .to(device) moves weight and bias; the quant state's tensors must follow (Params4bit.to)
        super()._apply(fn, *args, **kwargs)
        self.quant_state.to(self.weight.device)
        return self

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, quant_type={self.quant_type}, "
                f"blocksize={self.blocksize}, double_quant={self.compress_statistics}, "
                f"compute_dtype={self.compute_dtype}")

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # weight (packed uint8) and bias, then the quant state under "weight.<key>" as bnb writes
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for key, value in self.quant_state.as_dict(packed=True).items():
            destination[prefix + "weight." + key] = value if keep_vars else value.detach()

    def _load_from_state_dict(self, state_dict, prefix, *args):
        # a 4-bit checkpoint (packed weight + "weight.<quant key>"s) restores the bytes as saved;
        # a float [out, in] weight is quantized here, as bnb does when it meets a float checkpoint
        key = prefix + "weight"
        weight = state_dict.get(key)
        quant = {k[len(key) + 1:]: v for k, v in state_dict.items() if k.startswith(key + ".")}
        if weight is not None and quant:
            qs_cls = _bnb().functional.QuantState
            self.quant_state = qs_cls.from_dict(quant, device=self.weight.device)
            self.weight = nn.Parameter(torch.empty_like(weight, device=self.weight.device),
                                       requires_grad=False)
            # torch would report the dotted quant keys as unexpected; they are consumed here
            state_dict = {k: v for k, v in state_dict.items() if not k.startswith(key + ".")}
        elif weight is not None and weight.is_floating_point():
            if tuple(weight.shape) != (self.out_features, self.in_features):
                raise ValueError(
                    f"{key}: float checkpoint weight has shape {tuple(weight.shape)} but this "
                    f"Linear4bit is ({self.out_features}, {self.in_features}); fix the config")
            self.set_weight(weight.to(self.weight.device))
            # the default loader below now copies our own freshly quantized bytes
            state_dict = {**state_dict, key: self.weight.data}
        super()._load_from_state_dict(state_dict, prefix, *args)


# ----------------------------------------------------------------------------- model level


@dataclasses.dataclass
class BitsAndBytesConfig:
    """4-bit loading options under transformers' names and defaults (fp4, no double quant, fp32
    compute); pass it to `CausalLM.from_pretrained(quantization_config=...)`.
    Mirrors: transformers BitsAndBytesConfig
    Differs: 4-bit only; uint8 storage only; skip patterns match names, not regexes."""

    load_in_4bit: bool = False
    load_in_8bit: bool = False
    llm_int8_threshold: float = 6.0
    llm_int8_skip_modules: list | None = None  # None: ["lm_head"], as transformers' default
    llm_int8_enable_fp32_cpu_offload: bool = False
    llm_int8_has_fp16_weight: bool = False
    bnb_4bit_compute_dtype: torch.dtype | str | None = None  # None: torch.float32
    bnb_4bit_quant_type: str = "fp4"
    bnb_4bit_use_double_quant: bool = False
    bnb_4bit_quant_storage: torch.dtype | str | None = None  # None: torch.uint8

    def __post_init__(self):
        from nanosft.io import hub  # the files layer below: imported on use

        def refuse(field, fix):
            raise ValueError(f"BitsAndBytesConfig: {field}={getattr(self, field)!r} is not "
                             f"supported; {fix}")

        if self.load_in_8bit:
            refuse("load_in_8bit", "nanosft quantizes to 4 bits: use load_in_4bit=True")
        if not self.load_in_4bit:
            refuse("load_in_4bit", "set load_in_4bit=True, or pass no quantization_config")
        if self.bnb_4bit_quant_type not in ("nf4", "fp4"):
            refuse("bnb_4bit_quant_type", 'use "nf4" (QLoRA) or "fp4"')
        if hub.torch_dtype(self.bnb_4bit_quant_storage or torch.uint8,
                           "bnb_4bit_quant_storage") != torch.uint8:
            refuse("bnb_4bit_quant_storage", 'use "uint8" (packed codes, two a byte)')
        self.bnb_4bit_quant_storage = torch.uint8
        self.bnb_4bit_compute_dtype = hub.torch_dtype(self.bnb_4bit_compute_dtype or torch.float32,
                                                      "bnb_4bit_compute_dtype")
        for field in ("llm_int8_enable_fp32_cpu_offload", "llm_int8_has_fp16_weight"):
            if getattr(self, field):
                refuse(field, "it is an 8-bit option with no 4-bit meaning here: leave it False")

    @classmethod
    def from_any(cls, config):
        """Ours from ours, a dict (config.json's quantization_config) or any object with
        transformers' attribute names (e.g. transformers.BitsAndBytesConfig)."""
        if isinstance(config, cls):
            return config
        names = [f.name for f in dataclasses.fields(cls)]
        if isinstance(config, dict):
            return cls(**{k: config[k] for k in names if k in config})
        return cls(**{k: getattr(config, k) for k in names if hasattr(config, k)})

    def quantizes(self, name, weight, tied_lm_head=False):
        """Whether the linear `name` with this float weight becomes 4-bit: not matched by a skip
        pattern (full name, dotted suffix or enclosing module), not a tied lm_head (that is the
        embedding), and rows the CPU kernels decode (else it stays float, with a warning)."""
        patterns = ["lm_head"] if self.llm_int8_skip_modules is None else self.llm_int8_skip_modules
        if (tied_lm_head and name == "lm_head") or any(
                name == p or name.endswith("." + p) or name.startswith(p + ".") for p in patterns):
            return False
        if not cpu_kernels_decode(weight.shape[1], 64, weight.device):
            logger.warning("from_pretrained: %s stays in float (in_features=%d, not a multiple "
                           "of 64)", name, weight.shape[1])
            return False
        return True

    def quantize(self, weight, bias=None):
        """A `Linear4bit` holding `weight` (already in the load dtype) and `bias` as given.
        Mirrors: transformers Bnb4BitHfQuantizer (quantize_4bit per weight)"""
        layer = Linear4bit(weight.shape[1], weight.shape[0], bias=False,
                           compute_dtype=self.bnb_4bit_compute_dtype,
                           compress_statistics=self.bnb_4bit_use_double_quant,
                           quant_type=self.bnb_4bit_quant_type, weight=weight)
        layer.bias = bias
        return layer


def quantize_model(model, skip_modules=("lm_head",), compute_dtype=None, compress_statistics=True):
    """Swap every `nn.Linear` in `model` (in place) for a `Linear4bit`, except `skip_modules`.
    Mirrors: transformers replace_with_bnb_linear"""
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            # exact type: subclasses such as MultiheadAttention's out_proj are read elsewhere
            if type(child) is not nn.Linear or child_name in skip_modules or full in skip_modules:
                continue
            if not cpu_kernels_decode(child.in_features, 64, child.weight.device):
                logger.warning("quantize_model: %s stays in float (in_features=%d, not a "
                               "multiple of 64)", full, child.in_features)
                continue
            layer = Linear4bit.from_linear(child, compute_dtype=compute_dtype,
                                           compress_statistics=compress_statistics)
            setattr(module, child_name, layer)
    return model


def is_quantized(model):
    """True when any module of `model` is a `Linear4bit`.
    Mirrors: transformers `model.is_loaded_in_4bit`"""
    return any(isinstance(m, Linear4bit) for m in model.modules())

"""LoRA, rsLoRA and DoRA adapters around a frozen linear (`nn.Linear` or `nanosft.nf4.Linear4bit`).

`LoraLinear.forward` reads like walkthrough 2.7 (`Linear4bit.forward`) line by line: the base
output, the defensive clone, the loop over active adapters, `lora_B(lora_A(dropout(x))) * scaling`,
and the DoRA branch reusing `base_result`. Init, merge, dtype casts and the mixed-adapter batch
follow peft 0.21.2 (LoRA on embeddings and convolutions: lora_layers.py). Beside them, the other
layers and settings a LoRA run puts on the base model: `ModulesToSaveWrapper` (a config's
`modules_to_save`: a trained full copy) and `prepare_model_for_kbit_training` (QLoRA's base:
frozen, fp32 outside the 4-bit layers).
Papers: LoRA (2106.09685), rsLoRA (2312.03732), QLoRA (2305.14314), DoRA (2402.09353).
"""

import copy
import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from nanosft.adapter_files import INIT_LORA_WEIGHTS, PeftWarning
from nanosft.alora import alora_delta
from nanosft.nf4 import Linear4bit, is_quantized
from nanosft.reference import fast_path


def _fan_in_fan_out(base_layer):
    # transformers' Conv1D (GPT-2) stores its weight (in, out), the transpose of nn.Linear's
    return type(base_layer).__name__ == "Conv1D" and hasattr(base_layer, "nf")


def base_weight(base_layer):
    """Float weight [out, in] of a base layer: dequantized (a new tensor) for `Linear4bit`,
    transposed for transformers' Conv1D, else the parameter itself.
    Mirrors: peft dequantize_module_weight, transpose(weight, fan_in_fan_out)"""
    if isinstance(base_layer, Linear4bit):
        return base_layer.dequantize()
    return base_layer.weight.T if _fan_in_fan_out(base_layer) else base_layer.weight


def set_base_weight(base_layer, weight):
    """Write a float [out, in] weight back: requantize a `Linear4bit` (lossy), else copy it in.
    Mirrors: peft bnb Linear4bit.merge (Params4bit(w_data).to(device))"""
    if isinstance(base_layer, Linear4bit):
        base_layer.set_weight(weight)  # quantized in weight.dtype, as peft's Params4bit(w_data) is
    else:
        weight = weight.T if _fan_in_fan_out(base_layer) else weight
        base_layer.weight.data = weight.contiguous().to(base_layer.weight.dtype)


def dora_weight_norm(weight, lora_weight, scaling):
    """||W + scaling * B A|| per output row (the DoRA paper's column norm of W^T), shape [out].
    DoRA 4.1 | Mirrors: peft DoraLinearLayer.get_weight_norm"""
    weight = weight + scaling * lora_weight
    return torch.linalg.norm(weight, dim=1).to(weight.dtype)


def warn_lora_bias_without_bias(base_layer, lora_bias):
    """lora_B's bias can train on a base without bias, but never be merged: say so up front.
    Mirrors: peft LoraLayer.update_layer (its PeftWarning)"""
    if lora_bias and getattr(base_layer, "bias", None) is None:
        warnings.warn(f"`lora_bias=True` was passed but the targeted layer of type "
                      f"{type(base_layer).__name__} has no bias. This means that merging LoRA "
                      "weights won't be possible.", PeftWarning)


def adapters_to_merge(layer, adapter_names=None):
    """The adapters a merge folds in: the named (or active) ones not merged yet; warns, as peft,
    when some or all already are. Mirrors: peft check_adapters_to_merge"""
    names = layer.active_adapters if adapter_names is None else adapter_names
    if isinstance(names, str):
        raise TypeError("merge: adapter_names must be a list of names, got the string "
                        f"{names!r}")
    if layer.merged:
        names = [n for n in names if n not in layer.merged_adapters]
        if names:
            merged = ",".join(layer.merged_adapters)
            warnings.warn(f"Already following adapters were merged {merged}. You are now "
                          f"additionally merging {','.join(names)}.")
        else:
            warnings.warn("All adapters are already merged, nothing to do.")
    return names


class DoraMagnitude(nn.Module):
    """DoRA's magnitude m (`.weight`, [out]); calling it returns the term added to the base output.
    What 2.7's DoRA branch calls as `self.lora_magnitude_vector[active_adapter](...)`.
    Mirrors: peft DoraLinearLayer.forward"""

    def __init__(self, weight_norm):
        super().__init__()
        self.weight = nn.Parameter(weight_norm)

    def forward(self, x, *, lora_A, lora_B, scaling, base_layer, base_result=None):
        """The DoRA term (B, T, out) turning `base_result` into m / ||W + s B A|| * (W x + s B A x).
        Mirrors: peft DoraLinearLayer.forward"""
        # B @ A through the modules on an identity, as peft does: (in, in) -> (in, out) -> T
        A = lora_A.weight
        eye = torch.eye(A.shape[1], device=A.device, dtype=A.dtype)
        lora_weight = lora_B(lora_A(eye)).T.to(x.dtype)  # (out, in)
        weight = base_weight(base_layer).to(x.dtype)  # 4-bit: dequantized again on every call
        # DoRA 4.3: "treat ||V + dV||_c as a constant", so the norm gets no gradient
        weight_norm = dora_weight_norm(weight, lora_weight.detach(), scaling).detach()
        mag_norm_scale = (self.weight / weight_norm).view(1, -1)  # (1, out)
        # no dropout here: x is already dropped (or dropout is identity)
        lora_result = lora_B(lora_A(x))
        if base_result is not None:
            if base_layer.bias is not None:
                base_result = base_result - base_layer.bias  # W x without the bias
        else:
            base_result = F.linear(x, weight)
        # total = base + this = m / ||W + sBA|| * (W x + s B A x) + bias
        return (mag_norm_scale - 1) * base_result + mag_norm_scale * lora_result * scaling


class AdapterLinear(nn.Linear):
    """lora_A / lora_B: an nn.Linear (same init, keys, checks as peft's adapters). Outside reference
    mode, where torch has no bf16 GEMM on this CPU, its bf16 products run as fp32 GEMMs
    (nanosft.fast.lora.bf16_adapter_linear): QLoRA trains bf16 adapters (TRL casts them).
    Mirrors: peft's nn.Linear adapters"""

    def forward(self, x):
        if (speed_path := fast_path("bf16_adapter_linear")) is not None:  # None in reference mode
            if (out := speed_path(self, x)) is not None:
                return out
        return super().forward(x)


def peft_repr(module, name, first_line=""):
    """The module's print under peft's name for its layer, `lora.<name>(...)`, so a printed model
    reads as peft's does. Mirrors: peft's LoRA layers' __repr__"""
    body = nn.Module.__repr__(module)[len(type(module).__name__) + 1:]
    return f"lora.{name}({first_line}{body}"


class LoraLinear(nn.Module):
    """A frozen base linear plus low-rank adapters by name: y = base(x) + B(A(dropout(x))) * s.
    This is the walkthrough's `Linear4bit` of 2.7 (peft's LoRA layer; over a float base, its
    `Linear`), not nf4.Linear4bit, which is its base_layer.
    Walkthrough 2.7 | Mirrors: peft lora.Linear and lora.bnb.Linear4bit (LoraLayer)
    Differs: one class for float and 4-bit bases; DoRA merge takes the unmerged weight on a copy;
    adapter_layer_names lists only the dicts this layer has."""

    # the per-adapter dicts: of trainable weights, and of settings (peft's names for the two)
    adapter_layer_names = ("lora_A", "lora_B", "lora_magnitude_vector")
    other_param_names = ("r", "lora_alpha", "scaling", "lora_dropout", "use_rslora", "use_dora",
                         "lora_bias")

    def __init__(self, base_layer, adapter_name="default", r=8, lora_alpha=8, lora_dropout=0.0,
                 use_rslora=False, use_dora=False, init_lora_weights=True, lora_bias=False,
                 use_alora=False):
        super().__init__()
        fan_in_fan_out = _fan_in_fan_out(base_layer)
        # a subclass registered for another module type (_register_custom_module) wraps any
        # module with in_features and out_features
        custom = type(self) is not LoraLinear and hasattr(base_layer, "out_features")
        if not isinstance(base_layer, (nn.Linear, Linear4bit)) and not (fan_in_fan_out or custom):
            raise TypeError(f"LoraLinear: base_layer must be nn.Linear, nanosft.nf4.Linear4bit or "
                            f"transformers' Conv1D, got {type(base_layer).__name__}")
        self.base_layer = base_layer
        self.fan_in_fan_out = fan_in_fan_out  # peft sets it for Conv1D, warning if unset
        if fan_in_fan_out:
            self.in_features, self.out_features = base_layer.weight.shape  # stored (in, out)
        else:
            self.in_features = base_layer.in_features
            self.out_features = base_layer.out_features
        # per-adapter modules and settings, keyed by adapter name
        self.lora_A = nn.ModuleDict()
        self.lora_B = nn.ModuleDict()
        self.lora_dropout = nn.ModuleDict()
        self.lora_magnitude_vector = nn.ModuleDict()
        self.r = {}
        self.lora_alpha = {}
        self.scaling = {}
        self.use_rslora = {}
        self.use_dora = {}
        self.lora_bias = {}
        self.use_alora = {}  # aLoRA adapters (nanosft.alora): active from an invocation on
        self.merged_adapters = []
        self.active_adapters = [adapter_name]
        self.disable_adapters = False
        self._dora_merged_norm = {}  # weight norms cached at merge time, needed to unmerge DoRA
        self.update_layer(adapter_name, r, lora_alpha, lora_dropout, use_rslora, use_dora,
                          init_lora_weights, lora_bias, use_alora)

    @property
    def merged(self):
        """True while an adapter is folded into the base weight.
        Mirrors: peft BaseTunerLayer.merged"""
        return bool(self.merged_adapters)

    def _all_available_adapter_names(self):
        """Every adapter this layer holds, sorted. Mirrors: peft _all_available_adapter_names"""
        return sorted(self.r)

    @property
    def weight(self):
        """The base layer's weight, for code reading `q_proj.weight`. Mirrors: peft .weight"""
        return self.base_layer.weight

    @property
    def bias(self):
        """The base layer's bias. Mirrors: peft BaseTunerLayer.bias"""
        return self.base_layer.bias

    def get_base_layer(self):
        """The wrapped frozen layer (2.7: `base_layer=self.get_base_layer()`).
        Mirrors: peft BaseTunerLayer.get_base_layer"""
        return self.base_layer

    def __repr__(self):
        return peft_repr(self, "Linear")

    def update_layer(self, adapter_name, r, lora_alpha, lora_dropout=0.0, use_rslora=False,
                     use_dora=False, init_lora_weights=True, lora_bias=False, use_alora=False):
        """Add adapter `adapter_name`: A and B (B zero by default: it starts as the identity),
        scaling, DoRA's m. Mirrors: peft LoraLayer.update_layer,
        reset_lora_parameters, DoraLinearVariant.init"""
        if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
            raise ValueError(f"LoraLinear adapter {adapter_name!r}: r (the LoRA rank) must be a "
                             f"positive int, got r={r!r}; pass e.g. r=8")
        if init_lora_weights not in INIT_LORA_WEIGHTS:
            raise ValueError(f"LoraLinear adapter {adapter_name!r}: init_lora_weights="
                             f"{init_lora_weights!r} is not implemented; use True (peft's "
                             "default), False, 'gaussian' or 'orthogonal'")
        if init_lora_weights == "orthogonal" and r % 2:
            raise ValueError("Orthogonal initialization requires the LoRA rank to be even, got "
                             f"{r} instead.")
        warn_lora_bias_without_bias(self.base_layer, lora_bias)
        self.r[adapter_name] = r
        self.lora_alpha[adapter_name] = lora_alpha
        dropout = nn.Dropout(p=lora_dropout) if lora_dropout > 0.0 else nn.Identity()
        self.lora_dropout[adapter_name] = dropout
        # RNG order as peft: A's constructor init, B's constructor init, then A is drawn again below
        self.lora_A[adapter_name] = AdapterLinear(self.in_features, r, bias=False)
        self.lora_B[adapter_name] = AdapterLinear(r, self.out_features, bias=lora_bias)
        self.scaling[adapter_name] = lora_alpha / math.sqrt(r) if use_rslora else lora_alpha / r
        self.use_rslora[adapter_name] = use_rslora
        self.use_dora[adapter_name] = use_dora
        self.lora_bias[adapter_name] = lora_bias
        self.use_alora[adapter_name] = use_alora
        if init_lora_weights == "orthogonal":
            self.orthogonal_init(adapter_name)
        else:
            self.reset_lora_parameters(adapter_name, init_lora_weights)
        # to the base's device, and its dtype if floating (4-bit uint8 weights leave fp32 adapters)
        w = self.base_layer.weight
        dtype = w.dtype if w.dtype.is_floating_point else None
        for d in (self.lora_A, self.lora_B):
            d[adapter_name] = d[adapter_name].to(device=w.device, dtype=dtype)
        if use_dora:
            magnitude = DoraMagnitude(self._dora_init_norm(adapter_name))
            self.lora_magnitude_vector[adapter_name] = magnitude
        self.set_adapter(self.active_adapters)

    def reset_lora_parameters(self, adapter_name, init_lora_weights=True):
        """True: A ~ Kaiming-uniform(a=sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in)), B = 0.
        "gaussian": A ~ N(0, 1/r), B = 0. False: both keep nn.Linear's init, so the adapter does
        not start as the identity (for tests).
        Mirrors: peft LoraLayer.reset_lora_parameters"""
        if init_lora_weights is False:
            return
        A = self.lora_A[adapter_name].weight
        if init_lora_weights == "gaussian":
            nn.init.normal_(A, std=1 / self.r[adapter_name])
        else:
            nn.init.kaiming_uniform_(A, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B[adapter_name].weight)
        if self.lora_B[adapter_name].bias is not None:
            nn.init.zeros_(self.lora_B[adapter_name].bias)

    def orthogonal_init(self, adapter_name):
        """A and B from the odd and even rows of one random orthogonal r x r matrix, so B A = 0
        while neither is zero. Mirrors: peft LoraLayer.orthogonal_init (its draws, in its order)"""
        r = self.r[adapter_name]
        Q, _ = torch.linalg.qr(torch.randn(r, r))
        A = torch.randn(self.in_features, r // 2).mm(Q[0::2, :]).T / 10.0
        B = torch.randn(r // 2, self.out_features).T.mm(Q[1::2, :]) / 10.0
        dtype = self.base_layer.weight.dtype
        dtype = dtype if dtype.is_floating_point else A.dtype
        self.lora_A[adapter_name].weight = nn.Parameter(A.contiguous().to(dtype))
        self.lora_B[adapter_name].weight = nn.Parameter(B.contiguous().to(dtype))

    @torch.no_grad()
    def _dora_init_norm(self, name):
        # m starts as ||W + s B A||_row: the row norms of W (dequantized for 4-bit) when B = 0
        A, B = self.lora_A[name].weight, self.lora_B[name].weight
        half = A.dtype == torch.float16  # peft computes B @ A of fp16 adapters in fp32
        lora_weight = B.float() @ A.float() if half else B @ A
        weight = base_weight(self.base_layer).to(A.device)
        if hasattr(weight, "full_tensor"):  # split by a tp_plan (a DTensor): the whole rows' norm
            weight = weight.full_tensor()
        lora_weight = lora_weight.half() if half else lora_weight
        return dora_weight_norm(weight, lora_weight, self.scaling[name])

    def set_adapter(self, adapter_names):
        """Make `adapter_names` the active adapters; only their parameters require grad.
        Mirrors: peft BaseTunerLayer.set_adapter"""
        names = [adapter_names] if isinstance(adapter_names, str) else list(adapter_names)
        for layer in (self.lora_A, self.lora_B, self.lora_magnitude_vector):
            for key, module in layer.items():
                module.requires_grad_(key in names)
        self.active_adapters = names

    def enable_adapters(self, enabled):
        """Switch all adapters on (the active ones trainable again) or off (all frozen).
        Mirrors: peft BaseTunerLayer.enable_adapters"""
        if enabled:
            self.set_adapter(self.active_adapters)
        else:
            for layer in (self.lora_A, self.lora_B, self.lora_magnitude_vector):
                layer.requires_grad_(False)
        self.disable_adapters = not enabled

    def get_delta_weight(self, adapter_name):
        """The adapter's weight update B @ A * scaling, [out, in] (CPU fp16/bf16: product in fp32).
        Mirrors: peft lora.Linear.get_delta_weight"""
        A, B = self.lora_A[adapter_name].weight, self.lora_B[adapter_name].weight
        upcast = A.device.type == "cpu" and A.dtype in (torch.float16, torch.bfloat16)
        delta = (B.float() @ A.float() if upcast else B @ A) * self.scaling[adapter_name]
        return delta.to(A.dtype)

    def _merged_weight(self, name, weight):
        # LoRA: W + dW.  DoRA: m / ||W0 + dW|| * (W + dW), the norm taken on the unmerged W0, cached
        delta = self.get_delta_weight(name)
        if not self.use_dora[name]:
            return weight + delta
        norm = dora_weight_norm(self._unmerged_base_weight(), delta, 1).detach()
        self._dora_merged_norm[name] = norm
        factor = (self.lora_magnitude_vector[name].weight / norm).view(-1, 1)
        return (factor * (weight + delta)).to(weight.dtype)

    def _unmerged_weight(self, name, weight):
        delta = self.get_delta_weight(name)
        if not self.use_dora[name]:
            return weight - delta.to(weight.dtype)
        magnitude = self.lora_magnitude_vector[name].weight
        factor = (magnitude / self._dora_merged_norm[name]).view(-1, 1)
        return (weight / factor - delta).to(weight.dtype)

    def _unmerged_base_weight(self):
        # the base weight with every merged adapter taken out again, computed on a copy
        weight = base_weight(self.base_layer).detach().clone()
        for name in reversed(self.merged_adapters):
            weight = self._unmerged_weight(name, weight)
        return weight

    @torch.no_grad()
    def merge(self, safe_merge=False, adapter_names=None):
        """Fold adapters into the base weight (4-bit: dequantize, add, requantize: slightly lossy);
        safe_merge: check the merged weight is finite before writing it.
        Mirrors: peft lora.Linear.merge, lora.bnb.Linear4bit.merge"""
        if not isinstance(safe_merge, bool):  # merge("default"): the name went to safe_merge
            raise TypeError("merge: adapter_names must be a list of names passed by keyword, "
                            f"got {safe_merge!r} as safe_merge")
        names = adapters_to_merge(self, adapter_names)
        if any(self.use_alora.get(n) for n in names):
            raise NotImplementedError("aLoRA does not support merging.")
        for name in [n for n in names if n in self.lora_A]:
            weight = self._merged_weight(name, base_weight(self.base_layer).clone())
            if safe_merge and not torch.isfinite(weight).all():
                raise ValueError(f"NaNs detected in the merged weights. The adapter {name} seems "
                                 "to be broken")
            bias = self.lora_B[name].bias
            if bias is not None:
                if self.base_layer.bias is None:
                    raise RuntimeError("Impossible to merge LoRA with `lora_bias=True` because "
                                       "the base layer has no bias.")
                self.base_layer.bias.data += (bias * self.scaling[name]).to(bias.dtype)
            set_base_weight(self.base_layer, weight)
            self.merged_adapters.append(name)

    @torch.no_grad()
    def unmerge(self):
        """Take merged adapters out of the base weight again, last merged first.
        What 2.7's disable_adapters branch calls. Mirrors: peft lora.Linear.unmerge"""
        if not self.merged:
            warnings.warn("LoraLinear.unmerge: already unmerged, nothing to do.")
            return
        while self.merged_adapters:
            name = self.merged_adapters.pop()
            weight = self._unmerged_weight(name, base_weight(self.base_layer))
            set_base_weight(self.base_layer, weight)
            self._dora_merged_norm.pop(name, None)
            if self.lora_B[name].bias is not None:
                self.base_layer.bias.data -= self.lora_B[name].bias * self.scaling[name]

    def delete_adapter(self, adapter_name):
        """Drop one adapter's modules and settings; a deleted active adapter hands over to the
        remaining ones (or the first left, by name). Mirrors: peft BaseTunerLayer.delete_adapter"""
        for attr in self.adapter_layer_names + self.other_param_names + ("use_alora",):
            if adapter_name in getattr(self, attr, {}):  # (use_alora: LoraLinear's own)
                getattr(self, attr).pop(adapter_name)
        if adapter_name in self.active_adapters:
            remaining = [n for n in self.active_adapters if n != adapter_name]
            if not remaining and len(self.lora_A):
                remaining = [sorted(self.lora_A)[0]]
            self.set_adapter(remaining)

    def _check_forward_args(self, x, adapter_names):
        if x.shape[-1] != self.in_features:
            raise ValueError(f"LoraLinear: input x has shape {tuple(x.shape)} but the layer "
                             f"expects last dim in_features={self.in_features}")
        if adapter_names is None:
            return
        if len(adapter_names) != len(x):
            raise ValueError("Length of `adapter_names` should be the same as the number of "
                             f"inputs, but got {len(adapter_names)} and {len(x)} respectively: "
                             f"adapter_names has {len(adapter_names)} entries but x has "
                             f"{len(x)} rows; give one adapter name (or '__base__') per row")
        if self.merged:
            raise ValueError("Cannot pass `adapter_names` when there are merged adapters, please "
                             "call `unmerge_adapter` first.")
        dora = sorted({n for n in adapter_names if self.use_dora.get(n, False)})
        if dora:
            raise ValueError(f"Cannot pass `adapter_names` when DoRA is enabled. (DoRA adapters "
                             f"{dora}: mixed batches support LoRA only.)")

    @staticmethod
    def _cast_input_dtype(x, dtype):
        return x if x.dtype == dtype else x.to(dtype)

    def _mixed_batch_forward(self, x, adapter_names, alora_offsets=None):
        """Row i gets adapter adapter_names[i]'s delta ("__base__": none). Mirrors: peft
        LoraLayer._mixed_batch_forward. Differs: the base output is cloned (peft adds rows in place
        into bnb's MatMul4Bit view, which autograd refuses); adapters run in first-seen order
        (peft: set order; rows are disjoint, so the sums agree); DoRA adapters are refused."""
        result = self.base_layer(x).clone()  # the 2.7 path's defensive clone
        for name in dict.fromkeys(adapter_names):  # unique names, first-seen order
            if name == "__base__" or name not in self.lora_A:
                continue
            rows = [i for i, n in enumerate(adapter_names) if n == name]
            lora_A = self.lora_A[name]
            lora_B = self.lora_B[name]
            requires_conversion = not torch.is_autocast_enabled()
            if requires_conversion:
                expected_dtype = result.dtype
                x = self._cast_input_dtype(x, lora_A.weight.dtype)
            if self.use_alora[name]:  # its rows' offsets only
                offsets = None if alora_offsets is None else [alora_offsets[i] for i in rows]
                result[rows] = alora_delta(x[rows], result[rows], lora_A, lora_B,
                                           self.lora_dropout[name], self.scaling[name], offsets)
                continue
            output = lora_B(lora_A(self.lora_dropout[name](x[rows]))) * self.scaling[name]
            if requires_conversion:
                output = output.to(expected_dtype)
            result[rows] += output
        return result

    def forward(self, x, adapter_names=None, alora_offsets=None):
        """Base output plus each active adapter's (DoRA-scaled) low-rank update (or per-row ones;
        aLoRA adapters: on each row's last alora_offsets[i] positions only).
        Walkthrough 2.7 | Mirrors: peft lora.bnb.Linear4bit.forward, lora.Linear.forward
        Differs: DoRA's dropped input stays in a local `x_dora` (peft 0.21.2; the walkthrough
        rebinds x); casts as peft 0.21.2: DoRA adds, then casts; a float base casts at the end."""
        self._check_forward_args(x, adapter_names)
        if self.disable_adapters:  # "if self.disable_adapters: if self.merged: self.unmerge()"
            if self.merged:
                self.unmerge()
            return self.base_layer(x)
        if adapter_names is not None:  # "elif adapter_names is not None: _mixed_batch_forward"
            return self._mixed_batch_forward(x, adapter_names, alora_offsets)
        if self.merged:  # "elif self.merged": the deltas already live in the base weight
            return self.base_layer(x)
        result = self.base_layer(x)  # "result = self.base_layer(x, *args, **kwargs)"
        # speed path (nanosft.fast.lora; off in reference mode): the loop's sum without the clone
        if any(self.use_alora.get(n) for n in self.active_adapters):  # not a full-sequence sum
            return self._alora_forward(x, result, alora_offsets)
        if (add_lora := fast_path("add_lora")) is not None:
            if (fused := add_lora(self, x, result)) is not None:
                return fused
        # peft's 4-bit layer casts back after every adapter; its float layer (lora.Linear) adds in
        # the adapters' dtype and casts once, at the end
        cast_each = isinstance(self.base_layer, Linear4bit)
        if cast_each:  # "As per Tim Dettmers, for 4bit, we need to defensively clone here"
            result = result.clone()
        torch_result_dtype = result.dtype
        for active_adapter in self.active_adapters:  # "for active_adapter in self.active_adapters:"
            if active_adapter not in self.lora_A:
                continue
            lora_A = self.lora_A[active_adapter]
            lora_B = self.lora_B[active_adapter]
            dropout = self.lora_dropout[active_adapter]
            scaling = self.scaling[active_adapter]
            # no device argument: this asks about CUDA autocast only, so on CPU it is always True
            requires_conversion = not torch.is_autocast_enabled()
            if requires_conversion:
                expected_dtype = result.dtype
                x = self._cast_input_dtype(x, lora_A.weight.dtype)
            if not self.use_dora[active_adapter]:
                # speed path (nanosft.fast; off in reference mode): fp32 throughout, the same sum
                # with B's product added into result by one addmm
                if (lora_addmm := fast_path("lora_addmm")) is not None:
                    fused = lora_addmm(result, x, lora_A, lora_B, dropout, scaling)
                    if fused is not None:
                        result = fused
                        continue
                # (B, T, in) -> (B, T, r) -> (B, T, out)
                output = lora_B(lora_A(dropout(x))) * scaling
                if requires_conversion and cast_each:
                    output = output.to(expected_dtype)  # cast, then add
                result = result + output
            else:
                # reuse the base output when dropout cannot change x; else W x is recomputed
                if isinstance(dropout, nn.Identity) or not self.training:
                    x_dora = x
                    base_result = result
                else:
                    x_dora = dropout(x)  # "x = dropout(x)", kept local: later adapters get x
                    base_result = None
                output = self.lora_magnitude_vector[active_adapter](
                    x_dora, lora_A=lora_A, lora_B=lora_B, scaling=scaling,
                    base_layer=self.get_base_layer(), base_result=base_result)
                result = result + output  # in fp32 when the adapters are fp32
                if requires_conversion and cast_each:
                    result = result.to(expected_dtype)  # add, then cast (peft's DoRA variant)
        return result.to(torch_result_dtype)


    def _alora_forward(self, x, result, alora_offsets):
        # aLoRA adapters change only the positions from the invocation on; others as usual
        dtype = result.dtype
        for name in [n for n in self.active_adapters if n in self.lora_A]:
            lora_A, lora_B = self.lora_A[name], self.lora_B[name]
            dropout, scaling = self.lora_dropout[name], self.scaling[name]
            if self.use_alora[name]:
                result = alora_delta(x, result, lora_A, lora_B, dropout, scaling, alora_offsets)
            else:
                result = result + lora_B(lora_A(dropout(x.to(lora_A.weight.dtype)))) * scaling
        return result.to(dtype)


class ModulesToSaveWrapper(nn.Module):
    """Keeps the frozen `original_module`; trains a full copy under `modules_to_save.<adapter>`.
    Attributes it lacks (`weight`, `bias`, ...) are read from the active copy, or from the
    original when adapters are off or none of its copies is active.
    Mirrors: peft ModulesToSaveWrapper (AuxiliaryTrainingWrapper)"""

    adapter_layer_names = ("modules_to_save",)
    other_param_names = ()

    def __init__(self, module, adapter_name, trainable=True, tied_weight=None):
        super().__init__()
        # containers have no forward to wrap; an adapter layer is trained by its own adapter
        containers = (nn.ModuleDict, nn.ModuleList, nn.ParameterDict, nn.ParameterList)
        if isinstance(module, containers) or isinstance(getattr(module, "lora_A", None),
                                                        nn.ModuleDict):
            raise TypeError(f"modules_to_save cannot be applied to modules of type "
                            f"{module.__class__}: name a module with a forward of its own in "
                            "modules_to_save (e.g. one entry of the container)")
        self.original_module = module.requires_grad_(False)
        self.modules_to_save = nn.ModuleDict()
        self._active_adapter = adapter_name  # a name, or None: none of its copies is active
        self.disable_adapters = False
        self.update(adapter_name, trainable, tied_weight)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)  # its own modules and parameters
        except AttributeError:
            pass
        if "_modules" not in self.__dict__:  # not built yet: no recursion into the lookups below
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
        if self.disable_adapters or not self.active_adapters:
            return getattr(self.original_module, name)
        if self._active_adapter in self.modules_to_save:
            return getattr(self.modules_to_save[self._active_adapter], name)
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def update(self, adapter_name, trainable=True, tied_weight=None):
        """Add a trained copy for `adapter_name`; `tied_weight`: the copy reads that weight (the
        embedding's trained copy, for a tied LM head). Mirrors: peft ModulesToSaveWrapper.update"""
        memo = {id(self.original_module.weight): tied_weight} if tied_weight is not None else {}
        trained_copy = copy.deepcopy(self.original_module, memo).requires_grad_(trainable)
        self.modules_to_save[adapter_name] = trained_copy
        if adapter_name != self._active_adapter:
            trained_copy.requires_grad_(False)

    @property
    def active_adapter(self):
        """The active adapter's name; None when none of this wrapper's copies is active."""
        return self._active_adapter

    @property
    def active_adapters(self):
        """The active adapter as a list ([] for none). Mirrors: peft
        AuxiliaryTrainingWrapper.active_adapters"""
        return [] if self._active_adapter is None else [self._active_adapter]

    def set_adapter(self, adapter_names, inference_mode=False):
        """Use (and train) the copy of the one active adapter this wrapper holds; none active
        when it holds none of them. Mirrors: peft ModulesToSaveWrapper.set_adapter, _set_adapter"""
        names = [adapter_names] if isinstance(adapter_names, str) else list(adapter_names)
        held = [n for n in names if n in self.modules_to_save]
        if len(held) > 1:
            raise ValueError("Only one adapter can be set at a time for ModulesToSaveWrapper, "
                             f"got {held}")
        for key, module in self.modules_to_save.items():
            module.requires_grad_(key in held and not inference_mode)
        self._active_adapter = held[0] if held else None

    def enable_adapters(self, enabled):
        """Off: the original module runs. Mirrors: peft ModulesToSaveWrapper.enable_adapters"""
        if enabled:
            self.set_adapter(self.active_adapters)
        else:
            self.modules_to_save.requires_grad_(False)
        self.disable_adapters = not enabled

    def delete_adapter(self, adapter_name, new_active_adapters=None):
        """Drop one trained copy; the new active adapters' copy (if held) takes over.
        Mirrors: peft ModulesToSaveWrapper.delete_adapter"""
        if adapter_name not in self.modules_to_save:
            return
        del self.modules_to_save[adapter_name]
        self.set_adapter(new_active_adapters or [])

    def _active_module(self):
        if self.disable_adapters or self._active_adapter not in self.modules_to_save:
            return self.original_module
        return self.modules_to_save[self._active_adapter]

    def forward(self, *args, **kwargs):
        """Run the active trained copy (the original when disabled or none is active).
        Mirrors: peft ModulesToSaveWrapper.forward"""
        return self._active_module()(*args, **kwargs)


def prepare_model_for_kbit_training(model, use_gradient_checkpointing=True,
                                    gradient_checkpointing_kwargs=None, auto_clear_cache=True):
    """Freeze everything, upcast fp16/bf16 (non-4-bit) params to fp32; 4-bit: checkpointing on.
    auto_clear_cache: hand the CUDA allocator's cache of the half-precision copies back.
    Mirrors: peft prepare_model_for_kbit_training (an opt-in step TRL skips)"""
    kwargs = gradient_checkpointing_kwargs or {}
    for p in model.parameters():
        p.requires_grad = False
        if p.dtype in (torch.float16, torch.bfloat16):  # norms, embeddings, lm_head; not NF4 codes
            p.data = p.data.float()
    if auto_clear_cache and torch.cuda.is_available():
        torch.cuda.empty_cache()
    if is_quantized(model) and use_gradient_checkpointing:
        if kwargs.get("use_reentrant", True):  # else no grad reaches the frozen embeddings' output
            model.enable_input_require_grads()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model

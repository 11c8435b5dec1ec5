"""LoRA and DoRA on the other module types peft wraps: `nn.Embedding` (LoraEmbedding),
`nn.Conv1d/2d/3d` (LoraConv) and, LoRA only, `nn.MultiheadAttention` (LoraMultiheadAttention), with
the same adapter surface as lora.LoraLinear (adapters keyed by name, merge / unmerge, active and
disabled adapters). Not on the walkthrough's path, whose 2.7 is
LoraLinear.forward: kept here so lora.py reads beside it.
Papers: LoRA (2106.09685), DoRA (2402.09353).
"""

import contextlib
import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from nanosft.lora import (
    AdapterLinear, DoraMagnitude, LoraLinear, adapters_to_merge, peft_repr,
    warn_lora_bias_without_bias)


class LoraEmbedding(nn.Module):
    """A frozen nn.Embedding plus low-rank adapters: y = E[x] + (A^T[x] @ B^T) * s, with
    `lora_embedding_A` [r, num_embeddings] (zeros) and `lora_embedding_B` [dim, r] (normal), so the
    adapter starts as the identity; DoRA scales each output channel by m / ||E^T + s B A||.
    Mirrors: peft lora.Embedding, DoraEmbeddingLayer"""

    adapter_layer_names = ("lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")
    other_param_names = ("r", "lora_alpha", "scaling", "lora_dropout", "use_dora")

    def __init__(self, base_layer, adapter_name="default", r=8, lora_alpha=8, lora_dropout=0.0,
                 use_rslora=False, init_lora_weights=True, use_dora=False, lora_bias=False):
        super().__init__()
        self.base_layer = base_layer
        self.in_features = base_layer.num_embeddings
        self.out_features = base_layer.embedding_dim
        self.lora_embedding_A = nn.ParameterDict()
        self.lora_embedding_B = nn.ParameterDict()
        self.lora_dropout = nn.ModuleDict()
        self.lora_magnitude_vector = nn.ModuleDict()
        self.r, self.lora_alpha, self.scaling, self.use_dora = {}, {}, {}, {}
        self._dora_merged_norm = {}
        self.merged_adapters = []
        self.active_adapters = [adapter_name]
        self.disable_adapters = False
        self.update_layer(adapter_name, r, lora_alpha, lora_dropout, use_rslora, init_lora_weights,
                          use_dora, lora_bias)

    merged = LoraLinear.merged
    weight = LoraLinear.weight
    get_base_layer = LoraLinear.get_base_layer
    _all_available_adapter_names = LoraLinear._all_available_adapter_names

    def update_layer(self, adapter_name, r, lora_alpha, lora_dropout=0.0, use_rslora=False,
                     init_lora_weights=True, use_dora=False, lora_bias=False):
        """Add adapter `adapter_name`. Mirrors: peft lora.Embedding.update_layer"""
        if lora_bias:  # peft names the layer class; here the base's, as nn.Embedding is wrapped
            raise ValueError(f"lora_bias={lora_bias} is not supported for "
                             f"{type(self.base_layer).__name__}: the embedding adapter has no "
                             "bias; set lora_bias=False or leave this layer out of target_modules")
        self.r[adapter_name] = r
        self.lora_alpha[adapter_name] = lora_alpha
        self.use_dora[adapter_name] = use_dora
        self.lora_dropout[adapter_name] = (nn.Dropout(p=lora_dropout) if lora_dropout > 0.0
                                           else nn.Identity())
        w = self.base_layer.weight
        A = torch.randn(r, self.in_features, device=w.device, dtype=w.dtype)
        B = torch.randn(self.out_features, r, device=w.device, dtype=w.dtype)
        self.lora_embedding_A[adapter_name] = nn.Parameter(A)
        self.lora_embedding_B[adapter_name] = nn.Parameter(B)
        self.scaling[adapter_name] = lora_alpha / math.sqrt(r) if use_rslora else lora_alpha / r
        if init_lora_weights:  # peft: A zeros, B normal (the reverse of Linear's), whatever
            # init was asked for ("gaussian", "orthogonal" included)
            nn.init.zeros_(self.lora_embedding_A[adapter_name])
            nn.init.normal_(self.lora_embedding_B[adapter_name])
        if use_dora:  # m starts as the per-channel norm of E^T + s B A
            with torch.no_grad():
                norm = self._dora_norm(adapter_name, self.base_layer.weight)
            self.lora_magnitude_vector[adapter_name] = DoraMagnitude(norm)
        self.set_adapter(self.active_adapters)

    def _dora_norm(self, name, weight, delta=None):
        # ||E^T + s B A|| per embedding channel, [dim] (peft's get_weight_norm, fan_in_fan_out)
        if delta is None:
            delta = self.get_delta_weight(name)  # (num_embeddings, dim), scaling included
        return torch.linalg.norm(weight.T + delta.T, dim=1).to(weight.dtype)

    def set_adapter(self, adapter_names):
        """Activate `adapter_names`; only their A and B require grad. Mirrors: peft set_adapter"""
        names = [adapter_names] if isinstance(adapter_names, str) else list(adapter_names)
        for d in (self.lora_embedding_A, self.lora_embedding_B):
            for key, p in d.items():
                p.requires_grad_(key in names)
        for key, m in self.lora_magnitude_vector.items():
            m.requires_grad_(key in names)
        self.active_adapters = names

    def enable_adapters(self, enabled):
        """Switch all adapters on or off. Mirrors: peft BaseTunerLayer.enable_adapters"""
        if enabled:
            self.set_adapter(self.active_adapters)
        else:
            for d in (self.lora_embedding_A, self.lora_embedding_B, self.lora_magnitude_vector):
                d.requires_grad_(False)
        self.disable_adapters = not enabled

    def get_delta_weight(self, adapter_name):
        """(B @ A)^T * scaling, [num_embeddings, dim].
        Mirrors: peft lora.Embedding.get_delta_weight"""
        A = self.lora_embedding_A[adapter_name]
        B = self.lora_embedding_B[adapter_name]
        return (B @ A).T * self.scaling[adapter_name]

    @torch.no_grad()
    def merge(self, safe_merge=False, adapter_names=None):
        """Add the active adapters' deltas to the embedding table. Mirrors: peft Embedding.merge"""
        names = adapters_to_merge(self, adapter_names)
        for name in [n for n in names if n in self.lora_embedding_A]:
            delta = self.get_delta_weight(name)
            weight = self.base_layer.weight.data + delta
            if self.use_dora[name]:  # m / ||E0^T + dW^T|| per channel, the norm cached to unmerge
                norm = self._dora_norm(name, self.base_layer.weight.data, delta).detach()
                self._dora_merged_norm[name] = norm
                weight = (self.lora_magnitude_vector[name].weight / norm).view(1, -1) * weight
            if safe_merge and not torch.isfinite(weight).all():
                raise ValueError(f"NaNs detected in the merged weights. The adapter {name} seems "
                                 "to be broken")
            self.base_layer.weight.data = weight.to(self.base_layer.weight.dtype)
            self.merged_adapters.append(name)

    @torch.no_grad()
    def unmerge(self):
        """Subtract merged deltas again, last first. Mirrors: peft lora.Embedding.unmerge"""
        if not self.merged:
            warnings.warn("Already unmerged. Nothing to do.")
        while self.merged_adapters:
            name = self.merged_adapters.pop()
            weight = self.base_layer.weight.data
            if self.use_dora[name]:
                norm = self._dora_merged_norm.pop(name)
                weight = weight / (self.lora_magnitude_vector[name].weight / norm).view(1, -1)
            weight = weight - self.get_delta_weight(name)
            self.base_layer.weight.data = weight.to(self.base_layer.weight.dtype)

    def delete_adapter(self, adapter_name):
        """Drop one adapter. Mirrors: peft BaseTunerLayer.delete_adapter"""
        for attr in self.adapter_layer_names + self.other_param_names:
            if adapter_name in getattr(self, attr):
                getattr(self, attr).pop(adapter_name)
        if adapter_name in self.active_adapters:
            remaining = [n for n in self.active_adapters if n != adapter_name]
            if not remaining and len(self.lora_embedding_A):
                remaining = [sorted(self.lora_embedding_A)[0]]
            self.set_adapter(remaining)

    def _embed_scale(self, dtype):
        """The factor a scaled embedding (Gemma 3's) multiplies its rows by inside its own forward:
        base_layer(x) carries it, so the adapter's rows take it too (None: no such factor).
        Mirrors: peft BaseTunerLayer._get_embed_scale"""
        scale = getattr(self.base_layer, "embed_scale", None)
        if isinstance(scale, (int, float)):
            return torch.tensor(scale, dtype=dtype, device=self.base_layer.weight.device)
        if isinstance(scale, torch.Tensor) and scale.numel() == 1:
            return scale.to(dtype)
        if scale is not None:
            warnings.warn(f"Found embed_scale attribute with shape {tuple(scale.shape)}, expected "
                          "scalar. Embedding scaling will not be applied to the LoRA rows.")
        return None

    def _scaled(self, rows):
        scale = self._embed_scale(rows.dtype)
        return rows if scale is None else rows * scale

    def _embed(self, x, weight):
        base = self.base_layer  # the base's padding_idx, max_norm, ... as peft passes them
        return F.embedding(x, weight, padding_idx=base.padding_idx, max_norm=base.max_norm,
                           norm_type=base.norm_type, scale_grad_by_freq=base.scale_grad_by_freq,
                           sparse=base.sparse)

    def __repr__(self):
        return peft_repr(self, "Embedding")

    def forward(self, x, adapter_names=None):
        """Base rows plus each active adapter's low-rank rows.
        Mirrors: peft lora.Embedding.forward"""
        if self.disable_adapters:
            if self.merged:
                self.unmerge()
            return self.base_layer(x)
        result = self.base_layer(x)
        if adapter_names is not None:  # one adapter per row ("__base__": none)
            for name in dict.fromkeys(adapter_names):
                if name in self.lora_embedding_A:
                    rows = [i for i, n in enumerate(adapter_names) if n == name]
                    after_A = self._embed(x[rows], self.lora_embedding_A[name].T)
                    delta = self._scaled(after_A @ self.lora_embedding_B[name].T
                                         * self.scaling[name])
                    result[rows] = result[rows] + delta.to(result.dtype)
            return result
        if self.merged:
            return result
        result_dtype = result.dtype
        for name in self.active_adapters:
            if name not in self.lora_embedding_A:
                continue
            after_A = self._embed(x, self.lora_embedding_A[name].T)  # (B, T, r)
            lora_result = (after_A @ self.lora_embedding_B[name].T) * self.scaling[name]
            if not self.use_dora[name]:
                lora_result = self._scaled(lora_result)
                result = result + lora_result
                continue
            # DoRA 4.3: the norm is a constant (no gradient); m / ||.|| scales base and update alike
            A, B = self.lora_embedding_A[name], self.lora_embedding_B[name]
            delta = ((B @ A).T * self.scaling[name]).detach()
            norm = self._dora_norm(name, self.base_layer.weight, delta).detach()
            mag_norm_scale = self.lora_magnitude_vector[name].weight / norm  # (dim,)
            # (the scale after the norm, as peft: the norm is of the unscaled table)
            result = mag_norm_scale * result + self._scaled(mag_norm_scale * lora_result)
        return result.to(result_dtype)


class LoraConv(nn.Module):
    """A frozen nn.Conv1d / Conv2d / Conv3d plus low-rank adapters: lora_A a conv of the base's
    kernel, stride and padding into r channels, lora_B a 1x..x1 conv back out; y = base(x) +
    B(A(dropout(x))) * s; DoRA scales each output channel by m / ||W + s B A||.
    Mirrors: peft lora.Conv1d / Conv2d / Conv3d (_ConvNd), _DoraConvNdLayer"""

    def __init__(self, base_layer, adapter_name="default", r=8, lora_alpha=8, lora_dropout=0.0,
                 use_rslora=False, init_lora_weights=True, lora_bias=False, use_dora=False):
        super().__init__()
        if r % base_layer.groups:
            raise ValueError(f"Targeting a {type(base_layer).__name__} with groups="
                             f"{base_layer.groups} and rank {r}. Currently, support is limited to "
                             "conv layers where the rank is divisible by groups. Either choose a "
                             "different rank or do not target this specific layer.")
        self.base_layer = base_layer
        self.in_features = base_layer.in_channels
        self.out_features = base_layer.out_channels
        self.lora_A = nn.ModuleDict()
        self.lora_B = nn.ModuleDict()
        self.lora_dropout = nn.ModuleDict()
        self.lora_magnitude_vector = nn.ModuleDict()
        self.r, self.lora_alpha, self.scaling, self.use_dora, self.lora_bias = {}, {}, {}, {}, {}
        self.use_rslora = {}
        self._dora_merged_norm = {}
        self.merged_adapters = []
        self.active_adapters = [adapter_name]
        self.disable_adapters = False
        self.update_layer(adapter_name, r, lora_alpha, lora_dropout, use_rslora, init_lora_weights,
                          lora_bias, use_dora)

    adapter_layer_names = LoraLinear.adapter_layer_names
    other_param_names = LoraLinear.other_param_names
    merged = LoraLinear.merged
    weight = LoraLinear.weight
    bias = LoraLinear.bias
    get_base_layer = LoraLinear.get_base_layer
    _all_available_adapter_names = LoraLinear._all_available_adapter_names
    set_adapter = LoraLinear.set_adapter
    enable_adapters = LoraLinear.enable_adapters
    delete_adapter = LoraLinear.delete_adapter
    reset_lora_parameters = LoraLinear.reset_lora_parameters

    def update_layer(self, adapter_name, r, lora_alpha, lora_dropout=0.0, use_rslora=False,
                     init_lora_weights=True, lora_bias=False, use_dora=False):
        """Add adapter `adapter_name` (A: the base's kernel into r channels; B: 1x1 out).
        Mirrors: peft _ConvNd.update_layer"""
        base = self.base_layer
        if init_lora_weights not in (True, False, "gaussian"):  # peft's reset_lora_parameters
            raise ValueError(f"Unknown initialization init_lora_weights={init_lora_weights!r} "
                             f"for a LoRA {type(base).__name__}; use True, False or 'gaussian'")
        warn_lora_bias_without_bias(base, lora_bias)
        conv = type(base)
        ones = (1,) * (base.weight.dim() - 2)
        self.r[adapter_name] = r
        self.lora_alpha[adapter_name] = lora_alpha
        self.lora_dropout[adapter_name] = (nn.Dropout(p=lora_dropout) if lora_dropout > 0.0
                                           else nn.Identity())
        # RNG order as peft: A's constructor init, B's, then A drawn again
        self.lora_A[adapter_name] = conv(self.in_features, r, base.kernel_size, base.stride,
                                         base.padding, bias=False)
        self.lora_B[adapter_name] = conv(r, self.out_features, ones, ones, groups=base.groups,
                                         bias=lora_bias)
        self.scaling[adapter_name] = lora_alpha / math.sqrt(r) if use_rslora else lora_alpha / r
        self.use_rslora[adapter_name] = use_rslora
        self.use_dora[adapter_name] = use_dora
        self.lora_bias[adapter_name] = lora_bias
        self.reset_lora_parameters(adapter_name, init_lora_weights)
        for d in (self.lora_A, self.lora_B):
            d[adapter_name] = d[adapter_name].to(base.weight.device, base.weight.dtype)
        if use_dora:  # m starts as ||W + s B A|| per output channel, shaped (1, out, 1, ...)
            with torch.no_grad():
                norm = self._dora_norm(base.weight, self._lora_weight(adapter_name),
                                       self.scaling[adapter_name])
            self.lora_magnitude_vector[adapter_name] = DoraMagnitude(norm)
        self.set_adapter(self.active_adapters)

    def _lora_weight(self, name):
        # B A as a kernel shaped like W (B is 1x..x1): peft's get_lora_weight for convolutions
        A, B = self.lora_A[name].weight, self.lora_B[name].weight
        r = A.shape[0]
        return (B.reshape(-1, r) @ A.reshape(r, -1)).reshape(self.base_layer.weight.shape)

    @staticmethod
    def _dora_norm(weight, lora_weight, scaling):
        # ||W + s B A|| over all but the output channel, as (1, out, 1, ...)
        weight = weight + scaling * lora_weight
        dims = tuple(range(1, weight.dim()))
        return weight.norm(p=2, dim=dims, keepdim=True).transpose(1, 0)

    def _dora_factor(self, name, norm):
        view = (-1,) + (1,) * (self.base_layer.weight.dim() - 1)
        return (self.lora_magnitude_vector[name].weight / norm).view(*view)

    def get_delta_weight(self, adapter_name):
        """B * A as one kernel, shaped like the base weight, times scaling.
        Mirrors: peft _ConvNd.get_delta_weight"""
        A, B = self.lora_A[adapter_name].weight, self.lora_B[adapter_name].weight
        upcast = A.device.type == "cpu" and A.dtype in (torch.float16, torch.bfloat16)
        A, B = (A.float(), B.float()) if upcast else (A, B)
        if self.base_layer.weight.shape[2:] == (1,) * (A.dim() - 2):  # 1x1: a matrix product
            flat = B.flatten(1) @ A.flatten(1)
            delta = flat.reshape(*flat.shape, *A.shape[2:])
        else:  # compose the two convolutions: A's kernel through B's 1x1 mixing
            conv_fn = (F.conv1d, F.conv2d, F.conv3d)[A.dim() - 3]
            delta = conv_fn(A.transpose(0, 1), B).transpose(0, 1)
        return (delta * self.scaling[adapter_name]).to(self.lora_A[adapter_name].weight.dtype)

    @torch.no_grad()
    def merge(self, safe_merge=False, adapter_names=None):
        """Add the deltas to the base kernel. Mirrors: peft _ConvNd.merge"""
        if self.base_layer.groups > 1:
            raise NotImplementedError("Merging is not supported for _ConvNd layers with "
                                      "groups > 1!")
        names = adapters_to_merge(self, adapter_names)
        for name in [n for n in names if n in self.lora_A]:
            if self.lora_B[name].bias is not None and self.base_layer.bias is None:
                raise RuntimeError("Impossible to merge LoRA with `lora_bias=True` because the "
                                   "base layer has no bias.")
            delta = self.get_delta_weight(name)
            weight = self.base_layer.weight.data + delta
            if self.use_dora[name]:  # m / ||W0 + dW|| per channel; the norm cached to unmerge
                norm = self._dora_norm(self.base_layer.weight.data, delta, 1).detach()
                self._dora_merged_norm[name] = norm
                weight = self._dora_factor(name, norm) * weight
            if safe_merge and not torch.isfinite(weight).all():
                raise ValueError(f"NaNs detected in the merged weights. The adapter {name} seems "
                                 "to be broken")
            self.base_layer.weight.data = weight.to(self.base_layer.weight.dtype)
            if self.lora_B[name].bias is not None:
                self.base_layer.bias.data += self.lora_B[name].bias * self.scaling[name]
            self.merged_adapters.append(name)

    @torch.no_grad()
    def unmerge(self):
        """Subtract the merged deltas, last first. Mirrors: peft _ConvNd.unmerge"""
        if not self.merged:
            warnings.warn("Already unmerged. Nothing to do.")
        while self.merged_adapters:
            name = self.merged_adapters.pop()
            weight = self.base_layer.weight.data
            if self.use_dora[name]:
                weight = weight / self._dora_factor(name, self._dora_merged_norm.pop(name))
            weight = weight - self.get_delta_weight(name)
            self.base_layer.weight.data = weight.to(self.base_layer.weight.dtype)
            if self.lora_B[name].bias is not None:
                self.base_layer.bias.data -= self.lora_B[name].bias * self.scaling[name]

    def __repr__(self):
        return peft_repr(self, type(self.base_layer).__name__)

    def forward(self, x, adapter_names=None):
        """Base output plus each active adapter's low-rank convolution.
        Mirrors: peft _ConvNd.forward"""
        if self.disable_adapters:
            if self.merged:
                self.unmerge()
            return self.base_layer(x)
        if self.merged:
            return self.base_layer(x)
        result = self.base_layer(x)
        result_dtype = result.dtype
        for name in self.active_adapters:
            if name not in self.lora_A:
                continue
            lora_A = self.lora_A[name]
            lora_B = self.lora_B[name]
            dropout = self.lora_dropout[name]
            scaling = self.scaling[name]
            x_in = x.to(lora_A.weight.dtype)
            if not self.use_dora[name]:
                result = result + lora_B(lora_A(dropout(x_in))) * scaling
                continue
            result = result + self._dora_term(name, x_in, result, lora_A, lora_B, dropout, scaling)
        return result.to(result_dtype)

    def _dora_term(self, name, x, result, lora_A, lora_B, dropout, scaling):
        # (m / ||W + s B A|| - 1) * W x + m / ||.|| * s B A x, the norm a constant (DoRA 4.3)
        base = self.base_layer
        norm = self._dora_norm(base.weight, self._lora_weight(name).detach(), scaling).detach()
        mag_norm_scale = self.lora_magnitude_vector[name].weight / norm  # (1, out, 1, ...)
        if isinstance(dropout, nn.Identity) or not self.training:
            base_result = result  # W x + bias: take the bias out again
            if base.bias is not None:
                base_result = base_result - base.bias.view(1, -1, *(1,) * (result.dim() - 2))
        else:
            x = dropout(x)
            conv_fn = (F.conv1d, F.conv2d, F.conv3d)[base.weight.dim() - 3]
            base_result = conv_fn(x, base.weight, None, base.stride, base.padding, base.dilation,
                                  base.groups)
        return (mag_norm_scale - 1) * base_result + mag_norm_scale * lora_B(lora_A(x)) * scaling



@contextlib.contextmanager
def _swapped(module, name, tensor):
    # `module.<name>` reads `tensor` for one call, then the original object is set back (a
    # parameter re-registers, last in order; FSDP's plain-tensor views go back as they were)
    original = getattr(module, name)
    delattr(module, name)
    setattr(module, name, tensor)  # a plain tensor: an attribute, not a parameter
    try:
        yield
    finally:
        delattr(module, name)
        setattr(module, name, original)


def _from_base(name):
    # an attribute of the wrapped nn.MultiheadAttention, read through the LoRA layer
    return property(lambda self: getattr(self.base_layer, name))


class LoraMultiheadAttention(nn.Module):
    """A frozen nn.MultiheadAttention plus low-rank adapters on its fused q/k/v projection
    (`in_proj_weight` [3E, E]: lora_A [r, E], lora_B [3E, r]) and on `out_proj` (a LoraLinear put
    in its place). torch's attention reads both weights directly, never calling a linear's forward,
    so each call runs on W + s B A swapped in for the call; gradients reach only A and B.
    Args as LoraLinear's; DoRA, aLoRA, lora_bias and mixed adapter batches are refused.
    Mirrors: peft lora.MultiheadAttention
    Differs: forward swaps W + s B A in for one call where peft merges, runs and unmerges in
    place; lora_bias refused (peft makes the biases, never trains them). Kept from peft 0.21.2:
    out_proj's delta counts twice (its merge adds the delta, then out_proj's own merge adds it
    again), in forward and merge alike, so peft's files give peft's outputs; the gradient flows
    through one copy, as in peft."""

    def __init__(self, base_layer, adapter_name="default", r=8, lora_alpha=8, lora_dropout=0.0,
                 use_rslora=False, init_lora_weights=True, lora_bias=False, use_dora=False,
                 use_alora=False):
        super().__init__()
        if not getattr(base_layer, "_qkv_same_embed_dim", True):
            raise ValueError("Only same embed for query/key/value is supported as of now for "
                             "MultiheadAttention (this one has kdim/vdim != embed_dim and separate "
                             "q/k/v weights); target another module or build it without kdim/vdim")
        self._refuse(use_dora, use_alora, lora_bias)
        if not isinstance(base_layer.out_proj, nn.Linear):
            raise TypeError("out_proj must be an instance of nn.Linear for MultiheadAttention, got "
                            f"{type(base_layer.out_proj).__name__}")
        self.base_layer = base_layer
        self.in_features = base_layer.embed_dim
        self.out_features = 3 * base_layer.embed_dim  # q, k and v stacked in in_proj_weight
        self.lora_A = nn.ModuleDict()
        self.lora_B = nn.ModuleDict()
        self.lora_dropout = nn.ModuleDict()  # kept for peft's surface; the merged call has none
        self.lora_magnitude_vector = nn.ModuleDict()  # stays empty: no DoRA here
        self.r, self.lora_alpha, self.scaling, self.use_rslora = {}, {}, {}, {}
        self.use_dora, self.lora_bias = {}, {}
        self.merged_adapters = []
        self.active_adapters = [adapter_name]
        self.disable_adapters = False
        common = dict(r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout, use_rslora=use_rslora,
                      init_lora_weights=init_lora_weights)
        # RNG order as peft: out_proj's adapter is drawn here, then in update_layer once more
        base_layer.out_proj = LoraLinear(base_layer.out_proj, adapter_name, **common)
        self.update_layer(adapter_name, **common)

    adapter_layer_names = LoraLinear.adapter_layer_names
    other_param_names = LoraLinear.other_param_names
    merged = LoraLinear.merged
    get_base_layer = LoraLinear.get_base_layer
    _all_available_adapter_names = LoraLinear._all_available_adapter_names
    reset_lora_parameters = LoraLinear.reset_lora_parameters
    get_delta_weight = LoraLinear.get_delta_weight  # B @ A * s, [3E, E]

    # what code reading an nn.MultiheadAttention asks of it (out_proj: the plain linear)
    embed_dim, kdim, vdim = _from_base("embed_dim"), _from_base("kdim"), _from_base("vdim")
    num_heads, head_dim = _from_base("num_heads"), _from_base("head_dim")
    dropout, batch_first = _from_base("dropout"), _from_base("batch_first")
    _qkv_same_embed_dim = _from_base("_qkv_same_embed_dim")
    in_proj_weight, in_proj_bias = _from_base("in_proj_weight"), _from_base("in_proj_bias")
    bias_k, bias_v = _from_base("bias_k"), _from_base("bias_v")
    add_zero_attn = _from_base("add_zero_attn")

    @property
    def out_proj(self):
        """The base's output projection, unwrapped. Mirrors: peft MultiheadAttention.out_proj"""
        return self.base_layer.out_proj.get_base_layer()

    def merge_masks(self, *args, **kwargs):
        """The base's mask merging. Mirrors: nn.MultiheadAttention.merge_masks"""
        return self.base_layer.merge_masks(*args, **kwargs)

    @staticmethod
    def _refuse(use_dora, use_alora, lora_bias):
        if use_dora:
            raise ValueError("MultiheadAttention does not support DoRA (yet), please set use_dora "
                             "to False")
        if use_alora:
            raise ValueError("MultiheadAttention does not support aLoRA (yet), please set "
                             "use_alora to False")
        if lora_bias:
            raise ValueError("MultiheadAttention does not support lora_bias here (peft creates the "
                             "biases but its merged forward never uses them); set lora_bias=False")

    def update_layer(self, adapter_name, r, lora_alpha, lora_dropout=0.0, use_rslora=False,
                     init_lora_weights=True, lora_bias=False, use_dora=False, use_alora=False):
        """Add adapter `adapter_name` to in_proj (A [r, E], B [3E, r]) and to out_proj.
        Mirrors: peft MultiheadAttention.update_layer"""
        self._refuse(use_dora, use_alora, lora_bias)
        if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
            raise ValueError(f"MultiheadAttention adapter {adapter_name!r}: r (the LoRA rank) must "
                             f"be a positive int, got r={r!r}; pass e.g. r=8")
        if init_lora_weights not in (True, False, "gaussian"):
            raise ValueError(f"MultiheadAttention adapter {adapter_name!r}: init_lora_weights="
                             f"{init_lora_weights!r} is not implemented; use True (peft's "
                             "default), False or 'gaussian'")
        self.r[adapter_name] = r
        self.lora_alpha[adapter_name] = lora_alpha
        self.lora_dropout[adapter_name] = (nn.Dropout(p=lora_dropout) if lora_dropout > 0.0
                                           else nn.Identity())
        self.lora_A[adapter_name] = AdapterLinear(self.in_features, r, bias=False)
        self.lora_B[adapter_name] = AdapterLinear(r, self.out_features, bias=False)
        self.scaling[adapter_name] = lora_alpha / math.sqrt(r) if use_rslora else lora_alpha / r
        self.use_rslora[adapter_name] = use_rslora
        self.use_dora[adapter_name] = False
        self.lora_bias[adapter_name] = False
        self.reset_lora_parameters(adapter_name, init_lora_weights)
        w = self.out_proj.weight  # peft places the adapters by out_proj's device and dtype
        for d in (self.lora_A, self.lora_B):
            d[adapter_name] = d[adapter_name].to(device=w.device, dtype=w.dtype)
        self.base_layer.out_proj.update_layer(adapter_name, r, lora_alpha, lora_dropout,
                                              use_rslora, init_lora_weights=init_lora_weights)
        self.set_adapter(self.active_adapters)

    def set_adapter(self, adapter_names):
        """Activate `adapter_names` here and on out_proj. Mirrors: peft set_adapter"""
        LoraLinear.set_adapter(self, adapter_names)
        self.base_layer.out_proj.set_adapter(adapter_names)

    def enable_adapters(self, enabled):
        """All adapters on or off (out_proj's layer keeps its own switch, as in peft).
        Mirrors: peft BaseTunerLayer.enable_adapters"""
        LoraLinear.enable_adapters(self, enabled)

    def delete_adapter(self, adapter_name):
        """Drop one adapter here and on out_proj. Mirrors: peft delete_adapter"""
        self.base_layer.out_proj.delete_adapter(adapter_name)
        LoraLinear.delete_adapter(self, adapter_name)

    @torch.no_grad()
    def merge(self, safe_merge=False, adapter_names=None):
        """Add the deltas to in_proj_weight and out_proj's weight (out_proj's twice, as peft
        0.21.2). Mirrors: peft MultiheadAttention.merge"""
        names = adapters_to_merge(self, adapter_names)
        base, out_proj = self.base_layer, self.base_layer.out_proj
        for name in [n for n in names if n in self.lora_A]:
            dtype = out_proj.base_layer.weight.dtype
            w_in = base.in_proj_weight.data + self.get_delta_weight(name).to(dtype)
            w_out = out_proj.base_layer.weight.data + out_proj.get_delta_weight(name).to(dtype)
            if safe_merge and not (torch.isfinite(w_in).all() and torch.isfinite(w_out).all()):
                raise ValueError(f"NaNs detected in the merged weights. The adapter {name} seems "
                                 "to be broken")
            base.in_proj_weight.data = w_in
            out_proj.base_layer.weight.data = w_out
            out_proj.merge(adapter_names=[name])  # peft's second add of out_proj's delta
            self.merged_adapters.append(name)

    @torch.no_grad()
    def unmerge(self):
        """Subtract the merged deltas again, last first. Mirrors: peft MultiheadAttention.unmerge"""
        if not self.merged:
            warnings.warn("Already unmerged. Nothing to do.")
            return
        base, out_proj = self.base_layer, self.base_layer.out_proj
        dtype = out_proj.base_layer.weight.dtype
        while self.merged_adapters:
            name = self.merged_adapters.pop()
            base.in_proj_weight.data = base.in_proj_weight.data - self.get_delta_weight(name).to(
                dtype)
            out_proj.base_layer.weight.data = (out_proj.base_layer.weight.data
                                               - out_proj.get_delta_weight(name).to(dtype))
        out_proj.unmerge()  # the second copies, as peft

    def unload_and_optionally_merge_module(self, merge, safe_merge, adapter_names):
        """The plain nn.MultiheadAttention (merged first if asked), out_proj unwrapped too.
        Mirrors: peft MultiheadAttention.unload_and_optionally_merge_module"""
        if merge:
            self.merge(safe_merge=safe_merge, adapter_names=adapter_names)
        self.base_layer.out_proj = self.out_proj
        return self.base_layer

    def _restore_weights(self):
        """Nothing to do: forward and merge keep the base's parameters registered (peft re-registers
        them after its in-place merge). Mirrors: peft MultiheadAttention._restore_weights"""

    def _weights_with_deltas(self):
        # in_proj's and out_proj's W + s B A for one call; no gradient to W (peft detaches it)
        out_proj = self.base_layer.out_proj
        w_in = self.base_layer.in_proj_weight.detach()
        w_out = out_proj.base_layer.weight.detach()
        for name in [n for n in self.active_adapters if n in self.lora_A]:
            w_in = w_in + self.get_delta_weight(name).to(w_out.dtype)
            delta = out_proj.get_delta_weight(name).to(w_out.dtype)
            w_out = w_out + delta + delta.detach()  # value: two deltas; gradient: one (peft)
        return w_in, w_out

    def __repr__(self):
        return peft_repr(self, "MultiheadAttention")

    def forward(self, query, *args, adapter_names=None, **kwargs):
        """The base attention with the active adapters' deltas in both projections; returns
        (attn_output, attn_weights) in the query's dtype.
        Mirrors: peft MultiheadAttention.forward"""
        if adapter_names is not None:
            raise TypeError("lora.MultiheadAttention does not support mixed adapter batches.")
        previous_dtype = query.dtype
        out_proj = self.base_layer.out_proj
        if self.disable_adapters:
            if self.merged:
                self.unmerge()
            result = self.base_layer(query, *args, **kwargs)
        elif self.merged:
            result = self.base_layer(query, *args, **kwargs)
        else:
            if out_proj.merged or out_proj.active_adapters != self.active_adapters:
                raise ValueError("The out_proj layer of MultiheadAttention has merged layers but "
                                 "MultiheadAttention itself doesn't; please ensure that either "
                                 "both or none have merged layers (merge and set adapters on the "
                                 "MultiheadAttention layer, not on its out_proj)")
            w_in, w_out = self._weights_with_deltas()
            with _swapped(self.base_layer, "in_proj_weight", w_in), \
                    _swapped(out_proj.base_layer, "weight", w_out):
                result = self.base_layer(query, *args, **kwargs)
        attn_output, attn_weights = result
        if attn_weights is not None:
            attn_weights = attn_weights.to(previous_dtype)
        return attn_output.to(previous_dtype), attn_weights


# ----------------------------------------------------------------------------- around the adapters

"""LoRA's `trainable_token_indices`: a few rows of an embedding (and of an LM head tied to it)
trained in place of the whole matrix.

`TrainableTokensWrapper` replaces the embedding module; its `token_adapter` (a
`TrainableTokensLayer`) keeps, per adapter, the trained rows (`trainable_tokens_delta`, a
[len(indices), dim] parameter, despite its name the new rows' values, not a difference) and the
rows they replace. The forward writes those rows into a copy of the weight (index_copy) and embeds
with it; merge writes them into the weight itself. A module whose weight is the embedding's (a
tied LM head) gets a wrapper sharing the embedding's adapter, so both always read the same rows.
Saved under peft's key `<embedding>.token_adapter.trainable_tokens_delta`; a tied wrapper saves
nothing (the weights it reads are the embedding's).
"""

import warnings

import torch
import torch.nn.functional as F
from torch import nn


class TrainableTokensLayer(nn.Module):
    """The trained rows of `base_layer` (nn.Embedding, or the nn.Linear of a tied LM head), per
    adapter. Mirrors: peft TrainableTokensLayer"""

    adapter_layer_names = ("trainable_tokens_delta",)
    other_param_names = ("token_indices",)

    def __init__(self, base_layer, adapter_name, token_indices=None, tied_adapter=None):
        super().__init__()
        self.base_layer = base_layer
        # a list keeps the tied layer out of named_modules (and out of the state dict)
        self._tied_adapter = [tied_adapter] if tied_adapter is not None else []
        if tied_adapter is None:
            self.trainable_tokens_delta = nn.ParameterDict()
            self.trainable_tokens_original = _Buffers()  # not persistent: never saved
            self.token_indices = {}
        else:  # the tied layer's own containers: every update shows in both
            self.trainable_tokens_delta = tied_adapter.trainable_tokens_delta
            self.trainable_tokens_original = tied_adapter.trainable_tokens_original
            self.token_indices = tied_adapter.token_indices
        self.merged_adapters = []
        self.active_adapters = [adapter_name]
        self.disable_adapters = False

    @property
    def tied_adapter(self):
        """The embedding's layer this one follows (a tied LM head), else None."""
        return self._tied_adapter[0] if self._tied_adapter else None

    @property
    def merged(self):
        """True while trained rows are written into the base weight. Mirrors: peft merged"""
        return bool(self.merged_adapters)

    @property
    def weight(self):
        """The base layer's weight. Mirrors: peft BaseTunerLayer.weight"""
        return self.base_layer.weight

    def get_base_layer(self):
        """The wrapped module. Mirrors: peft BaseTunerLayer.get_base_layer"""
        return self.base_layer

    def update_layer(self, adapter_name, token_indices, init_weights=True):
        """Start adapter `adapter_name`'s rows as copies of the base rows (init_weights=False:
        N(0, 1), for tests). A tied layer adds nothing of its own.
        Mirrors: peft TrainableTokensLayer.update_layer"""
        if self.tied_adapter is not None:
            return
        weight = self.base_layer.weight
        self.token_indices[adapter_name] = list(token_indices)
        originals = weight[list(token_indices)].detach().clone()
        if init_weights:
            values = originals.clone()
        else:
            values = torch.randn(originals.shape, dtype=weight.dtype, device=weight.device)
        self.trainable_tokens_delta[adapter_name] = nn.Parameter(values)
        self.trainable_tokens_original[adapter_name] = originals

    def set_adapter(self, adapter_names, inference_mode=False):
        """Only the named adapters' rows require grad (none in inference mode).
        Mirrors: peft BaseTunerLayer.set_adapter"""
        names = [adapter_names] if isinstance(adapter_names, str) else list(adapter_names)
        for key, p in self.trainable_tokens_delta.items():
            p.requires_grad_(key in names and not inference_mode)
        self.active_adapters = names

    def enable_adapters(self, enabled):
        """Off: the base layer alone (rows frozen). Mirrors: peft BaseTunerLayer.enable_adapters"""
        if enabled:
            self.set_adapter(self.active_adapters)
        else:
            self.trainable_tokens_delta.requires_grad_(False)
        self.disable_adapters = not enabled

    def delete_adapter(self, adapter_name):
        """Drop one adapter's rows. Mirrors: peft BaseTunerLayer.delete_adapter"""
        if self.tied_adapter is None:
            if adapter_name in self.trainable_tokens_delta:
                del self.trainable_tokens_delta[adapter_name]
            self.token_indices.pop(adapter_name, None)
            self.trainable_tokens_original.pop(adapter_name)
        self.active_adapters = [n for n in self.active_adapters if n != adapter_name]

    def _check_overlapping_tokens(self, adapter_names):
        # two adapters writing the same row have no defined result
        seen = set()
        for name in dict.fromkeys(self.merged_adapters + list(adapter_names)):
            rows = set(self.token_indices[name])
            if seen & rows:
                raise ValueError(f"Token indices of adapter {name} are already defined and would "
                                 "result in undefined merging behavior. Only disjunct token "
                                 "indices are currently supported.")
            seen |= rows

    def get_merged_weights(self, adapter_names):
        """The base weight with each named adapter's rows written in (a new tensor).
        Mirrors: peft TrainableTokensLayer.get_merged_weights"""
        weight = self.base_layer.weight
        for name in adapter_names:
            index = torch.tensor(self.token_indices[name], device=weight.device)
            weight = weight.index_copy(0, index, self.trainable_tokens_delta[name].to(weight))
        return weight

    @torch.no_grad()
    def merge(self, safe_merge=False, adapter_names=None):
        """Write the adapters' rows into the base weight.
        Mirrors: peft TrainableTokensLayer.merge"""
        names = self.active_adapters if adapter_names is None else list(adapter_names)
        names = [n for n in names if n not in self.merged_adapters and n in self.token_indices]
        if not names:
            return
        self._check_overlapping_tokens(names)
        merged = self.get_merged_weights(names)
        if safe_merge and not torch.isfinite(merged).all():
            raise ValueError(f"NaNs detected in the merged weights. The adapter {names} seems to "
                             "be broken")
        self.base_layer.weight.data = merged
        self.merged_adapters.extend(names)

    @torch.no_grad()
    def unmerge(self):
        """Put the original rows back, last merged first. Mirrors: peft
        TrainableTokensLayer.unmerge"""
        if not self.merged:
            warnings.warn("Already unmerged. Nothing to do.")
            return
        weight = self.base_layer.weight
        while self.merged_adapters:
            name = self.merged_adapters.pop()
            index = torch.tensor(self.token_indices[name], device=weight.device)
            weight.data.index_copy_(0, index, self.trainable_tokens_original[name].to(weight))

    def forward(self, x, active_adapters=None):
        """Embed (or, for a tied LM head, project) with the trained rows in place.
        Mirrors: peft TrainableTokensLayer.forward_adapters"""
        names = self.active_adapters if active_adapters is None else active_adapters
        names = [n for n in names if n in self.token_indices]
        if self.disable_adapters or not names:
            if self.merged:
                self.unmerge()
            return self.base_layer(x)
        if self.merged:
            return self.base_layer(x)
        self._check_overlapping_tokens(names)
        weight = self.get_merged_weights(names)
        base = self.base_layer
        if isinstance(base, nn.Embedding):
            out = F.embedding(x, weight, padding_idx=base.padding_idx, max_norm=base.max_norm,
                              norm_type=base.norm_type, scale_grad_by_freq=base.scale_grad_by_freq,
                              sparse=base.sparse)
            embed_scale = getattr(base, "embed_scale", None)  # Gemma's scaled embedding
            if embed_scale is not None:
                out = out * torch.as_tensor(embed_scale).to(out.dtype)
            return out
        if isinstance(base, nn.Linear):  # a tied LM head (peft: no bias either)
            return F.linear(x, weight)
        raise ValueError(f"trainable_token_indices wraps an unknown layer type "
                         f"{type(base).__name__}; target an nn.Embedding (or a tied nn.Linear)")


class _Buffers(nn.Module):
    # adapter name -> a non-persistent buffer: moves with .to(), stays out of state_dict
    def __setitem__(self, name, tensor):
        self.register_buffer(name, tensor, persistent=False)

    def __getitem__(self, name):
        return self._buffers[name]

    def __contains__(self, name):
        return name in self._buffers

    def pop(self, name):
        return self._buffers.pop(name, None)


class TrainableTokensWrapper(nn.Module):
    """Stands in for the embedding (or a tied LM head): forwards through its `token_adapter`; one
    adapter active at a time, like ModulesToSaveWrapper. Mirrors: peft TrainableTokensWrapper"""

    def __init__(self, module, adapter_name, token_indices, tied_adapter=None, trainable=True):
        super().__init__()
        self.token_adapter = TrainableTokensLayer(module, adapter_name, token_indices,
                                                  tied_adapter)
        self.active_adapter = adapter_name
        self.disable_adapters = False
        self.update(adapter_name, token_indices)
        self.set_adapter(adapter_name, inference_mode=not trainable)

    @property
    def original_module(self):
        """The wrapped module (a property: not a second state-dict entry).
        Mirrors: peft TrainableTokensWrapper.original_module"""
        return self.token_adapter.base_layer

    @property
    def active_adapters(self):
        """The active adapter, as a list (empty when none). Mirrors: peft active_adapters"""
        return [self.active_adapter] if self.active_adapter is not None else []

    @property
    def weight(self):
        """The weight with the trained rows in (what `get_input_embeddings().weight` reads).
        Mirrors: peft TrainableTokensWrapper._getattr_wrapped"""
        return self.token_adapter.get_merged_weights(self._held(self.active_adapters))

    def _held(self, names):
        return [n for n in names if n in self.token_adapter.token_indices]

    def adapter_names(self):
        """Every adapter with rows here."""
        return list(self.token_adapter.token_indices)

    def update(self, adapter_name, token_indices=None, trainable=True):
        """Add rows for `adapter_name` (kept inactive unless it is the active one).
        Mirrors: peft TrainableTokensWrapper.update"""
        if adapter_name not in self.token_adapter.token_indices:
            self.token_adapter.update_layer(adapter_name, token_indices)
        self.set_adapter(self.active_adapter, inference_mode=not trainable)

    def set_adapter(self, adapter_names, inference_mode=False):
        """Use (and train) the one named adapter this wrapper holds.
        Mirrors: peft TrainableTokensWrapper.set_adapter, check_set_adapter"""
        names = [adapter_names] if isinstance(adapter_names, str) else list(adapter_names or [])
        held = self._held(names)
        if len(held) > 1:
            raise ValueError(f"Only one adapter can be set at a time for {type(self).__name__}, "
                             f"got {len(held)}")
        self.active_adapter = held[0] if held else None
        self.token_adapter.set_adapter(held, inference_mode=inference_mode)

    def enable_adapters(self, enabled):
        """Off: the base rows. Mirrors: peft TrainableTokensWrapper.enable_adapters"""
        self.token_adapter.enable_adapters(enabled)
        self.disable_adapters = not enabled

    def delete_adapter(self, adapter_name, new_active_adapters=None):
        """Drop one adapter's rows. Mirrors: peft TrainableTokensWrapper.delete_adapter"""
        self.token_adapter.delete_adapter(adapter_name)
        left = self._held(list(new_active_adapters or []))
        self.set_adapter(left[:1])

    def unload(self, merge=False, safe_merge=False, adapter_names=None):
        """The wrapped module, with the rows merged in when asked.
        Mirrors: peft TrainableTokensWrapper.unload_and_optionally_merge_module"""
        if merge:
            self.token_adapter.merge(safe_merge=safe_merge, adapter_names=adapter_names)
        return self.token_adapter.base_layer

    def forward(self, x, adapter_names=None):
        """Through the token adapter (which knows disabled and no-adapter states); with
        `adapter_names`, row i reads adapter adapter_names[i]'s rows ("__base__": none).
        Mirrors: peft TrainableTokensWrapper._forward_wrapped, AuxiliaryTrainingWrapper
        ._mixed_batch_forward"""
        if adapter_names is None or self.disable_adapters:
            return self.token_adapter(x)
        out = [None] * len(x)
        for name in dict.fromkeys(adapter_names):
            rows = [i for i, n in enumerate(adapter_names) if n == name]
            part = self.token_adapter(x[rows], [] if name == "__base__" else [name])
            for j, i in enumerate(rows):
                out[i] = part[j]
        return torch.stack(out)


def tied_module_names(model, embedding):
    """Names of the modules whose weight is the input embedding's weight (a tied LM head); none
    when the config says tie_word_embeddings=False.
    Mirrors: peft _get_module_names_tied_with_embedding
    Differs: found by parameter identity, not by `_tied_weights_keys`."""
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "tie_word_embeddings", None) is False:
        return []
    weight = getattr(embedding, "weight", None)
    return [n for n, m in model.named_modules()
            if m is not embedding and isinstance(getattr(m, "weight", None), nn.Parameter)
            and m.weight is weight and not isinstance(m, TrainableTokensLayer)]

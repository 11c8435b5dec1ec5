"""The tuner surface: LoRA put into any nn.Module, and peft's adapter API around it.

`inject_adapter` swaps each targeted module (nn.Linear, 4-bit linear, transformers' Conv1D,
nn.Embedding, nn.Conv1d/2d/3d, nn.MultiheadAttention) for a LoRA layer, or adds an adapter to the
LoRA layer already there; `LoraModel` holds the model (names read `base_model.model....`) and
carries peft's `LoraModel` / `BaseTuner` methods: several adapters by name, the active set,
merge / unmerge in place, unload, delete.
`BaseTunerLayer` and `LoraLayer` are what peft's isinstance checks ask for. Kept apart from
peft.py (walkthrough 2.6's forward) and lora.py (2.7's forward) so neither is read through it.
"""

import abc
import contextlib
import warnings

import torch
from torch import nn

from nanosft.alora import alora_offsets, is_alora_batch
from nanosft.adapter_files import (
    custom_layer_class, find_target_modules, is_lora_target, pattern_value,
    resolve_target_modules)
from nanosft.lora import LoraLinear, ModulesToSaveWrapper
from nanosft.lora_layers import LoraConv, LoraEmbedding, LoraMultiheadAttention
from nanosft.trainable_tokens import TrainableTokensWrapper, tied_module_names
from nanosft.weighted_adapters import (  # noqa: F401 (convert_to_lora: peft's name, re-exported)
    convert_to_lora, fill_weighted_adapter, supports_lora_conversion, weighted_adapter_config)
from nanosft.weight_tying import (
    check_tied_modules, is_tied_target, module_names_tied_with_embedding, tie_lora_to_embedding,
    untie_config_if_diverged)

# peft's private name for the same function (peft.utils.other)
_get_module_names_tied_with_embedding = module_names_tied_with_embedding


class BaseTunerLayer(abc.ABC):
    """What every adapter layer is to an isinstance check: a module with a `base_layer` and
    `active_adapters` (LoraLinear, LoraEmbedding, the parameter wrappers); no code is inherited.
    Mirrors: peft BaseTunerLayer"""

    @classmethod
    def __subclasshook__(cls, C):
        if not issubclass(C, nn.Module):
            return NotImplemented
        names = set().union(*(vars(k) for k in C.__mro__))
        return bool({"update_layer", "merge", "unmerge"} <= names) or NotImplemented


class LoraLayer(BaseTunerLayer):
    """A LoRA layer to an isinstance check: a tuner layer with a LoRA delta (not the trainable
    tokens layer). Mirrors: peft LoraLayer"""

    @classmethod
    def __subclasshook__(cls, C):
        if BaseTunerLayer.__subclasshook__(C) is not True:
            return NotImplemented
        return "get_delta_weight" in set().union(*(vars(k) for k in C.__mro__)) or NotImplemented


def _replace_module(model, name, new):
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def _new_or_updated_layer(target, config, adapter_name, name):
    # an existing LoRA layer gets one more adapter; a plain module becomes a LoRA layer
    r = pattern_value(config.rank_pattern, name, config.r)
    alpha = pattern_value(config.alpha_pattern, name, config.lora_alpha)
    common = dict(r=r, lora_alpha=alpha, lora_dropout=config.lora_dropout,
                  use_rslora=config.use_rslora, init_lora_weights=config.init_lora_weights)
    use_alora = config.alora_invocation_tokens is not None
    custom = None if isinstance(target, BaseTunerLayer) else custom_layer_class(config, target)
    if custom is not None:  # a registered class (peft's dynamic dispatch) comes first
        if not is_lora_target(target):
            warnings.warn(f"Unsupported layer type '{type(target)}' encountered, proceed at your "
                          "own risk.", UserWarning)
        return custom(target, adapter_name, use_dora=config.use_dora, lora_bias=config.lora_bias,
                      use_alora=use_alora, **common)
    if isinstance(target, (LoraMultiheadAttention, nn.MultiheadAttention)):  # refuses aLoRA, DoRA
        extra = dict(lora_bias=config.lora_bias, use_dora=config.use_dora, use_alora=use_alora)
        if isinstance(target, LoraMultiheadAttention):
            target.update_layer(adapter_name, **extra, **common)
            return None
        return LoraMultiheadAttention(target, adapter_name, **extra, **common)
    if use_alora and not isinstance(target, LoraLinear) and (
            not _is_linear_target(target)):
        raise ValueError(f"{type(target).__name__} does not support aLoRA (yet), please set "
                         "use_alora to False")
    if isinstance(target, LoraEmbedding) or isinstance(target, nn.Embedding):
        extra = dict(lora_bias=config.lora_bias, use_dora=config.use_dora)
        if isinstance(target, LoraEmbedding):
            target.update_layer(adapter_name, **extra, **common)
            return None
        return LoraEmbedding(target, adapter_name, **extra, **common)
    if isinstance(target, (LoraConv, nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        extra = dict(lora_bias=config.lora_bias, use_dora=config.use_dora)
        if isinstance(target, LoraConv):
            target.update_layer(adapter_name, **extra, **common)
            return None
        return LoraConv(target, adapter_name, **extra, **common)
    if isinstance(target, LoraLinear):
        target.update_layer(adapter_name, use_dora=config.use_dora, lora_bias=config.lora_bias,
                            use_alora=use_alora, **common)
        return None
    if type(target).__name__ == "Conv1D" and not config.fan_in_fan_out:
        warnings.warn("fan_in_fan_out is set to False but the target module is `Conv1D`. "
                      "Setting fan_in_fan_out to True.")
        config.fan_in_fan_out = True
    return LoraLinear(target, adapter_name, use_dora=config.use_dora, lora_bias=config.lora_bias,
                      use_alora=use_alora, **common)


def check_bias(config):
    """Refuse a `bias` setting other than "none", "all" and "lora_only" before any layer changes.
    Mirrors: peft LoraModel._mark_only_adapters_as_trainable (its NotImplementedError)"""
    if config.bias not in ("none", "all", "lora_only"):
        raise NotImplementedError(f"Requested bias: {config.bias}, is not implemented.")


def _is_linear_target(module):
    # what a LoraLinear wraps: nn.Linear, a 4-bit linear, transformers' Conv1D
    return not isinstance(module, (nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d, LoraEmbedding,
                                   LoraConv))


def inject_adapter(model, config, adapter_name="default"):
    """Put adapter `adapter_name` on every target module, in named_modules order (peft's RNG order).
    Mirrors: peft BaseTuner.inject_adapter, LoraModel._create_and_replace"""
    convert = getattr(model, "convert_peft_config", None)  # a family's rewrite (MoE experts)
    if convert is not None:
        convert(config)
    if config.layer_replication:  # product layer, imported on use (peft: _prepare_model)
        from nanosft.layer_replication import replicate_layers

        replicate_layers(model, config.layer_replication)
    check_tied_modules(model, config)  # ensure_weight_tying: the embedding targeted, not its ties
    names = find_target_modules(model, config) if config.target_modules not in ([], "") else []
    config.target_modules = resolve_target_modules(model, config)  # saved resolved, as peft does
    inside = [n for n, m in model.named_modules() if isinstance(m, BaseTunerLayer)]
    tied = [n for n, _ in model.named_modules() if is_tied_target(config, n)
            and not any(n.startswith(p + ".") for p in inside)]
    names = [n for n in names if n not in tied] + tied  # the tied ones after the embedding
    for name in names:
        layer = _new_or_updated_layer(model.get_submodule(name), config, adapter_name, name)
        if layer is not None:
            _replace_module(model, name, layer)
        layer = model.get_submodule(name)
        if name in tied and isinstance(layer, LoraLinear):
            tie_lora_to_embedding(layer, model.get_input_embeddings(), adapter_name,
                                  config.init_lora_weights)
    if config.target_parameters:  # LoRA on parameters: product layer, imported on use
        from nanosft.expert_lora import inject_parameter_adapters

        inject_parameter_adapters(model, config, adapter_name, _replace_module)
    return names


def mark_only_adapters_as_trainable(model, config, adapter_name="default"):
    """Freeze the base (bias per `config.bias`), wrap `modules_to_save`, upcast fp16/bf16 adapters.
    Mirrors: peft _mark_only_adapters_as_trainable, _set_trainable"""
    trainable = not config.inference_mode
    for n, p in model.named_parameters():
        if ".modules_to_save." in n or ".token_adapter." in n:
            continue  # the wrappers keep their own requires_grad
        bias_trains = config.bias == "all" or (config.bias == "lora_only" and ".base_layer." in n)
        own = "lora_" in n and f".{adapter_name}" in n
        if own or (n.endswith(".bias") and bias_trains and "lora_" not in n):
            p.requires_grad = trainable
        elif "lora_" not in n:
            p.requires_grad = False
    to_save = config.modules_to_save or []
    for name, module in list(model.named_modules()):
        if to_save and ".lora_" in name and _matches_any(to_save, name):
            _refuse_inside_tuner_layer(model, name, ModulesToSaveWrapper, adapter_name)
        if not to_save or ".lora_" in name or ".modules_to_save." in name:
            continue
        if name.endswith(".original_module") or not _matches_any(to_save, name):
            continue
        if isinstance(module, ModulesToSaveWrapper):
            module.update(adapter_name, trainable)
        elif not isinstance(module, ModulesToSaveWrapper):
            _replace_module(model, name, ModulesToSaveWrapper(module, adapter_name, trainable))
    tied = getattr(config, "modules_to_tie", None)
    if tied:  # ensure_weight_tying: these copies read the embedding copy's weight
        weight = model.get_input_embeddings().modules_to_save[adapter_name].weight
        for name in tied:
            module = model.get_submodule(name)
            if isinstance(module, ModulesToSaveWrapper):
                module.update(adapter_name, trainable, tied_weight=weight)
            else:
                _replace_module(model, name, ModulesToSaveWrapper(module, adapter_name, trainable,
                                                                  tied_weight=weight))


def _refuse_inside_tuner_layer(model, name, wrapper_cls, adapter_name):
    # a modules_to_save entry equal to the adapter name matches the LoRA layers' own
    # `lora_A.<adapter>` modules: wrapping those is never meant
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        parent = model.get_submodule(".".join(parts[:i]))
        if isinstance(parent, BaseTunerLayer):
            raise ValueError(f"You are trying to target a module with {wrapper_cls} that is a "
                             f"child of {type(parent)}. This is almost certainly not the intended "
                             f"behavior. Please ensure that the adapter name, '{adapter_name}', "
                             "does not conflict with any of the targeted modules.")


def _matches_any(to_save, name):
    return any(name == t or name.endswith("." + t) for t in to_save)


def _input_embedding(model):
    # the input embedding module (the wrapped one if a wrapper stands there) and its name
    get = getattr(model, "get_input_embeddings", None)
    embedding = get() if get is not None else None
    name = next((n for n, m in model.named_modules() if m is embedding), None)
    if isinstance(embedding, TrainableTokensWrapper):
        embedding = embedding.original_module
    return embedding, name


def add_trainable_tokens(model, config, adapter_name="default"):
    """`config.trainable_token_indices`: wrap the embedding (a list: the input embedding; a dict:
    {module name: indices}) so only those rows train; modules tied to the input embedding (an LM
    head sharing its weight) get a wrapper that shares its rows, so the two stay equal.
    Mirrors: peft set_additional_trainable_modules (its trainable_token_indices part)"""
    indices = getattr(config, "trainable_token_indices", None)
    if indices is None:
        return
    embedding, embedding_name = _input_embedding(model)
    targets = dict(indices) if isinstance(indices, dict) else {
        (embedding_name or "embed_tokens"): list(indices)}
    for target in targets:
        if target in (config.modules_to_save or []):
            raise ValueError("The embedding layer is already marked to be trained fully, either "
                             f"specify `modules_to_save=[..., \"{target}\", ...]` or "
                             f"`trainable_tokens={{'{target}': x}}` but not both.")
    tied = tied_module_names(model, embedding) if embedding is not None else []
    ties = bool(tied) and bool(getattr(getattr(model, "config", None), "tie_word_embeddings",
                                       False))
    # a tied module listed with the embedding's own indices is left to the tying below
    embedding_indices = next((v for k, v in targets.items()
                              if embedding_name and embedding_name.endswith(k)), None)
    tied_targets = [k for k in targets if any(_matches_any([k], t) for t in tied)]
    mismatch = any(targets[k] != embedding_indices for k in tied_targets)
    if ties and mismatch and embedding_indices is not None and config.ensure_weight_tying:
        listed = ", ".join(f"{k}: {v}" for k, v in targets.items())
        raise ValueError("Cannot ensure weight tying when different token indices are specified "
                         f"for tied layers. Conflicting layers: {listed}. Please use the same "
                         "indices for all tied layers or set ensure_weight_tying=False.")
    trainable = not config.inference_mode
    for target, rows in targets.items():
        if ties and not mismatch and embedding_indices is not None and target in tied_targets:
            continue
        found = _wrap_tokens(model, [target], adapter_name, rows, trainable)
        if not found:
            raise ValueError(f"trainable_token_indices names {target!r}, which matches no module "
                             "of the model; give the embedding module's name, e.g. "
                             f"{embedding_name or 'embed_tokens'!r}")
    if config.ensure_weight_tying and not ties:
        warnings.warn("ensure_weight_tying=True but the model does not have tied weights "
                      "(tie_word_embeddings=False). Weight tying will not be applied for "
                      "trainable_token_indices.")
    wrapper = model.get_input_embeddings() if embedding_name else None
    if ties and isinstance(wrapper, TrainableTokensWrapper) and (
            config.ensure_weight_tying or not mismatch):
        rows = wrapper.token_adapter.token_indices[adapter_name]
        _wrap_tokens(model, tied, adapter_name, rows, trainable, wrapper.token_adapter)


def _wrap_tokens(model, names, adapter_name, rows, trainable, tied_adapter=None):
    # wrap (or add an adapter to the wrapper of) every module named by `names`
    found = False
    for name, module in list(model.named_modules()):
        if not _matches_any(names, name) or ".token_adapter" in name:
            continue
        found = True
        if isinstance(module, TrainableTokensWrapper):
            module.update(adapter_name, rows, trainable)
        else:
            _replace_module(model, name, TrainableTokensWrapper(
                module, adapter_name, rows, tied_adapter=tied_adapter, trainable=trainable))
    return found


def cast_adapter_dtype(model, adapter_name, autocast_adapter_dtype=True):
    """fp16 / bf16 adapter weights of `adapter_name` to fp32 (stable training), unless asked not to.
    Mirrors: peft cast_adapter_dtype"""
    if not autocast_adapter_dtype:
        return
    for n, p in model.named_parameters():
        if "lora_" in n and f".{adapter_name}" in n and p.dtype in (torch.float16, torch.bfloat16):
            p.data = p.data.float()


class LoraModel(nn.Module):
    """Holds the model as `.model` after injection: names read `base_model.model.<module>`; the
    adapter API works on every LoRA layer inside it.
    Mirrors: peft LoraModel (BaseTuner)"""

    prefix = "lora_"

    def __init__(self, model, peft_config, adapter_name="default", autocast_adapter_dtype=True):
        super().__init__()
        self.model = model
        self.peft_config = peft_config
        self.active_adapter = adapter_name
        check_bias(peft_config[adapter_name])
        self.targeted_module_names = inject_adapter(model, peft_config[adapter_name], adapter_name)
        mark_only_adapters_as_trainable(model, peft_config[adapter_name], adapter_name)
        add_trainable_tokens(model, peft_config[adapter_name], adapter_name)
        cast_adapter_dtype(model, adapter_name, autocast_adapter_dtype)

    def forward(self, *args, adapter_names=None, alora_offsets=None, **kwargs):
        """The model's forward; the LoRA layers inside it do the rest (`adapter_names`: one
        adapter per batch row, "__base__" for none; aLoRA adapters: `alora_offsets` found in the
        input ids). What 2.6's `self.base_model(...)` runs.
        Mirrors: peft BaseTuner.forward, LoraModel._enable_peft_forward_hooks"""
        for handle in self.__dict__.pop("_alora_handles", []):  # kept for the last backward
            handle.remove()
        offsets = self._alora_offsets(args, kwargs, adapter_names, alora_offsets)
        with self._mixed_batch(adapter_names, offsets):
            return self.model(*args, **kwargs)

    def generate(self, *args, adapter_names=None, alora_offsets=None, **kwargs):
        """The model's generate, with per-row adapters when asked (aLoRA: the offsets found in
        the prompt hold for every step). Mirrors: peft PeftModel.generate"""
        offsets = self._alora_offsets(args, kwargs, adapter_names, alora_offsets)
        beams = kwargs.get("num_beams")
        if offsets is not None and (beams or 1) > 1:
            raise ValueError("Beam search not yet supported for aLoRA.")
        if adapter_names is not None and isinstance(beams, int) and beams > 1:
            # beam search repeats each row num_beams times: so does its adapter name
            if not isinstance(adapter_names, (list, tuple)):
                raise TypeError(f"Got adapter names of type {type(adapter_names)}, expected a list "
                                "of str.")
            adapter_names = [n for n in adapter_names for _ in range(beams)]
        with self._mixed_batch(adapter_names, offsets):
            return self.model.generate(*args, **kwargs)

    def _alora_offsets(self, args, kwargs, adapter_names, offsets):
        # peft get_alora_offsets_for_forward / _for_generate: None when no aLoRA adapter is used
        active = self.active_adapters[0] if self.active_adapters else None
        if offsets is not None or not is_alora_batch(self.peft_config, active, adapter_names):
            return offsets
        input_ids = kwargs.get("input_ids")
        if input_ids is None and args and isinstance(args[0], torch.Tensor):
            input_ids = args[0]
        if input_ids is None:
            warnings.warn("Cannot calculate aLoRA offsets when only inputs_embeds are provided. "
                          "Disabling aLoRA for this forward pass.")
            return None
        input_ids = input_ids[None] if input_ids.dim() == 1 else input_ids
        return alora_offsets(self.peft_config, active, input_ids, adapter_names)

    @contextlib.contextmanager
    def _mixed_batch(self, adapter_names, offsets=None):
        # hand `adapter_names` (and aLoRA offsets) to every LoRA layer for the length of one call
        if adapter_names is None and offsets is None:
            yield
            return
        if offsets is not None and adapter_names is None:
            def alora_hook(module, args, kwargs):
                return args, {**kwargs, "alora_offsets": offsets}
            handles = [m.register_forward_pre_hook(alora_hook, with_kwargs=True)
                       for m in self.model.modules() if isinstance(m, LoraLinear)]
            # checkpointed blocks run their forward again in backward, after this call: the
            # offsets stay until the next call (peft: hooks on each checkpointed layer)
            keep = self.training and any(getattr(m, "gradient_checkpointing", False)
                                         for m in self.model.modules())
            try:
                yield
            finally:
                if keep:
                    self._alora_handles = handles
                else:
                    for h in handles:
                        h.remove()
            return
        if self.training:
            raise ValueError("Cannot pass `adapter_names` when the model is in training mode.")
        unknown = sorted(set(adapter_names) - set(self.peft_config) - {"__base__"})
        if unknown:
            raise ValueError(f"Trying to infer with non-existing adapter(s): {', '.join(unknown)}")

        def hook(module, args, kwargs):
            extra = {"alora_offsets": offsets} if isinstance(module, LoraLinear) else {}
            return args, {**kwargs, "adapter_names": adapter_names, **extra}
        handles = [m.register_forward_pre_hook(hook, with_kwargs=True)
                   for m in self.model.modules()
                   if isinstance(m, (LoraLinear, LoraEmbedding, TrainableTokensWrapper,
                                     LoraMultiheadAttention))]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def __getattr__(self, name):
        """Attributes the wrapper lacks come from the model. Mirrors: peft BaseTuner.__getattr__"""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "model":
                raise
            return getattr(self.model, name)

    def supports_lora_conversion(self, adapter_name="default"):
        """Whether every tuner layer's delta can become plain LoRA factors (convert_to_lora): a
        LoRA linear's can. Mirrors: peft BaseTuner.supports_lora_conversion"""
        return all(supports_lora_conversion(m) for m in self._layers())

    def _get_module_names_tied_with_embedding(self):
        """Modules sharing the input embedding's weight. Mirrors: peft BaseTuner (same name)"""
        return module_names_tied_with_embedding(self.model)

    @property
    def active_adapters(self):
        """The active adapter names, a list. Mirrors: peft BaseTuner.active_adapters"""
        names = self.active_adapter
        return [names] if isinstance(names, str) else list(names)

    def _layers(self):
        return [m for m in self.model.modules() if isinstance(m, BaseTunerLayer)]

    def _param_wrappers(self):
        # LoRA on parameters (nanosft.expert_lora.ParamWrapper): merged and unmerged as layers
        return [m for m in self.model.modules() if hasattr(m, "parameter_name")]

    def _wrappers(self):
        wrappers = (ModulesToSaveWrapper, TrainableTokensWrapper)
        return [m for m in self.model.modules() if isinstance(m, wrappers)]

    def add_adapter(self, adapter_name, config, autocast_adapter_dtype=True):
        """Inject one more adapter (inactive until set_adapter).
        Mirrors: peft BaseTuner.inject_adapter (as PeftModel.add_adapter calls it)"""
        if len(self.peft_config) >= 1 and config.bias != "none" and any(
                c.bias != "none" for c in self.peft_config.values()):
            raise ValueError("LoraModel supports only 1 adapter with bias. When using multiple "
                             "adapters, set bias to 'none' for all adapters.")
        check_bias(config)
        if config.target_parameters:  # product layer, imported on use
            from nanosft.expert_lora import check_same_target_parameters

            check_same_target_parameters(self.peft_config, config)
        self.peft_config[adapter_name] = config
        try:
            inject_adapter(self.model, config, adapter_name)
        except Exception:
            del self.peft_config[adapter_name]
            raise
        mark_only_adapters_as_trainable(self.model, config, adapter_name)
        add_trainable_tokens(self.model, config, adapter_name)
        # the new one stays inactive; the active ones train unless the new config is for inference
        self.set_adapter(self.active_adapters, inference_mode=config.inference_mode)
        cast_adapter_dtype(self.model, adapter_name, autocast_adapter_dtype)

    def add_weighted_adapter(self, adapters, weights, adapter_name, combination_type="svd",
                             svd_rank=None, svd_clamp=None, svd_full_matrices=True,
                             svd_driver=None, density=None, majority_sign_method="total"):
        """A new (inactive, frozen) adapter: the weighted mix of `adapters`; nothing if the name
        exists. combination_type: "cat" (exact), "svd" (exact up to `svd_rank`), "linear" and
        the TIES / DARE / magnitude-pruning kinds (nanosft.weighted_adapters).
        Mirrors: peft LoraModel.add_weighted_adapter"""
        if adapter_name in self.peft_config:
            return
        combination_type, config = weighted_adapter_config(self, adapters, combination_type,
                                                           svd_rank)
        self.add_adapter(adapter_name, config)
        for n, p in self.model.named_parameters():  # peft _freeze_adapter
            if adapter_name in n:
                p.requires_grad = False
        for layer in self._layers():
            fill_weighted_adapter(layer, adapter_name, adapters, weights, combination_type,
                                  config.r, density, majority_sign_method, svd_clamp,
                                  svd_full_matrices, svd_driver)

    def set_adapter(self, adapter_name, inference_mode=False):
        """Make `adapter_name` (a name or list) active; only its weights require grad.
        Mirrors: peft BaseTuner.set_adapter"""
        for layer in self._layers():
            layer.set_adapter(adapter_name)
            if inference_mode:
                for d in ("lora_A", "lora_B", "lora_magnitude_vector", "lora_embedding_A",
                          "lora_embedding_B"):
                    if hasattr(layer, d):
                        getattr(layer, d).requires_grad_(False)
        for wrapper in self._param_wrappers():
            wrapper.set_adapter(adapter_name)
            if inference_mode:
                wrapper.lora_A.requires_grad_(False)
                wrapper.lora_B.requires_grad_(False)
        for wrapper in self._wrappers():
            wrapper.set_adapter(adapter_name, inference_mode)
        self.active_adapter = adapter_name

    def set_requires_grad(self, adapter_names, requires_grad=True):
        """Switch gradients of the named adapters' weights on or off, active or not.
        Mirrors: peft BaseTuner.set_requires_grad"""
        names = [adapter_names] if isinstance(adapter_names, str) else list(adapter_names)
        for layer in self._layers() + self._param_wrappers():
            for attr in getattr(layer, "adapter_layer_names", ()):
                for name in names:
                    if name in getattr(layer, attr, {}):
                        getattr(layer, attr)[name].requires_grad_(requires_grad)
        for wrapper in self._wrappers():
            for name in names:
                if isinstance(wrapper, TrainableTokensWrapper):
                    deltas = wrapper.token_adapter.trainable_tokens_delta
                    if name in deltas:
                        deltas[name].requires_grad_(requires_grad)
                elif name in wrapper.modules_to_save:
                    wrapper.modules_to_save[name].requires_grad_(requires_grad)

    def _enable_adapter_layers(self, enabled):
        params = [m for m in self.model.modules() if hasattr(m, "parameter_name")]  # ParamWrapper
        for module in self._layers() + self._wrappers() + params:
            module.enable_adapters(enabled)

    def disable_adapter_layers(self):
        """Every adapter off: the model computes as its base.
        Mirrors: peft BaseTuner.disable_adapter_layers"""
        for name in self.active_adapters:
            bias = getattr(self.peft_config[name], "bias", "none")
            if bias != "none":
                warnings.warn(f"Careful, disabling adapter layers with bias configured to be "
                              f"'{bias}' does not produce the same output as the base model would "
                              "without adaption.")
        self._enable_adapter_layers(False)

    def enable_adapter_layers(self):
        """Every adapter on again. Mirrors: peft BaseTuner.enable_adapter_layers"""
        self._enable_adapter_layers(True)

    def delete_adapter(self, adapter_name):
        """Remove an adapter from every layer; a merged one must be unmerged first.
        Mirrors: peft BaseTuner.delete_adapter"""
        if adapter_name not in self.peft_config:
            raise ValueError(f"Adapter {adapter_name} does not exist")
        if any(adapter_name in layer.merged_adapters
               for layer in self._layers() + self._param_wrappers()):
            raise ValueError(f"Cannot delete adapter(s) {[adapter_name]} while they are merged. "
                             "Please unmerge them first.")
        del self.peft_config[adapter_name]
        new_active = [n for n in self.active_adapters if n != adapter_name]
        if not new_active and self.peft_config:
            new_active = sorted(self.peft_config)[:1]
            warnings.warn(f"Adapter {adapter_name} was active which is now deleted. Setting active "
                          f"adapter to {new_active[0]}.")
        for layer in self._layers() + self._param_wrappers():
            layer.delete_adapter(adapter_name)
            layer.set_adapter(new_active)
        for wrapper in self._wrappers():
            wrapper.delete_adapter(adapter_name, new_active)
        self.active_adapter = new_active

    def _check_merge_allowed(self):
        # a replicated layer shares its base weights with its copies: a merge would change them all
        # Differs: peft's check reads the adapter dict for the key, so it never refuses
        if any(getattr(c, "layer_replication", None) for c in self.peft_config.values()):
            raise ValueError("Cannot merge LORA layers when base model layers are replicated")

    def merge_adapter(self, adapter_names=None, safe_merge=False):
        """Fold the (active) adapters into the base weights, keeping them to unmerge.
        Mirrors: peft BaseTuner.merge_adapter"""
        self._check_merge_allowed()
        for layer in self._layers() + self._param_wrappers():
            layer.merge(adapter_names=adapter_names, safe_merge=safe_merge)

    def unmerge_adapter(self):
        """Take every merged adapter out again. Mirrors: peft BaseTuner.unmerge_adapter"""
        for layer in self._layers() + self._param_wrappers():
            if layer.merged:
                layer.unmerge()

    def _unload_and_optionally_merge(self, merge=True, safe_merge=False, adapter_names=None):
        replaced = []  # names already swapped for their base: what was inside them is gone
        for name, module in list(self.model.named_modules()):
            if any(name.startswith(r + ".") for r in replaced):
                continue
            if hasattr(module, "parameter_name"):  # ParamWrapper: one per wrapped parameter
                if isinstance(self.model.get_submodule(name), ModulesToSaveWrapper):
                    continue
                replaced.append(name)
                while hasattr(module, "parameter_name"):  # nested: one per parameter
                    if merge and not module.merged:
                        module.merge()
                    module = module.base_layer
                _replace_module(self.model, name, module)
            elif isinstance(module, TrainableTokensWrapper):
                replaced.append(name)
                _replace_module(self.model, name, module.unload(merge, safe_merge, adapter_names))
            elif isinstance(module, LoraMultiheadAttention):  # its out_proj is unwrapped too
                replaced.append(name)
                _replace_module(self.model, name, module.unload_and_optionally_merge_module(
                    merge, safe_merge, adapter_names))
            elif isinstance(module, BaseTunerLayer):
                if merge:
                    module.merge(safe_merge=safe_merge, adapter_names=adapter_names)
                _replace_module(self.model, name, module.base_layer)
            elif isinstance(module, ModulesToSaveWrapper):
                keep = module._active_module() if merge else module.original_module
                _replace_module(self.model, name, keep)
        return self.model

    def merge_and_unload(self, progressbar=False, safe_merge=False, adapter_names=None):
        """Merge the adapters and return the plain model. Mirrors: peft merge_and_unload"""
        self._check_merge_allowed()
        model = self._unload_and_optionally_merge(True, safe_merge, adapter_names)
        untie_config_if_diverged(model)
        return model

    def unload(self):
        """Return the plain model with the adapters dropped, not merged. Mirrors: peft unload"""
        return self._unload_and_optionally_merge(merge=False)


def get_base_model_state_dict(model):
    """The base model's own state dict from a PEFT model: keys as the unwrapped model has them, no
    adapter tensors (a merged model is read merged). Mirrors: peft get_base_model_state_dict"""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    out = {}
    for key, value in base.state_dict().items():
        if ".lora_" in key or ".modules_to_save." in key or ".trainable_tokens_" in key:
            continue
        out[_base_key(key)] = value
    return out


def _base_key(key):
    # the unwrapped model's name of a wrapped module's tensor
    key = key.replace(".token_adapter.base_layer.", ".")
    return key.replace(".base_layer.", ".").replace(".original_module.", ".")


def set_base_model_state_dict(model, state_dict, strict=False):
    """Load a base model's state dict (keys as the unwrapped model has them) into a PEFT model,
    under its LoRA layers' `base_layer` and modules_to_save's `original_module`.
    Mirrors: peft set_base_model_state_dict"""
    from nanosft.adapter_files import LoadResult

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    own = {}
    for key in base.state_dict():
        if ".lora_" in key or ".modules_to_save." in key or ".trainable_tokens_" in key:
            continue
        own[_base_key(key)] = key
    unexpected = sorted(set(state_dict) - set(own))
    missing = sorted(set(own) - set(state_dict))
    base.load_state_dict({own[k]: v for k, v in state_dict.items() if k in own}, strict=False)
    return LoadResult(missing_keys=missing, unexpected_keys=unexpected)


def inject_adapter_in_model(peft_config, model, adapter_name="default", low_cpu_mem_usage=False,
                            state_dict=None):
    """Put LoRA layers into `model` in place and return it (no PeftModel around it; only the
    adapters train). low_cpu_mem_usage: the adapter weights are left on the meta device, to be
    filled by a load. Mirrors: peft inject_adapter_in_model"""
    if peft_config.is_prompt_learning:
        raise ValueError("`inject_adapter_in_model` does not support prompt learning and adaption "
                         "prompt yet.")
    model = LoraModel(model, {adapter_name: peft_config}, adapter_name).model
    if low_cpu_mem_usage:
        for layer in [m for m in model.modules() if isinstance(m, BaseTunerLayer)]:
            for name in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B",
                         "lora_magnitude_vector"):
                if hasattr(layer, name) and adapter_name in getattr(layer, name):
                    getattr(layer, name)[adapter_name] = getattr(layer, name)[adapter_name].to(
                        "meta")
    return model

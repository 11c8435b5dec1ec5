"""Hot-swapping a loaded LoRA adapter: another adapter's weights copied into the same tensors.

A server keeps one model (maybe compiled) and changes which LoRA it runs without adding a second
adapter: `hotswap_adapter(model, path, adapter_name="default")` reads the new adapter's files and
writes its A and B into the loaded adapter's parameters, in place; layers the new adapter does not
touch get zeros (no update), and each layer's scaling becomes the new alpha / r. Before compiling,
`prepare_model_for_compiled_hotswap` pads every A and B to one `target_rank` with zeros (the
product B A is unchanged) and turns the scalings into tensors, so later swaps of other ranks and
alphas change values only, never shapes or Python constants a compiled graph was built on.
Mirrors: peft.utils.hotswap (hotswap_adapter, hotswap_adapter_from_state_dict,
prepare_model_for_compiled_hotswap, check_hotswap_configs_compatible)
Differs: each layer's rank and alpha come from rank_pattern / alpha_pattern matched on its module
name (peft matches the patterns against the full parameter key, where they never match).
"""

import math
import warnings

import torch
from torch import nn

from nanosft.adapter_files import (
    PEFT_TYPE_TO_PREFIX_MAPPING, PeftType, _adapter_keys, load_adapter_files, pattern_value,
)
from nanosft.lora import AdapterLinear, LoraLinear
from nanosft.lora_layers import LoraConv

# config fields two adapters must share: nothing in the model changes with them on a swap
CONFIG_KEYS_TO_CHECK = {PeftType.LORA: ("use_rslora", "lora_dropout", "alpha_pattern", "use_dora")}


def check_hotswap_configs_compatible(config0, config1):
    """Refuse a swap between different methods, of a method other than LoRA, or between configs
    that differ in a field the loaded layers keep (CONFIG_KEYS_TO_CHECK).
    Mirrors: peft check_hotswap_configs_compatible"""
    type0, type1 = PeftType(config0.peft_type), PeftType(config1.peft_type)
    if type0 != type1:
        raise ValueError(f"Incompatible PEFT types found: {type0.value} and {type1.value}")
    if type0 not in CONFIG_KEYS_TO_CHECK:
        supported = ", ".join(t.value for t in CONFIG_KEYS_TO_CHECK)
        raise ValueError(f"Hotswapping only supports {supported} but {type0.value} was passed.")
    d0, d1 = config0.to_dict(), config1.to_dict()
    for key in CONFIG_KEYS_TO_CHECK[type0]:
        if d0.get(key) != d1.get(key):
            raise ValueError(f"Configs are incompatible: for {key}, {d0.get(key)} != {d1.get(key)}")


def _unwrap(model):
    return getattr(model, "_orig_mod", model)  # a torch.compile'd module's original


def _lora_layers(model):
    return [m for m in model.modules() if isinstance(getattr(m, "scaling", None), dict)
            and isinstance(getattr(m, "lora_A", None), nn.ModuleDict)]


def _set_scaling(layer, adapter_name, scaling):
    old = layer.scaling[adapter_name]
    if isinstance(old, torch.Tensor):  # prepared for compilation: the same tensor, a new value
        old.fill_(scaling)
    else:
        layer.scaling[adapter_name] = scaling


def _insert_adapter_name(key, adapter_name, prefix):
    # a saved key (no adapter name) as the model names it: lora_A.weight -> lora_A.<name>.weight
    parts = key.split(".")
    i = max((j for j, p in enumerate(parts) if p.startswith(prefix)), default=None)
    return key if i is None else ".".join(parts[:i + 1] + [adapter_name] + parts[i + 1:])


def _copy_rank_blocks(destination, source, groups):
    # a grouped conv's A: group g's rows sit at g * (rank / groups), for either rank
    dst, src = destination.shape[0] // groups, source.shape[0] // groups
    for g in range(groups):
        destination[g * dst:g * dst + src].copy_(source[g * src:(g + 1) * src])


def _conv_groups(layer):
    return layer.get_base_layer().groups if isinstance(layer, LoraConv) else 1


def hotswap_adapter_from_state_dict(model, state_dict, adapter_name, config,
                                    parameter_prefix="lora_"):
    """Write `state_dict` (keys as the model names them, adapter name inside) into the loaded
    adapter `adapter_name`: a same-shaped tensor is copied, a smaller one (a model padded by
    prepare_model_for_compiled_hotswap) fills the top-left corner of zeros, a larger one replaces
    the parameter's data; the adapter's tensors the state dict lacks become zeros.
    Mirrors: peft hotswap_adapter_from_state_dict"""
    model = _unwrap(model)
    if any(adapter_name in getattr(m, "merged_adapters", ()) for m in _lora_layers(model)):
        raise ValueError(f"Cannot hot-swap adapter '{adapter_name}' because it is currently merged "
                         "into the base weights. Please unmerge the adapter first by calling "
                         "`peft_model.unmerge_adapter()`.")
    params = dict(model.named_parameters())
    unexpected = [k for k in state_dict if k not in params]
    if unexpected:
        raise RuntimeError("Hot swapping the adapter did not succeed, unexpected keys found: "
                           f"{', '.join(unexpected)}.")
    name_part = f".{adapter_name}"
    for key, param in params.items():  # the old adapter's tensors the new one does not have
        if parameter_prefix in key and name_part in key and key not in state_dict:
            param.data.zero_()
    for key, new in state_dict.items():
        module_name = key.split("." + parameter_prefix)[0]
        layer = model.get_submodule(module_name)
        short = module_name.removeprefix("base_model.model.")
        rank = pattern_value(config.rank_pattern or {}, short, config.r)
        alpha = pattern_value(config.alpha_pattern or {}, short, config.lora_alpha)
        _set_scaling(layer, adapter_name,
                     alpha / math.sqrt(rank) if config.use_rslora else alpha / rank)
        _swap_tensor(params[key], new.to(params[key].device), key, layer)


def _swap_tensor(old, new, key, layer):
    with torch.no_grad():
        if old.shape == new.shape:
            old.copy_(new)
        elif all(o >= n for o, n in zip(old.shape, new.shape)):  # padded: the corner, zeros around
            if old.dim() not in (2, 4):
                raise NotImplementedError(f"Trying to hotswap an adapter whose weight has "
                                          f"{old.dim()} dimensions, but only Conv2d and Linear "
                                          "are supported")
            old.zero_()
            groups = _conv_groups(layer)
            if old.shape[0] > new.shape[0] and ".lora_A." in key and groups > 1:
                _copy_rank_blocks(old, new, groups)
            elif old.shape[0] > new.shape[0]:
                old[:new.shape[0]].copy_(new)
            else:
                old[:, :new.shape[1]].copy_(new)
        else:  # a larger rank than the model holds: the parameter takes the new tensor
            old.data = new.to(old.dtype)


def hotswap_adapter(model, model_name_or_path, adapter_name, torch_device=None, **kwargs):
    """Replace the weights of the loaded adapter `adapter_name` with those of the adapter folder
    `model_name_or_path` (a compatible LoRA: see check_hotswap_configs_compatible), keeping its
    name and the model's modules. Mirrors: peft hotswap_adapter"""
    config, saved, _ = load_adapter_files(str(model_name_or_path))
    peft_model = _unwrap(model)
    check_hotswap_configs_compatible(peft_model.peft_config[adapter_name], config)
    prefix = PEFT_TYPE_TO_PREFIX_MAPPING[PeftType(config.peft_type)]
    live = _adapter_keys(peft_model, adapter_name)  # saved key -> the model's key
    state_dict = {live.get(k, _insert_adapter_name(k, adapter_name, prefix)): v
                  for k, v in saved.items()}
    if torch_device is not None:
        state_dict = {k: v.to(torch_device) for k, v in state_dict.items()}
    hotswap_adapter_from_state_dict(peft_model, state_dict, adapter_name, config, prefix)


def _padded(module, target_rank, is_A, groups=1):
    # module (an adapter's A or B) with its rank dimension zero-padded to target_rank
    w = module.weight
    rank = w.shape[0] if is_A else w.shape[1] * module.groups if w.dim() == 4 else w.shape[1]
    if rank == target_rank:
        return module
    if rank > target_rank:
        raise ValueError(f"Trying to pad the adapter to the target rank {target_rank}, but the "
                         f"original rank is larger ({rank}). This is not possible.")
    bias = module.bias is not None
    if w.dim() == 2:
        new = (AdapterLinear(w.shape[1], target_rank, bias=bias) if is_A
               else AdapterLinear(target_rank, w.shape[0], bias=bias))
    else:
        if not is_A and target_rank % module.groups:
            raise ValueError(f"Trying to pad a Conv2d LoRA B with groups={module.groups} to target "
                             f"rank {target_rank}, but the target rank is not divisible by "
                             f"{module.groups}. Please choose a target rank that is divisible by "
                             "groups.")
        shape = ((w.shape[1], target_rank) if is_A else (target_rank, w.shape[0]))
        new = nn.Conv2d(*shape, module.kernel_size, module.stride, module.padding, bias=bias,
                        groups=module.groups)
    new = new.to(w.device, w.dtype)
    with torch.no_grad():
        new.weight.zero_()
        if is_A and groups > 1:
            _copy_rank_blocks(new.weight, w, groups)
        elif is_A:
            new.weight[:rank].copy_(w)
        else:
            new.weight[:, :w.shape[1]].copy_(w)
        if bias:
            new.bias.copy_(module.bias)
    new.weight.requires_grad_(w.requires_grad)
    return new


def prepare_model_for_compiled_hotswap(model, *, target_rank=None, config=None,
                                       check_compiled="error"):
    """Get a model with its first adapter loaded ready to compile and then hot-swap adapters of
    other ranks and alphas: every scaling becomes a tensor; with `target_rank`, every Linear and
    Conv2d adapter's A and B are zero-padded to that rank (the largest of the adapters to come),
    and the `config`s passed (one or a dict) record it.
    Mirrors: peft prepare_model_for_compiled_hotswap"""
    if hasattr(model, "_orig_mod") or getattr(model, "_compiled_call_impl", False):
        if check_compiled == "error":
            raise ValueError("Call prepare_model_for_compiled_hotswap *before* compiling the model")
        if check_compiled == "warn":
            warnings.warn("prepare_model_for_compiled_hotswap was called with a model that is "
                          "already compiled. This will likely result in re-compilation, hurting "
                          "performance. Call the function before compiling the model.")
        elif check_compiled != "ignore":
            raise ValueError("check_compiles should be one of 'error', 'warn', or 'ignore', got "
                             f"'{check_compiled}' instead.")
    layers = _lora_layers(_unwrap(model))
    for layer in layers:
        device = layer.get_base_layer().weight.device
        for name, value in layer.scaling.items():
            if not isinstance(value, torch.Tensor):
                layer.scaling[name] = torch.tensor(float(value), device=device)
    if not layers:
        raise ValueError("No adapter layers found on the model, make sure call "
                         "`prepare_model_for_compiled_hotswap` after loading the first adapter and "
                         "before loading the second adapter.")
    if target_rank is None:
        return
    for layer in layers:
        if isinstance(layer, LoraConv) and isinstance(layer.get_base_layer(), nn.Conv2d):
            groups = layer.get_base_layer().groups
            if target_rank % groups:
                raise ValueError(f"Trying to pad a Conv2d LoRA adapter with groups={groups} to "
                                 f"target rank {target_rank}, but the target rank is not divisible "
                                 f"by {groups}. Please choose a target rank that is divisible by "
                                 f"{groups}.")
        elif isinstance(layer, LoraLinear):
            groups = 1
        else:
            continue
        for name in list(layer.lora_A):
            layer.lora_A[name] = _padded(layer.lora_A[name], target_rank, True, groups)
            layer.lora_B[name] = _padded(layer.lora_B[name], target_rank, False)
    configs = config.values() if isinstance(config, dict) else [config] if config else []
    for c in configs:
        c.r = target_rank
        for key in c.rank_pattern or {}:
            c.rank_pattern[key] = target_rank

"""peft's `add_weighted_adapter`: a new LoRA adapter made from a weighted mix of existing ones.

Three families of combination, per LoRA layer:
- "cat": the adapters' A stacked along the rank (each times weight x scaling) and their B side by
  side; exact (the new delta is the weighted sum), rank = the sum of the ranks.
- "linear", "ties", "dare_linear", "dare_ties", "magnitude_prune": A and B mixed separately, each
  side weighted by sqrt(|weight x scaling|) (the sign on A); needs equal ranks, an approximation.
- "svd" and the "*_svd" variants: the weighted deltas B A mixed (TIES, DARE, magnitude pruning as
  asked), then cut to rank `svd_rank` by a truncated SVD: B = U S, A = Vh.
The new adapter's lora_alpha equals its rank (scaling 1: the scalings are inside A, B).
Papers: TIES-merging (2306.01708), DARE (2311.03099).
"""

import dataclasses
import math
import warnings

import torch

from nanosft.lora import ModulesToSaveWrapper

COMBINATIONS = ("svd", "linear", "cat", "ties", "ties_svd", "dare_ties", "dare_linear",
                "dare_ties_svd", "dare_linear_svd", "magnitude_prune", "magnitude_prune_svd")
_SAME_RANK = ("linear", "ties", "dare_ties", "dare_linear", "magnitude_prune")


def weighted_adapter_config(lora_model, adapters, combination_type, svd_rank):
    """Check the request; return the combination used and the new adapter's config (the first
    adapter's, with the new rank and the union of the targets).
    Mirrors: peft LoraModel._check_add_weighted_adapter"""
    configs = lora_model.peft_config
    for name in adapters:
        if name not in configs:
            raise ValueError(f"Adapter {name} does not exist")
    for name in adapters:
        if configs[name].target_parameters:
            raise ValueError("add_weighted_adapter does not support targeting nn.Parameter "
                             f"(problematic adapter '{name}')")
    wrappers = [m for m in lora_model.modules() if isinstance(m, ModulesToSaveWrapper)]
    clashes = [w for w in wrappers if sum(a in w.modules_to_save for a in adapters) > 1]
    if clashes:
        raise ValueError("Cannot add weighted adapters if they target the same module with "
                         f"modules_to_save, but found {len(clashes)} such instance(s).")
    if combination_type not in COMBINATIONS:
        raise ValueError(f"Invalid combination_type: {combination_type}")
    combination_type = "linear" if len(adapters) == 1 else combination_type
    # the largest rank any layer of an adapter has (rank_pattern included): room for all
    ranks = [max(c.r, *c.rank_pattern.values()) if c.rank_pattern else c.r
             for c in (configs[a] for a in adapters)]
    if combination_type in _SAME_RANK:
        if len(set(ranks)) != 1:
            raise ValueError("All adapters must have the same r value when using combination_type "
                             "linear, ties, dare_ties or dare_linear.")
        rank = ranks[0]
    elif combination_type == "cat":
        rank = sum(ranks)
    else:
        rank = svd_rank or max(ranks)
    targets = [configs[a].target_modules for a in adapters]
    if len({isinstance(t, str) for t in targets}) > 1:
        raise ValueError("all adapter configs should follow the same target modules type. "
                         "Combining adapters with `target_modules` type being a mix of list/set "
                         "and string is not supported.")
    if isinstance(targets[0], str):
        target_modules = "|".join(f"({t})" for t in targets)
    else:
        target_modules = sorted(set().union(*targets))
    config = dataclasses.replace(configs[adapters[0]], r=rank, lora_alpha=rank,
                                 target_modules=target_modules, alpha_pattern={}, rank_pattern={})
    return combination_type, config


def _factors(layer, name):
    # (A, B) of adapter `name` in a LoRA layer: [r, in] and [out, r] (conv: kernels), or None
    if name in getattr(layer, "lora_A", {}):
        return layer.lora_A[name].weight, layer.lora_B[name].weight
    if name in getattr(layer, "lora_embedding_A", {}):
        return layer.lora_embedding_A[name], layer.lora_embedding_B[name]
    return None


@torch.no_grad()
def fill_weighted_adapter(layer, adapter_name, adapters, weights, combination_type, rank,
                          density=None, majority_sign_method="total", svd_clamp=None,
                          svd_full_matrices=True, svd_driver=None):
    """Write the mix of `adapters` into `layer`'s fresh adapter `adapter_name`.
    Mirrors: peft LoraModel.add_weighted_adapter (its per-layer loop)"""
    new = _factors(layer, adapter_name)
    if new is None:
        return
    new_A, new_B = new
    found = [(a, w, _factors(layer, a)) for a, w in zip(adapters, weights)]
    found = [(a, w, f) for a, w, f in found if f is not None]
    if not found:
        raise ValueError("No matching LoRAs found. Please raise an issue on GitHub.")
    if combination_type == "cat":
        A = torch.cat([f[0] * w * layer.scaling[a] for a, w, f in found], dim=0)
        B = torch.cat([f[1] for _, _, f in found], dim=1)
        new_A.zero_()[:A.shape[0]] = A
        new_B.zero_()[:, :B.shape[1]] = B
    elif combination_type.endswith("svd"):
        kind = combination_type[:-len("_svd")] if combination_type != "svd" else "linear"
        deltas = [layer.get_delta_weight(a) for a, _, _ in found]
        mix = _out_in(layer, merge_tensors(kind, deltas, torch.tensor([w for _, w, _ in found]),
                                           density, majority_sign_method))
        U, S, Vh = torch.linalg.svd(mix, full_matrices=svd_full_matrices, driver=svd_driver)
        U, Vh = U[:, :rank] @ torch.diag(S[:rank]), Vh[:rank]
        if svd_clamp is not None:  # clip both factors at the svd_clamp quantile of their values
            high = torch.quantile(torch.cat([U.flatten(), Vh.flatten()]), svd_clamp)
            U, Vh = U.clamp(-high, high), Vh.clamp(-high, high)
        new_A.data = Vh.reshape(new_A.shape) if new_A.dim() > 2 else Vh
        new_B.data = U.reshape(new_B.shape) if new_B.dim() > 2 else U
    else:  # A and B mixed apart: sqrt of |weight x scaling| on each, the sign on A
        scaled = [w * layer.scaling[a] for a, w, _ in found]
        weights_A = torch.tensor([math.copysign(math.sqrt(abs(s)), s) if s else 0.0
                                  for s in scaled])
        weights_B = torch.tensor([math.sqrt(abs(s)) for s in scaled])
        dtype = found[0][2][0].dtype
        A = merge_tensors(combination_type, [f[0] for _, _, f in found], weights_A, density,
                          majority_sign_method)
        B = merge_tensors(combination_type, [f[1] for _, _, f in found], weights_B, density,
                          majority_sign_method)
        new_A.data, new_B.data = A.to(dtype), B.to(dtype)


def _out_in(layer, delta):
    # a delta as an [out, in] matrix (a conv's kernel flattened; an embedding's [num_embeddings,
    # dim] transposed), so that the SVD's U is B and its Vh is A
    if hasattr(layer, "lora_embedding_A"):
        return delta.T
    return delta.flatten(1) if delta.dim() > 2 else delta


# ----------------------------------------------------------------------------- merging tensors

def merge_tensors(kind, tensors, weights, density=None, majority_sign_method="total"):
    """Weighted merge of same-shaped tensors: "linear" (task arithmetic: the weighted sum),
    "magnitude_prune" (each pruned to its largest `density` share first), "ties" (pruned, then
    only the entries agreeing with the majority sign, averaged), "dare_linear" / "dare_ties"
    (random pruning, rescaled by 1/density, then as linear / ties).
    Mirrors: peft.utils.merge_utils task_arithmetic, magnitude_prune, ties, dare_linear,
    dare_ties"""
    if kind in ("magnitude_prune", "ties"):
        tensors = [prune(t, density, "magnitude") for t in tensors]
    elif kind in ("dare_linear", "dare_ties"):
        tensors = [prune(t, density, "random", rescale=True) for t in tensors]
    elif kind != "linear":
        raise ValueError("Invalid combination type")
    stacked = torch.stack(tensors)
    weighted = stacked * weights.to(stacked.device).view(-1, *[1] * (stacked.dim() - 1))
    if kind not in ("ties", "dare_ties"):
        return weighted.sum(dim=0)
    # TIES: per entry, the sign of the (signed or counted) majority; the others are dropped
    votes = stacked.sum(dim=0) if majority_sign_method == "total" else (
        stacked.sign().sum(dim=0) if majority_sign_method == "frequency" else None)
    if votes is None:
        raise RuntimeError(f'Unimplemented mask method "{majority_sign_method}"')
    agree = stacked.sign() == torch.where(votes >= 0, 1, -1)
    return (weighted * agree).sum(dim=0) / agree.sum(dim=0).clamp(min=1.0)


def prune(tensor, density, method, rescale=False):
    """Keep a `density` share of the entries: the largest in magnitude, or random ones (Bernoulli,
    optionally rescaled by 1/density). Mirrors: peft.utils.merge_utils.prune"""
    if density >= 1:
        warnings.warn(f"The density {density} is greater than or equal to 1, no pruning will be "
                      "performed.")
        return tensor
    if density < 0:
        raise ValueError(f"Density should be >= 0, got {density}")
    if method == "magnitude":
        keep = torch.zeros(tensor.numel(), dtype=tensor.dtype, device=tensor.device)
        keep[tensor.abs().flatten().topk(int(density * tensor.numel())).indices] = 1
        return tensor * keep.view(tensor.shape)
    if method == "random":
        pruned = tensor * torch.bernoulli(torch.full_like(tensor, density))
        return pruned / density if rescale else pruned
    raise ValueError(f"Unknown method {method}")


# ----------------------------------------------------------------------------- conversion

def supports_lora_conversion(layer):
    """A layer whose delta can become plain LoRA factors: a LoRA linear (not aLoRA).
    Mirrors: peft lora.Linear.supports_lora_conversion (other tuner layers answer no)"""
    return type(layer).__name__ == "LoraLinear" and not any(layer.use_alora.values())


@torch.no_grad()
def convert_to_lora(model, rank, adapter_name="default", progressbar=False, compile_kwargs=None):
    """(LoraConfig, state dict) of a plain LoRA adapter approximating `adapter_name` layer by
    layer: each delta's truncated SVD, B = U S and A = Vh, at `rank` (an int) or at the smallest
    rank keeping that share of the squared singular values (a float in (0, 1]); alpha = rank.
    Mirrors: peft convert_to_lora
    Differs: progressbar and compile_kwargs change nothing."""
    from nanosft.adapter_files import LoraConfig  # the files layer: imported on use

    if isinstance(rank, float) and not 0 < rank <= 1:
        raise ValueError("If rank is a float, it is interpreted as a threshold. It must be between "
                         f"0 and 1 but got {rank}.")
    if rank == 0:
        raise ValueError("Passing a rank of 0 doesn't make sense, please pass a valid value.")
    layers = [(n, m) for n, m in model.named_modules() if _is_tuner_layer(m)]
    unsupported = {repr(type(m)) for _, m in layers if not supports_lora_conversion(m)}
    if unsupported:
        raise TypeError("Some module types on this model do not support LoRA conversion: "
                        f"{', '.join(unsupported)}.")
    if not layers:
        raise TypeError("Could not detect any layer that supports LoRA conversion.")
    config = getattr(model, "peft_config", {}).get(adapter_name)
    if config is not None and config.peft_type == "LORA":
        warnings.warn("Converting a PEFT adapter to LoRA that is already a LoRA adapter. There is "
                      "typically no need for that.")
    if config is not None and config.bias != "none":
        raise ValueError(f"The adapter's config sets bias={config.bias}, this is not supported "
                         "right now.")
    targets = list(config.target_modules) if config is not None else []
    rank_pattern, state_dict = {}, {}
    for name, layer in layers:
        delta = layer.get_delta_weight(adapter_name)
        U, S, Vh = torch.linalg.svd(delta.float(), full_matrices=False)
        k = rank if isinstance(rank, int) else _energy_rank(S, rank)
        if k > U.shape[1]:
            raise ValueError(f"The chosen rank {k} is larger than the weight shape ({U.shape[1]}), "
                             "please choose a lower rank.")
        short = name.removeprefix("base_model.model.")
        if k != rank or isinstance(targets, str):
            rank_pattern[short] = k
        elif short not in targets:
            targets.append(short)
        state_dict[f"{name}.lora_A.weight"] = Vh[:k].to(delta.dtype).contiguous()
        state_dict[f"{name}.lora_B.weight"] = (U[:, :k] * S[:k]).to(delta.dtype).contiguous()
    kwargs = dict(rank_pattern=rank_pattern, alpha_pattern=dict(rank_pattern), exclude_modules=[],
                  target_modules=targets, task_type=None)
    if config is not None:
        kwargs.update(base_model_name_or_path=config.base_model_name_or_path,
                      layers_pattern=config.layers_pattern,
                      layers_to_transform=config.layers_to_transform)
    r = rank if isinstance(rank, int) else 1
    lora_config = LoraConfig(r=r, lora_alpha=r, **kwargs)
    if config is not None and config.modules_to_save:
        lora_config.modules_to_save = list(config.modules_to_save)
        for name, module in model.named_modules():
            if isinstance(module, ModulesToSaveWrapper):
                for param_name, param in module.modules_to_save.named_parameters():
                    state_dict[f"{name}.{param_name.rpartition('.')[2]}"] = param.data
    return lora_config, state_dict


def _is_tuner_layer(module):
    # peft BaseTunerLayer: a module with update_layer, merge and unmerge (nanosft.tuners' check)
    names = set().union(*(vars(k) for k in type(module).__mro__))
    return {"update_layer", "merge", "unmerge"} <= names


def _energy_rank(S, threshold):
    # the smallest k whose top-k singular values hold `threshold` of the total S^2
    energy = torch.cumsum(S ** 2, dim=0)
    return int(torch.searchsorted(energy, threshold * energy[-1]).item()) + 1

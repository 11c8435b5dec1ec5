"""LoraConfig's `ensure_weight_tying`: modules tied to the input embedding (an LM head sharing its
weight) stay tied through the adapter.

Before injection the config is rewritten as peft rewrites it: the input embedding is targeted (in
`target_modules` or `modules_to_save`) and the tied modules are taken out, remembered on the config
as `target_modules_to_tie` / `modules_to_tie` (attributes, not saved fields). The embedding then
gets its adapter first; a tied LoRA linear's A and B are the embedding's B and A transposed (views
of the same storage), and a tied modules_to_save copy reads the embedding copy's weight.
"""

import re
import warnings

from torch import nn

# peft EMBEDDING_LAYER_NAMES: the module names that count as an embedding (input or output)
EMBEDDING_LAYER_NAMES = ("embed_tokens", "lm_head")
_WRAPPED = re.compile(r"\.(base_layer|original_module|token_adapter\.base_layer)(?=\.|$)")


def module_names_tied_with_embedding(model):
    """Names of the modules whose weight is the input embedding's (relative to the base model),
    sorted; [] when the config says tie_word_embeddings=False or there is no input embedding.
    Mirrors: peft _get_module_names_tied_with_embedding
    Differs: found by parameter identity, not read from `_tied_weights_keys`."""
    model = model.get_base_model() if hasattr(model, "get_base_model") else model
    model = getattr(model, "model", model) if type(model).__name__ == "LoraModel" else model
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "tie_word_embeddings", None) is False:
        return []
    get = getattr(model, "get_input_embeddings", None)
    embedding = get() if get is not None else None
    if embedding is None:
        return []
    weight = _source_weight(embedding)
    own = {id(p) for p in embedding.parameters()} - {id(weight)}
    names = set()
    for name, module in model.named_modules():
        if module is embedding or any(id(p) in own for p in module.parameters(recurse=False)):
            continue
        if module._parameters.get("weight") is weight:
            names.add(_WRAPPED.sub("", name))
    embedding_name = next(n for n, m in model.named_modules() if m is embedding)
    return sorted(names - {embedding_name})


def _source_weight(embedding):
    # the frozen weight the tied modules share: under a LoRA layer or a wrapper, the base's
    for attr in ("base_layer", "original_module"):
        embedding = getattr(embedding, attr, embedding)
    return embedding.weight


def _embedding_name(model):
    embedding = model.get_input_embeddings()
    return next(n for n, m in model.named_modules() if m is embedding)


def _names_a_target(entry, key):
    # peft: a list entry `m` names `key` if key is m or ends in ".m" (or a module inside it)
    return re.match(rf"(^|.*\.){entry}($|\..*)", key) is not None


def check_tied_modules(model, config):
    """Rewrite `config` for weight tying (or warn why none happens).
    Mirrors: peft BaseTuner._check_tied_modules, LoraModel._add_modules_to_save_to_tie,
    LoraModel._add_targets_to_tie"""
    to_save = list(config.modules_to_save or [])
    embedding_to_save = any(m.split(".")[-1] in EMBEDDING_LAYER_NAMES for m in to_save)
    target = config.target_modules
    if isinstance(target, str):
        embedding_in_target = any(_regex_names(target, m) for m in EMBEDDING_LAYER_NAMES)
    else:
        embedding_in_target = any(m.split(".")[-1] in EMBEDDING_LAYER_NAMES
                                  for m in (target or []))
    tied = module_names_tied_with_embedding(model)
    if not getattr(config, "ensure_weight_tying", False):
        if (embedding_to_save or embedding_in_target) and tied:
            warnings.warn("Model has `tie_word_embeddings=True` and a tied layer is part of the "
                          "adapter, but `ensure_weight_tying` is not set to True. This can lead to "
                          "complications, for example when merging the adapter or converting your "
                          "model to formats other than safetensors. Check the discussion here: "
                          "https://github.com/huggingface/peft/issues/2777")
        return
    if not tied:
        warnings.warn("You have requested `ensure_weight_tying`, but no tied modules were found "
                      "in the model")
    elif embedding_to_save:
        config.modules_to_tie = tied
        config.modules_to_save = _retarget(to_save, _embedding_name(model), tied)
    elif embedding_in_target:
        config.target_modules_to_tie = tied
        embedding_name = _embedding_name(model)
        if isinstance(target, str):  # the embedding always gets the adapter the others share
            config.target_modules = rf"(?:{target}|^{re.escape(embedding_name)}$)"
        else:
            config.target_modules = sorted(_retarget(sorted(set(target)), embedding_name, tied))
    else:
        warnings.warn("You have requested `ensure_weight_tying`, but no tied modules are added in "
                      "either `modules_to_save` or `target_modules`")


def _regex_names(pattern, key):
    return re.fullmatch(pattern, key) is not None


def _retarget(entries, embedding_name, tied):
    # the embedding in, then for each tied module the first entry naming it out
    entries = entries + ([embedding_name] if embedding_name not in entries else [])
    for key in tied:
        hit = next((m for m in entries if _names_a_target(m, key)), None)
        if hit is not None:
            entries.remove(hit)
    return entries


def is_tied_target(config, name):
    """True if `name` is a module left to follow the embedding's LoRA adapter.
    Mirrors: peft BaseTuner._check_tied_module_exists"""
    tied = getattr(config, "target_modules_to_tie", None) or []
    return any(name == t or name.endswith("." + t) for t in tied)


def tie_lora_to_embedding(layer, embedding, adapter_name, init_lora_weights=True):
    """Make a LoRA linear's adapter `adapter_name` the embedding's, transposed: A is the
    embedding's B^T and B its A^T (views, so both always hold the same numbers). The linear's
    freshly drawn init, unless init_lora_weights=False, is written into the shared storage in
    the order peft's reset of the transposed views writes it.
    Mirrors: peft LoraLayer.update_layer (tied_adapter)"""
    for lora, source in ((layer.lora_A[adapter_name], embedding.lora_embedding_B[adapter_name]),
                         (layer.lora_B[adapter_name], embedding.lora_embedding_A[adapter_name])):
        if init_lora_weights is not False:  # torch fills a transposed view in memory order
            source.data.copy_(lora.weight.data.reshape(source.shape))
        lora.weight = nn.Parameter(source.t(), requires_grad=lora.weight.requires_grad)



def untie_config_if_diverged(model):
    """After a merge: a config that still says tie_word_embeddings=True while the input and output
    embeddings now hold different weights (a merged embedding adapter) is set to False, with a
    warning, so saving and reloading does not tie them again.
    Mirrors: peft BaseTuner._unload_and_optionally_merge (its tie_word_embeddings fix)"""
    config = getattr(model, "config", None)
    if not getattr(config, "tie_word_embeddings", False):
        return
    try:
        out_emb, in_emb = model.get_output_embeddings(), model.get_input_embeddings()
    except (NotImplementedError, AttributeError):
        return
    out_w, in_w = getattr(out_emb, "weight", None), getattr(in_emb, "weight", None)
    if out_w is not None and in_w is not None and out_w.data_ptr() != in_w.data_ptr():
        config.tie_word_embeddings = False
        warnings.warn("Input and output embeddings are no longer tied after merging. Setting "
                      "`tie_word_embeddings=False` in the model config.")

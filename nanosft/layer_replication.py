"""LoraConfig's `layer_replication`: a deeper model from the same weights. The decoder's layer list
is rebuilt from ranges of the original layers, e.g. [[0, 4], [2, 5]] on five layers gives
[0, 1, 2, 3, 2, 3, 4]; a repeated layer is a new module whose parameters are the original's
tensors, so each copy gets its own LoRA adapter while the base weights are stored once.
Mirrors: peft.tuners.tuners_utils.replicate_layers, clone_module
"""

import copy

from torch import nn


def clone_module(module, share_weights=False):
    """A deep copy of `module`; with share_weights, every parameter of the copy is the original's
    Parameter object (buffers stay copies). Mirrors: peft clone_module"""
    clone = copy.deepcopy(module)
    if share_weights:
        for name, submodule in module.named_modules():
            target = clone.get_submodule(name)
            for pname, param in submodule.named_parameters(recurse=False):
                target.register_parameter(pname, param)
    return clone


def replicate_layers(model, layer_map):
    """Replace the decoder's layer list (model(.model)*.layers, a BERT encoder's layer, or
    Falcon's h) by the layers `layer_map`'s [start, end) ranges name, weights shared; each copy's
    `layer_idx` is its new position and config.num_hidden_layers the new depth.
    Mirrors: peft replicate_layers"""
    while hasattr(model, "model"):
        model = model.model
    if hasattr(model, "bert"):
        model = model.bert
    if hasattr(model, "layers"):
        owner, attr = model, "layers"
    elif hasattr(model, "encoder") and hasattr(model.encoder, "layer"):
        owner, attr = model.encoder, "layer"
    elif hasattr(model, "h"):
        owner, attr = model, "h"
    else:
        owner, attr = None, None
    layers = getattr(owner, attr, None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError("Could not locate the layers attribute in the model. Expected Llama, "
                         "Bert or Falcon compatible architectures. (LoraConfig.layer_replication "
                         "rebuilds model.layers, encoder.layer or h.)")
    for pair in layer_map:
        start, end = pair
        if not 0 <= start < end <= len(layers):
            raise ValueError(f"LoraConfig.layer_replication range {list(pair)} is not a range "
                             f"[start, end) of the model's {len(layers)} layers")
    new_layers = []
    for start, end in layer_map:
        for i in range(start, end):
            clone = clone_module(layers[i], share_weights=True)
            for submodule in clone.modules():  # transformers' attention indexes its cache by it
                if hasattr(submodule, "layer_idx"):
                    submodule.layer_idx = len(new_layers)
            new_layers.append(clone)
    setattr(owner, attr, nn.ModuleList(new_layers))
    config = getattr(model, "config", None)
    if hasattr(config, "num_hidden_layers"):
        config.num_hidden_layers = len(new_layers)

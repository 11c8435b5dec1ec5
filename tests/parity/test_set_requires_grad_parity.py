"""PeftModel.set_requires_grad against peft 0.21.2: after adding a second adapter (with a
modules_to_save copy) and switching gradients on for it, then off for both, every parameter's
requires_grad equals peft's, on Linear and Embedding layers; each layer names its per-adapter
weights in adapter_layer_names as peft's does.
Run: python -m pytest -q tests/parity/test_set_requires_grad_parity.py
"""

import peft
import torch
from torch import nn

import nanosft


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])

    def forward(self, x):
        h = self.emb(x)
        for layer in self.layers:
            h = layer(h)
        return h


def _states(lib):
    torch.manual_seed(0)
    model = lib.get_peft_model(Net(), lib.LoraConfig(target_modules=["layers.0", "emb"]),
                               adapter_name="a0")
    model.add_adapter("a1", lib.LoraConfig(target_modules=["layers.0", "layers.1", "emb"],
                                           modules_to_save=["layers.2"]))
    seen = []
    for step in (lambda: None, lambda: model.set_requires_grad("a1"),
                 lambda: model.set_requires_grad(["a0", "a1"], requires_grad=False)):
        step()
        seen.append({n: p.requires_grad for n, p in model.named_parameters()
                     if ".a0" in n or ".a1" in n})
    layer = model.base_model.model.layers[0]
    names = {name: (name in layer.adapter_layer_names) for name in ("lora_A", "lora_B")}
    return seen, names


def test_requires_grad_follows_peft():
    ours, theirs = _states(nanosft), _states(peft)
    assert ours == theirs
    first, switched, off = ours[0]
    assert any(first.values()) and not all(first.values())
    assert all(v for n, v in switched.items() if ".a1" in n)
    assert not any(off.values())


def _after_delete(lib):
    torch.manual_seed(0)
    model = lib.get_peft_model(Net(), lib.LoraConfig(target_modules=["layers.0", "emb"]))
    model.add_adapter("a1", lib.LoraConfig(target_modules=["layers.0", "emb"]))
    model.delete_adapter("a1")
    left = {}
    for name in ("layers.0", "emb"):
        layer = model.base_model.model.get_submodule(name)
        names = layer.adapter_layer_names + layer.other_param_names
        left[name] = [n for n in names if hasattr(layer, n) and "a1" in getattr(layer, n)]
        assert [n for n in names if hasattr(layer, n) and "default" in getattr(layer, n)]
    return left, model.active_adapters


def test_delete_adapter_clears_every_named_dict_as_peft():
    ours, theirs = _after_delete(nanosft), _after_delete(peft)
    assert ours == theirs == ({"layers.0": [], "emb": []}, ["default"])
    for cls, names in ((nanosft.lora.LoraLinear, ("lora_A", "lora_B", "r", "scaling")),
                       (nanosft.lora_layers.LoraEmbedding, ("lora_embedding_A", "scaling"))):
        assert set(names) <= set(cls.adapter_layer_names + cls.other_param_names)

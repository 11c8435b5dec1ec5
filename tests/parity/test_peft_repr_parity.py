"""A printed adapted model reads as peft 0.21.2's: each LoRA layer prints as `lora.<peft's class>`
(Linear, also over transformers' Conv1D; Embedding; Conv2d; MultiheadAttention; ParamWrapper
with the parameter's name first), then its children as usual.
Run: python -m pytest -q tests/parity/test_peft_repr_parity.py
"""

import peft
import pytest
import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

import nanosft


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(10, 20)
        self.emb = nn.Embedding(100, 5)
        self.conv1d = Conv1D(3, 5)
        self.conv2d = nn.Conv2d(5, 10, 3)
        self.mha = nn.MultiheadAttention(8, 2)

    def forward(self, x):
        return self.lin(x)


CASES = [({"target_modules": ["lin"]}, "lin"), ({"target_modules": ["emb"]}, "emb"),
         ({"target_modules": ["conv1d"]}, "conv1d"), ({"target_modules": ["conv2d"]}, "conv2d"),
         ({"target_modules": ["mha"]}, "mha"),
         ({"target_modules": [], "target_parameters": ["lin.weight"]}, "lin")]


def _head(lib, kwargs, name):
    torch.manual_seed(0)
    model = lib.get_peft_model(Net(), lib.LoraConfig(r=2, **kwargs))
    text = repr(model.base_model.model.get_submodule(name))
    return text.splitlines()[:2], text


@pytest.mark.parametrize("kwargs,name", CASES, ids=[c[1] + ("-param" if "target_parameters" in c[0]
                                                             else "") for c in CASES])
def test_layer_prints_as_peft(kwargs, name):
    (theirs, _), (ours, text) = _head(peft, kwargs, name), _head(nanosft, kwargs, name)
    assert ours[0] == theirs[0] and ours[0].startswith("lora.")
    if "target_parameters" in kwargs:
        assert ours[1] == theirs[1] == "  parameter_name='weight',"
    for part in ("lora_", "default", "base_layer"):
        assert part in text

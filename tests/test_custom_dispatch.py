"""LoRA layers registered for other module types (LoraConfig._register_custom_module, peft's
dynamic dispatch) against real peft 0.21.2: a linear-like custom module wrapped by a LoraLinear
subclass (peft: a lora.Linear subclass) gives the same outputs, trained weights and saved tensors
(fp32 atol=rtol=1e-5), the same warning, and reloads from its files. Hermetic. Run:
PYTHONPATH=$PWD OMP_NUM_THREADS=1 python -m pytest -q tests/test_custom_dispatch.py
"""

import warnings

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from nanosft.adapter_files import LoraConfig
from nanosft.lora import LoraLinear
from nanosft.peft import PeftModel, get_peft_model

peft = pytest.importorskip("peft")
from peft.tuners import lora as peft_lora  # noqa: E402

TOL = dict(atol=1e-5, rtol=1e-5)


class LinearLike(nn.Module):
    """Behaves as nn.Linear without being one."""

    def __init__(self):
        super().__init__()
        self.in_features, self.out_features = 10, 20
        self.weight = nn.Parameter(torch.randn(20, 10))

    def forward(self, x):
        return nn.functional.linear(x, self.weight)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin0 = nn.Linear(10, 10)
        self.my_module = LinearLike()
        self.lin1 = nn.Linear(20, 2)

    def forward(self, x):
        return self.lin1(torch.relu(self.my_module(torch.relu(self.lin0(x)))))


class OurLora(LoraLinear):
    pass


class TheirLora(peft_lora.Linear):
    pass


def _wrap(lib, layer_cls, config_cls):
    torch.manual_seed(0)
    base = Model()
    config = config_cls(target_modules=["lin0", "my_module", "lin1"], init_lora_weights=False)
    config._register_custom_module({LinearLike: layer_cls})
    torch.manual_seed(1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model = lib(base, config)
    return model, [str(w.message) for w in seen if "Unsupported layer" in str(w.message)]


def test_custom_layer_trains_and_saves_as_peft(tmp_path):
    ours, our_warnings = _wrap(get_peft_model, OurLora, LoraConfig)
    theirs, their_warnings = _wrap(peft.get_peft_model, TheirLora, peft.LoraConfig)
    assert isinstance(ours.base_model.model.my_module, OurLora)
    assert isinstance(ours.base_model.model.lin0, LoraLinear)
    assert not isinstance(ours.base_model.model.lin0, OurLora)
    assert our_warnings == their_warnings and len(our_warnings) == 1
    x = torch.randn(16, 10)
    for model in (ours, theirs):
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        for _ in range(3):
            opt.zero_grad()
            (model(x).sum() ** 2).backward()
            opt.step()
    torch.testing.assert_close(ours(x), theirs(x), **TOL)
    ours.save_pretrained(tmp_path / "ours")
    theirs.save_pretrained(tmp_path / "theirs")
    a = load_file(tmp_path / "ours" / "adapter_model.safetensors")
    b = load_file(tmp_path / "theirs" / "adapter_model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], **TOL)
    # the registration is not saved: register again, then load
    config = LoraConfig.from_pretrained(tmp_path / "ours")
    assert "_custom_modules" not in config.to_dict()
    config._register_custom_module({LinearLike: OurLora})
    torch.manual_seed(0)
    loaded = PeftModel.from_pretrained(Model(), tmp_path / "ours", config=config)
    assert isinstance(loaded.base_model.model.my_module, OurLora)
    torch.testing.assert_close(loaded(x), ours(x), **TOL)


def test_unregistered_custom_module_is_refused():
    with pytest.raises(ValueError, match="Target module 'my_module' is a LinearLike"):
        get_peft_model(Model(), LoraConfig(target_modules=["my_module"]))
    with pytest.raises(TypeError, match="base_layer must be nn.Linear"):
        LoraLinear(LinearLike())  # only a registered subclass wraps other types

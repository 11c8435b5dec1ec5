"""Attribute reads on a modules_to_save wrapper go to the module in use, as in peft 0.21.2: the
active adapter's trained copy, another adapter's after set_adapter, the original under
disable_adapter; a name no module has raises AttributeError naming it. Each read is compared by
role (which module's tensor it is) with peft's wrapper on the same model.
Run: python -m pytest -q tests/parity/test_modules_to_save_access_parity.py
"""

import peft
import pytest
from torch import nn

import nanosft


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin0 = nn.Linear(1, 2)
        self.lin1 = nn.Linear(3, 4)


def _roles(lib):
    config = lib.LoraConfig(target_modules=["lin0"], modules_to_save=["lin1"])
    model = lib.get_peft_model(Net(), config)
    model.add_adapter("other", config)
    wrapper = model.base_model.model.lin1

    def role(attr):
        value = getattr(wrapper, attr)
        places = {"original": wrapper.original_module, **wrapper.modules_to_save}
        return next(k for k, m in places.items() if getattr(m, attr) is value)

    seen = [(role("weight"), role("bias"))]
    model.set_adapter("other")
    seen.append((role("weight"), role("bias")))
    model.set_adapter("default")
    with model.disable_adapter():
        seen.append((role("weight"), role("bias")))
    with pytest.raises(AttributeError, match="has no attribute 'foo'"):
        wrapper.foo
    return seen


def test_reads_follow_the_active_module_as_peft():
    ours = _roles(nanosft)
    assert ours == _roles(peft)
    assert ours == [("default", "default"), ("other", "other"), ("original", "original")]


def test_reading_the_class_attribute_does_not_recurse():
    with pytest.raises(AttributeError, match="original_module"):
        nanosft.lora.ModulesToSaveWrapper.original_module

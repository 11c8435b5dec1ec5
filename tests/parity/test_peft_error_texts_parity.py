"""Errors peft's own tests match by text, raised by nanosft with peft 0.21.2's words first (and
nanosft's fix after them): a TEXT prompt-tuning init without a tokenizer, and LoRA on a model
whose type has no default target modules; and the warning for an adapter named inside its
method's prefix ("lora" in "lora_"), from get_peft_model and add_adapter.
Run: python -m pytest -q tests/parity/test_peft_error_texts_parity.py
"""

import warnings

import peft
import pytest
import torch
from torch import nn

import nanosft


def _message(make):
    with pytest.raises(ValueError) as caught:
        make()
    return str(caught.value)


def test_text_init_without_tokenizer():
    kwargs = dict(num_virtual_tokens=4, prompt_tuning_init="TEXT",
                  prompt_tuning_init_text="hello")
    theirs = _message(lambda: peft.PromptTuningConfig(task_type="CAUSAL_LM", **kwargs))
    ours = _message(lambda: nanosft.PromptTuningConfig(task_type="CAUSAL_LM", **kwargs))
    assert theirs == "When prompt_tuning_init='TEXT', tokenizer_name_or_path can't be None."
    assert ours.startswith(theirs[:-1])


class _Config:  # what both read: peft its to_dict(), nanosft the attribute
    model_type = "not-a-known-type"

    def to_dict(self):
        return {"model_type": self.model_type}


class _Unknown(nn.Module):
    def __init__(self):
        super().__init__()
        self.config = _Config()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)


def test_no_default_target_modules():
    torch.manual_seed(0)
    theirs = _message(lambda: peft.get_peft_model(_Unknown(), peft.LoraConfig(r=2)))
    ours = _message(lambda: nanosft.get_peft_model(_Unknown(), nanosft.LoraConfig(r=2)))
    assert theirs.startswith("Please specify `target_modules`")
    assert ours.startswith("Please specify `target_modules` in `peft_config`")
    assert "model_type='not-a-known-type'" in ours  # which model type had no default


def test_prefix_mapping_matches_peft():
    from peft.mapping import PEFT_TYPE_TO_PREFIX_MAPPING as theirs

    for peft_type, prefix in nanosft.PEFT_TYPE_TO_PREFIX_MAPPING.items():
        assert theirs[peft.PeftType(peft_type.value)] == prefix


def _name_warnings(lib, name, add):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x)

    config = lib.LoraConfig(r=2, target_modules=["lin"])
    with pytest.warns() as caught:
        warnings.warn("marker")  # (so an empty record is not an error)
        model = lib.get_peft_model(Net(), config, adapter_name="other" if add else name)
        if add:
            model.add_adapter(name, config)
    return [str(w.message) for w in caught if "should not be contained" in str(w.message)]


@pytest.mark.parametrize("add", [False, True], ids=["get_peft_model", "add_adapter"])
@pytest.mark.parametrize("name", ["lora", "ora_", "adapter"])
def test_adapter_name_inside_the_prefix_warns_as_peft(name, add):
    theirs = _name_warnings(peft, name, add)
    ours = _name_warnings(nanosft, name, add)
    assert len(ours) == len(theirs) == (name != "adapter")
    for o, t in zip(ours, theirs):
        assert o.startswith(t)


class _WithContainer(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.other_layer = nn.Linear(4, 4)
        self.module = {
            "ModuleDict": lambda: nn.ModuleDict({"a": nn.Linear(4, 4)}),
            "ModuleList": lambda: nn.ModuleList([nn.Linear(4, 4)]),
            "ParameterDict": lambda: nn.ParameterDict({"a": nn.Parameter(torch.ones(4))}),
            "ParameterList": lambda: nn.ParameterList([nn.Parameter(torch.ones(4))]),
        }[kind]()

    def forward(self, x):
        return self.other_layer(x)


def _type_error(lib, kind):
    config = lib.LoraConfig(r=2, target_modules=["other_layer"], modules_to_save=["module"])
    with pytest.raises(TypeError) as caught:
        lib.get_peft_model(_WithContainer(kind), config)
    return str(caught.value)


@pytest.mark.parametrize("kind", ["ModuleDict", "ModuleList", "ParameterDict", "ParameterList"])
def test_modules_to_save_on_a_container_raises_as_peft(kind):
    theirs, ours = _type_error(peft, kind), _type_error(nanosft, kind)
    assert theirs.startswith("modules_to_save cannot be applied to modules of type")
    assert ours.startswith(theirs)


def test_modules_to_save_on_an_adapter_layer_raises():
    model = nanosft.get_peft_model(_WithContainer("ModuleList"),
                                   nanosft.LoraConfig(r=2, target_modules=["other_layer"]))
    with pytest.raises(TypeError, match="modules_to_save cannot be applied to modules of type"):
        nanosft.lora.ModulesToSaveWrapper(model.base_model.model.other_layer, "x")


@pytest.mark.parametrize("auto_clear_cache", [True, False])
def test_kbit_preparation_clears_the_cuda_cache_as_peft(auto_clear_cache):
    from unittest import mock

    calls = {}
    for lib in (peft, nanosft.peft):
        model = nn.Sequential(nn.Linear(4, 4)).to(torch.float16)
        with mock.patch("torch.cuda.is_available", return_value=True), \
                mock.patch("torch.cuda.empty_cache") as empty_cache:
            lib.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False,
                                                auto_clear_cache=auto_clear_cache)
        calls[lib.__name__] = empty_cache.call_count
        assert model[0].weight.dtype == torch.float32
    assert calls["nanosft.peft"] == calls["peft"] == int(auto_clear_cache)

"""The Auto layer (nanosft.families.auto) is the one place that reads model_type: AutoConfig and
AutoModelForCausalLM pick a family's classes, while ModelConfig / CausalLM and each family's class
read a folder as their own class and refuse another family's folder by name.

Compared: the classes and weights each loader returns for a Llama and a Qwen3 folder saved in
the test, and the errors where a class is given the wrong folder (the negative control of the
dispatch). Hermetic, CPU, tiny models, a few seconds. Run: python -m pytest -q tests/test_auto.py
"""

import pytest
import torch
from tiny import TINY_LLAMA, one_thread, tiny_model  # noqa: F401 (one_thread: an autouse fixture)

from nanosft.configuration import ModelConfig
from nanosft.families.auto import AutoConfig, AutoModelForCausalLM, config_from_dict, from_config
from nanosft.families.qwen3 import Qwen3Config, Qwen3ForCausalLM
from nanosft.model import CausalLM

QWEN3 = {**TINY_LLAMA, "model_type": "qwen3", "head_dim": 8}


@pytest.fixture
def folders(tmp_path):
    llama, qwen3 = tmp_path / "llama", tmp_path / "qwen3"
    tiny_model(seed=0).save_pretrained(str(llama))
    torch.manual_seed(1)
    from_config(config_from_dict(QWEN3)).save_pretrained(str(qwen3))
    return str(llama), str(qwen3)


def same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_auto_picks_the_family_by_model_type(folders):
    llama, qwen3 = folders
    assert type(AutoConfig.from_pretrained(llama)) is ModelConfig
    assert type(AutoConfig.from_pretrained(qwen3)) is Qwen3Config
    assert type(AutoConfig.for_model("qwen3", **TINY_LLAMA)) is Qwen3Config
    ours = AutoModelForCausalLM.from_pretrained(qwen3)
    assert type(ours) is Qwen3ForCausalLM and not ours.training  # eval(), as transformers
    assert type(AutoModelForCausalLM.from_pretrained(llama)) is CausalLM


def test_each_class_loads_its_own_folder(folders):
    llama, qwen3 = folders
    assert same_weights(Qwen3ForCausalLM.from_pretrained(qwen3),
                        AutoModelForCausalLM.from_pretrained(qwen3))
    assert same_weights(CausalLM.from_pretrained(llama), tiny_model(seed=0))
    assert type(Qwen3Config.from_pretrained(qwen3)) is Qwen3Config


def test_the_base_classes_refuse_a_family_folder_naming_the_auto_loader(folders):
    _, qwen3 = folders
    for load in (CausalLM.from_pretrained, ModelConfig.from_pretrained):
        with pytest.raises(ValueError, match="model_type='qwen3'.*AutoModelForCausalLM"):
            load(qwen3)


def test_a_family_class_refuses_another_familys_folder(folders):
    llama, _ = folders
    with pytest.raises(ValueError, match="model_type='llama' is not supported by Qwen3Config"):
        Qwen3ForCausalLM.from_pretrained(llama)


def test_from_pretrained_takes_the_config_it_is_given(folders):
    # the Auto layer reads config.json once and hands the config on (transformers' config=)
    _, qwen3 = folders
    config = AutoConfig.from_pretrained(qwen3)
    model = Qwen3ForCausalLM.from_pretrained(qwen3, config=config)
    assert model.config is config


def test_the_auto_classes_are_top_level_names():
    import nanosft

    assert nanosft.AutoConfig is AutoConfig and nanosft.AutoModelForCausalLM is AutoModelForCausalLM

"""Errors peft's own tests match by text, raised by nanosft with peft 0.21.2's words first (and
nanosft's fix after them): a TEXT prompt-tuning init without a tokenizer, and LoRA on a model
whose type has no default target modules.
Run: python -m pytest -q tests/parity/test_peft_error_texts_parity.py
"""

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

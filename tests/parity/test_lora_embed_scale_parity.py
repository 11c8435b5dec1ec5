"""LoRA on a scaled embedding (transformers' Gemma3TextScaledWordEmbedding, whose forward
multiplies the rows by embed_scale; nanosft's Gemma 3 embedding the same) against peft 0.21.2:
the adapter's rows are scaled too, for LoRA, DoRA and a mixed-adapter batch, fp32 within 1e-6
(DoRA: relative 1e-6, one ulp);
merged equals unmerged; embed_scale 0 gives zeros.
Run: python -m pytest -q tests/parity/test_lora_embed_scale_parity.py
"""

import peft
import pytest
import torch
from torch import nn
from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

import nanosft


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = Gemma3TextScaledWordEmbedding(30, 8, 0, embed_scale=8**0.5)

    def forward(self, x):
        return self.embed_tokens(x)


def _model(lib, use_dora=False, second=False):
    torch.manual_seed(0)
    config = lib.LoraConfig(r=4, target_modules=["embed_tokens"], init_lora_weights=False,
                            use_dora=use_dora)
    model = lib.get_peft_model(Net(), config)
    if second:
        model.add_adapter("other", config)
    return model


@pytest.mark.parametrize("use_dora", [False, True], ids=["lora", "dora"])
def test_adapter_rows_are_scaled_as_peft(use_dora):
    x = torch.arange(12).view(2, 6)
    ours, theirs = _model(nanosft, use_dora), _model(peft, use_dora)
    with torch.no_grad():
        out = ours(x)
        # DoRA: 1 ulp at |y| ~ 32 (3.8e-6), peft multiplying the scale in another order
        assert torch.allclose(out, theirs(x), atol=1e-6, rtol=1e-6)
        ours.merge_adapter()
        assert torch.allclose(ours(x), out, atol=1e-5, rtol=0)
        ours.unmerge_adapter()
        ours.base_model.model.embed_tokens.base_layer.embed_scale.fill_(0)
        assert (ours(x) == 0).all()


def test_mixed_batch_rows_are_scaled_as_peft():
    x = torch.arange(12).view(2, 6)
    names = ["default", "other"]
    ours, theirs = _model(nanosft, second=True).eval(), _model(peft, second=True).eval()
    with torch.no_grad():
        assert torch.allclose(ours(x, adapter_names=names), theirs(x, adapter_names=names),
                              atol=1e-6, rtol=0)

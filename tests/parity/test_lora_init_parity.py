"""init_lora_weights="orthogonal" and lora_bias's argument checks against peft 0.21.2: the same
seed gives peft's A and B exactly (B A = 0 at the start, neither factor zero); an odd rank and
lora_bias beside DoRA or a non-default init are refused with peft's words.
Run: python -m pytest -q tests/parity/test_lora_init_parity.py
"""

import peft
import pytest
import torch
from torch import nn

import nanosft


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin0 = nn.Linear(10, 20)
        self.lin1 = nn.Linear(20, 6)

    def forward(self, x):
        return self.lin1(self.lin0(x))


def _factors(lib, r):
    torch.manual_seed(0)
    model = lib.get_peft_model(MLP(), lib.LoraConfig(r=r, target_modules=["lin0", "lin1"],
                                                     init_lora_weights="orthogonal"))
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


@pytest.mark.parametrize("r", [2, 8])
def test_orthogonal_init_equals_peft(r):
    ours, theirs = _factors(nanosft, r), _factors(peft, r)
    assert ours.keys() == theirs.keys() and len(ours) == 4
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    for layer in ("lin0", "lin1"):
        A = ours[f"base_model.model.{layer}.lora_A.default.weight"]
        B = ours[f"base_model.model.{layer}.lora_B.default.weight"]
        assert A.abs().max() > 0
        assert B.abs().max() > 0
        assert (B @ A).abs().max() < 1e-6  # the adapter starts as the identity


def test_orthogonal_init_odd_rank_raises_as_peft():
    for lib in (peft, nanosft):
        with pytest.raises(ValueError, match="requires the LoRA rank to be even, got 3"):
            _factors(lib, 3)


@pytest.mark.parametrize("extra", [{"use_dora": True}, {"init_lora_weights": "gaussian"},
                                   {"init_lora_weights": "orthogonal"},
                                   {"init_lora_weights": "pissa"}],
                         ids=["dora", "gaussian", "orthogonal", "pissa"])
def test_lora_bias_refusals_match_peft(extra):
    messages = []
    for lib in (peft, nanosft):
        with pytest.raises(ValueError) as caught:
            lib.LoraConfig(target_modules=["lin0"], lora_bias=True, **extra)
        messages.append(str(caught.value))
    assert messages[0] == messages[1]
    assert messages[0].startswith("The argument lora_bias=True is")

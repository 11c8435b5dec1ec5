"""Hot-swapping LoRA adapters against peft 0.21.2 (peft.utils.hotswap), on the same adapter files
(written by peft): after loading adapter 0 and swapping in adapter 1 (and back), nanosft's outputs
equal peft's and the output of adapter 1 loaded directly (fp32, 1e-6); with different ranks and
alphas, with and without prepare_model_for_compiled_hotswap's zero padding (Linear, Conv2d,
grouped Conv2d); tensors the new adapter lacks become zeros; an extra key, another config or a
rank that cannot be padded raise peft's errors; scalings become tensors and configs record the
padded rank.
Run: python -m pytest -q tests/parity/test_hotswap_parity.py
"""

import peft
import peft.utils.hotswap as peft_hotswap
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import nanosft
from nanosft import hotswap


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin0 = nn.Linear(10, 20)
        self.relu = nn.ReLU()
        self.lin1 = nn.Linear(20, 5, bias=False)

    def forward(self, X):
        return self.lin1(self.relu(self.lin0(X)))


class Conv(nn.Module):
    def __init__(self, groups=1):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, groups=groups)

    def forward(self, X):
        return self.conv(X)


def _base(make):
    torch.manual_seed(0)
    return make()


def _write(tmp_path, name, make, seed, **config):
    torch.manual_seed(seed)
    model = peft.get_peft_model(_base(make), peft.LoraConfig(init_lora_weights=False, **config))
    model.save_pretrained(tmp_path / name)
    return tmp_path / name


def _direct(lib, make, path, X):
    with torch.no_grad():
        return lib.PeftModel.from_pretrained(_base(make), path).eval()(X)


def _swapped(lib, swap, make, paths, X, target_rank=None, prepare=None):
    model = lib.PeftModel.from_pretrained(_base(make), paths[0]).eval()
    if target_rank is not None:
        prepare(model, target_rank=target_rank)
    outs = []
    for path in paths[1:]:
        swap(model, path, adapter_name="default")
        with torch.no_grad():
            outs.append(model(X))
    return outs


LIBS = {"peft": (peft, peft_hotswap.hotswap_adapter,
                 peft_hotswap.prepare_model_for_compiled_hotswap),
        "nanosft": (nanosft, hotswap.hotswap_adapter, hotswap.prepare_model_for_compiled_hotswap)}


@pytest.mark.parametrize("case", ["same-rank", "ranks-7-13", "ranks-13-7", "padded",
                                  "conv-padded", "grouped-conv-padded"])
def test_swapped_outputs_equal_peft_and_the_adapter_loaded_directly(case, tmp_path):
    make, X = MLP, torch.rand(3, 10)
    ranks, target = (8, 8), None
    if case in ("ranks-7-13", "ranks-13-7", "padded"):
        ranks = (7, 13) if case != "ranks-13-7" else (13, 7)
        target = 13 if case == "padded" else None
    if case.endswith("conv-padded"):
        groups = 2 if case.startswith("grouped") else 1
        make, X, ranks, target = (lambda: Conv(groups)), torch.rand(2, 4, 6, 6), (2, 6), 8
    kwargs = [dict(r=r, lora_alpha=2 * r) for r in ranks]
    target_modules = ["conv"] if make is not MLP else ["lin0", "lin1"]
    p0 = _write(tmp_path, "a0", make, 0, target_modules=target_modules, **kwargs[0])
    p1 = _write(tmp_path, "a1", make, 1, target_modules=target_modules[:1], **kwargs[1])
    expected = [_direct(peft, make, p, X) for p in (p1, p0)]
    results = {name: _swapped(lib, swap, make, [p0, p1, p0], X, target, prepare)
               for name, (lib, swap, prepare) in LIBS.items()}
    for ours, theirs, want in zip(results["nanosft"], results["peft"], expected):
        assert torch.allclose(ours, theirs, atol=1e-6, rtol=0)
        assert torch.allclose(ours, want, atol=1e-6, rtol=0)
    assert not torch.allclose(expected[0], expected[1], atol=1e-3)  # the swap changed something


def test_a_tensor_the_new_adapter_lacks_becomes_zeros(tmp_path):
    p0 = _write(tmp_path, "a0", MLP, 0, target_modules=["lin0", "lin1"])
    p1 = _write(tmp_path, "a1", MLP, 1, target_modules=["lin0", "lin1"])
    state = load_file(p1 / "adapter_model.safetensors")
    del state["base_model.model.lin1.lora_A.weight"]
    save_file(state, p1 / "adapter_model.safetensors", metadata={"format": "pt"})
    model = nanosft.PeftModel.from_pretrained(_base(MLP), p0)
    A = model.base_model.model.lin1.lora_A["default"].weight
    assert not (A == 0).all()
    hotswap.hotswap_adapter(model, p1, adapter_name="default")
    assert (A == 0).all()


def _error(lib, swap, path0, path1):
    model = lib.PeftModel.from_pretrained(_base(MLP), path0)
    with pytest.raises((ValueError, RuntimeError)) as caught:
        swap(model, path1, adapter_name="default")
    return caught.type, str(caught.value)


def test_an_extra_key_or_another_config_raises_as_peft(tmp_path):
    p0 = _write(tmp_path, "a0", MLP, 0, target_modules=["lin0"])
    extra = _write(tmp_path, "extra", MLP, 1, target_modules=["lin0"])
    state = load_file(extra / "adapter_model.safetensors")
    state["base_model.model.lin1.lora_A.weight"] = torch.zeros(8, 20)
    save_file(state, extra / "adapter_model.safetensors", metadata={"format": "pt"})
    rslora = _write(tmp_path, "rslora", MLP, 1, target_modules=["lin0"], use_rslora=True)
    for path in (extra, rslora):
        theirs = _error(peft, peft_hotswap.hotswap_adapter, p0, path)
        assert _error(nanosft, hotswap.hotswap_adapter, p0, path) == theirs


def test_prepare_pads_and_records_the_rank_as_peft(tmp_path):
    p0 = _write(tmp_path, "a0", MLP, 0, target_modules=["lin0", "lin1"], r=4)
    shapes = {}
    for name, (lib, _, prepare) in LIBS.items():
        model = lib.PeftModel.from_pretrained(_base(MLP), p0)
        config = model.peft_config["default"]
        prepare(model, target_rank=9, config=config)
        lin0 = model.base_model.model.lin0
        assert isinstance(lin0.scaling["default"], torch.Tensor)
        assert config.r == 9
        shapes[name] = [tuple(lin0.lora_A["default"].weight.shape),
                        tuple(lin0.lora_B["default"].weight.shape)]
        with pytest.raises(ValueError, match="original rank is larger"):
            prepare(model, target_rank=3)
    assert shapes["nanosft"] == shapes["peft"] == [(9, 10), (20, 9)]


def test_prepare_refuses_what_peft_refuses(tmp_path):
    p0 = _write(tmp_path, "c0", lambda: Conv(2), 0, target_modules=["conv"], r=2)
    for lib, _, prepare in LIBS.values():
        model = lib.PeftModel.from_pretrained(_base(lambda: Conv(2)), p0)
        with pytest.raises(ValueError, match="target rank is not divisible by 2"):
            prepare(model, target_rank=5)
        with pytest.raises(ValueError, match="No adapter layers found"):
            prepare(MLP())

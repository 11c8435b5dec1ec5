"""add_weighted_adapter (nanosft.weighted_adapters) against real peft 0.21.2.

Both libraries build the same adapters from the same seed on the same base (a linear, an
embedding, a Conv2d), then mix them; compared at fp32 assert_close(atol=rtol=1e-5): each new
adapter's delta weight in every layer, the model's output with it active, its rank and config,
which parameters require grad. DARE's random pruning draws from the same seed in both. The
refusals are compared by their ValueError text. Tiny in-process modules, no network.
Run: PYTHONPATH=$PWD OMP_NUM_THREADS=1 python -m pytest -q tests/test_weighted_adapters.py
"""

import pytest
import torch
from torch import nn

from nanosft.adapter_files import LoraConfig
from nanosft.peft import get_peft_model
from nanosft.tuners import BaseTunerLayer

peft = pytest.importorskip("peft")
TOL = dict(atol=1e-5, rtol=1e-5)


class EmbLinConv(nn.Module):
    """An embedding, a linear and a 3x3 Conv2d; forward takes token ids X of shape (B, 16)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(30, 8)
        self.lin0 = nn.Linear(8, 8)
        self.conv = nn.Conv2d(2, 6, 3, padding=1)
        self.lin1 = nn.Linear(48, 4)

    def forward(self, X):
        h = self.lin0(self.emb(X))  # (B, 16, 8)
        h = self.conv(h.reshape(-1, 2, 8, 8))  # (B, 6, 8, 8)
        return self.lin1(h.reshape(h.shape[0], -1)[:, :48])


def _pair(configs):
    """Both libraries: the same base, the adapters `configs` ({name: kwargs}) from one seed."""
    torch.manual_seed(0)
    base = EmbLinConv()
    theirs_base = EmbLinConv()
    theirs_base.load_state_dict(base.state_dict())
    models = []
    for cfg_cls, wrap, b in ((LoraConfig, get_peft_model, base),
                             (peft.LoraConfig, peft.get_peft_model, theirs_base)):
        torch.manual_seed(1)
        names = list(configs)
        model = wrap(b, cfg_cls(**configs[names[0]]), adapter_name=names[0])
        for name in names[1:]:
            model.add_adapter(name, cfg_cls(**configs[name]))
        models.append(model)
    return models


def _layers(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, BaseTunerLayer)}


def _compare(ours, theirs, name):
    X = torch.randint(0, 30, (2, 16))
    ours_layers = _layers(ours)
    theirs_layers = {n: m for n, m in theirs.named_modules()
                     if isinstance(m, peft.tuners.lora.LoraLayer)}
    assert sorted(ours_layers) == sorted(theirs_layers)
    for n, layer in ours_layers.items():
        assert layer.r.get(name) == theirs_layers[n].r.get(name)
        if name in layer.r:
            torch.testing.assert_close(layer.get_delta_weight(name),
                                       theirs_layers[n].get_delta_weight(name), **TOL)
    ours.set_adapter(name)
    theirs.set_adapter(name)
    torch.testing.assert_close(ours(X), theirs(X), **TOL)
    assert sorted(n for n, p in ours.named_parameters() if p.requires_grad) == \
        sorted(n for n, p in theirs.named_parameters() if p.requires_grad)


ALL = ["emb", "lin0", "conv"]
TWO = {"one": dict(target_modules=ALL, init_lora_weights=False, r=4, lora_alpha=8),
       "two": dict(target_modules=ALL, init_lora_weights=False, r=4, lora_alpha=16)}


@pytest.mark.parametrize("combination_type,kwargs", [
    ("svd", {}), ("svd", dict(svd_rank=3)), ("svd", dict(svd_clamp=0.9)), ("cat", {}),
    ("linear", {}), ("ties", dict(density=0.5)), ("ties", dict(density=0.5,
                                                               majority_sign_method="frequency")),
    ("magnitude_prune", dict(density=0.5)), ("dare_linear", dict(density=0.5)),
    ("dare_ties", dict(density=0.5)), ("ties_svd", dict(density=0.5)),
    ("dare_linear_svd", dict(density=0.5)), ("dare_ties_svd", dict(density=0.5)),
    ("magnitude_prune_svd", dict(density=0.5)),
])
def test_weighted_adapter_matches_peft(combination_type, kwargs):
    ours, theirs = _pair(TWO)
    for model in (ours, theirs):
        torch.manual_seed(7)  # DARE's random masks
        model.add_weighted_adapter(["one", "two"], [0.7, -0.4], "mix",
                                   combination_type=combination_type, **kwargs)
    assert ours.peft_config["mix"].r == theirs.peft_config["mix"].r
    assert ours.peft_config["mix"].lora_alpha == theirs.peft_config["mix"].lora_alpha
    assert ours.active_adapter == theirs.active_adapter == "one"
    _compare(ours, theirs, "mix")


def test_cat_and_svd_are_the_weighted_sum():
    # what the mix means: cat (and svd at full rank) give exactly 0.7 dW_a - 0.4 dW_b
    ours, _ = _pair({k: {**v, "target_modules": ["emb", "lin0"]} for k, v in TWO.items()})
    ours.add_weighted_adapter(["one", "two"], [0.7, -0.4], "cat", combination_type="cat")
    ours.add_weighted_adapter(["one", "two"], [0.7, -0.4], "svd", svd_rank=8)
    for layer in _layers(ours).values():
        want = 0.7 * layer.get_delta_weight("one") - 0.4 * layer.get_delta_weight("two")
        torch.testing.assert_close(layer.get_delta_weight("cat"), want, **TOL)
        torch.testing.assert_close(layer.get_delta_weight("svd"), want, **TOL)


def test_different_ranks_and_targets_as_peft():
    configs = {"one": dict(target_modules=["lin0", "emb"], init_lora_weights=False, r=4),
               "two": dict(target_modules=["lin0", "conv"], init_lora_weights=False, r=6,
                         rank_pattern={"conv": 2})}
    ours, theirs = _pair(configs)
    for model in (ours, theirs):
        model.add_weighted_adapter(["one", "two"], [1.0, 1.0], "cat", combination_type="cat")
        model.add_weighted_adapter(["one", "two"], [1.0, 0.5], "svd")
        model.add_weighted_adapter(["two"], [-1.0], "single")  # one adapter: linear, negated
    theirs_targets = sorted(theirs.peft_config["cat"].target_modules)
    assert ours.peft_config["cat"].target_modules == theirs_targets
    for name in ("cat", "svd", "single"):
        _compare(ours, theirs, name)
    errors = []
    for model in (ours, theirs):
        with pytest.raises(ValueError) as caught:
            model.add_weighted_adapter(["one", "two"], [1.0, 1.0], "lin", combination_type="linear")
        errors.append(str(caught.value))
        with pytest.raises(ValueError) as caught:
            model.add_weighted_adapter(["one", "nope"], [1.0, 1.0], "x")
        errors.append(str(caught.value))
    assert errors[:2] == errors[2:]


def test_modules_to_save_refusal_and_copy_as_peft():
    configs = {"one": dict(target_modules=["lin0"], modules_to_save=["lin1"]),
               "two": dict(target_modules=["lin0"])}
    ours, theirs = _pair(configs)
    for model in (ours, theirs):
        model.add_weighted_adapter(["one", "two"], [1.0, 1.0], "mix")
    assert sorted(ours.base_model.model.lin1.modules_to_save) == \
        sorted(theirs.base_model.model.lin1.modules_to_save) == ["mix", "one"]
    _compare(ours, theirs, "mix")
    configs["two"]["modules_to_save"] = ["lin1"]
    errors = []
    for model in _pair(configs):
        with pytest.raises(ValueError) as caught:
            model.add_weighted_adapter(["one", "two"], [1.0, 1.0], "mix")
        errors.append(str(caught.value))
    assert errors[0] == errors[1]


@pytest.mark.parametrize("rank", [2, 0.9, 1.0])
def test_convert_to_lora_matches_peft(rank):
    from peft.tuners.lora.conversion import convert_to_lora as theirs_convert

    from nanosft.adapter_files import set_peft_model_state_dict
    from nanosft.tuners import convert_to_lora

    configs = {"one": dict(target_modules=["lin0", "lin1"], init_lora_weights=False, r=4,
                           lora_alpha=8, modules_to_save=["conv"])}
    ours, theirs = _pair(configs)
    with pytest.warns(UserWarning, match="already a LoRA adapter"):
        our_config, our_sd = convert_to_lora(ours, rank, adapter_name="one")
    with pytest.warns(UserWarning, match="already a LoRA adapter"):
        their_config, their_sd = theirs_convert(theirs, rank, adapter_name="one")
    assert sorted(our_sd) == sorted(their_sd)
    assert our_config.rank_pattern == their_config.rank_pattern
    assert our_config.target_modules == sorted(their_config.target_modules)
    assert our_config.modules_to_save == their_config.modules_to_save
    for key in our_sd:
        if key.endswith("lora_A.weight"):  # the factors' product (SVD signs are free)
            b_key = key.replace("lora_A", "lora_B")
            torch.testing.assert_close(our_sd[b_key] @ our_sd[key],
                                       their_sd[b_key] @ their_sd[key], **TOL)
        elif "lora_B" not in key:
            torch.testing.assert_close(our_sd[key], their_sd[key], **TOL)
    # the converted adapter loads into a fresh model and gives the original adapter's output
    if rank != 1.0:  # a lower rank or energy share: an approximation (the one peft makes)
        return
    torch.manual_seed(0)  # _pair's base
    converted = get_peft_model(EmbLinConv(), our_config)
    set_peft_model_state_dict(converted, our_sd)
    X = torch.randint(0, 30, (2, 16))
    torch.testing.assert_close(converted(X), ours(X), **TOL)

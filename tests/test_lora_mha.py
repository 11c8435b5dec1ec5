"""LoRA on torch.nn.MultiheadAttention (nanosft.lora_layers.LoraMultiheadAttention) against real
peft 0.21.2 (its lora.MultiheadAttention).

Compared at fp32, exactly or with assert_close(atol=rtol=1e-5): state-dict keys and values after
injection (both libraries draw the adapters from the same seed in peft's RNG order), outputs and
attention weights, gradients of every adapter tensor, merged outputs and merged weights, unmerge,
merge_and_unload / unload, several adapters (add / set / delete), disabled adapters, adapter files
both ways; refusals (DoRA, kdim != embed_dim, mixed batches) in peft's words. Hermetic: a tiny
module built in-process (embed 8, 2 heads), no network.
Run: PYTHONPATH=$PWD OMP_NUM_THREADS=1 python -m pytest -q tests/test_lora_mha.py
"""

import pytest
import torch
from torch import nn

from nanosft.adapter_files import LoraConfig
from nanosft.lora import LoraLinear
from nanosft.lora_layers import LoraMultiheadAttention
from nanosft.peft import PeftModel, get_peft_model

peft = pytest.importorskip("peft")
TOL = dict(atol=1e-5, rtol=1e-5)
EXACT = dict(atol=0, rtol=0)


class Attn(nn.Module):
    """Self-attention, then a linear head: peft's tests' shape of MHA model (forward takes X)."""

    def __init__(self, batch_first=False):
        super().__init__()
        self.mha = nn.MultiheadAttention(8, 2, batch_first=batch_first)
        self.lin0 = nn.Linear(8, 3)

    def forward(self, X):
        out, weights = self.mha(X, X, X)
        return self.lin0(out) + weights.sum()  # the attention weights reach the output too


def _pair(cfg, seed=0, **base_kwargs):
    """The same base weights wrapped by nanosft and by peft, each from the same seed."""
    torch.manual_seed(seed)
    base = Attn(**base_kwargs)
    theirs_base = Attn(**base_kwargs)
    theirs_base.load_state_dict(base.state_dict())
    torch.manual_seed(seed + 1)
    ours = get_peft_model(base, LoraConfig(**cfg))
    torch.manual_seed(seed + 1)
    theirs = peft.get_peft_model(theirs_base, peft.LoraConfig(**cfg))
    return ours, theirs


def _X(seed=3):
    return torch.randn(5, 2, 8, generator=torch.Generator().manual_seed(seed))  # (T, B, C)


def _mha(model):
    return model.base_model.model.mha


@pytest.mark.parametrize("cfg", [
    dict(target_modules=["mha"], init_lora_weights=False),
    dict(target_modules=["mha", "lin0"], init_lora_weights=False, r=4, lora_alpha=16),
    dict(target_modules=["mha"], init_lora_weights="gaussian", use_rslora=True, r=2),
])
def test_outputs_and_gradients_match_peft(cfg):
    ours, theirs = _pair(cfg)
    assert isinstance(_mha(ours), LoraMultiheadAttention)
    assert isinstance(_mha(ours).base_layer.out_proj, LoraLinear)
    mine, ref = ours.state_dict(), theirs.state_dict()
    assert sorted(mine) == sorted(ref)
    assert "base_model.model.mha.base_layer.out_proj.lora_A.default.weight" in mine
    for k in ref:  # same draws: peft's RNG order (out_proj's adapter drawn twice)
        torch.testing.assert_close(mine[k], ref[k], **EXACT)
    trainable = [n for n, p in ours.named_parameters() if p.requires_grad]
    assert trainable == [n for n, p in theirs.named_parameters() if p.requires_grad]
    X = _X()
    y_ours, y_theirs = ours(X), theirs(X)
    torch.testing.assert_close(y_ours, y_theirs, **TOL)
    y_ours.square().mean().backward()
    y_theirs.square().mean().backward()
    theirs_params = dict(theirs.named_parameters())
    for n, p in ours.named_parameters():
        if p.requires_grad:
            if cfg["init_lora_weights"] is False or ".lora_B." in n:  # B = 0: no grad to A yet
                assert p.grad.abs().sum() > 0, n
            torch.testing.assert_close(p.grad, theirs_params[n].grad, **TOL)
        else:
            assert p.grad is None, n  # the base weights get no gradient
    base = _mha(ours).base_layer  # the swapped-in weights are gone again: parameters, frozen
    assert isinstance(base.in_proj_weight, nn.Parameter)
    assert isinstance(base.out_proj.base_layer.weight, nn.Parameter)
    assert not base.in_proj_weight.requires_grad


def test_batch_first_and_attention_weights_match_peft():
    ours, theirs = _pair(dict(target_modules=["mha"], init_lora_weights=False), batch_first=True)
    q = torch.randn(2, 5, 8)
    mask = torch.zeros(5, 5, dtype=torch.bool).triu(1)
    out_o, w_o = _mha(ours)(q, q, q, attn_mask=mask, average_attn_weights=False)
    out_t, w_t = _mha(theirs)(q, q, q, attn_mask=mask, average_attn_weights=False)
    torch.testing.assert_close(out_o, out_t, **TOL)
    torch.testing.assert_close(w_o, w_t, **TOL)
    assert _mha(ours).embed_dim == 8 and _mha(ours).batch_first
    assert type(_mha(ours).out_proj) is type(_mha(theirs).out_proj)  # the unwrapped linear


def test_merge_unmerge_match_peft_and_out_proj_delta_counts_twice():
    ours, theirs = _pair(dict(target_modules=["mha"], init_lora_weights=False))
    X = _X()
    with torch.no_grad():
        before = ours(X)
        layer = _mha(ours)
        w_in = layer.base_layer.in_proj_weight.clone()
        w_out = layer.base_layer.out_proj.base_layer.weight.clone()
        d_in = layer.get_delta_weight("default")
        d_out = layer.base_layer.out_proj.get_delta_weight("default")
        ours.merge_adapter()
        theirs.merge_adapter()
        assert layer.merged and layer.base_layer.out_proj.merged
        torch.testing.assert_close(ours(X), theirs(X), **TOL)
        torch.testing.assert_close(ours(X), before, **TOL)
        torch.testing.assert_close(layer.base_layer.in_proj_weight, w_in + d_in, **TOL)
        # peft 0.21.2 adds out_proj's delta twice (in its merge and out_proj's); kept, so that
        # peft's adapters give peft's outputs. A single delta would land elsewhere:
        merged_out = layer.base_layer.out_proj.base_layer.weight
        torch.testing.assert_close(merged_out, w_out + 2 * d_out, **TOL)
        assert (merged_out - (w_out + d_out)).abs().max() > 1e-3
        torch.testing.assert_close(
            merged_out, _mha(theirs).base_layer.out_proj.base_layer.weight, **TOL)
        ours.unmerge_adapter()
        assert not layer.merged and not layer.base_layer.out_proj.merged
        torch.testing.assert_close(layer.base_layer.in_proj_weight, w_in, **TOL)
        torch.testing.assert_close(layer.base_layer.out_proj.base_layer.weight, w_out, **TOL)
        torch.testing.assert_close(ours(X), before, **TOL)


@pytest.mark.parametrize("merge", [True, False])
def test_merge_and_unload_and_unload_match_peft(merge):
    ours, theirs = _pair(dict(target_modules=["mha", "lin0"], init_lora_weights=False))
    X = _X()
    with torch.no_grad():
        adapted = ours(X)
        plain_ours = ours.merge_and_unload() if merge else ours.unload()
        plain_theirs = theirs.merge_and_unload() if merge else theirs.unload()
        assert type(plain_ours.mha) is nn.MultiheadAttention
        assert type(plain_ours.mha.out_proj) is type(plain_theirs.mha.out_proj)
        assert sorted(plain_ours.state_dict()) == sorted(Attn().state_dict())
        torch.testing.assert_close(plain_ours(X), plain_theirs(X), **TOL)
        if merge:
            torch.testing.assert_close(plain_ours(X), adapted, **TOL)
        else:
            assert (plain_ours(X) - adapted).abs().max() > 1e-3


def test_several_adapters_match_peft():
    ours, theirs = _pair(dict(target_modules=["mha"], init_lora_weights=False))
    other = dict(target_modules=["mha"], r=4, init_lora_weights=False)
    torch.manual_seed(7)
    ours.add_adapter("other", LoraConfig(**other))
    torch.manual_seed(7)
    theirs.add_adapter("other", peft.LoraConfig(**other))
    X = _X()
    trainable = [n for n, p in theirs.named_parameters() if p.requires_grad]
    assert [n for n, p in ours.named_parameters() if p.requires_grad] == trainable
    torch.testing.assert_close(ours(X), theirs(X), **TOL)
    ours.set_adapter("other")
    theirs.set_adapter("other")
    torch.testing.assert_close(ours(X), theirs(X), **TOL)
    ours.base_model.set_adapter(["default", "other"])  # both at once
    theirs.base_model.set_adapter(["default", "other"])
    torch.testing.assert_close(ours(X), theirs(X), **TOL)
    with torch.no_grad():
        ours.merge_adapter()
        theirs.merge_adapter()
        torch.testing.assert_close(ours(X), theirs(X), **TOL)
        ours.unmerge_adapter()
        theirs.unmerge_adapter()
    ours.delete_adapter("other")
    theirs.delete_adapter("other")
    assert sorted(ours.state_dict()) == sorted(theirs.state_dict())
    assert _mha(ours).base_layer.out_proj.active_adapters == ["default"]
    torch.testing.assert_close(ours(X), theirs(X), **TOL)


def test_disabled_adapters_give_the_base_attention():
    ours, theirs = _pair(dict(target_modules=["mha"], init_lora_weights=False))
    torch.manual_seed(0)
    base = Attn()  # the same base weights (seed 0)
    X = _X()
    with torch.no_grad(), ours.disable_adapter():
        torch.testing.assert_close(ours(X), base(X), **EXACT)
    assert (ours(X) - base(X)).abs().max() > 1e-3


def test_adapter_files_move_both_ways(tmp_path):
    cfg = dict(target_modules=["mha", "lin0"], init_lora_weights=False)
    ours, theirs = _pair(cfg)
    X = _X()
    ours.save_pretrained(tmp_path / "ours")
    theirs.save_pretrained(tmp_path / "theirs")
    from safetensors.torch import load_file
    saved_ours = load_file(tmp_path / "ours" / "adapter_model.safetensors")
    saved_theirs = load_file(tmp_path / "theirs" / "adapter_model.safetensors")
    assert sorted(saved_ours) == sorted(saved_theirs)
    assert "base_model.model.mha.base_layer.out_proj.lora_B.weight" in saved_ours
    torch.manual_seed(0)  # the same base weights as _pair's
    peft_reads_ours = peft.PeftModel.from_pretrained(Attn(), tmp_path / "ours")
    torch.manual_seed(0)
    we_read_theirs = PeftModel.from_pretrained(Attn(), tmp_path / "theirs")
    with torch.no_grad():
        torch.testing.assert_close(peft_reads_ours(X), ours(X), **TOL)
        torch.testing.assert_close(we_read_theirs(X), theirs(X), **TOL)


def test_refusals_use_peft_words():
    class KdimAttn(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = nn.MultiheadAttention(8, 2, kdim=4, vdim=4)

    for lib in (peft, None):
        make = peft.get_peft_model if lib else get_peft_model
        config = peft.LoraConfig if lib else LoraConfig
        with pytest.raises(ValueError, match="MultiheadAttention does not support DoRA"):
            make(Attn(), config(target_modules=["mha"], use_dora=True))
        with pytest.raises(ValueError, match="Only same embed for query/key/value"):
            make(KdimAttn(), config(target_modules=["mha"]))
        model = make(Attn(), config(target_modules=["mha"], init_lora_weights=False)).eval()
        with pytest.raises(TypeError, match="does not support mixed adapter batches"):
            model(_X(), adapter_names=["default", "__base__"])
    with pytest.raises(ValueError, match="lora_bias"):  # peft makes biases it never trains
        get_peft_model(Attn(), LoraConfig(target_modules=["mha"], lora_bias=True))

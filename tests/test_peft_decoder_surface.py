"""Decoder-model LoRA details against real peft 0.21.2: a float or non-scalar embed_scale on the
base embedding (tests/test_lora_embed_scale.py has Gemma 3's tensor one); merge_and_unload sets
tie_word_embeddings=False when the merged embeddings no longer share a weight; and
LoraConfig.layer_replication rebuilds the decoder from ranges of its layers, weights shared. Both
libraries get the same base weights and peft's adapter tensors; outputs are compared in fp32 at
1e-5 (a different summation order of the same products) or exactly. Tiny models (hidden 32,
2 layers), built from configs: no files, no network. Run:
PYTHONPATH=$PWD OMP_NUM_THREADS=1 python -m pytest -q tests/test_peft_decoder_surface.py
"""

import copy
import warnings

import pytest
import torch
from torch import nn

from nanosft.adapter_files import LoraConfig, get_peft_model_state_dict, set_peft_model_state_dict
from nanosft.peft import get_peft_model

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

TOL = dict(atol=1e-5, rtol=1e-5)
UNTIE_MSG = "Setting `tie_word_embeddings=False`"


def _llama(tie=False):
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tie)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _pair(make_base, config_kwargs, adapters=("default",)):
    """(peft model, nanosft model) over copies of one base, nanosft holding peft's adapter
    tensors (init_lora_weights=False: none of them is zero)."""
    base = make_base()
    torch.manual_seed(1)
    theirs = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(**config_kwargs))
    ours = get_peft_model(copy.deepcopy(base), LoraConfig(**config_kwargs))
    for name in adapters[1:]:
        theirs.add_adapter(name, peft.LoraConfig(**config_kwargs))
        ours.add_adapter(name, LoraConfig(**config_kwargs))
    for name in adapters:
        state = peft.get_peft_model_state_dict(theirs, adapter_name=name)
        set_peft_model_state_dict(ours, state, adapter_name=name)
    return theirs.eval(), ours.eval()


def _wrap_both(make_base, config_kwargs):
    """peft's and nanosft's get_peft_model on two fresh bases (same seed), nanosft loaded with
    copies of peft's adapter tensors (peft's merge adds into the tensors its state dict views)."""
    torch.manual_seed(1)
    theirs = peft.get_peft_model(make_base(), peft.LoraConfig(**config_kwargs))
    state = {k: v.clone() for k, v in peft.get_peft_model_state_dict(theirs).items()}
    ours = get_peft_model(make_base(), LoraConfig(**config_kwargs))
    set_peft_model_state_dict(ours, state)
    return theirs, ours


def test_embed_scale_float_attribute_and_non_scalar_warns():
    # a float embed_scale (nanosft's Gemma 3 family keeps one) is applied as peft converts it; a
    # scale with more than one element is left out with a warning, in both libraries
    for scale in (3.0, torch.ones(2)):
        def make_base():
            torch.manual_seed(0)
            model = nn.Sequential()
            model.add_module("emb", nn.Embedding(16, 8))
            model.emb.embed_scale = scale
            return model
        outs, warned = [], []
        for model in _wrap_both(make_base, dict(target_modules=["emb"], init_lora_weights=False)):
            with warnings.catch_warnings(record=True) as seen, torch.no_grad():
                warnings.simplefilter("always")
                # the base nn.Embedding does not scale: only the LoRA rows are (peft's contract)
                outs.append(model.base_model.model.emb(torch.arange(16)))
            warned.append(any("embed_scale" in str(w.message) for w in seen))
        torch.testing.assert_close(outs[1], outs[0], **TOL)
        assert warned[0] == warned[1] == (not isinstance(scale, float))


@pytest.mark.parametrize("untie", [False, True])
def test_merge_and_unload_unties_config_as_peft(untie):
    def make_base():
        base = _llama(tie=True)
        if untie:  # a checkpoint whose two matrices differ although the config says tied
            base.lm_head.weight = nn.Parameter(base.lm_head.weight.detach().clone() + 1)
        return base

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        models = _wrap_both(make_base, dict(target_modules=["embed_tokens"],
                                            init_lora_weights=False))
    results = []
    for model in models:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            merged = model.merge_and_unload()
        warned = any(UNTIE_MSG in str(w.message) for w in seen)
        shared = merged.lm_head.weight.data_ptr() == merged.model.embed_tokens.weight.data_ptr()
        results.append((warned, merged.config.tie_word_embeddings, shared,
                        merged.model.embed_tokens.weight.detach()))
    (w_t, tie_t, shared_t, emb_t), (w_o, tie_o, shared_o, emb_o) = results
    assert (w_o, tie_o, shared_o) == (w_t, tie_t, shared_t) == (untie, not untie, not untie)
    torch.testing.assert_close(emb_o, emb_t, **TOL)


LAYER_MAP = [[0, 1], [0, 2], [1, 2]]
REPLICATED = dict(target_modules=["down_proj", "up_proj"], layer_replication=LAYER_MAP,
                  init_lora_weights=False)


def _ptr(p):
    return p.untyped_storage().data_ptr()


def test_layer_replication_structure_and_logits_as_peft():
    theirs, ours = _pair(_llama, REPLICATED)
    lt, lo = theirs.base_model.model.model.layers, ours.base_model.model.model.layers
    assert len(lo) == len(lt) == 4
    assert ours.get_base_model().config.num_hidden_layers == 4
    idx = [m.self_attn.layer_idx for m in lo]
    assert idx == [m.self_attn.layer_idx for m in lt] == [0, 1, 2, 3]
    base_ptrs = [_ptr(m.mlp.up_proj.base_layer.weight) for m in lo]
    assert base_ptrs[0] == base_ptrs[1] and base_ptrs[2] == base_ptrs[3] != base_ptrs[0]
    assert len({_ptr(m.mlp.up_proj.lora_A["default"].weight) for m in lo}) == 4
    assert sorted(get_peft_model_state_dict(ours)) == sorted(peft.get_peft_model_state_dict(theirs))
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=ids).logits, theirs(input_ids=ids).logits,
                                   **TOL)


def test_layer_replication_on_nanosft_model_matches_transformers(tmp_path):
    # nanosft's own Llama, replicated and adapted, against transformers' Llama under peft
    from nanosft.families.auto import AutoModelForCausalLM

    base = _llama()
    base.save_pretrained(tmp_path)
    torch.manual_seed(1)
    theirs = peft.get_peft_model(base, peft.LoraConfig(**REPLICATED)).eval()
    ours = get_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path), LoraConfig(**REPLICATED))
    set_peft_model_state_dict(ours, peft.get_peft_model_state_dict(theirs))
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(input_ids=ids)["logits"],
                                   theirs(input_ids=ids).logits, **TOL)


def test_layer_replication_errors():
    # a range outside the layers is named before anything changes; merging would write into
    # weights the copies share (peft's check reads the wrong dict and lets it through)
    with pytest.raises(ValueError, match=r"range \[1, 3\]"):
        get_peft_model(_llama(), LoraConfig(target_modules=["up_proj"], layer_replication=[[1, 3]]))
    _, ours = _pair(_llama, REPLICATED)
    with pytest.raises(ValueError, match="replicated"):
        ours.merge_and_unload()


def test_layer_replication_adapter_written_by_peft_loads(tmp_path):
    # the saved config carries layer_replication, so loading rebuilds the layers first
    from nanosft.peft import PeftModel

    torch.manual_seed(1)
    theirs = peft.get_peft_model(_llama(), peft.LoraConfig(**REPLICATED)).eval()
    theirs.save_pretrained(tmp_path)
    ours = PeftModel.from_pretrained(_llama(), tmp_path)
    assert ours.peft_config["default"].layer_replication == LAYER_MAP
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=ids).logits, theirs(input_ids=ids).logits,
                                   **TOL)

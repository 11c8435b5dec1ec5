"""LoraConfig(ensure_weight_tying=True) against real peft 0.21.2: an LM head tied to the input
embedding stays tied through the adapter (nanosft.weight_tying).

Compared with peft, exactly or at fp32 assert_close(atol=rtol=1e-5): the warnings' text; which
modules become LoRA layers or modules_to_save wrappers; the tied LoRA linear's A and B as views of
the embedding's B and A (same storage); the values both build from the same seed; the adapter
files (tensor names and values, target_modules / modules_to_save as saved) and loading each
library's files into the other. Tiny in-process models, no network.
Run: PYTHONPATH=$PWD OMP_NUM_THREADS=1 python -m pytest -q tests/test_weight_tying.py
"""

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from nanosft.adapter_files import LoraConfig
from nanosft.peft import PeftModel, get_peft_model
from nanosft.tuners import LoraLayer, ModulesToSaveWrapper
from nanosft.weight_tying import module_names_tied_with_embedding

peft = pytest.importorskip("peft")
TOL = dict(atol=1e-5, rtol=1e-5)


class _Config:
    model_type = "tied_lm"  # peft's causal-LM forward reads it

    def __init__(self, tie):
        self.tie_word_embeddings = tie

    def to_dict(self):
        return {"tie_word_embeddings": self.tie_word_embeddings}


class _Body(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(40, 12)
        self.linear = nn.Linear(12, 12, bias=False)


class TiedLM(nn.Module):
    """An LM head sharing the embedding's weight (transformers' tie_word_embeddings)."""
    _tied_weights_keys = ["lm_head.weight"]  # what peft reads; nanosft reads the shared Parameter

    def __init__(self, tie=True, config_tie=None):
        super().__init__()
        self.model = _Body()
        self.config = _Config(tie if config_tie is None else config_tie)
        self.lm_head = nn.Linear(12, 40, bias=False)
        if tie:
            self.lm_head.weight = self.model.embed_tokens.weight

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    def prepare_inputs_for_generation(self):  # peft's causal-LM wrapper asks for it
        return None

    def forward(self, input_ids, **kwargs):  # nanosft passes a causal LM's keywords as None
        return self.lm_head(self.model.linear(self.model.embed_tokens(input_ids)))


def _both(config_kwargs, seed=0, tie=True, config_tie=None):
    # the same base weights and seed under each library; warnings recorded per library
    out = []
    for lib_config, wrap in ((LoraConfig, get_peft_model), (peft.LoraConfig, peft.get_peft_model)):
        torch.manual_seed(seed)
        base = TiedLM(tie, config_tie)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = wrap(base, lib_config(ensure_weight_tying=True, **config_kwargs))
        texts = sorted(str(w.message) for w in caught if "weight_tying" in str(w.message)
                       or "tie_word_embeddings" in str(w.message))
        out.append((model, texts))
    return out


def _perturb(model, seed=1):
    # the tied adapter starts as the identity: give every trainable weight new values
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)


@pytest.mark.parametrize("target_modules", [["linear", "lm_head"], ["linear", "embed_tokens"],
                                            ".*(embed_tokens|lm_head)$"])
def test_lora_on_tied_lm_head_shares_the_embedding_adapter(target_modules, tmp_path):
    (ours, our_warn), (theirs, their_warn) = _both(dict(target_modules=target_modules))
    assert our_warn == their_warn == []
    head, embed = ours.base_model.model.lm_head, ours.base_model.model.model.embed_tokens
    assert isinstance(head, LoraLayer) and isinstance(embed, LoraLayer)
    # A and B of the head are the embedding's B and A, transposed, in the same storage
    assert head.lora_A["default"].weight.data_ptr() == embed.lora_embedding_B["default"].data_ptr()
    assert head.lora_B["default"].weight.data_ptr() == embed.lora_embedding_A["default"].data_ptr()
    ours_sd, theirs_sd = ours.state_dict(), theirs.state_dict()
    assert sorted(ours_sd) == sorted(theirs_sd)
    for k in ours_sd:
        torch.testing.assert_close(ours_sd[k], theirs_sd[k], **TOL)
    # a step on the embedding's adapter moves the head's with it, in both
    _perturb(ours), _perturb(theirs)
    X = torch.randint(0, 40, (2, 5))
    torch.testing.assert_close(ours(input_ids=X), theirs(input_ids=X), **TOL)
    ours.save_pretrained(tmp_path / "ours")
    theirs.save_pretrained(tmp_path / "theirs")
    a = load_file(tmp_path / "ours" / "adapter_model.safetensors")
    b = load_file(tmp_path / "theirs" / "adapter_model.safetensors")
    assert sorted(a) == sorted(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], **TOL)
    ca = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    cb = json.loads((tmp_path / "theirs" / "adapter_config.json").read_text())
    target = cb["target_modules"]
    assert (sorted(ca["target_modules"]) if isinstance(target, list) else ca["target_modules"]) \
        == (sorted(target) if isinstance(target, list) else target)
    # each library loads the other's files: tied again, same outputs
    torch.manual_seed(5)
    loaded = PeftModel.from_pretrained(TiedLM(), tmp_path / "theirs")
    torch.manual_seed(5)
    peft_loaded = peft.PeftModel.from_pretrained(TiedLM(), tmp_path / "ours")
    torch.testing.assert_close(loaded(input_ids=X), peft_loaded(input_ids=X), **TOL)
    head = loaded.base_model.model.lm_head
    assert head.lora_A["default"].weight.data_ptr() == \
        loaded.base_model.model.model.embed_tokens.lora_embedding_B["default"].data_ptr()


@pytest.mark.parametrize("modules_to_save", [["lm_head"], ["embed_tokens"],
                                             ["lm_head", "embed_tokens"]])
def test_modules_to_save_copy_shared_with_tied_head(modules_to_save, tmp_path):
    (ours, our_warn), (theirs, their_warn) = _both(
        dict(target_modules=["linear"], modules_to_save=modules_to_save))
    assert our_warn == their_warn == []
    head, embed = ours.base_model.model.lm_head, ours.base_model.model.model.embed_tokens
    assert isinstance(head, ModulesToSaveWrapper) and isinstance(embed, ModulesToSaveWrapper)
    assert head.modules_to_save["default"].weight is embed.modules_to_save["default"].weight
    trainable = sorted(n for n, p in ours.named_parameters() if p.requires_grad)
    assert trainable == sorted(n for n, p in theirs.named_parameters() if p.requires_grad)
    _perturb(ours), _perturb(theirs)
    X = torch.randint(0, 40, (2, 5))
    torch.testing.assert_close(ours(input_ids=X), theirs(input_ids=X), **TOL)
    ours.save_pretrained(tmp_path / "ours")
    theirs.save_pretrained(tmp_path / "theirs")
    a = load_file(tmp_path / "ours" / "adapter_model.safetensors")
    b = load_file(tmp_path / "theirs" / "adapter_model.safetensors")
    assert sorted(a) == sorted(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], **TOL)
    ca = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    cb = json.loads((tmp_path / "theirs" / "adapter_config.json").read_text())
    assert ca["modules_to_save"] == cb["modules_to_save"]
    torch.manual_seed(5)
    loaded = PeftModel.from_pretrained(TiedLM(), tmp_path / "theirs")
    base = loaded.base_model.model
    assert base.lm_head.weight is base.model.embed_tokens.weight
    torch.manual_seed(5)
    peft_loaded = peft.PeftModel.from_pretrained(TiedLM(), tmp_path / "ours")
    torch.testing.assert_close(loaded(input_ids=X), peft_loaded(input_ids=X), **TOL)


@pytest.mark.parametrize("kwargs,tie,config_tie", [
    (dict(target_modules=["linear"]), True, None),  # nothing tied is part of the adapter
    (dict(target_modules=["linear", "lm_head"]), False, None),  # nothing tied in the model
    (dict(target_modules=["linear"], modules_to_save=["lm_head"]), True, False),  # config: untied
])
def test_warnings_and_modules_as_peft(kwargs, tie, config_tie):
    (ours, our_warn), (theirs, their_warn) = _both(kwargs, tie=tie, config_tie=config_tie)
    assert our_warn == their_warn and len(our_warn) == 1
    for name in ("lm_head", "model.embed_tokens", "model.linear"):
        mine = ours.base_model.model.get_submodule(name)
        real = theirs.base_model.model.get_submodule(name)
        assert isinstance(mine, LoraLayer) == isinstance(real, peft.tuners.lora.LoraLayer)
        assert isinstance(mine, ModulesToSaveWrapper) == (type(real).__name__ ==
                                                          "ModulesToSaveWrapper")


def test_tied_layer_without_ensure_weight_tying_warns_as_peft():
    torch.manual_seed(0)
    texts = []
    for lib_config, wrap in ((LoraConfig, get_peft_model), (peft.LoraConfig, peft.get_peft_model)):
        with pytest.warns(UserWarning) as caught:
            wrap(TiedLM(), lib_config(target_modules=["linear", "lm_head"]))
        texts.append([str(w.message) for w in caught if "ensure_weight_tying" in str(w.message)])
    assert texts[0] == texts[1] and len(texts[0]) == 1


def test_module_names_tied_with_embedding_as_peft():
    from peft.utils.other import _get_module_names_tied_with_embedding as theirs

    for model in (TiedLM(), TiedLM(tie=False), TiedLM(config_tie=False)):
        assert module_names_tied_with_embedding(model) == theirs(model)
    assert module_names_tied_with_embedding(TiedLM()) == ["lm_head"]
    wrapped = get_peft_model(TiedLM(), LoraConfig(target_modules=["linear", "lm_head"],
                                                  ensure_weight_tying=True))
    assert wrapped._get_module_names_tied_with_embedding() == ["lm_head"]


@pytest.mark.parametrize("targets,save", [(["linear"], True), (["linear", "embed_tokens"], False),
                                          (["linear", "embed_tokens"], True)])
def test_save_embedding_layers_as_peft(targets, save, tmp_path):
    # untied model: save_embedding_layers=True writes the embeddings' weights (a targeted one's
    # base layer), False none; each library loads the other's file
    files = []
    for name, (lib_config, wrap) in {"ours": (LoraConfig, get_peft_model),
                                     "theirs": (peft.LoraConfig, peft.get_peft_model)}.items():
        torch.manual_seed(0)
        model = wrap(TiedLM(tie=False), lib_config(target_modules=targets, init_lora_weights=False))
        model.save_pretrained(tmp_path / name, save_embedding_layers=save)
        files.append(load_file(tmp_path / name / "adapter_model.safetensors"))
    assert sorted(files[0]) == sorted(files[1])
    assert any(k.endswith("embed_tokens.weight") or ".base_layer." in k for k in files[0]) == save
    for k in files[0]:
        torch.testing.assert_close(files[0][k], files[1][k], **TOL)
    X = torch.randint(0, 40, (2, 5))
    torch.manual_seed(3)
    loaded = PeftModel.from_pretrained(TiedLM(tie=False), tmp_path / "theirs")
    torch.manual_seed(3)
    peft_loaded = peft.PeftModel.from_pretrained(TiedLM(tie=False), tmp_path / "ours")
    torch.testing.assert_close(loaded(input_ids=X), peft_loaded(input_ids=X), **TOL)

"""The tuner surface (nanosft.tuners, nanosft.peft.PeftModel) against real peft 0.21.2.

Compared, each at fp32 with assert_close(atol=rtol=1e-5) or exactly: the generic PeftModel on a
custom module whose forward takes `X` (outputs, parameter names, requires_grad); the adapter API
(add / set / delete adapters, merge / unmerge, disable_adapter, merge_and_unload / unload); LoRA on
transformers' Conv1D and nn.Embedding; layers_to_transform; configs as files; adapter files both
ways (safetensors and .bin). Both libraries build the same adapters from the same seed (peft's RNG
order), so nothing is copied between them. Hermetic: tiny modules built in-process, no network.
Run: PYTHONPATH=$PWD OMP_NUM_THREADS=1 python -m pytest -q tests/test_tuners.py
"""

import json
import os

import pytest
import torch
from torch import nn

from nanosft.adapter_files import (
    LoraConfig, PeftType, PromptLearningConfig, PromptTuningInit, get_peft_model_state_dict,
    set_peft_model_state_dict)
from nanosft.peft import PeftModel, PeftModelForCausalLM, get_peft_model
from nanosft.tuners import BaseTunerLayer, get_base_model_state_dict, set_base_model_state_dict

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
TOL = dict(atol=1e-5, rtol=1e-5)


class MLP(nn.Module):
    """peft's tests' shape of custom model: forward takes X, not input_ids."""

    def __init__(self):
        super().__init__()
        self.lin0 = nn.Linear(10, 20)
        self.relu = nn.ReLU()
        self.lin1 = nn.Linear(20, 2)

    def forward(self, X):
        return self.lin1(self.relu(self.lin0(X)))


class EmbConv1D(nn.Module):
    """An embedding, then GPT-2's Conv1D (weight stored (in, out))."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.conv1d = transformers.pytorch_utils.Conv1D(6, 8)  # nf=6 outputs, nx=8 inputs
        self.lin = nn.Linear(6, 2)

    def forward(self, X):
        return self.lin(self.conv1d(self.emb(X)))


def _pair(base_cls, nano_config, peft_config, seed=0):
    """The same base weights, wrapped by nanosft and by peft, each from the same seed."""
    torch.manual_seed(seed)
    base = base_cls()
    theirs_base = base_cls()
    theirs_base.load_state_dict(base.state_dict())
    torch.manual_seed(seed + 1)
    ours = get_peft_model(base, nano_config)
    torch.manual_seed(seed + 1)
    theirs = peft.get_peft_model(theirs_base, peft_config)
    return ours, theirs


def _grads(model):
    return sorted(n for n, p in model.named_parameters() if p.requires_grad)


def test_generic_peft_model_forwards_whatever_the_base_takes():
    ours, theirs = _pair(MLP, LoraConfig(target_modules=["lin0"], init_lora_weights=False),
                         peft.LoraConfig(target_modules=["lin0"], init_lora_weights=False))
    assert type(ours) is PeftModel  # a module without a config is no causal LM
    X = torch.randn(4, 10)
    torch.testing.assert_close(ours(X=X), theirs(X=X), **TOL)
    torch.testing.assert_close(ours(X), theirs(X), **TOL)  # positional, too
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    assert _grads(ours) == _grads(theirs)
    assert isinstance(ours.base_model.model.lin0, BaseTunerLayer)
    assert not isinstance(ours.base_model.model.lin1, BaseTunerLayer)
    assert ours.lin1 is ours.base_model.model.lin1  # attributes fall through, as peft's


def test_adapter_api_matches_peft():
    cfg = dict(target_modules=["lin0", "lin1"], init_lora_weights=False)
    ours, theirs = _pair(MLP, LoraConfig(**cfg), peft.LoraConfig(**cfg))
    torch.manual_seed(5)
    ours.add_adapter("other", LoraConfig(target_modules=["lin1"], init_lora_weights=False))
    torch.manual_seed(5)
    theirs.add_adapter("other", peft.LoraConfig(target_modules=["lin1"], init_lora_weights=False))
    X = torch.randn(3, 10)
    assert ours.active_adapters == theirs.active_adapters == ["default"]
    assert _grads(ours) == _grads(theirs)  # the new adapter is added frozen
    torch.testing.assert_close(ours(X), theirs(X), **TOL)
    ours.set_adapter("other")
    theirs.set_adapter("other")
    assert ours.active_adapter == theirs.active_adapter == "other"
    assert _grads(ours) == _grads(theirs)
    torch.testing.assert_close(ours(X), theirs(X), **TOL)
    # merge in place, then out again: the output moves by less than the tolerance
    before = ours(X)
    ours.merge_adapter()
    assert ours.base_model.model.lin1.merged
    torch.testing.assert_close(ours(X), before, **TOL)
    ours.unmerge_adapter()
    assert not ours.base_model.model.lin1.merged
    with pytest.raises(ValueError, match="merged"):  # peft refuses to delete a merged adapter
        ours.merge_adapter()
        ours.delete_adapter("other")
    ours.unmerge_adapter()
    ours.delete_adapter("other")
    theirs.delete_adapter("other")
    assert ours.active_adapters == theirs.active_adapters == ["default"]
    assert list(ours.peft_config) == ["default"]
    assert "other" not in str(list(ours.state_dict()))
    torch.testing.assert_close(ours(X), theirs(X), **TOL)
    with pytest.raises(ValueError, match="already exists"):
        ours.add_adapter("default", LoraConfig(target_modules=["lin0"]))


def test_disable_adapter_is_the_base_and_restores():
    cfg = dict(target_modules=["lin0"], init_lora_weights=False)
    ours, theirs = _pair(MLP, LoraConfig(**cfg), peft.LoraConfig(**cfg))
    X = torch.randn(3, 10)
    adapted = ours(X)
    with ours.disable_adapter(), theirs.disable_adapter():
        torch.testing.assert_close(ours(X), theirs(X), **TOL)
        torch.testing.assert_close(ours(X), ours.get_base_model().lin1(
            ours.get_base_model().relu(ours.get_base_model().lin0.base_layer(X))), **TOL)
        assert not _grads(ours)
    torch.testing.assert_close(ours(X), adapted, **TOL)
    assert _grads(ours) == _grads(theirs)


def test_merge_and_unload_and_unload_match_peft():
    cfg = dict(target_modules=["lin0", "lin1"], init_lora_weights=False)
    X = torch.randn(3, 10)
    ours, theirs = _pair(MLP, LoraConfig(**cfg), peft.LoraConfig(**cfg))
    merged_ours, merged_theirs = ours.merge_and_unload(), theirs.merge_and_unload()
    assert type(merged_ours.lin0) is nn.Linear
    torch.testing.assert_close(merged_ours(X), merged_theirs(X), **TOL)
    ours, theirs = _pair(MLP, LoraConfig(**cfg), peft.LoraConfig(**cfg))
    plain_ours, plain_theirs = ours.unload(), theirs.unload()
    assert type(plain_ours.lin1) is nn.Linear
    torch.testing.assert_close(plain_ours(X), plain_theirs(X), **TOL)


def test_base_model_state_dict_has_the_base_keys():
    cfg = dict(target_modules=["lin0"], init_lora_weights=False)
    ours, theirs = _pair(MLP, LoraConfig(**cfg), peft.LoraConfig(**cfg))
    mine = get_base_model_state_dict(ours)
    ref = peft.get_base_model_state_dict(theirs)
    assert sorted(mine) == sorted(ref) == sorted(MLP().state_dict())
    for k in ref:
        torch.testing.assert_close(mine[k], ref[k], atol=0, rtol=0)
    fresh = MLP().state_dict()
    result = set_base_model_state_dict(ours, fresh)
    assert result.missing_keys == result.unexpected_keys == []
    for k, v in get_base_model_state_dict(ours).items():
        torch.testing.assert_close(v, fresh[k], atol=0, rtol=0)


def test_merging_twice_warns_and_changes_nothing():
    model = get_peft_model(MLP(), LoraConfig(target_modules=["lin0"], init_lora_weights=False))
    model.merge_adapter()
    merged = model.base_model.model.lin0.base_layer.weight.detach().clone()
    with pytest.warns(UserWarning, match="All adapters are already merged"):
        model.merge_adapter()
    torch.testing.assert_close(model.base_model.model.lin0.base_layer.weight, merged,
                               atol=0, rtol=0)


@pytest.mark.parametrize("use_dora", [False, True])
@pytest.mark.parametrize("targets", [["conv1d"], ["emb"], ["emb", "conv1d"]])
def test_lora_on_conv1d_and_embedding_matches_peft(targets, use_dora, tmp_path):
    cfg = dict(target_modules=targets, init_lora_weights=False, use_dora=use_dora)
    ours, theirs = _pair(EmbConv1D, LoraConfig(**cfg), peft.LoraConfig(**cfg))
    X = torch.randint(0, 50, (2, 5))
    torch.testing.assert_close(ours(X), theirs(X), **TOL)
    assert sorted(ours.state_dict()) == sorted(theirs.state_dict())
    # our adapter file read by peft gives peft's own outputs
    ours.save_pretrained(tmp_path)
    torch.manual_seed(0)
    loaded = peft.PeftModel.from_pretrained(EmbConv1D(), tmp_path)
    loaded.base_model.model.load_state_dict(ours.get_base_model().state_dict())
    torch.testing.assert_close(loaded(X), ours(X), **TOL)
    before = ours(X)
    ours.merge_adapter()
    torch.testing.assert_close(ours(X), before, **TOL)
    ours.unmerge_adapter()
    torch.testing.assert_close(ours(X), before, **TOL)


def test_conv1d_merge_changes_the_stored_weight_transposed():
    # negative control: the delta is (out, in) but Conv1D stores (in, out); a merge that forgot
    # the transpose would fail to broadcast (6x8 vs 8x6) or land on the wrong entries
    model = get_peft_model(EmbConv1D(), LoraConfig(target_modules=["conv1d"],
                                                   init_lora_weights=False))
    layer = model.base_model.model.conv1d
    w0 = layer.base_layer.weight.detach().clone()
    layer.merge()
    torch.testing.assert_close(layer.base_layer.weight - w0, layer.get_delta_weight("default").T,
                               **TOL)


def test_layers_to_transform_targets_what_peft_targets():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=3, num_attention_heads=4,
                                      num_key_value_heads=2)
    kw = dict(target_modules=["q_proj", "v_proj"], layers_to_transform=[0, 2],
              layers_pattern="layers")

    def targeted(m):
        return sorted(n for n, mod in m.named_modules() if hasattr(mod, "lora_A"))
    ours = get_peft_model(transformers.LlamaForCausalLM(config), LoraConfig(**kw))
    theirs = peft.get_peft_model(transformers.LlamaForCausalLM(config), peft.LoraConfig(**kw))
    assert targeted(ours) == targeted(theirs)
    assert not any(".layers.1." in n for n in targeted(ours))
    with pytest.raises(ValueError, match="layers_to_transform"):
        LoraConfig(target_modules=["q_proj"], layers_pattern="layers")


def test_default_target_modules_follow_peft_for_gpt2():
    config = transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=4)
    ours = get_peft_model(transformers.GPT2LMHeadModel(config), LoraConfig())
    theirs = peft.get_peft_model(transformers.GPT2LMHeadModel(config), peft.LoraConfig())
    assert type(ours) is PeftModelForCausalLM
    assert ours.peft_config["default"].target_modules == ["c_attn"]
    assert sorted(n for n, p in ours.named_parameters() if "lora" in n) == sorted(
        n for n, p in theirs.named_parameters() if "lora" in n)


def test_config_names_and_files(tmp_path):
    config = LoraConfig(r=4, target_modules=["lin0"], init_lora_weights="gaussian",
                        rank_pattern={"lin0": 2}, alpha_pattern={"lin0": 3})
    assert config.peft_type is PeftType.LORA and config.peft_type == "LORA"
    assert issubclass(PeftModelForCausalLM, PeftModel)
    assert PromptTuningInit("TEXT") is PromptTuningInit.TEXT
    from nanosft.adapter_files import PromptTuningConfig
    assert issubclass(PromptTuningConfig, PromptLearningConfig)
    config.save_pretrained(tmp_path)
    again = LoraConfig.from_pretrained(tmp_path)
    assert again == config
    theirs = peft.LoraConfig.from_pretrained(tmp_path)  # peft reads our file
    assert (theirs.r, theirs.rank_pattern, theirs.init_lora_weights) == (4, {"lin0": 2},
                                                                         "gaussian")
    model = get_peft_model(MLP(), config)
    assert model.base_model.model.lin0.r["default"] == 2
    assert model.base_model.model.lin0.scaling["default"] == 3 / 2


@pytest.mark.parametrize("safe_serialization", [True, False])
def test_save_and_load_options(tmp_path, safe_serialization):
    model = get_peft_model(MLP(), LoraConfig(target_modules=["lin0"], init_lora_weights=False))
    model.add_adapter("second", LoraConfig(target_modules=["lin1"], init_lora_weights=False))
    model.save_pretrained(tmp_path, safe_serialization=safe_serialization)
    name = "adapter_model.safetensors" if safe_serialization else "adapter_model.bin"
    assert os.path.exists(tmp_path / name) and os.path.exists(tmp_path / "second" / name)
    card = (tmp_path / "README.md").read_text()
    assert "library_name: peft" in card and "- lora" in card
    base = MLP()
    base.load_state_dict(get_base_model_state_dict(model))
    loaded = PeftModel.from_pretrained(base, tmp_path, torch_device="cpu",
                                       low_cpu_mem_usage=True)
    result = loaded.load_adapter(tmp_path / "second", adapter_name="second")
    assert result.missing_keys == []
    X = torch.randn(2, 10)
    for name in ("default", "second"):
        model.set_adapter(name)
        loaded.set_adapter(name)
        torch.testing.assert_close(loaded(X), model(X), **TOL)
    given = LoraConfig(target_modules=["lin0"])
    again = PeftModel.from_pretrained(MLP(), tmp_path, config=given)
    assert again.peft_config["default"] is given and given.inference_mode
    if safe_serialization:  # peft reads the files we wrote
        peft.PeftModel.from_pretrained(MLP(), tmp_path)
        config = json.loads((tmp_path / "adapter_config.json").read_text())
        assert config["peft_type"] == "LORA"


def test_fp16_adapters_upcast_unless_asked_not_to():
    def dtypes(model):
        return {p.dtype for n, p in model.named_parameters() if "lora_" in n}
    assert dtypes(get_peft_model(MLP().half(), LoraConfig(target_modules=["lin0"]))) == {
        torch.float32}
    kept = get_peft_model(MLP().half(), LoraConfig(target_modules=["lin0"]),
                          autocast_adapter_dtype=False)
    assert dtypes(kept) == {torch.float16}


class Conv2dModel(nn.Module):
    """A 3x3 convolution and a 1x1 one, then a linear head."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.conv1x1 = nn.Conv2d(6, 4, 1)
        self.lin = nn.Linear(4 * 5 * 5, 2)

    def forward(self, X):
        return self.lin(self.conv1x1(self.conv(X)).flatten(1))


@pytest.mark.parametrize("use_dora", [False, True])
@pytest.mark.parametrize("targets", [["conv"], ["conv1x1"], ["conv", "conv1x1"]])
def test_lora_on_conv2d_matches_peft(targets, use_dora):
    cfg = dict(target_modules=targets, init_lora_weights=False, use_dora=use_dora)
    ours, theirs = _pair(Conv2dModel, LoraConfig(**cfg), peft.LoraConfig(**cfg))
    X = torch.randn(2, 3, 5, 5)
    torch.testing.assert_close(ours(X), theirs(X), **TOL)
    assert sorted(ours.state_dict()) == sorted(theirs.state_dict())
    for name in targets:  # the merged kernel equals peft's delta
        torch.testing.assert_close(ours.base_model.model.get_submodule(name).get_delta_weight(
            "default"), theirs.base_model.model.get_submodule(name).get_delta_weight("default"),
            **TOL)
    before = ours(X)
    ours.merge_adapter()
    torch.testing.assert_close(ours(X), before, **TOL)
    ours.unmerge_adapter()
    torch.testing.assert_close(ours(X), before, **TOL)


def test_push_to_hub_uploads_the_saved_folder(monkeypatch):
    import huggingface_hub

    seen = {}

    class FakeApi:  # no network: record what would be uploaded
        def __init__(self, token=None):
            pass

        def create_repo(self, repo_id, private=None, exist_ok=False):
            seen["repo"] = repo_id

        def upload_folder(self, repo_id, folder_path, commit_message):
            seen["files"] = sorted(os.listdir(folder_path))
            return "done"

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    model = get_peft_model(MLP(), LoraConfig(target_modules=["lin0"]))
    assert model.push_to_hub("me/adapter") == "done"
    assert seen == {"repo": "me/adapter", "files": ["README.md", "adapter_config.json",
                                                     "adapter_model.safetensors"]}


def test_peft_version_is_the_writers(tmp_path, monkeypatch):
    from nanosft import adapter_files
    from nanosft.adapter_files import PeftConfig

    monkeypatch.setattr(adapter_files, "__version__", "0.10.0")
    config = LoraConfig(target_modules=["lin0"])
    assert config.peft_version == "0.10.0"
    config.save_pretrained(tmp_path)
    monkeypatch.setattr(adapter_files, "__version__", "9.9.9")
    assert PeftConfig.from_pretrained(tmp_path).peft_version == "0.10.0"  # the file's, kept
    assert LoraConfig.from_json_file(tmp_path / "adapter_config.json")["peft_version"] == "0.10.0"
    assert peft.LoraConfig.from_pretrained(tmp_path).peft_version == "0.10.0"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_bases_keep_their_dtype_through_merge(dtype):
    # fp32 adapters (autocast) merged into a half base: the base stays half, forward still runs
    model = get_peft_model(EmbConv1D().to(dtype), LoraConfig(target_modules=["emb", "conv1d"]))
    conv = get_peft_model(Conv2dModel().to(dtype), LoraConfig(target_modules=["conv"]))
    X = torch.randint(0, 50, (2, 5))
    for m, x in ((model, X), (conv, torch.randn(2, 3, 5, 5, dtype=dtype))):
        m(x)
        m.merge_adapter()
        m(x)
        m.unmerge_adapter()
        assert {p.dtype for n, p in m.named_parameters() if "lora_" not in n} == {dtype}
        m(x)


def test_mixed_adapter_batch_matches_peft():
    # one adapter per row ("__base__": none), through the generic wrapper's forward
    cfg = dict(target_modules=["lin0", "lin1"], init_lora_weights=False)
    ours, theirs = _pair(MLP, LoraConfig(**cfg), peft.LoraConfig(**cfg))
    torch.manual_seed(7)
    ours.add_adapter("other", LoraConfig(**cfg))
    torch.manual_seed(7)
    theirs.add_adapter("other", peft.LoraConfig(**cfg))
    ours.eval()
    theirs.eval()
    X = torch.randn(3, 10)
    names = ["default", "other", "__base__"]
    got = ours(X=X, adapter_names=names)
    torch.testing.assert_close(got, theirs(X=X, adapter_names=names), **TOL)
    ours.set_adapter("other")
    torch.testing.assert_close(got[1], ours(X=X)[1], **TOL)  # row 1 is adapter "other" alone
    with ours.disable_adapter():
        torch.testing.assert_close(got[2], ours(X=X)[2], **TOL)  # row 2 is the base
    with pytest.raises(ValueError, match="Length of `adapter_names` should be the same"):
        ours(X=X, adapter_names=names[:2])  # peft's words for a batch and names that differ
    ours.train()
    with pytest.raises(ValueError, match="training mode"):
        ours(X=X, adapter_names=names)


@pytest.mark.parametrize("low_cpu_mem_usage", [False, True])
def test_inject_adapter_in_model_matches_peft(low_cpu_mem_usage):
    from nanosft.tuners import inject_adapter_in_model

    cfg = dict(target_modules=["lin0"], init_lora_weights=False)
    torch.manual_seed(0)
    ours_base, theirs_base = MLP(), MLP()
    theirs_base.load_state_dict(ours_base.state_dict())
    torch.manual_seed(1)
    ours = inject_adapter_in_model(LoraConfig(**cfg), ours_base,
                                   low_cpu_mem_usage=low_cpu_mem_usage)
    torch.manual_seed(1)
    theirs = peft.inject_adapter_in_model(peft.LoraConfig(**cfg), theirs_base,
                                          low_cpu_mem_usage=low_cpu_mem_usage)
    assert ours is ours_base and type(ours.lin0).__name__ == "LoraLinear"
    assert _grads(ours) == _grads(theirs)
    devices = {n: p.device.type for n, p in ours.named_parameters()}
    assert devices == {n: p.device.type for n, p in theirs.named_parameters()}
    if not low_cpu_mem_usage:
        X = torch.randn(2, 10)
        torch.testing.assert_close(ours(X), theirs(X), **TOL)


def test_set_requires_grad_names_the_adapters():
    model = get_peft_model(MLP(), LoraConfig(target_modules=["lin0"]))
    model.add_adapter("other", LoraConfig(target_modules=["lin0"]))
    model.set_requires_grad("other")  # inactive, yet trainable now
    assert "base_model.model.lin0.lora_A.other.weight" in _grads(model)
    model.set_requires_grad(["default", "other"], requires_grad=False)
    assert _grads(model) == []
    from nanosft.adapter_files import PromptTuningConfig
    prompt = get_peft_model(transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_embd=16, n_layer=1, n_head=4)), PromptTuningConfig(num_virtual_tokens=2))
    with pytest.raises(TypeError, match="prompt learning"):
        prompt.set_requires_grad("default")


def test_config_refuses_unknown_task_types_and_ignores_newer_keys(tmp_path):
    with pytest.raises(ValueError, match="Invalid task type: 'nope'"):
        LoraConfig(task_type="nope")
    config = LoraConfig(target_modules=["lin0"])
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**saved, "foobar": "baz"}))
    with pytest.warns(UserWarning, match=r"Unexpected keyword arguments \['foobar'\]"):
        again = LoraConfig.from_pretrained(tmp_path)
    assert again.to_dict() == config.to_dict()
    with pytest.warns(UserWarning, match="foobar"):  # peft says the same of it
        peft.LoraConfig.from_pretrained(tmp_path)


def test_deleting_a_conv_adapter_matches_peft():
    cfg = dict(target_modules=["conv"], init_lora_weights=False)
    ours, theirs = _pair(Conv2dModel, LoraConfig(**cfg), peft.LoraConfig(**cfg))
    for model, lib in ((ours, None), (theirs, peft)):
        torch.manual_seed(5)
        model.add_adapter("other", (lib.LoraConfig if lib else LoraConfig)(**cfg))
        model.delete_adapter("default")
    assert list(ours.base_model.model.conv.lora_A) == ["other"]
    X = torch.randn(2, 3, 5, 5)
    torch.testing.assert_close(ours(X), theirs(X), **TOL)


@pytest.mark.parametrize("bias", ["all", "lora_only"])
def test_trained_biases_load_into_a_bias_none_model_as_in_peft(bias):
    # the saved biases are loaded wherever the model has them, whatever the new config's bias
    cfg = dict(target_modules=["lin0"], init_lora_weights=False)
    ours, theirs = _pair(MLP, LoraConfig(**cfg, bias=bias), peft.LoraConfig(**cfg, bias=bias))
    with torch.no_grad():
        for model in (ours, theirs):
            for name, p in model.named_parameters():
                if name.endswith(".bias") and p.requires_grad:
                    p.fill_(1.23)
    state = {"nano": get_peft_model_state_dict(ours),
             "peft": peft.get_peft_model_state_dict(theirs)}
    assert sorted(state["nano"]) == sorted(state["peft"])
    X = torch.randn(3, 10)
    fresh_ours, fresh_theirs = _pair(MLP, LoraConfig(**cfg), peft.LoraConfig(**cfg))
    set_peft_model_state_dict(fresh_ours, state["peft"])
    peft.set_peft_model_state_dict(fresh_theirs, state["nano"])
    torch.testing.assert_close(fresh_ours(X), theirs(X), **TOL)
    torch.testing.assert_close(fresh_theirs(X), ours(X), **TOL)


def test_mixed_batch_refusals_use_peft_words():
    # the same ValueError text as peft for a merged model, a DoRA adapter and an unknown name
    X = torch.randn(2, 10)
    for cfg, prepare, names in (
            (dict(), lambda m: m.merge_adapter(), ["default", "__base__"]),
            (dict(use_dora=True), lambda m: None, ["default", "__base__"]),
            (dict(), lambda m: None, ["default", "does-not-exist"])):
        cfg = dict(target_modules=["lin0"], **cfg)
        messages = []
        for model in _pair(MLP, LoraConfig(**cfg), peft.LoraConfig(**cfg)):
            model.eval()
            prepare(model)
            with pytest.raises(ValueError) as err:
                model(X, adapter_names=names)
            messages.append(str(err.value))
        assert messages[0].startswith(messages[1]), messages


def test_supports_lora_conversion_answers_as_peft():
    # a LoRA linear's delta converts (yes); an embedding's layer does not (no, as peft's);
    # prompt learning has no layers to convert (no)
    ours, theirs = _pair(MLP, LoraConfig(target_modules=["lin0"]),
                         peft.LoraConfig(target_modules=["lin0"]))
    assert ours.supports_lora_conversion() is theirs.supports_lora_conversion() is True
    ours, theirs = _pair(EmbConv1D, LoraConfig(target_modules=["emb"]),
                         peft.LoraConfig(target_modules=["emb"]))
    assert ours.supports_lora_conversion() is theirs.supports_lora_conversion() is False
    from nanosft.adapter_files import PromptTuningConfig

    def gpt2():
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=16,
                                                                    n_layer=1, n_head=4))
    ours = get_peft_model(gpt2(), PromptTuningConfig(num_virtual_tokens=2))
    theirs = peft.get_peft_model(gpt2(), peft.PromptTuningConfig(num_virtual_tokens=2,
                                                                 task_type="CAUSAL_LM"))
    assert ours.supports_lora_conversion() is theirs.supports_lora_conversion() is False


def test_merge_and_delete_lora_on_parameters_as_peft():
    # target_parameters: merge_adapter folds the delta in, a merged adapter refuses deletion with
    # peft's text, disabling a merged one gives the base output, unmerge restores the weight
    cfg = dict(target_parameters=["lin0.weight"], target_modules=[], init_lora_weights=False)
    ours, theirs = _pair(MLP, LoraConfig(**cfg), peft.LoraConfig(**cfg))
    X = torch.randn(4, 10)
    base = ours.base_model.model.lin0.get_base_layer().weight.detach().clone()
    with ours.disable_adapter():
        base_out = ours(X)
    for model in (ours, theirs):
        model.merge_adapter()
    torch.testing.assert_close(ours(X), theirs(X), **TOL)
    errors = []
    for model in (ours, theirs):
        with pytest.raises(ValueError) as caught:
            model.delete_adapter("default")
        errors.append(str(caught.value))
    assert errors[0] == errors[1]
    with pytest.warns(UserWarning, match="All adapters are already merged"):
        ours.merge_adapter()
    with ours.disable_adapter():
        torch.testing.assert_close(ours(X), base_out, **TOL)
    ours.unmerge_adapter()
    torch.testing.assert_close(ours.base_model.model.lin0.get_base_layer().weight, base, **TOL)
    ours.delete_adapter("default")
    assert "default" not in ours.peft_config


@pytest.mark.parametrize("target_modules", [None, [], ""])
def test_nothing_targeted_refused_in_peft_words(target_modules):
    lead = ("No `target_modules` passed but also no `target_parameters` found. Please check the "
            "values for these arguments.")
    for config_cls, wrap in ((LoraConfig, get_peft_model), (peft.LoraConfig, peft.get_peft_model)):
        with pytest.raises(ValueError) as caught:
            wrap(MLP(), config_cls(target_modules=target_modules, target_parameters=["foobar"]))
        assert str(caught.value).startswith(lead)


def test_config_file_without_peft_type_refused_as_peft(tmp_path):
    (tmp_path / "adapter_config.json").write_text(json.dumps({"foo": "bar"}))
    texts = []
    for config_cls in (LoraConfig, peft.LoraConfig):
        with pytest.raises(TypeError) as caught:
            config_cls.from_pretrained(tmp_path)
        texts.append(str(caught.value))
    assert texts[0].startswith(texts[1])


def test_config_class_fixes_its_peft_type_as_peft():
    from nanosft.adapter_files import PrefixTuningConfig, PromptTuningConfig

    pairs = ((LoraConfig, peft.LoraConfig), (PromptTuningConfig, peft.PromptTuningConfig),
             (PrefixTuningConfig, peft.PrefixTuningConfig))
    for ours, theirs in pairs:
        assert ours(peft_type="test").peft_type.value == theirs(peft_type="test").peft_type.value


def test_runtime_config_in_a_file_dropped_with_peft_warning(tmp_path):
    config = LoraConfig(target_modules=["lin0"])
    config.save_pretrained(tmp_path)
    path = tmp_path / "adapter_config.json"
    saved = json.loads(path.read_text())
    path.write_text(json.dumps({**saved, "runtime_config": {"ephemeral_gpu_offload": True}}))
    texts = []
    for config_cls in (LoraConfig, peft.LoraConfig):
        with pytest.warns(UserWarning) as caught:
            read = config_cls.from_json_file(str(path))
        assert "runtime_config" not in read
        texts.append([str(w.message) for w in caught if "runtime_config" in str(w.message)])
    assert texts[0] == texts[1] and len(texts[0]) == 1
    with pytest.warns(UserWarning, match="runtime_config"):
        assert LoraConfig.from_pretrained(tmp_path).target_modules == ["lin0"]


def test_beam_search_with_adapter_names_as_peft():
    # beam search repeats every row num_beams times; each row keeps its adapter
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2)
    kw = dict(target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    outs = []
    for config_cls, wrap in ((LoraConfig, get_peft_model), (peft.LoraConfig, peft.get_peft_model)):
        torch.manual_seed(0)
        model = wrap(transformers.LlamaForCausalLM(config), config_cls(**kw))
        model.add_adapter("other", config_cls(**kw))
        model.eval()
        ids = torch.tensor([[1, 5, 9], [3, 4, 7]])
        outs.append(model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                   adapter_names=["default", "other"], num_beams=3,
                                   max_new_tokens=4, do_sample=False, pad_token_id=0))
    assert torch.equal(outs[0], outs[1])

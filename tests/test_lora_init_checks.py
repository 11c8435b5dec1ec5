"""LoRA set-up against real peft 0.21.2: initializations, refused settings and their words.

Compared: init_lora_weights="orthogonal" (A and B drawn as peft draws them, exactly, from one
seed) and "gaussian" on an embedding; the LoraConfig settings both refuse (same exception class,
same message); what get_peft_model refuses (an unknown bias, lora_bias on an embedding, a layer
targeted by module and by parameter, a conv rank not divisible by its groups); the lora_bias
warning on a base without bias and the merge it makes impossible; several adapters on the same
target_parameters (outputs at fp32 1e-5), and a different set refused. Hermetic: tiny in-process
modules. Run: PYTHONPATH=$PWD OMP_NUM_THREADS=1 python -m pytest -q tests/test_lora_init_checks.py
"""

import warnings

import pytest
import torch
from torch import nn

from nanosft.adapter_files import LoraConfig, PeftWarning
from nanosft.peft import PeftModel, get_peft_model

peft = pytest.importorskip("peft")
TOL = dict(atol=1e-5, rtol=1e-5)


class Net(nn.Module):
    def __init__(self, bias=True):
        super().__init__()
        self.linear = nn.Linear(12, 10, bias=bias)
        self.embed = nn.Embedding(30, 10)
        self.conv2d = nn.Conv2d(4, 6, 3, bias=bias)
        self.grouped = nn.Conv2d(4, 4, 3, groups=2)

    def forward(self, x):
        return self.linear(x)


def _both(config_kwargs, seed=0, bias=True, adapter_name="default"):
    """(nanosft model, peft model) built from the same seed: the same base and adapter draws."""
    torch.manual_seed(seed)
    ours = get_peft_model(Net(bias), LoraConfig(**config_kwargs), adapter_name=adapter_name)
    torch.manual_seed(seed)
    theirs = peft.get_peft_model(Net(bias), peft.LoraConfig(**config_kwargs),
                                 adapter_name=adapter_name)
    return ours, theirs


def _lora_state(model):
    return {k: v for k, v in model.state_dict().items() if "lora_" in k}


def _raised(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 (the class and words are what is compared)
        return type(e).__name__, str(e)
    return None


def test_orthogonal_init_draws_as_peft():
    ours, theirs = _both(dict(target_modules=["linear"], init_lora_weights="orthogonal", r=6))
    a, b = _lora_state(ours), _lora_state(theirs)
    assert a.keys() == b.keys() and len(a) == 2
    for k in a:
        assert torch.equal(a[k], b[k]), k
    layer = ours.base_model.model.linear
    A, B = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    assert (B @ A).abs().max() < 1e-6 and A.abs().min() > 0  # starts as the identity, A not 0
    x = torch.randn(3, 12)
    torch.testing.assert_close(ours(x), theirs(x), **TOL)
    # cast with the model, as any adapter weight is
    assert ours.to(torch.bfloat16).base_model.model.linear.lora_B["default"].weight.dtype == \
        torch.bfloat16


def test_orthogonal_odd_rank_refused_as_peft():
    kwargs = dict(target_modules=["linear"], init_lora_weights="orthogonal", r=7)
    ours = _raised(lambda: get_peft_model(Net(), LoraConfig(**kwargs)))
    theirs = _raised(lambda: peft.get_peft_model(Net(), peft.LoraConfig(**kwargs)))
    assert ours == theirs and ours[0] == "ValueError"


@pytest.mark.parametrize("init", [True, "gaussian", "orthogonal"])
def test_embedding_init_as_peft(init):
    # an embedding ignores "gaussian" / "orthogonal": A zeros, B normal, as with True
    ours, theirs = _both(dict(target_modules=["embed"], init_lora_weights=init))
    a, b = _lora_state(ours), _lora_state(theirs)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert (ours.base_model.model.embed.lora_embedding_A["default"] == 0).all()


@pytest.mark.parametrize("kwargs", [
    dict(lora_bias=True, use_dora=True),
    dict(lora_bias=True, init_lora_weights="gaussian"),
    dict(lora_bias=True, init_lora_weights="orthogonal"),
    dict(target_parameters="linear.weight"),
    dict(use_dora=True, megatron_config={"tensor_model_parallel_size": 2}),
])
def test_config_refusals_as_peft(kwargs):
    ours = _raised(lambda: LoraConfig(target_modules=["linear"], **kwargs))
    theirs = _raised(lambda: peft.LoraConfig(target_modules=["linear"], **kwargs))
    assert theirs is not None and ours == theirs


def test_megatron_config_alone_refused():
    # peft builds Megatron-LM parallel layers from it; nanosft has none, so says so
    with pytest.raises(ValueError, match="megatron_config"):
        LoraConfig(target_modules=["linear"], megatron_config={"tensor_model_parallel_size": 2})


@pytest.mark.parametrize("kwargs", [
    dict(target_modules=["linear"], bias="invalid"),
    dict(target_modules=["linear"], target_parameters=["linear.weight"]),
    dict(target_modules=["grouped"], r=3),
    dict(target_modules=["grouped"], r=3, use_dora=True),
])
def test_get_peft_model_refusals_as_peft(kwargs):
    config = LoraConfig(**kwargs)  # the config itself is accepted, as peft's is
    ours = _raised(lambda: get_peft_model(Net(), config))
    theirs = _raised(lambda: peft.get_peft_model(Net(), peft.LoraConfig(**kwargs)))
    assert theirs is not None and ours == theirs


def test_lora_bias_on_embedding_refused():
    kwargs = dict(target_modules=["embed"], lora_bias=True)
    ours = _raised(lambda: get_peft_model(Net(), LoraConfig(**kwargs)))
    theirs = _raised(lambda: peft.get_peft_model(Net(), peft.LoraConfig(**kwargs)))
    # peft names its layer class (Embedding), nanosft the wrapped nn.Embedding: the same word
    lead = "lora_bias=True is not supported for Embedding"
    assert ours[0] == theirs[0] == "ValueError"
    assert ours[1].startswith(lead) and theirs[1].startswith(lead)


def test_modules_to_save_naming_a_lora_layer_refused():
    # modules_to_save == the adapter name matches the LoRA layers' own lora_A.<name>
    kwargs = dict(target_modules=["linear"], modules_to_save=["foobar"])
    ours = _raised(lambda: get_peft_model(Net(), LoraConfig(**kwargs), adapter_name="foobar"))
    theirs = _raised(lambda: peft.get_peft_model(Net(), peft.LoraConfig(**kwargs),
                                                 adapter_name="foobar"))
    assert ours[0] == theirs[0] == "ValueError"
    # the same sentence; the classes named are each library's own
    assert ours[1].split("<class")[0] == theirs[1].split("<class")[0]
    assert ours[1].split(">")[-1] == theirs[1].split(">")[-1]


@pytest.mark.parametrize("target", ["linear", "conv2d"])
def test_lora_bias_without_base_bias_warns_and_merge_raises_as_peft(target):
    kwargs = dict(target_modules=[target], lora_bias=True)
    with warnings.catch_warnings(record=True) as ours_w:
        warnings.simplefilter("always")
        ours = get_peft_model(Net(bias=False), LoraConfig(**kwargs))
    with warnings.catch_warnings(record=True) as theirs_w:
        warnings.simplefilter("always")
        theirs = peft.get_peft_model(Net(bias=False), peft.LoraConfig(**kwargs))
    ours_w = [w for w in ours_w if "lora_bias" in str(w.message)]
    theirs_w = [w for w in theirs_w if "lora_bias" in str(w.message)]
    assert [str(w.message) for w in ours_w] == [str(w.message) for w in theirs_w]
    assert len(ours_w) == 1 and issubclass(ours_w[0].category, PeftWarning)
    assert issubclass(PeftWarning, UserWarning) and theirs_w[0].category.__name__ == "PeftWarning"
    weight = ours.base_model.model.get_submodule(target).base_layer.weight.clone()
    assert _raised(ours.merge_adapter) == _raised(theirs.merge_adapter)
    assert _raised(ours.merge_adapter)[0] == "RuntimeError"
    assert torch.equal(ours.base_model.model.get_submodule(target).base_layer.weight, weight)


def _two_adapters(lib_get, lib_config):
    torch.manual_seed(0)
    model = lib_get(Net(), lib_config(target_modules=[], target_parameters=["linear.weight"],
                                      init_lora_weights=False))
    model.add_adapter(adapter_name="other", peft_config=lib_config(
        target_modules=[], target_parameters=["linear.weight"], init_lora_weights=False))
    return model


def test_two_adapters_on_the_same_target_parameters_as_peft(tmp_path):
    ours = _two_adapters(get_peft_model, LoraConfig)
    theirs = _two_adapters(peft.get_peft_model, peft.LoraConfig)
    a, b = _lora_state(ours), _lora_state(theirs)
    assert a.keys() == b.keys() and len(a) == 4
    for k in a:
        assert torch.equal(a[k], b[k]), k
    x = torch.randn(3, 12)
    for active in ("default", "other", ["default", "other"]):
        ours.base_model.set_adapter(active)
        theirs.base_model.set_adapter(active)
        torch.testing.assert_close(ours(x), theirs(x), **TOL)
        trainable = sorted(n for n, p in ours.named_parameters() if p.requires_grad)
        assert trainable == sorted(n for n, p in theirs.named_parameters() if p.requires_grad)
    # written by nanosft, each adapter read back beside the other
    ours.base_model.set_adapter("default")
    ours.save_pretrained(tmp_path)
    torch.manual_seed(1)
    loaded = PeftModel.from_pretrained(Net(), tmp_path)
    loaded.load_adapter(tmp_path, adapter_name="other")
    assert list(loaded.peft_config) == ["default", "other"]
    layer = loaded.base_model.model.linear
    torch.testing.assert_close(layer.lora_B["other"].weight, layer.lora_B["default"].weight,
                               **TOL)


def test_a_different_set_of_target_parameters_refused_as_peft():
    results = []
    for get, config in ((get_peft_model, LoraConfig), (peft.get_peft_model, peft.LoraConfig)):
        model = get(Net(), config(target_modules=[], target_parameters=["linear.weight"]))
        results.append(_raised(lambda: model.add_adapter(adapter_name="other", peft_config=config(
            target_modules=[], target_parameters=["embed.weight"]))))
        assert "other" not in model.peft_config
    assert results[0] == results[1] and results[0][0] == "ValueError"


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin0 = nn.Linear(10, 20)
        self.lin1 = nn.Linear(20, 2)

    def forward(self, X):
        return self.lin1(self.lin0(X))


@pytest.mark.parametrize("existing", [None, "---\nmeta: hello\n---\nThis is a model card\n"])
def test_model_card_as_peft(tmp_path, existing):
    # a new card: huggingface_hub's template with peft's metadata; an existing one keeps its own
    pytest.importorskip("huggingface_hub")
    cards = []
    for lib_get, lib_config, folder in ((get_peft_model, LoraConfig, tmp_path / "ours"),
                                        (peft.get_peft_model, peft.LoraConfig, tmp_path / "peft")):
        folder.mkdir()
        if existing is not None:
            (folder / "README.md").write_text(existing)
        lib_get(MLP(), lib_config(target_modules=["lin0"])).save_pretrained(folder)
        cards.append((folder / "README.md").read_text())
    assert cards[0] == cards[1]
    assert "library_name: peft" in cards[0] and "- PEFT 0.21.2" in cards[0]


def test_modules_to_save_copies_follow_the_active_adapter_as_peft():
    # three adapters, two with modules_to_save: which copy is active, trains and is read through
    # the wrapper (its `weight`, `bias`), after add / set / delete, as peft's
    states = []
    for lib_get, lib_config in ((get_peft_model, LoraConfig),
                                (peft.get_peft_model, peft.LoraConfig)):
        model = lib_get(MLP(), lib_config(target_modules=["lin0"], modules_to_save=["lin1"]),
                        adapter_name="a0")
        model.add_adapter("a1", lib_config(target_modules=["lin0"]))
        model.add_adapter("a2", lib_config(target_modules=["lin0"], modules_to_save=["lin1"]))
        state = []
        for step in ("a1", "a2", "a0", "del a0", "del a1", "del a2"):
            if step.startswith("del"):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    model.delete_adapter(step[4:])
            else:
                model.set_adapter(step)
            wrapper = model.base_model.model.lin1
            copies = wrapper.modules_to_save
            reads = [n for n, m in copies.items() if wrapper.weight is m.weight
                     and wrapper.bias is m.bias]
            state.append((step, list(wrapper.active_adapters), sorted(copies), reads,
                          sorted(n for n, m in copies.items() if m.weight.requires_grad),
                          model.modules_to_save))
        states.append(state)
    assert states[0] == states[1]


@pytest.mark.parametrize("container", [
    lambda: nn.ModuleDict({"a": nn.Linear(4, 4)}), lambda: nn.ModuleList([nn.Linear(4, 4)]),
    lambda: nn.ParameterDict({"a": nn.Parameter(torch.ones(2))}),
    lambda: nn.ParameterList([nn.Parameter(torch.ones(2))])])
def test_modules_to_save_on_a_container_refused_as_peft(container):
    raised = []
    for lib_get, lib_config in ((get_peft_model, LoraConfig),
                                (peft.get_peft_model, peft.LoraConfig)):
        model = MLP()
        model.box = container()
        raised.append(_raised(lambda: lib_get(model, lib_config(target_modules=["lin0"],
                                                                modules_to_save=["box"]))))
    assert raised[0][0] == raised[1][0] == "TypeError"
    assert raised[0][1].startswith(raised[1][1])  # peft's words, then how to fix it


@pytest.mark.parametrize("kwargs", [
    dict(target_modules=["linear", "embed", "conv2d"]), dict(target_modules=["linear"],
                                                              use_dora=True),
    dict(target_modules=[], target_parameters=["linear.weight"])])
def test_deleted_adapter_leaves_no_entry_in_the_layer_dicts(kwargs):
    # adapter_layer_names / other_param_names: every dict a layer keys by adapter name, as
    # peft's LoraLayer names them (ours: those this layer has)
    from operator import attrgetter

    model = get_peft_model(Net(), LoraConfig(**kwargs))
    model.add_adapter("other", LoraConfig(**kwargs))
    model.delete_adapter("other")
    peft_names = set(peft.tuners.lora.LoraLayer.adapter_layer_names
                     + peft.tuners.lora.LoraLayer.other_param_names)
    seen = 0
    for _, module in model.named_modules():
        names = getattr(module, "adapter_layer_names", ()) + getattr(module, "other_param_names",
                                                                     ())
        assert set(names) <= peft_names
        for attr in names:
            assert "other" not in attrgetter(attr)(module)
            seen += "default" in attrgetter(attr)(module)
    assert seen >= 4

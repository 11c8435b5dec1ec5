"""Behaviour of nanosft.peft on a tiny CausalLM: naming, freezing, identity at init, the 2.6
forward, files, errors.

Compared against formulas written out here (peft's naming rule, r*(in+out) parameter counts, the
prompt-tuning concatenation done by hand, the NF4 two-codes-a-byte rule); the same checks against
peft itself live in tests/parity/test_peft_parity.py. Hermetic: models are built in-process from a
2-layer config, nothing is downloaded. Run: python -m pytest -q tests/test_peft.py
"""

import json
import warnings

import pytest
import torch
from safetensors import safe_open
from torch import nn

from nanosft.lora import LoraLinear
from nanosft.model import CausalLM, ModelConfig, causal_lm_loss
from nanosft.nf4 import Linear4bit, quantize_model
from nanosft.peft import (
    LoraConfig,
    PeftModelForCausalLM,
    PromptTuningConfig,
    get_peft_model,
    get_peft_model_state_dict,
    prepare_model_for_kbit_training,
    set_peft_model_state_dict,
)

TINY = {
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _model(seed=0, **overrides):
    torch.manual_seed(seed)
    return CausalLM(ModelConfig(**{**TINY, **overrides}))


def _batch():
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, TINY["vocab_size"], (2, 6), generator=g)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 4:] = 0
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "labels": input_ids.masked_fill(attention_mask == 0, -100),
    }


def _nonzero_B(model, seed=3):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def test_parameter_names_follow_peft_convention():
    # target_modules None -> llama default q_proj, v_proj
    model = get_peft_model(_model(), LoraConfig(r=4))
    expected = set()
    for i in range(2):
        for proj in ("q_proj", "v_proj"):
            prefix = f"base_model.model.model.layers.{i}.self_attn.{proj}"
            expected |= {
                f"{prefix}.base_layer.weight",
                f"{prefix}.lora_A.default.weight",
                f"{prefix}.lora_B.default.weight",
            }
    names = {n for n, _ in model.named_parameters()}
    assert expected <= names
    # untouched layers keep their names
    assert "base_model.model.model.layers.0.self_attn.k_proj.weight" in names
    assert not any("lora_" in n for n in names - expected)
    assert model.peft_config["default"].target_modules == ["q_proj", "v_proj"]


def test_base_frozen_only_adapters_trainable_with_rank_formula():
    model = get_peft_model(_model(), LoraConfig(r=4, target_modules=["q_proj", "down_proj"]))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A.default." in n or ".lora_B.default." in n for n in trainable)
    # r * (in + out) per wrapped layer: q_proj 64 -> 64, down_proj 128 -> 64, two layers each
    expected = 2 * (4 * (64 + 64) + 4 * (128 + 64))
    assert model.get_nb_trainable_parameters() == (
        expected,
        sum(p.numel() for p in model.parameters()),
    )


def test_identity_at_init_and_negative_control():
    batch = _batch()
    with torch.no_grad():
        base_logits = _model()(**batch).logits
        lora = get_peft_model(_model(), LoraConfig(r=4, use_dora=True, target_modules="all-linear"))
        torch.testing.assert_close(lora(**batch).logits, base_logits, rtol=0, atol=1e-6)
        # B not zero: not identity
        noisy = get_peft_model(_model(), LoraConfig(r=4, init_lora_weights=False))
        assert not torch.allclose(noisy(**batch).logits, base_logits, atol=1e-4)


def test_all_linear_excludes_lm_head_and_regex_is_fullmatch():
    model = get_peft_model(_model(), LoraConfig(r=2, target_modules="all-linear"))
    wrapped = [n for n, m in model.named_modules() if isinstance(m, LoraLinear)]
    assert len(wrapped) == 2 * 7 and not any("lm_head" in n for n in wrapped)
    # saved expanded
    assert model.peft_config["default"].target_modules[0] == "model.layers.0.self_attn.q_proj"
    regex = get_peft_model(
        _model(), LoraConfig(r=2, target_modules=r"model\.layers\.1\.mlp\.(up|gate)_proj")
    )
    assert [n for n, m in regex.named_modules() if isinstance(m, LoraLinear)] == [
        "base_model.model.model.layers.1.mlp.gate_proj",
        "base_model.model.model.layers.1.mlp.up_proj",
    ]
    # a bare name is not a fullmatch of a path
    with pytest.raises(ValueError, match="matches no module"):
        get_peft_model(_model(), LoraConfig(r=2, target_modules="q_proj"))


def test_lora_forward_passes_num_items_in_batch_through():
    model = get_peft_model(_model(), LoraConfig(r=4))
    _nonzero_B(model)
    batch = _batch()
    out = model(**batch, num_items_in_batch=torch.tensor(3))
    # sum / 3, not the mean
    expected = causal_lm_loss(out.logits, batch["labels"], num_items_in_batch=3)
    torch.testing.assert_close(out.loss, expected, **TOL)
    assert not torch.allclose(out.loss, causal_lm_loss(out.logits, batch["labels"]))


def test_prompt_tuning_forward_is_walkthrough_2_6_by_hand():
    model = get_peft_model(_model(), PromptTuningConfig(num_virtual_tokens=3))
    assert [n for n, p in model.named_parameters() if p.requires_grad] == [
        "prompt_encoder.default.embedding.weight"
    ]
    batch, n = _batch(), 3
    prompts = model.prompt_encoder["default"].embedding.weight.detach()
    inputs_embeds = torch.cat(
        [prompts.expand(2, -1, -1), model.word_embeddings(batch["input_ids"])], dim=1
    )
    mask = torch.cat([torch.ones(2, n, dtype=torch.long), batch["attention_mask"]], dim=1)
    labels = torch.cat([torch.full((2, n), -100), batch["labels"]], dim=1)
    with torch.no_grad():
        expected = model.get_base_model()(
            inputs_embeds=inputs_embeds, attention_mask=mask, labels=labels, num_items_in_batch=7
        )
        out = model(**batch, num_items_in_batch=7)
    torch.testing.assert_close(out.logits, expected.logits, **TOL)
    torch.testing.assert_close(out.loss, expected.loss, **TOL)
    with pytest.warns(UserWarning, match="Position ids"):  # dropped, as peft does
        model(**batch, position_ids=torch.arange(6).expand(2, -1))


def test_prompt_tuning_text_init_repeats_the_text_tokens(tmp_path):
    class Tok:
        def encode(self, text):
            return [5, 6]
    base = _model()
    model = get_peft_model(base, PromptTuningConfig(num_virtual_tokens=5, prompt_tuning_init="TEXT",
                                                    prompt_tuning_init_text="hi", tokenizer=Tok()))
    expected = base.get_input_embeddings().weight[[5, 6, 5, 6, 5]]
    torch.testing.assert_close(
        model.prompt_encoder["default"].embedding.weight, expected, rtol=0, atol=0
    )
    model.save_pretrained(tmp_path)  # reloading needs no tokenizer: the table comes from the file
    loaded = PeftModelForCausalLM.from_pretrained(_model(seed=1), tmp_path)
    assert torch.equal(loaded.prompt_encoder["default"].embedding.weight, expected)


def test_save_load_round_trip_is_exact(tmp_path):
    model = get_peft_model(
        _model(), LoraConfig(r=4, lora_alpha=16, use_dora=True, modules_to_save=["lm_head"])
    )
    _nonzero_B(model)
    model.save_pretrained(tmp_path)
    with safe_open(tmp_path / "adapter_model.safetensors", "pt") as f:
        keys, metadata = set(f.keys()), f.metadata()
    assert metadata == {"format": "pt"}
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector" in keys
    assert "base_model.model.lm_head.weight" in keys and not any(".default" in k for k in keys)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert (
        config["peft_type"] == "LORA"
        and config["inference_mode"] is True
        and config["lora_alpha"] == 16
    )
    loaded = PeftModelForCausalLM.from_pretrained(_model(), tmp_path)
    assert not loaded.training and not any(p.requires_grad for p in loaded.parameters())
    want, got = get_peft_model_state_dict(model), get_peft_model_state_dict(loaded)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    batch = _batch()
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(**batch).logits, model.eval()(**batch).logits, rtol=0, atol=0
        )
    trainable = PeftModelForCausalLM.from_pretrained(_model(), tmp_path, is_trainable=True)
    assert {n for n, p in trainable.named_parameters() if p.requires_grad} == \
        {n for n, p in model.named_parameters() if p.requires_grad}


def test_get_set_state_dict_round_trip_and_prompt_key():
    a, b = get_peft_model(_model(), LoraConfig(r=4)), get_peft_model(_model(), LoraConfig(r=4))
    _nonzero_B(a)
    set_peft_model_state_dict(b, get_peft_model_state_dict(a))
    assert all(torch.equal(p, dict(a.named_parameters())[n]) for n, p in b.named_parameters())
    prompt = get_peft_model(_model(), PromptTuningConfig(num_virtual_tokens=2))
    assert list(get_peft_model_state_dict(prompt)) == ["prompt_embeddings"]


def test_merge_and_unload_returns_plain_model_with_same_logits():
    model = get_peft_model(_model(), LoraConfig(r=4, use_rslora=True, target_modules="all-linear"))
    _nonzero_B(model)
    batch = _batch()
    with torch.no_grad():
        before = model(**batch).logits
        merged = model.merge_and_unload()
        after = merged(**batch).logits
    assert type(merged) is CausalLM and not any(isinstance(m, LoraLinear) for m in merged.modules())
    assert set(merged.state_dict()) == set(_model().state_dict())
    torch.testing.assert_close(after, before, **TOL)


def test_4bit_base_counts_two_params_per_byte_and_trains():
    float_count = sum(p.numel() for p in _model().parameters())
    model = get_peft_model(quantize_model(_model()), LoraConfig(r=4, target_modules="all-linear"))
    q = model.get_submodule("base_model.model.model.layers.0.self_attn.q_proj")
    assert isinstance(q.base_layer, Linear4bit) and q.base_layer.weight.dtype == torch.uint8
    trainable, total = model.get_nb_trainable_parameters()
    assert total == float_count + trainable  # each packed byte holds 2 of the original weights
    out = model(**_batch())
    out.loss.backward()
    assert q.lora_A["default"].weight.grad is not None


def test_prepare_model_for_kbit_training():
    model = quantize_model(_model()).to(torch.bfloat16)
    prepare_model_for_kbit_training(model)
    assert not any(p.requires_grad for p in model.parameters())
    # norms, embeddings upcast
    assert {p.dtype for p in model.parameters()} == {torch.float32, torch.uint8}
    assert model.is_gradient_checkpointing
    # the input-grad hook is on
    assert model.get_input_embeddings()(torch.tensor([[1, 2]])).requires_grad
    plain = prepare_model_for_kbit_training(_model())  # not quantized: no checkpointing
    assert not plain.is_gradient_checkpointing


def test_errors_name_the_culprit(tmp_path):
    with pytest.raises(ValueError, match=r"'q_porj'.*\['down_proj', 'gate_proj', 'k_proj'"):
        get_peft_model(_model(), LoraConfig(target_modules=["q_porj", "v_proj"]))
    with pytest.raises(ValueError, match="r must be a positive"):
        LoraConfig(r=0)
    with pytest.raises(ValueError, match="not a linear layer"):
        get_peft_model(_model(), LoraConfig(target_modules=["self_attn"]))
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        PeftModelForCausalLM.from_pretrained(_model(), tmp_path / "nothing")
    # a truncated adapter_config.json: the file and the position are named, not only json's
    # "Expecting value"
    get_peft_model(_model(), LoraConfig(r=4)).save_pretrained(tmp_path / "cut")
    config_file = tmp_path / "cut" / "adapter_config.json"
    config_file.write_text(config_file.read_text()[:40])
    with pytest.raises(ValueError, match=rf"{config_file}: invalid JSON at line \d+ column \d+"):
        PeftModelForCausalLM.from_pretrained(_model(), tmp_path / "cut")
    # an adapter for a wider base: the tensor and both shapes are named
    get_peft_model(_model(hidden_size=32, intermediate_size=64), LoraConfig(r=4)).save_pretrained(
        tmp_path / "w"
    )
    with pytest.raises(ValueError, match=r"q_proj\.lora_A\.weight.*\(4, 32\).*\(4, 64\)"):
        PeftModelForCausalLM.from_pretrained(_model(), tmp_path / "w")
    # an adapter for a deeper base: a tensor that fits no module
    get_peft_model(_model(num_hidden_layers=3), LoraConfig(r=4)).save_pretrained(tmp_path / "d")
    with pytest.raises(ValueError, match=r"layers\.2\..*fits no module"):
        PeftModelForCausalLM.from_pretrained(_model(), tmp_path / "d")
    config = json.loads((tmp_path / "d" / "adapter_config.json").read_text())
    (tmp_path / "d" / "adapter_config.json").write_text(
        json.dumps({**config, "use_qalora": True})
    )
    # a peft feature nanosft lacks is refused, the file named
    with pytest.raises(ValueError, match=r"d.adapter_config\.json sets use_qalora="):
        PeftModelForCausalLM.from_pretrained(_model(num_hidden_layers=3), tmp_path / "d")


def test_config_dict_round_trip_and_caller_config_untouched():
    config = LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj"], use_dora=True)
    assert LoraConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    prompt = PromptTuningConfig(num_virtual_tokens=4)
    assert PromptTuningConfig.from_dict(prompt.to_dict()) == prompt
    user = LoraConfig()
    get_peft_model(_model(), user)
    assert user.target_modules is None


def test_disable_adapter_gives_base_outputs():
    model = get_peft_model(_model(), LoraConfig(r=4))
    _nonzero_B(model)
    batch = _batch()
    with torch.no_grad(), warnings.catch_warnings():
        base = _model()(**batch).logits
        with model.disable_adapter():
            torch.testing.assert_close(model(**batch).logits, base, rtol=0, atol=0)
        assert not torch.allclose(model(**batch).logits, base, atol=1e-4)


def test_modules_to_save_trains_a_copy():
    model = get_peft_model(_model(), LoraConfig(r=4, modules_to_save=["lm_head"]))
    head = model.get_base_model().lm_head
    assert isinstance(head.modules_to_save["default"], nn.Linear)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert "base_model.model.lm_head.modules_to_save.default.weight" in trainable
    assert "base_model.model.lm_head.original_module.weight" not in trainable

"""Behaviour of P-tuning and prefix tuning (nanosft.prompt_learning; 2.6 in nanosft.peft).

Compared against what the methods mean, written out here: a prefix made of the cache of n real
tokens gives the logits those tokens would have led to (positions, mask and key/value layout all
right at once); P-tuning's prompts are the MLP of the embedding rows, prepended. Plus the configs'
errors, round trips and refusals (trainable prompt-learning loads, prefix tuning on a checkpointed
base); a resumed P-tuning / projected-prefix run restores the whole encoder; prefix tuning trained
with gradient checkpointing (switched on by the Trainer) logs what it logs without.
The same checks against peft itself: tests/parity/test_prompt_learning_parity.py.
Hermetic: a 2-layer model built in-process. Run: python -m pytest -q tests/test_prompt_learning.py
"""

import enum

import pytest
import torch
from tiny import one_thread  # noqa: F401 (an autouse fixture)

from nanosft.model import CausalLM, ModelConfig
from nanosft.peft import (PeftModelForCausalLM, PrefixTuningConfig, PromptEncoderConfig,
                          get_peft_model, peft_config_from_dict)

TINY = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _model():
    torch.manual_seed(0)
    return CausalLM(ModelConfig(**TINY)).eval()


def test_prefix_of_real_tokens_cache_equals_running_those_tokens():
    n, T = 3, 5
    prompt_ids = torch.tensor([[7, 21, 40]])
    ids = torch.tensor([[3, 9, 11, 50, 2], [8, 1, 17, 0, 0]])
    attention_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    base = _model()
    with torch.no_grad():
        # per layer (k, v), each (1, KV, n, D)
        cache = base(prompt_ids, use_cache=True).past_key_values
        full = base(torch.cat([prompt_ids.expand(2, n), ids], 1),
                    attention_mask=torch.cat([torch.ones(2, n, dtype=torch.long), attention_mask],
                                             1)).logits[:, n:]
    # the adapter file's layout: per virtual token, for each layer its key then its value heads
    flat = torch.stack([torch.cat([torch.cat([k[0, :, t].flatten(), v[0, :, t].flatten()])
                                   for k, v in cache]) for t in range(n)])  # (n, L * 2 * KV * D)
    config = PrefixTuningConfig(num_virtual_tokens=n, inference_mode=True)
    model = PeftModelForCausalLM(_model(), config)
    assert config.token_dim == 2 * 16 and config.num_attention_heads == 2  # KV heads x head_dim
    with torch.no_grad():
        model.prompt_encoder["default"].embedding.weight.copy_(flat)
        got = model(input_ids=ids, attention_mask=attention_mask).logits
        # explicit position ids 0..T-1 are moved past the prefix, as peft does
        shifted = model(input_ids=ids, attention_mask=attention_mask,
                        position_ids=torch.arange(T)[None]).logits
    real = attention_mask.bool()
    torch.testing.assert_close(got[real], full[real], **TOL)
    torch.testing.assert_close(shifted[real], full[real], **TOL)


def test_p_tuning_prompts_are_the_mlp_of_the_embedding_prepended():
    torch.manual_seed(1)
    model = get_peft_model(_model(), PromptEncoderConfig(num_virtual_tokens=4,
                                                         encoder_hidden_size=32))
    encoder = model.prompt_encoder["default"]
    lin = [m for m in encoder.mlp_head if isinstance(m, torch.nn.Linear)]
    assert [(m.in_features, m.out_features) for m in lin] == [(64, 32), (32, 32), (32, 64)]
    h = encoder.embedding.weight
    for i, m in enumerate(lin):  # Linear, ReLU, Linear, ReLU, Linear
        h = h @ m.weight.T + m.bias
        h = torch.relu(h) if i < 2 else h
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        torch.testing.assert_close(model.get_prompt(batch_size=2), h.expand(2, 4, 64), **TOL)
        by_hand = model.get_base_model()(
            inputs_embeds=torch.cat([h[None], model.word_embeddings(ids)], 1)).logits
        torch.testing.assert_close(model(input_ids=ids).logits, by_hand, **TOL)
    # the trainable parameters are the encoder's alone
    assert {n.split(".")[2] for n, p in model.named_parameters() if p.requires_grad} == {
        "embedding", "mlp_head"}


def test_lstm_p_tuning_and_projected_prefix_build_their_networks():
    lstm = get_peft_model(_model(), PromptEncoderConfig(
        num_virtual_tokens=2, encoder_reparameterization_type="LSTM", encoder_hidden_size=8,
        encoder_num_layers=3)).prompt_encoder["default"]
    assert lstm.lstm_head.num_layers == 3 and lstm.lstm_head.bidirectional
    assert lstm.mlp_head[0].in_features == 16 and lstm.mlp_head[-1].out_features == 64
    prefix = get_peft_model(_model(), PrefixTuningConfig(
        num_virtual_tokens=2, prefix_projection=True, init_weights="zero"))
    transform = prefix.prompt_encoder["default"].transform
    # encoder_hidden_size defaults to the (KV-sized) token_dim; the last layer starts at zero
    assert (transform[0].in_features, transform[0].out_features) == (32, 32)
    assert transform[-1].out_features == 2 * 2 * 32 and not transform[-1].weight.any()


def test_configs_refuse_bad_values_naming_the_field():
    with pytest.raises(ValueError, match="encoder_reparameterization_type must be 'MLP'"):
        PromptEncoderConfig(num_virtual_tokens=2, encoder_reparameterization_type="GRU")
    with pytest.raises(ValueError, match="PrefixTuningConfig.init_weights must be None"):
        PrefixTuningConfig(num_virtual_tokens=2, init_weights="gaussian")
    with pytest.raises(ValueError, match="PromptEncoderConfig.num_virtual_tokens must be"):
        PromptEncoderConfig(num_virtual_tokens=0)
    # None is peft's default: the config builds, wrapping a model with it does not
    with pytest.raises(ValueError, match="PromptEncoderConfig.num_virtual_tokens must be"):
        get_peft_model(_model(), PromptEncoderConfig())
    with pytest.warns(UserWarning, match="encoder_num_layers` is ignored"):
        get_peft_model(_model(), PromptEncoderConfig(num_virtual_tokens=2, encoder_num_layers=4))


def test_configs_round_trip_and_take_enum_values():
    class TaskType(str, enum.Enum):  # what peft's TaskType is
        CAUSAL_LM = "CAUSAL_LM"

    for config in (PromptEncoderConfig(num_virtual_tokens=3, encoder_hidden_size=8,
                                       task_type=TaskType.CAUSAL_LM),
                   PrefixTuningConfig(num_virtual_tokens=3, prefix_projection=True)):
        d = config.to_dict()
        assert d["task_type"] == "CAUSAL_LM" and type(d["task_type"]) is str
        assert peft_config_from_dict(d) == config


def test_refusals_trainable_load_and_prefix_with_checkpointing(tmp_path):
    get_peft_model(_model(), PromptEncoderConfig(num_virtual_tokens=2)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="Cannot set a prompt learning adapter to trainable"):
        PeftModelForCausalLM.from_pretrained(_model(), tmp_path, is_trainable=True)
    loaded = PeftModelForCausalLM.from_pretrained(_model(), tmp_path)
    assert not hasattr(loaded.prompt_encoder["default"], "mlp_head")  # the saved rows suffice
    base = _model()
    base.gradient_checkpointing_enable()
    with pytest.raises(ValueError, match="PREFIX_TUNING does not work with gradient checkpointing"):
        get_peft_model(base, PrefixTuningConfig(num_virtual_tokens=2))


@pytest.mark.parametrize("config", [
    PromptEncoderConfig(num_virtual_tokens=2, encoder_reparameterization_type="LSTM",
                        encoder_hidden_size=8),
    PrefixTuningConfig(num_virtual_tokens=2, prefix_projection=True)], ids=["lstm", "prefix"])
def test_resumed_run_restores_the_whole_encoder(tmp_path, config):
    from nanosft.args import TrainingArguments
    from nanosft.collator import DataCollatorForLanguageModeling
    from nanosft.trainer import Trainer

    g = torch.Generator().manual_seed(3)
    rows = [{"input_ids": torch.randint(1, 96, (6,), generator=g).tolist()} for _ in range(8)]
    args = {"per_device_train_batch_size": 2, "num_train_epochs": 1, "learning_rate": 1e-2,
            "save_steps": 2, "report_to": "none", "disable_tqdm": True, "use_cpu": True}

    def trainer(folder):
        model = get_peft_model(_model(), config)  # a fresh encoder: the checkpoint must set it
        return Trainer(model, TrainingArguments(str(tmp_path / folder), **args),
                       train_dataset=rows,
                       data_collator=DataCollatorForLanguageModeling(pad_token_id=0))

    whole = trainer("run")
    whole.train()
    resumed = trainer("run")
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    for (name, p), q in zip(whole.model.prompt_encoder.named_parameters(),
                            resumed.model.prompt_encoder.parameters()):
        assert torch.equal(p, q), name
    # a checkpoint without the encoder's weights (its adapter file holds only the output): refused
    (tmp_path / "run" / "checkpoint-2" / "prompt_encoder.safetensors").unlink()
    with pytest.raises(ValueError, match="has no prompt_encoder.safetensors"):
        trainer("run").train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))


def test_prefix_tuning_under_gradient_checkpointing_equals_without(tmp_path):
    # enabled by the Trainer after wrapping: the prefix is a tuple of tensors, not a cache object
    # that a recomputed layer would append to twice (TRL + peft fail here with a size mismatch)
    from nanosft.args import TrainingArguments
    from nanosft.collator import DataCollatorForLanguageModeling
    from nanosft.trainer import Trainer

    g = torch.Generator().manual_seed(4)
    rows = [{"input_ids": torch.randint(1, 96, (6,), generator=g).tolist()} for _ in range(6)]
    runs = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = get_peft_model(_model(), PrefixTuningConfig(num_virtual_tokens=2))
        args = TrainingArguments(str(tmp_path / str(checkpointing)), per_device_train_batch_size=2,
                                 num_train_epochs=1, logging_steps=1, report_to="none",
                                 disable_tqdm=True, use_cpu=True, save_strategy="no",
                                 gradient_checkpointing=checkpointing)
        trainer = Trainer(model, args, train_dataset=rows,
                          data_collator=DataCollatorForLanguageModeling(pad_token_id=0))
        trainer.train()
        assert model.get_base_model().is_gradient_checkpointing == checkpointing
        runs.append([(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h])
    assert len(runs[0]) == 3 and runs[0] == runs[1]

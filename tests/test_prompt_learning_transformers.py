"""Prompt tuning, P-tuning and prefix tuning on transformers decoders, against real peft 0.21.2.

Compared: the logits of PeftModelForCausalLM.forward over tiny GPT-2, OPT and Llama (GQA) models
built in-process from configs (GPT-2 and OPT have no head_dim and no num_key_value_heads, so
prefix tuning sizes its cache from hidden_size / heads; transformers 5 takes it as a Cache), at
fp32 with assert_close(atol=rtol=1e-5); and the greedy ids of generate() (keyword or positional
input_ids) equal to peft's; a second adapter beside the first. Both libraries build their
encoders from the same seed. No network.
Run: PYTHONPATH=$PWD OMP_NUM_THREADS=1 python -m pytest -q \
     tests/test_prompt_learning_transformers.py
"""

import copy

import pytest
import torch

from nanosft.adapter_files import PrefixTuningConfig, PromptEncoderConfig, PromptTuningConfig
from nanosft.peft import get_peft_model

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
TOL = dict(atol=1e-5, rtol=1e-5)

MODELS = {
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_embd=16, n_layer=2, n_head=4, n_positions=64)),
    "opt": lambda: transformers.OPTForCausalLM(transformers.OPTConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, ffn_dim=8,
        word_embed_proj_dim=16, max_position_embeddings=64)),
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2)),
}
KINDS = {
    "prompt": (PromptTuningConfig, "PromptTuningConfig", {}),
    "p_tuning": (PromptEncoderConfig, "PromptEncoderConfig", {"encoder_hidden_size": 8}),
    "prefix": (PrefixTuningConfig, "PrefixTuningConfig", {}),
}


def _pair(model_name, kind):
    ours_cls, theirs_name, kwargs = KINDS[kind]
    torch.manual_seed(0)
    base = MODELS[model_name]().eval()
    ref_base = copy.deepcopy(base)
    torch.manual_seed(1)
    ours = get_peft_model(base, ours_cls(num_virtual_tokens=3, **kwargs)).eval()
    torch.manual_seed(1)
    theirs = peft.get_peft_model(ref_base, getattr(peft, theirs_name)(
        task_type="CAUSAL_LM", num_virtual_tokens=3, **kwargs)).eval()
    return ours, theirs


def _batch():
    input_ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    attention_mask = torch.ones_like(input_ids)
    return input_ids, attention_mask


@pytest.mark.parametrize("model_name", sorted(MODELS))
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_forward_matches_peft(model_name, kind):
    ours, theirs = _pair(model_name, kind)
    input_ids, attention_mask = _batch()
    got = ours(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids)
    want = theirs(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids)
    torch.testing.assert_close(got.logits, want.logits, **TOL)
    torch.testing.assert_close(got.loss, want.loss, **TOL)


@pytest.mark.parametrize("model_name", ["gpt2", "opt"])
def test_prefix_sizes_from_configs_without_head_dim(model_name):
    ours, _ = _pair(model_name, "prefix")
    config = ours.peft_config["default"]
    base = ours.get_base_model().config
    assert config.token_dim == base.hidden_size  # KV heads == heads: head_dim * heads
    assert config.num_attention_heads == base.num_attention_heads
    prefix = ours.get_prompt(batch_size=2)
    assert isinstance(prefix, transformers.Cache) and prefix.get_seq_length() == 3


@pytest.mark.parametrize("model_name", sorted(MODELS))
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_generate_matches_peft(model_name, kind):
    ours, theirs = _pair(model_name, kind)
    input_ids, attention_mask = _batch()
    got = ours.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=4,
                        eos_token_id=-1)
    want = theirs.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=4,
                           do_sample=False, eos_token_id=-1, pad_token_id=0)
    assert got.tolist() == want.tolist()
    positional = ours.generate(input_ids, attention_mask=attention_mask, max_new_tokens=4,
                               eos_token_id=-1)
    assert positional.tolist() == want.tolist()
    # the first step's scores: the logits after the prompts, as peft's (cached) generate gives them
    got = ours.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=2,
                        eos_token_id=-1, return_dict_in_generate=True, output_scores=True)
    want = theirs.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=2,
                           do_sample=False, eos_token_id=-1, pad_token_id=0,
                           return_dict_in_generate=True, output_scores=True)
    torch.testing.assert_close(got.scores[0], want.scores[0], **TOL)
    assert got.sequences.tolist() == want.sequences.tolist()


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_second_prompt_adapter_keeps_the_first(kind):
    ours, _ = _pair("gpt2", kind)
    input_ids, attention_mask = _batch()
    first = ours(input_ids=input_ids, attention_mask=attention_mask).logits
    ours_cls, _, kwargs = KINDS[kind]
    ours.add_adapter("second", ours_cls(num_virtual_tokens=3, **kwargs))
    assert sorted(ours.prompt_encoder) == ["default", "second"]
    torch.testing.assert_close(ours(input_ids=input_ids, attention_mask=attention_mask).logits,
                               first, atol=0, rtol=0)
    ours.set_adapter("second")
    other = ours(input_ids=input_ids, attention_mask=attention_mask).logits
    assert not torch.allclose(other, first)  # the second adapter's own prompts

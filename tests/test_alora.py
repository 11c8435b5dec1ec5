"""Activated LoRA (LoraConfig.alora_invocation_tokens, nanosft.alora) against real peft 0.21.2.

A tiny transformers Llama (hidden 32, 2 layers, vocab 64) wrapped by both libraries from the same
seed with non-zero adapters (init_lora_weights=False). Compared at fp32 with
assert_close(atol=rtol=1e-5) or exactly: the offsets found per row, logits (positions before the
invocation equal the base model's), greedy generate, gradients in training (with and without
gradient checkpointing), a mixed batch of an aLoRA adapter, a LoRA adapter and the base, adapter
files both ways, and the refusal to merge.
Run: PYTHONPATH=$PWD OMP_NUM_THREADS=1 python -m pytest -q tests/test_alora.py
"""

import pytest
import torch

import nanosft.peft as nano
from nanosft.alora import alora_offsets

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
TOL = dict(atol=1e-5, rtol=1e-5)
IDS = torch.tensor([[7, 5, 6, 2, 9, 5, 6, 3], [1, 2, 3, 4, 8, 8, 7, 8], [9, 9, 9, 9, 9, 9, 5, 6]])


def _llama():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _pair(tokens=(5, 6)):
    models = []
    for lib in (nano, peft):
        torch.manual_seed(1)
        config = lib.LoraConfig(task_type="CAUSAL_LM", r=4, init_lora_weights=False,
                                alora_invocation_tokens=list(tokens))
        models.append(lib.get_peft_model(_llama(), config).eval())
    return models


def test_offsets_count_back_from_the_last_invocation():
    config = {"default": nano.LoraConfig(alora_invocation_tokens=[5, 6])}
    assert alora_offsets(config, "default", IDS) == [3, None, 2]
    assert alora_offsets(config, "default", IDS, ["default", "__base__", "__base__"]) == [
        3, None, None]


def test_logits_and_generate_match_peft():
    ours, theirs = _pair()
    a, b = ours(input_ids=IDS).logits, theirs(input_ids=IDS).logits
    torch.testing.assert_close(a, b, **TOL)
    with ours.disable_adapter():
        base = ours(input_ids=IDS).logits
    torch.testing.assert_close(a[0, :5], base[0, :5], atol=0, rtol=0)  # before the invocation
    assert not torch.allclose(a[0, 5:], base[0, 5:])  # from the invocation on
    torch.testing.assert_close(a[1], base[1], atol=0, rtol=0)  # no invocation: the base model
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(input_ids=IDS, **kwargs),
                       theirs.generate(input_ids=IDS, **kwargs))
    with pytest.raises(NotImplementedError, match="aLoRA does not support merging"):
        ours.merge_and_unload()


@pytest.mark.parametrize("checkpointing", [False, True])
def test_training_gradients_match_peft(checkpointing):
    ours, theirs = _pair()
    grads = []
    for model in (ours, theirs):
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable({"use_reentrant": False})
        model(input_ids=IDS, labels=IDS).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert sorted(grads[0]) == sorted(grads[1])
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], **TOL)


def test_mixed_batch_and_files_both_ways(tmp_path):
    ours, theirs = _pair()
    for model, lib in ((ours, nano), (theirs, peft)):
        torch.manual_seed(3)
        model.add_adapter("plain", lib.LoraConfig(task_type="CAUSAL_LM", r=4,
                                                  init_lora_weights=False))
    names = ["default", "plain", "__base__"]
    torch.testing.assert_close(ours(input_ids=IDS, adapter_names=names).logits,
                               theirs(input_ids=IDS, adapter_names=names).logits, **TOL)
    ours.save_pretrained(tmp_path / "ours", selected_adapters=["default"])
    theirs.save_pretrained(tmp_path / "theirs", selected_adapters=["default"])
    expected = theirs(input_ids=IDS).logits
    read_by_peft = peft.PeftModel.from_pretrained(_llama(), tmp_path / "ours")
    read_by_us = nano.PeftModel.from_pretrained(_llama(), tmp_path / "theirs")
    assert read_by_us.peft_config["default"].alora_invocation_tokens == [5, 6]
    torch.testing.assert_close(read_by_peft(input_ids=IDS).logits, expected, **TOL)
    torch.testing.assert_close(read_by_us(input_ids=IDS).logits, expected, **TOL)

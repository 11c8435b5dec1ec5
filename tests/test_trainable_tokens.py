"""LoRA's trainable_token_indices (nanosft.trainable_tokens) against real peft 0.21.2.

A tiny transformers Llama with tied embeddings (hidden 32, 2 layers, vocab 64) and a custom module
are wrapped by both libraries from the same seed; the trained rows are set to the same values in
both. Compared at fp32 with assert_close(atol=rtol=1e-5) or exactly: logits (the tied LM head
reads the trained rows too), the gradients reaching the rows, the adapter state dict (peft's keys),
adapter files both ways, merge_and_unload, a mixed-adapter batch, and the refusals.
Run: PYTHONPATH=$PWD OMP_NUM_THREADS=1 python -m pytest -q tests/test_trainable_tokens.py
"""

import pytest
import torch
from torch import nn

import nanosft.peft as nano
from nanosft.trainable_tokens import TrainableTokensWrapper

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
TOL = dict(atol=1e-5, rtol=1e-5)
ROWS = [0, 1, 3]


def _llama():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _pair(build, **config):
    # the same base and the same trained rows (set, not drawn) in both libraries
    base = build()
    models = []
    for lib in (nano, peft):
        model = build()
        model.load_state_dict(base.state_dict())
        torch.manual_seed(1)
        model = lib.get_peft_model(model, lib.LoraConfig(r=4, init_lora_weights=False, **config))
        for name, p in model.named_parameters():
            if "trainable_tokens_delta" in name:
                with torch.no_grad():
                    p.copy_(torch.linspace(-1, 1, p.numel()).view_as(p))
        models.append(model.eval())
    return models


def test_tied_llama_logits_grads_and_state_dict_match_peft():
    ours, theirs = _pair(_llama, task_type="CAUSAL_LM", trainable_token_indices=ROWS)
    base = ours.get_base_model()
    assert isinstance(base.model.embed_tokens, TrainableTokensWrapper)
    assert isinstance(base.lm_head, TrainableTokensWrapper)  # tied: shares the embedding's rows
    assert base.lm_head.token_adapter.trainable_tokens_delta is (
        base.model.embed_tokens.token_adapter.trainable_tokens_delta)
    ids = torch.tensor([[0, 5, 3, 9, 1, 2]])
    a, b = ours(input_ids=ids).logits, theirs(input_ids=ids).logits
    with ours.disable_adapter():  # the trained rows change what the base computes
        assert not torch.allclose(ours(input_ids=ids).logits, a)
    torch.testing.assert_close(a, b, **TOL)
    a.square().mean().backward()
    b.square().mean().backward()
    grads = [{n: p.grad for n, p in m.named_parameters() if p.requires_grad}
             for m in (ours, theirs)]
    assert sorted(grads[0]) == sorted(grads[1])
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], **TOL)
    ours_sd = nano.get_peft_model_state_dict(ours)
    theirs_sd = peft.get_peft_model_state_dict(theirs)
    assert sorted(ours_sd) == sorted(theirs_sd)
    assert "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta" in ours_sd
    for key in ours_sd:
        torch.testing.assert_close(ours_sd[key], theirs_sd[key], atol=0, rtol=0)


def test_adapter_files_both_ways_and_merge(tmp_path):
    ours, theirs = _pair(_llama, task_type="CAUSAL_LM", trainable_token_indices=ROWS)
    ids = torch.tensor([[3, 1, 0, 7]])
    expected = theirs(input_ids=ids).logits
    ours.save_pretrained(tmp_path / "ours")
    theirs.save_pretrained(tmp_path / "theirs")
    read_by_peft = peft.PeftModel.from_pretrained(_llama(), tmp_path / "ours")
    read_by_us = nano.PeftModel.from_pretrained(_llama(), tmp_path / "theirs")
    torch.testing.assert_close(read_by_peft(input_ids=ids).logits, expected, **TOL)
    torch.testing.assert_close(read_by_us(input_ids=ids).logits, expected, **TOL)
    assert not any(p.requires_grad for p in read_by_us.parameters())  # is_trainable=False
    merged = ours.merge_and_unload()
    assert isinstance(merged.model.embed_tokens, nn.Embedding)
    torch.testing.assert_close(merged(input_ids=ids).logits, expected, **TOL)
    torch.testing.assert_close(merged.model.embed_tokens.weight[ROWS],
                               theirs.get_input_embeddings().token_adapter
                               .trainable_tokens_delta["default"], atol=0, rtol=0)


class EmbMLP(nn.Module):
    """An untied embedding, then a linear: trainable tokens by module name."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.lin0 = nn.Linear(8, 4)

    def forward(self, X):
        return self.lin0(self.emb(X))


def test_named_module_two_adapters_mixed_batch_match_peft():
    def build():
        torch.manual_seed(0)
        return EmbMLP()
    ours, theirs = _pair(build, target_modules=["lin0"], trainable_token_indices={"emb": [2, 4]})
    for model, lib in ((ours, nano), (theirs, peft)):
        torch.manual_seed(2)
        model.add_adapter("other", lib.LoraConfig(r=4, target_modules=["lin0"],
                                                  init_lora_weights=False,
                                                  trainable_token_indices={"emb": [4, 5]}))
        with torch.no_grad():
            model.base_model.model.emb.token_adapter.trainable_tokens_delta["other"].fill_(0.5)
    x = torch.tensor([[2, 4, 5], [4, 5, 6], [1, 2, 4]])
    names = ["default", "other", "__base__"]
    torch.testing.assert_close(ours(x, adapter_names=names), theirs(x, adapter_names=names), **TOL)
    ours.set_adapter("other")
    theirs.set_adapter("other")
    torch.testing.assert_close(ours(x), theirs(x), **TOL)
    ours.delete_adapter("other")
    theirs.delete_adapter("other")
    torch.testing.assert_close(ours(x), theirs(x), **TOL)


def test_refusals_name_the_problem():
    with pytest.raises(ValueError, match="already marked to be trained fully"):
        nano.get_peft_model(EmbMLP(), nano.LoraConfig(target_modules=["lin0"],
                                                      modules_to_save=["emb"],
                                                      trainable_token_indices={"emb": [0]}))
    with pytest.raises(ValueError, match="matches no module"):
        nano.get_peft_model(EmbMLP(), nano.LoraConfig(target_modules=["lin0"],
                                                      trainable_token_indices={"nope": [0]}))

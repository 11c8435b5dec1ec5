"""LoRA dropout masks drawn as peft draws them, so the same seed gives peft's numbers.

Compared with peft 0.21.2 / transformers 5.23 on a tiny fp32 Llama with the same adapters
(lora_B non-zero) and lora_dropout 0.3: one training forward from the same seed gives the same
logits and leaves the global RNG in the same state, on a full batch and on a right-padded one,
with nanosft's speed paths on and in reference mode (masks over the padded (B, T, C) input, one
per LoRA layer in forward order); and a Trainer's train dataloader draws what transformers'
draws from the global RNG for each epoch's iterator (one int64: torch's base seed). Negative
control: unpadding the batch under dropout (the speed path that used to run) draws other masks.
The multi-step loss parity of a whole script with dropout is tests/test_trl_construction.py.
Hermetic: tmp folders, CPU.
Run: python -m pytest -q tests/parity/test_dropout_rng_parity.py
"""

import hashlib

import peft
import pytest
import torch
import transformers

from nanosft.args import TrainingArguments
from nanosft.fast import unpad
from nanosft.model import CausalLM
from nanosft.peft import LoraConfig, get_peft_model
from nanosft.reference import reference_mode
from nanosft.trainer import Trainer

V = 128
LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.3, "target_modules": ["q_proj", "v_proj"]}


def rng_digest():
    return hashlib.md5(torch.get_rng_state().numpy().tobytes()).hexdigest()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    config = transformers.LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, pad_token_id=0)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    ref = peft.get_peft_model(transformers.LlamaForCausalLM.from_pretrained(folder),
                              peft.LoraConfig(task_type="CAUSAL_LM", **LORA))
    ours = get_peft_model(CausalLM.from_pretrained(folder), LoraConfig(**LORA))
    g = torch.Generator().manual_seed(1)
    theirs = dict(ref.named_parameters())
    with torch.no_grad():  # lora_B non-zero, or no mask would show in the logits
        for n, p in ours.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
                theirs[n].copy_(p)
    return ref.train(), ours.train()


def batch(padded):
    x = torch.randint(3, V, (2, 10), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(x)
    if padded:
        mask[1, 6:] = 0
    return {"input_ids": x, "attention_mask": mask}


def seeded_forward(model, inputs):
    torch.manual_seed(5)
    logits = model(**inputs).logits
    return logits, rng_digest()


@pytest.mark.parametrize("reference", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_one_training_forward_draws_peft_masks(models, padded, reference):
    ref, ours = models
    inputs = batch(padded)
    want, want_rng = seeded_forward(ref, inputs)
    with reference_mode(reference):
        got, got_rng = seeded_forward(ours, inputs)
    keep = inputs["attention_mask"].bool()
    torch.testing.assert_close(got[keep], want[keep], rtol=0, atol=1e-5)
    assert got_rng == want_rng  # as many draws as peft's, so the next step's masks agree too


def test_negative_control_unpadding_under_dropout_draws_other_masks(models, monkeypatch):
    ref, ours = models
    inputs = batch(padded=True)
    want, _ = seeded_forward(ref, inputs)
    monkeypatch.setattr(unpad, "draws_dropout", lambda model: False)  # the bug: pad tokens gone
    got, _ = seeded_forward(ours, inputs)
    keep = inputs["attention_mask"].bool()
    assert (got[keep] - want[keep]).abs().max() > 1e-3


def test_train_dataloader_iter_draws_what_transformers_draws(tmp_path):
    rows = [{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}] * 6
    common = {"per_device_train_batch_size": 2, "use_cpu": True, "report_to": "none"}
    digests = []
    for trainer in (
            transformers.Trainer(torch.nn.Linear(2, 2), transformers.TrainingArguments(
                str(tmp_path / "hf"), **common), train_dataset=rows),
            Trainer(torch.nn.Linear(2, 2), TrainingArguments(str(tmp_path / "ours"), **common),
                    train_dataset=rows)):
        loader = trainer.get_train_dataloader()
        torch.manual_seed(0)
        next(iter(loader))  # accelerate's loader draws at the first batch, torch's at iter()
        next(iter(loader))  # each epoch's iterator draws again
        digests.append(rng_digest())
    assert digests[1] == digests[0]
    torch.manual_seed(0)
    assert rng_digest() != digests[0]  # control: the iterators did draw

"""SFTTrainer set-up and loss: prompt-completion masking, pad fallback, LoRA wrapping, QLoRA bf16 cast, bfd packing
(padding-free batches), the SFT loss against a hand-written shifted cross-entropy, TRL's logged metrics.

Hermetic: a byte-level BPE tokenizer trained in-process on a few sentences, a tiny nanosft CausalLM, CPU, fixed
seeds. The TRL comparison itself is in tests/parity/test_trainer_parity.py.
Run: python -m pytest -q tests/test_sft.py
"""

import pytest
import torch
import torch.nn.functional as F
from tiny import one_thread, tiny_model  # noqa: F401 (one_thread: an autouse fixture)

from nanosft.args import SFTConfig
from nanosft.collator import DataCollatorForLanguageModeling
from nanosft.nf4 import quantize_model
from nanosft.peft import LoraConfig, PeftModelForCausalLM
from nanosft.sft import SFTTrainer
from nanosft.tokenizer import Tokenizer

TEXTS = ["the cat sat on the mat", "two plus two is four", "red green blue", "a b c d e f g"]
PAIRS = [{"prompt": "what is two plus two?", "completion": " four"},
         {"prompt": "name a colour:", "completion": " red"},
         {"prompt": "where did the cat sit?", "completion": " on the mat"},
         {"prompt": "first letter?", "completion": " a"}] * 2


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.train(TEXTS + [p["prompt"] + p["completion"] for p in PAIRS], vocab_size=300)


def model_for(tokenizer):
    return tiny_model(vocab_size=len(tokenizer), max_position_embeddings=128)


def config(tmp_path, **overrides):
    values = {"output_dir": str(tmp_path), "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2,
              "max_steps": 3, "learning_rate": 1e-2, "logging_steps": 1, "save_strategy": "no", "use_cpu": True,
              "bf16": False, "gradient_checkpointing": False, "optim": "adamw_torch", "disable_tqdm": True}
    return SFTConfig(**{**values, **overrides})


def test_prompt_completion_trains_only_the_completion(tmp_path, tokenizer):
    trainer = SFTTrainer(model_for(tokenizer), config(tmp_path), train_dataset=PAIRS, processing_class=tokenizer)
    assert trainer.completion_only_loss
    row, example = trainer.train_dataset[0], PAIRS[0]
    n_prompt = len(tokenizer.encode(example["prompt"]))
    assert row["labels"][:n_prompt] == [-100] * n_prompt
    assert row["labels"][n_prompt:] == row["input_ids"][n_prompt:]
    assert row["input_ids"][-1] == tokenizer.eos_token_id  # TRL appends EOS to the completion


def test_pad_token_falls_back_to_eos(tmp_path):
    tok = Tokenizer.train(TEXTS, vocab_size=300, pad_token=None)
    assert tok.pad_token is None
    trainer = SFTTrainer(model_for(tok), config(tmp_path), train_dataset=[{"text": t} for t in TEXTS],
                         processing_class=tok)
    assert trainer.data_collator.pad_token_id == tok.eos_token_id
    assert trainer.model.config.pad_token_id == tok.eos_token_id


def test_lora_trains_adapters_only(tmp_path, tokenizer):
    model = model_for(tokenizer)
    base_before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = SFTTrainer(model, config(tmp_path, gradient_checkpointing=True), train_dataset=PAIRS,
                         processing_class=tokenizer, peft_config=LoraConfig(r=4, lora_alpha=8))
    assert isinstance(trainer.model, PeftModelForCausalLM)
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    trainer.train()
    for key, value in trainer.model.get_base_model().state_dict().items():
        if "lora_" not in key and "base_layer" not in key:
            assert torch.equal(value, base_before[key]), key
    lora_b = [p for n, p in trainer.model.named_parameters() if "lora_B" in n]
    assert any(p.abs().sum() > 0 for p in lora_b)  # B starts at zero; training moved it


def test_qlora_casts_adapters_to_bf16_but_not_dora_magnitude(tmp_path, tokenizer):
    model = quantize_model(model_for(tokenizer))
    trainer = SFTTrainer(model, config(tmp_path), train_dataset=PAIRS, processing_class=tokenizer,
                         peft_config=LoraConfig(r=4, lora_alpha=8, use_dora=True))
    dtypes = {n: p.dtype for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert any("lora_magnitude_vector" in n for n in dtypes)
    for name, dtype in dtypes.items():
        assert dtype == (torch.float32 if "lora_magnitude_vector" in name else torch.bfloat16), name


def test_bfd_packing_gives_padding_free_batches(tmp_path, tokenizer):
    trainer = SFTTrainer(model_for(tokenizer), config(tmp_path, packing=True, max_length=32),
                         train_dataset=[{"text": t} for t in TEXTS * 3], processing_class=tokenizer)
    assert trainer.padding_free
    batch = next(iter(trainer.get_train_dataloader()))
    assert "attention_mask" not in batch and batch["input_ids"].shape[0] == 1
    assert (batch["labels"][batch["position_ids"] == 0] == -100).all()  # no target across documents
    with pytest.raises(ValueError, match="padding_free"):
        SFTTrainer(model_for(tokenizer), config(tmp_path, packing=True, max_length=32),
                   train_dataset=[{"text": t} for t in TEXTS], processing_class=tokenizer,
                   data_collator=DataCollatorForLanguageModeling(pad_token_id=0))


def test_sft_loss_is_shifted_cross_entropy_over_num_items(tmp_path, tokenizer):
    trainer = SFTTrainer(model_for(tokenizer), config(tmp_path), train_dataset=PAIRS, processing_class=tokenizer)
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    num_items = torch.tensor(37.0)  # any window count: the loss divides by it, not by this batch's tokens
    loss = trainer.compute_loss(trainer.model, dict(batch), num_items_in_batch=num_items)
    logits = trainer.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    expected = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(),
                               ignore_index=-100, reduction="sum") / num_items
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-6)
    own = trainer.model(**batch, num_items_in_batch=num_items).loss  # the model's ForCausalLMLoss agrees
    torch.testing.assert_close(loss, own, rtol=0, atol=1e-6)
    # negative control: the unshifted loss (logits t vs label t) is another number
    unshifted = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100,
                                reduction="sum") / num_items
    assert abs(unshifted.item() - loss.item()) > 1e-3


def test_logs_carry_trl_metrics(tmp_path, tokenizer):
    trainer = SFTTrainer(model_for(tokenizer), config(tmp_path), train_dataset=PAIRS, processing_class=tokenizer)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert list(logs[0]) == ["loss", "grad_norm", "learning_rate", "entropy", "mean_token_accuracy", "num_tokens",
                             "epoch", "step"]
    # num_tokens: the running count of attention-mask tokens over all micro-batches seen so far
    total = sum(len(trainer.train_dataset[i]["input_ids"]) for i in range(len(trainer.train_dataset)))
    assert logs[1]["num_tokens"] == total  # 8 rows = 2 windows of 2 x 2: one full epoch by step 2
    assert all(0.0 <= h["mean_token_accuracy"] <= 1.0 and h["entropy"] > 0 for h in logs)


def test_prompt_tuning_loss_counts_the_virtual_prefix_as_peft_does(tmp_path, tokenizer):
    """With prompt tuning the logits are n_virtual positions longer than the labels; the SFT loss must pad the
    labels with -100 in front (as PeftModelForCausalLM.forward does for the model's own loss), not crash or misalign."""
    from nanosft.peft import PromptTuningConfig

    n_virtual = 3
    trainer = SFTTrainer(model_for(tokenizer), config(tmp_path), train_dataset=PAIRS, processing_class=tokenizer,
                         peft_config=PromptTuningConfig(num_virtual_tokens=n_virtual))
    batch = trainer.data_collator(trainer.train_dataset[:2])
    loss = trainer.compute_loss(trainer.model, dict(batch))
    own = trainer.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
    assert own.logits.size(1) == batch["labels"].size(1) + n_virtual
    torch.testing.assert_close(loss, own.loss, rtol=1e-6, atol=1e-6)  # both: mean over supervised targets
    trainer.train()
    assert trainer.state.global_step == 3

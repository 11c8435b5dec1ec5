"""Per-step log_history of nanosft Trainer / SFTTrainer against transformers Trainer and TRL
SFTTrainer + peft LoRA.

The same tiny Llama (transformers LlamaForCausalLM built in-process, weights copied into nanosft
CausalLM), the same pre-tokenized rows with prompt labels -100, seed, batch 2 x GA 3 (8
micro-batches per epoch, so every epoch ends on a short window), adamw_torch, linear warmup,
clipping, with and without label smoothing. Compared per optimizer step (>= 20 steps, also for
BFD-packed padding-free batches): loss, grad_norm, learning_rate, epoch, and TRL's entropy /
mean_token_accuracy / num_tokens. Negative control: the LoRA run with its adapters frozen
(learning_rate 0) fails the loss comparison. Hermetic: CPU, fp32, no downloads (a WordLevel
tokenizer built in memory). Tolerance 1e-5 (fp32; TRL's chunked log-softmax and our plain one differ
by float rounding only).
Run: python -m pytest -q tests/parity/test_trainer_parity.py
"""

import datasets
import peft
import pytest
import torch
import transformers
import trl
from tiny import one_thread  # noqa: F401 (an autouse fixture)
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit

from nanosft.args import SFTConfig, TrainingArguments
from nanosft.collator import DataCollatorForLanguageModeling
from nanosft.model import CausalLM, ModelConfig
from nanosft.peft import LoraConfig
from nanosft.sft import SFTTrainer
from nanosft.tokenizer import Tokenizer
from nanosft.trainer import Trainer

VOCAB = 96
CONFIG = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "pad_token_id": 0,
}
COMMON = {
    "per_device_train_batch_size": 2,
    "gradient_accumulation_steps": 3,
    "num_train_epochs": 7,
    "learning_rate": 2e-3,
    "warmup_steps": 3,
    "max_grad_norm": 0.3,
    "weight_decay": 0.05,
    "logging_steps": 1,
    "save_strategy": "no",
    "use_cpu": True,
    "bf16": False,
    "fp16": False,
    "optim": "adamw_torch",
    "seed": 11,
    "report_to": "none",
    "disable_tqdm": True,
}
KEYS = ("loss", "grad_norm", "learning_rate", "epoch")


def make_rows(n=16, seed=2):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(5, 14, (1,), generator=g))
        ids = torch.randint(2, VOCAB, (length,), generator=g).tolist()
        prompt = int(torch.randint(1, length - 2, (1,), generator=g))
        rows.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return rows


def make_models():
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    ours = CausalLM(ModelConfig(**CONFIG))
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def train_logs(trainer):
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h]


def assert_logs_close(ours, ref, keys):
    assert len(ours) == len(ref) >= 20
    for a, b in zip(ours, ref):
        assert a["step"] == b["step"]
        for key in keys:
            torch.testing.assert_close(
                a[key], b[key], rtol=0, atol=1e-5, msg=f"step {a['step']} {key}"
            )


@pytest.mark.parametrize(
    "label_smoothing_factor", [0.0, 0.1]
)  # 0.1: transformers LabelSmoother path
def test_trainer_matches_transformers_trainer(tmp_path, label_smoothing_factor):
    rows = make_rows()
    ref_model, our_model = make_models()
    collator = DataCollatorForLanguageModeling(pad_token_id=0)
    common = {**COMMON, "label_smoothing_factor": label_smoothing_factor}
    ref = transformers.Trainer(
        model=ref_model,
        args=transformers.TrainingArguments(str(tmp_path / "ref"), **common),
        train_dataset=datasets.Dataset.from_list(rows),
        data_collator=collator,
    )
    ours = Trainer(
        our_model,
        TrainingArguments(str(tmp_path / "ours"), **common),
        train_dataset=rows,
        data_collator=collator,
    )
    ref_logs, our_logs = train_logs(ref), train_logs(ours)
    assert_logs_close(our_logs, ref_logs, KEYS)
    assert ours.state.global_step == ref.state.global_step == 21


def wordlevel_tokenizers():
    vocab = {"<pad>": 0, "</s>": 1, **{f"t{i}": i for i in range(2, VOCAB)}}
    backend = BackendTokenizer(WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = (
        WhitespaceSplit()
    )  # "t5 t7</s>" -> t5, t7, </s> (special tokens split first)
    backend.add_special_tokens(["<pad>", "</s>"])
    ref_tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="</s>"
    )
    return ref_tok, Tokenizer(backend, pad_token="<pad>", eos_token="</s>")


def test_sft_trainer_matches_trl_with_lora(tmp_path):
    rows = make_rows()
    ref_model, our_model = make_models()
    ref_tok, our_tok = wordlevel_tokenizers()
    sft = {**COMMON, "gradient_checkpointing": False, "max_length": None}
    lora = {
        "r": 4,
        "lora_alpha": 8,
        "target_modules": ["q_proj", "v_proj", "down_proj"],
        "lora_dropout": 0.0,
    }
    ref = trl.SFTTrainer(
        model=ref_model,
        args=trl.SFTConfig(str(tmp_path / "ref"), **sft),
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=ref_tok,
        peft_config=peft.LoraConfig(**lora),
    )
    ours = SFTTrainer(
        our_model,
        SFTConfig(str(tmp_path / "ours"), **sft),
        train_dataset=rows,
        processing_class=our_tok,
        peft_config=LoraConfig(**lora),
    )
    # same starting adapters whatever RNG draws each library's LoRA init makes (B is zero in both)
    ref_start = {name: p.detach().clone() for name, p in ref.model.named_parameters()}
    with torch.no_grad():
        for name, param in ours.model.named_parameters():
            if param.requires_grad:
                param.copy_(ref_start[name])
    ref_logs, our_logs = train_logs(ref), train_logs(ours)
    assert_logs_close(our_logs, ref_logs, KEYS + ("entropy", "mean_token_accuracy"))
    assert [h["num_tokens"] for h in our_logs] == [h["num_tokens"] for h in ref_logs]
    # Negative control: the same run with the adapters frozen (learning_rate 0: AdamW and its
    # decoupled weight decay move nothing) starts at TRL's loss, then fails the comparison above.
    frozen = SFTTrainer(
        make_models()[1],
        SFTConfig(str(tmp_path / "frozen"), **{**sft, "learning_rate": 0.0}),
        train_dataset=rows,
        processing_class=our_tok,
        peft_config=LoraConfig(**lora),
    )
    with torch.no_grad():
        for name, param in frozen.model.named_parameters():
            if param.requires_grad:
                param.copy_(ref_start[name])
    start = {n: p.detach().clone() for n, p in frozen.model.named_parameters() if p.requires_grad}
    frozen_logs = train_logs(frozen)
    assert all(torch.equal(p, start[n]) for n, p in frozen.model.named_parameters() if n in start)
    assert frozen_logs[0]["loss"] == pytest.approx(ref_logs[0]["loss"], abs=1e-5)
    with pytest.raises(AssertionError):
        assert_logs_close(frozen_logs, ref_logs, ("loss",))


def sft_pair(tmp_path, dataset, **overrides):
    """TRL and nanosft SFTTrainers on one model, data and LoRA init; returns (ours, ref) logs."""
    ref_model, our_model = make_models()
    ref_tok, our_tok = wordlevel_tokenizers()
    sft = {**COMMON, "gradient_checkpointing": False, **overrides}
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}
    ref = trl.SFTTrainer(
        model=ref_model,
        args=trl.SFTConfig(str(tmp_path / "ref"), **sft),
        train_dataset=datasets.Dataset.from_list(dataset),
        processing_class=ref_tok,
        peft_config=peft.LoraConfig(**lora),
    )
    ours = SFTTrainer(
        our_model,
        SFTConfig(str(tmp_path / "ours"), **sft),
        train_dataset=dataset,
        processing_class=our_tok,
        peft_config=LoraConfig(**lora),
    )
    if sft.get("packing"):  # the same bins in the same order, or the comparison below means nothing
        assert [r["seq_lengths"] for r in ours.train_dataset] == list(
            ref.train_dataset["seq_lengths"]
        )
    ref_params = dict(ref.model.named_parameters())
    with torch.no_grad():
        for name, param in ours.model.named_parameters():
            if param.requires_grad:
                param.copy_(ref_params[name])
    return train_logs(ours), train_logs(ref)


def test_sft_bfd_packing_padding_free_matches_trl(tmp_path):
    # text rows -> EOS appended -> BFD bins of 32 tokens -> one padding-free row per micro-batch,
    # position_ids restarting per document; 8 packed rows / batch 2 = 4 micro-batches, GA 3 -> 2
    # updates x 10 epochs
    texts = [{"text": " ".join(f"t{i}" for i in row["input_ids"])} for row in make_rows(24)]
    ours, ref = sft_pair(tmp_path, texts, packing=True, max_length=32, num_train_epochs=10)
    assert_logs_close(ours, ref, KEYS + ("entropy", "mean_token_accuracy"))
    assert [h["num_tokens"] for h in ours] == [h["num_tokens"] for h in ref]

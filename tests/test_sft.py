"""SFTTrainer set-up and loss: prompt-completion masking, pad fallback, LoRA wrapping, QLoRA bf16
cast, bfd packing (padding-free batches), the SFT loss against a hand-written shifted
cross-entropy, TRL's logged metrics.

Hermetic: a byte-level BPE tokenizer trained in-process on a few sentences, a tiny nanosft
CausalLM, CPU, fixed seeds. The TRL training-log comparison is in
tests/parity/test_trainer_parity.py; the eval token accuracy is compared with TRL's
SFTTrainer.evaluate here (a tiny transformers Llama with the same weights, a WordLevel tokenizer
built in memory; fp32, tolerance 1e-6).
Run: python -m pytest -q tests/test_sft.py
"""

import json

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
    values = {
        "output_dir": str(tmp_path),
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "max_steps": 3,
        "learning_rate": 1e-2,
        "logging_steps": 1,
        "save_strategy": "no",
        "use_cpu": True,
        "bf16": False,
        "gradient_checkpointing": False,
        "optim": "adamw_torch",
        "disable_tqdm": True,
    }
    return SFTConfig(**{**values, **overrides})


def test_prompt_completion_trains_only_the_completion(tmp_path, tokenizer):
    trainer = SFTTrainer(
        model_for(tokenizer), config(tmp_path), train_dataset=PAIRS, processing_class=tokenizer
    )
    assert trainer.completion_only_loss
    row, example = trainer.train_dataset[0], PAIRS[0]
    n_prompt = len(tokenizer.encode(example["prompt"]))
    assert row["labels"][:n_prompt] == [-100] * n_prompt
    assert row["labels"][n_prompt:] == row["input_ids"][n_prompt:]
    assert row["input_ids"][-1] == tokenizer.eos_token_id  # TRL appends EOS to the completion


def test_pad_token_falls_back_to_eos(tmp_path):
    tok = Tokenizer.train(TEXTS, vocab_size=300, pad_token=None)
    assert tok.pad_token is None
    trainer = SFTTrainer(
        model_for(tok),
        config(tmp_path),
        train_dataset=[{"text": t} for t in TEXTS],
        processing_class=tok,
    )
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
    trainer = SFTTrainer(
        model_for(tokenizer), config(tmp_path), train_dataset=PAIRS, processing_class=tokenizer
    )
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    # any window count: the loss divides by it, not by this batch's tokens
    num_items = torch.tensor(37.0)
    loss = trainer.compute_loss(trainer.model, dict(batch), num_items_in_batch=num_items)
    logits = trainer.model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
    ).logits
    expected = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(),
                               ignore_index=-100, reduction="sum") / num_items
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-6)
    # the model's ForCausalLMLoss agrees
    own = trainer.model(**batch, num_items_in_batch=num_items).loss
    torch.testing.assert_close(loss, own, rtol=0, atol=1e-6)
    # negative control: the unshifted loss (logits t vs label t) is another number
    unshifted = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100,
                                reduction="sum") / num_items
    assert abs(unshifted.item() - loss.item()) > 1e-3


def test_fused_path_takes_the_models_loss(tmp_path, tokenizer):
    # the fused LM head's forward already divides by num_items_in_batch: SFTTrainer passes the
    # window's count in and returns that loss instead of computing a second one
    from nanosft.reference import reference_mode

    trainer = SFTTrainer(
        model_for(tokenizer), config(tmp_path), train_dataset=PAIRS, processing_class=tokenizer
    )
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    seen = []
    trainer.model.register_forward_hook(
        lambda module, args, kwargs, output: seen.append((kwargs, output)), with_kwargs=True)
    num_items = torch.tensor(37.0)
    with reference_mode(False):
        loss = trainer.compute_loss(trainer.model, dict(batch), num_items_in_batch=num_items)
    (kwargs, outputs), = seen
    assert kwargs["fused_lm_head"] and kwargs["num_items_in_batch"] is num_items
    assert outputs.logits is None and torch.equal(loss, outputs.loss)
    expected = -outputs.log_probs.sum() / num_items  # the sum TRL's SFTTrainer divides
    torch.testing.assert_close(loss, expected, rtol=0, atol=0)


def test_logs_carry_trl_metrics(tmp_path, tokenizer):
    trainer = SFTTrainer(
        model_for(tokenizer), config(tmp_path, report_to="nanosft"), train_dataset=PAIRS,
        processing_class=tokenizer
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    # transformers' keys and TRL's in their order; the throughput callback's appended after them
    trl_keys = ["loss", "grad_norm", "learning_rate", "entropy", "mean_token_accuracy",
                "num_tokens", "epoch", "step"]
    speed_keys = ["train_tokens_per_second", "train_samples_per_second", "train_steps_per_second",
                  "train_step_time", "train_model_flops_per_second", "mfu"]
    assert list(logs[0]) == trl_keys + speed_keys
    # num_tokens: the running count of attention-mask tokens over all micro-batches seen so far
    total = sum(
        len(trainer.train_dataset[i]["input_ids"]) for i in range(len(trainer.train_dataset))
    )
    assert logs[1]["num_tokens"] == total  # 8 rows = 2 windows of 2 x 2: one full epoch by step 2
    assert all(0.0 <= h["mean_token_accuracy"] <= 1.0 and h["entropy"] > 0 for h in logs)


def test_prompt_tuning_loss_counts_the_virtual_prefix_as_peft_does(tmp_path, tokenizer):
    """With prompt tuning the logits are n_virtual positions longer than the labels; the SFT loss
    must pad the labels with -100 in front (as PeftModelForCausalLM.forward does for the model's own
    loss), not crash or misalign."""
    from nanosft.peft import PromptTuningConfig

    n_virtual = 3
    trainer = SFTTrainer(
        model_for(tokenizer),
        config(tmp_path),
        train_dataset=PAIRS,
        processing_class=tokenizer,
        peft_config=PromptTuningConfig(num_virtual_tokens=n_virtual),
    )
    batch = trainer.data_collator(trainer.train_dataset[:2])
    loss = trainer.compute_loss(trainer.model, dict(batch))
    own = trainer.model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]
    )
    assert own.logits.size(1) == batch["labels"].size(1) + n_virtual
    # both: mean over supervised targets
    torch.testing.assert_close(loss, own.loss, rtol=1e-6, atol=1e-6)
    trainer.train()
    assert trainer.state.global_step == 3


def test_eval_mean_token_accuracy_is_trls_mean_of_batch_accuracies(tmp_path):
    """One definition of eval token accuracy, TRL 1.16's: SFTTrainer.log averages the per-batch
    accuracies (correct / supervised tokens of each eval batch). Same weights in a transformers
    Llama and a nanosft CausalLM, five rows in eval batches of 2, 2, 1; fp32, tolerance 1e-6.
    Negative control: the token-weighted accuracy over the whole set is another number."""
    import datasets
    import transformers
    import trl
    from tokenizers import Tokenizer as BackendTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    from nanosft.model import CausalLM, ModelConfig

    vocab = 48
    config = {
        "vocab_size": vocab,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "pad_token_id": 0,
    }
    torch.manual_seed(0)
    ref_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    with torch.no_grad():  # a head that mostly predicts the current token: repeats score hits
        ref_model.lm_head.weight.copy_(4 * ref_model.model.embed_tokens.weight)
    our_model = CausalLM(ModelConfig(**config))
    our_model.load_state_dict(ref_model.state_dict())
    g = torch.Generator().manual_seed(3)
    rows = []
    for length, runs in ((9, 3), (6, 1), (12, 4), (5, 5), (10, 2)):  # few runs: many repeats
        ids = torch.randint(2, vocab, (runs,), generator=g).repeat_interleave(-(-length // runs))
        ids = ids[:length].tolist()
        rows.append({"input_ids": ids, "labels": [-100] * 2 + ids[2:]})
    backend = BackendTokenizer(
        WordLevel(
            {"<pad>": 0, "</s>": 1, **{f"t{i}": i for i in range(2, vocab)}}, unk_token="<pad>"
        )
    )
    backend.pre_tokenizer = WhitespaceSplit()
    backend.add_special_tokens(["<pad>", "</s>"])
    ref_tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>",
                                                   eos_token="</s>")
    common = {"per_device_eval_batch_size": 2, "use_cpu": True, "bf16": False, "report_to": "none",
              "gradient_checkpointing": False, "max_length": None, "disable_tqdm": True}
    ref = trl.SFTTrainer(model=ref_model, args=trl.SFTConfig(str(tmp_path / "ref"), **common),
                         train_dataset=datasets.Dataset.from_list(rows),
                         eval_dataset=datasets.Dataset.from_list(rows), processing_class=ref_tok)
    ours = SFTTrainer(our_model, SFTConfig(str(tmp_path / "ours"), **common), train_dataset=rows,
                      eval_dataset=rows, processing_class=Tokenizer(backend, pad_token="<pad>",
                                                                    eos_token="</s>"))
    theirs, mine = ref.evaluate(), ours.evaluate()
    for key in ("eval_mean_token_accuracy", "eval_entropy", "eval_loss"):
        torch.testing.assert_close(mine[key], theirs[key], rtol=0, atol=1e-6, msg=key)
    # the same accuracies by hand: per batch, then the mean of the three
    correct, valid = [], []
    with torch.no_grad():
        for chunk in (rows[0:2], rows[2:4], rows[4:5]):
            batch = DataCollatorForLanguageModeling(pad_token_id=0)(chunk)
            target = batch["labels"][:, 1:]
            hits = (our_model(**batch).logits[:, :-1].argmax(-1) == target) & (target != -100)
            correct.append(int(hits.sum()))
            valid.append(int((target != -100).sum()))
    per_batch_mean = sum(c / v for c, v in zip(correct, valid)) / 3
    assert 0.05 < per_batch_mean < 0.95  # the metric is not trivially 0 or 1 here
    assert mine["eval_mean_token_accuracy"] == pytest.approx(per_batch_mean, abs=1e-6)
    token_weighted = sum(correct) / sum(valid)
    assert abs(token_weighted - theirs["eval_mean_token_accuracy"]) > 1e-3  # negative control


def test_a_model_of_custom_code_is_refused_naming_custom_code(tmp_path, tokenizer):
    # TRL's tiny-RemoteForCausalLM: a model_type only the folder's own code defines (auto_map);
    # TRL and transformers refuse it without trust_remote_code, saying "custom code"
    folder = tmp_path / "remote"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "remote", "architectures": ["RemoteForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_remote.RemoteConfig",
                     "AutoModelForCausalLM": "modeling_remote.RemoteForCausalLM"}}))
    with pytest.raises(ValueError, match="custom code"):
        SFTTrainer(model=str(folder), args=config(tmp_path), train_dataset=PAIRS,
                   processing_class=tokenizer)
    with pytest.raises(ValueError, match="custom code"):  # asking to run it: out of scope
        config(tmp_path, trust_remote_code=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "remote"}))  # control
    with pytest.raises(ValueError, match="not supported") as error:
        SFTTrainer(model=str(folder), args=config(tmp_path), train_dataset=PAIRS,
                   processing_class=tokenizer)
    assert "custom code" not in str(error.value)

"""Trainer / SFTTrainer constructor arguments against transformers 5.23 and TRL 1.16.

Compared: the two signatures (names, order, defaults); then, on the tiny Llama and rows of
test_trainer_parity (weights copied, CPU, fp32), the per-step losses of a run given
`optimizers=(optimizer, scheduler)`, `optimizer_cls_and_kwargs`, `compute_loss_func`, and (on
SFTTrainer with LoRA) `callbacks` and `compute_loss_func`, each against the reference library's
Trainer given the same argument, at the existing tests' tolerance (atol 1e-5). SFTTrainer given a
model folder (processing_class=None; model_init_kwargs with a dtype or none: TRL's float32 default
over a bf16 folder) and `quantization_config=` (NF4 QLoRA): the loaded tokenizer's rows and the
per-step losses equal TRL's on the same folder (atol 1e-5). `chat_template_path` (.jinja / .j2):
the tokenized chat rows equal TRL's; a folder is refused by name. Refusals: model_init
and the both-optimizer conflict name the argument. Negative control: the optimizer_cls_and_kwargs
run differs from the default-AdamW run. Hermetic: no downloads.
Run: python -m pytest -q tests/parity/test_trainer_signature.py
"""

import inspect

import datasets
import peft
import pytest
import torch
import transformers
import trl
from test_trainer_parity import (COMMON, CONFIG, make_models, make_rows, train_logs,
                                 wordlevel_tokenizers)
from tiny import one_thread  # noqa: F401 (an autouse fixture)

from nanosft.args import SFTConfig, TrainingArguments
from nanosft.collator import DataCollatorForLanguageModeling
from nanosft import nf4
from nanosft.nf4 import BitsAndBytesConfig
from nanosft.peft import LoraConfig
from nanosft.sft import SFTTrainer
from nanosft.trainer import Trainer

SHORT = {**COMMON, "num_train_epochs": 2, "gradient_accumulation_steps": 2}  # 8 steps
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}


def _parameters(cls):
    return [(p.name, p.default) for p in inspect.signature(cls.__init__).parameters.values()]


def test_signatures_equal_transformers_and_trl():
    assert _parameters(Trainer) == _parameters(transformers.Trainer)
    assert _parameters(SFTTrainer) == _parameters(trl.SFTTrainer)


def test_model_init_and_two_optimizers_are_refused(tmp_path):
    _, model = make_models()
    args = TrainingArguments(str(tmp_path), **SHORT)
    with pytest.raises(ValueError, match="model_init is not supported.*hyperparameter search"):
        Trainer(model, args, model_init=lambda: model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="optimizer_cls_and_kwargs"):
        Trainer(model, args, optimizers=(optimizer, None),
                optimizer_cls_and_kwargs=(torch.optim.SGD, {"lr": 0.1}))


def _trainer_pair(tmp_path, ref_kwargs, our_kwargs, **overrides):
    rows = make_rows()
    ref_model, our_model = make_models()
    collator = DataCollatorForLanguageModeling(pad_token_id=0)
    settings = {**SHORT, **overrides}
    ref = transformers.Trainer(
        model=ref_model, args=transformers.TrainingArguments(str(tmp_path / "ref"), **settings),
        train_dataset=datasets.Dataset.from_list(rows), data_collator=collator,
        **ref_kwargs(ref_model))
    ours = Trainer(our_model, TrainingArguments(str(tmp_path / "ours"), **settings),
                   train_dataset=rows, data_collator=collator, **our_kwargs(our_model))
    return [h["loss"] for h in train_logs(ours)], [h["loss"] for h in train_logs(ref)]


def _sgd_and_schedule(model):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return {"optimizers": (optimizer, torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 1.0 / (1 + step)))}


def test_optimizers_tuple_matches_transformers(tmp_path):
    ours, ref = _trainer_pair(tmp_path, _sgd_and_schedule, _sgd_and_schedule)
    assert len(ours) == len(ref) == 8
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)


def test_optimizer_cls_and_kwargs_matches_transformers(tmp_path):
    def kwargs(_):
        return {"optimizer_cls_and_kwargs": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9})}

    ours, ref = _trainer_pair(tmp_path, kwargs, kwargs)
    assert len(ours) == len(ref) == 8
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)
    default, _ = _trainer_pair(tmp_path / "default", lambda m: {}, lambda m: {})
    assert default[0] == pytest.approx(ours[0], abs=1e-6)  # same start, different optimizer
    assert max(abs(a - b) for a, b in zip(default, ours)) > 1e-3


def token_sum_loss(outputs, labels, num_items_in_batch=None):
    """A user loss: cross-entropy summed over the shifted targets, over num_items_in_batch."""
    logits = outputs["logits"][:, :-1].float()
    targets = labels[:, 1:]
    total = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)),
                                              targets.reshape(-1), reduction="sum")
    return total / (num_items_in_batch if num_items_in_batch is not None else 1.0) * 0.5


def test_compute_loss_func_matches_transformers(tmp_path):
    def kwargs(_):
        return {"compute_loss_func": token_sum_loss}

    ours, ref = _trainer_pair(tmp_path, kwargs, kwargs)
    assert len(ours) == len(ref) == 8
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)


class StopAt(transformers.TrainerCallback):
    """Stops training after `step` optimizer steps; records the global_step of each step end."""

    def __init__(self, step):
        self.step, self.seen = step, []

    def on_step_end(self, args, state, control, **kwargs):
        self.seen.append(state.global_step)
        if state.global_step == self.step:
            control.should_training_stop = True
        return control


def _sft_pair(tmp_path, **trainer_kwargs):
    rows = make_rows()
    ref_model, our_model = make_models()
    ref_tok, our_tok = wordlevel_tokenizers()
    sft = {**SHORT, "gradient_checkpointing": False, "max_length": None}
    ref_cb, our_cb = StopAt(5), StopAt(5)
    ref = trl.SFTTrainer(model=ref_model, args=trl.SFTConfig(str(tmp_path / "ref"), **sft),
                         train_dataset=datasets.Dataset.from_list(rows), processing_class=ref_tok,
                         peft_config=peft.LoraConfig(**LORA), callbacks=[ref_cb],
                         **trainer_kwargs)
    ours = SFTTrainer(model=our_model, args=SFTConfig(str(tmp_path / "ours"), **sft),
                      train_dataset=rows, processing_class=our_tok,
                      peft_config=LoraConfig(**LORA), callbacks=[our_cb], **trainer_kwargs)
    ref_params = dict(ref.model.named_parameters())
    with torch.no_grad():
        for name, param in ours.model.named_parameters():
            if param.requires_grad:
                param.copy_(ref_params[name])
    return (ours, our_cb), (ref, ref_cb)


@pytest.mark.parametrize("loss_func", [None, token_sum_loss], ids=["callbacks", "loss_func"])
def test_sft_callbacks_and_compute_loss_func_match_trl(tmp_path, loss_func):
    kwargs = {} if loss_func is None else {"compute_loss_func": loss_func}
    (ours, our_cb), (ref, ref_cb) = _sft_pair(tmp_path, **kwargs)  # TRL: a FutureWarning
    our_logs, ref_logs = train_logs(ours), train_logs(ref)
    assert our_cb.seen == ref_cb.seen == [1, 2, 3, 4, 5]
    assert ours.state.global_step == ref.state.global_step == 5
    torch.testing.assert_close([h["loss"] for h in our_logs], [h["loss"] for h in ref_logs],
                               rtol=0, atol=1e-5)
    for key in ("entropy", "mean_token_accuracy"):
        torch.testing.assert_close([h[key] for h in our_logs], [h[key] for h in ref_logs],
                                   rtol=0, atol=1e-5)



def test_formatting_func_rows_match_trl(tmp_path):
    rows = [{"q": " ".join(f"t{i}" for i in range(2 + n, 6 + 2 * n)), "a": f"t{40 + n}"}
            for n in range(6)]
    ref_model, our_model = make_models()
    ref_tok, our_tok = wordlevel_tokenizers()
    sft = {**SHORT, "gradient_checkpointing": False, "max_length": None}

    def formatting_func(row):
        return f"{row['q']} {row['a']}"

    ref = trl.SFTTrainer(model=ref_model, args=trl.SFTConfig(str(tmp_path / "ref"), **sft),
                         train_dataset=datasets.Dataset.from_list(rows), processing_class=ref_tok,
                         formatting_func=formatting_func)
    ours = SFTTrainer(our_model, SFTConfig(str(tmp_path / "ours"), **sft), train_dataset=rows,
                      processing_class=our_tok, formatting_func=formatting_func)
    assert [r["input_ids"] for r in ours.train_dataset] == ref.train_dataset["input_ids"]
    pairs = [{"prompt": "t5 t6", "completion": "t7"}] * 2  # completion-only loss has no text form
    with pytest.raises(ValueError, match="formatting_func"):
        SFTTrainer(make_models()[1], SFTConfig(str(tmp_path / "pc"), **sft), train_dataset=pairs,
                   processing_class=our_tok,
                   formatting_func=lambda row: f"{row['prompt']} {row['completion']}")


CHAT_TEMPLATE = ("{% for message in messages %}{{ message['content'] }}{% if not loop.last %} "
                 "{% endif %}{% endfor %}{{ eos_token }}")
CHAT_ROWS = [{"messages": [{"role": "user", "content": f"t{2 + n} t{3 + n}"},
                           {"role": "assistant", "content": f"t{40 + n} t{41 + n} t{42 + n}"}]}
             for n in range(6)]


@pytest.mark.parametrize("suffix", [".jinja", ".j2"])
def test_chat_template_path_rows_match_trl(tmp_path, suffix):
    path = tmp_path / f"template{suffix}"
    path.write_text(CHAT_TEMPLATE, encoding="utf-8")
    ref_model, our_model = make_models()
    ref_tok, our_tok = wordlevel_tokenizers()  # neither has a chat template of its own
    sft = {**SHORT, "gradient_checkpointing": False, "max_length": None,
           "chat_template_path": str(path)}
    ref = trl.SFTTrainer(model=ref_model, args=trl.SFTConfig(str(tmp_path / "ref"), **sft),
                         train_dataset=datasets.Dataset.from_list(CHAT_ROWS),
                         processing_class=ref_tok)
    ours = SFTTrainer(our_model, SFTConfig(str(tmp_path / "ours"), **sft), train_dataset=CHAT_ROWS,
                      processing_class=our_tok)
    assert our_tok.chat_template == ref_tok.chat_template == CHAT_TEMPLATE  # replaced in place
    assert [r["input_ids"] for r in ours.train_dataset] == ref.train_dataset["input_ids"]
    # the rows are the template's: t2 t3 t40 t41 t42 </s> for the first
    assert ours.train_dataset[0]["input_ids"] == [2, 3, 40, 41, 42, 1]


def test_chat_template_path_folder_is_refused(tmp_path):
    _, our_model = make_models()
    _, our_tok = wordlevel_tokenizers()
    args = SFTConfig(str(tmp_path / "ours"), chat_template_path=str(tmp_path))
    with pytest.raises(ValueError, match="chat_template_path=.*clone_chat_template"):
        SFTTrainer(our_model, args, train_dataset=CHAT_ROWS, processing_class=our_tok)


def _save_tiny_folder(folder, dtype, **config):
    torch.manual_seed(0)
    ref_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**CONFIG, **config}))
    ref_tok, _ = wordlevel_tokenizers()
    ref_model.to(dtype).save_pretrained(folder)
    ref_tok.save_pretrained(folder)
    return str(folder)


# None: TRL loads in float32 (not transformers 5's "auto", which would read bf16 here)
@pytest.mark.parametrize("model_init_kwargs", [{"dtype": "float32"}, None],
                         ids=["dtype", "default"])
def test_model_id_folder_matches_trl(tmp_path, model_init_kwargs):
    folder = _save_tiny_folder(tmp_path / "tiny", torch.bfloat16)
    sft = {**SHORT, "gradient_checkpointing": False, "max_length": None,
           "model_init_kwargs": model_init_kwargs}
    rows = make_rows()
    ref = trl.SFTTrainer(model=folder, args=trl.SFTConfig(str(tmp_path / "ref"), **sft),
                         train_dataset=datasets.Dataset.from_list(rows), processing_class=None)
    ours = SFTTrainer(model=folder, args=SFTConfig(str(tmp_path / "ours"), **sft),
                      train_dataset=rows, processing_class=None)
    assert ours.model.model.embed_tokens.weight.dtype == torch.float32
    assert ours.processing_class.eos_token == ref.processing_class.eos_token == "</s>"
    assert [r["input_ids"] for r in ours.train_dataset] == ref.train_dataset["input_ids"]
    ours_losses = [h["loss"] for h in train_logs(ours)]
    ref_losses = [h["loss"] for h in train_logs(ref)]
    assert len(ours_losses) == len(ref_losses) == 8
    torch.testing.assert_close(ours_losses, ref_losses, rtol=0, atol=1e-5)


def test_quantization_config_argument_matches_trl(tmp_path):
    pytest.importorskip("bitsandbytes")
    # 64 wide: nanosft quantizes in_features that are multiples of the 64-value NF4 block
    folder = _save_tiny_folder(tmp_path / "tiny", torch.float32, hidden_size=64,
                               intermediate_size=128)
    options = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
               "bnb_4bit_use_double_quant": True, "bnb_4bit_compute_dtype": torch.float32}
    sft = {**SHORT, "gradient_checkpointing": False, "max_length": None, "bf16": False,
           "model_init_kwargs": {"dtype": "float32"}}
    rows = make_rows()
    ref = trl.SFTTrainer(model=folder, args=trl.SFTConfig(str(tmp_path / "ref"), **sft),
                         train_dataset=datasets.Dataset.from_list(rows),
                         peft_config=peft.LoraConfig(**LORA),
                         quantization_config=transformers.BitsAndBytesConfig(**options))
    ours = SFTTrainer(model=folder, args=SFTConfig(str(tmp_path / "ours"), **sft),
                      train_dataset=rows, peft_config=LoraConfig(**LORA),
                      quantization_config=BitsAndBytesConfig(**options))
    assert nf4.is_quantized(ours.model)
    assert any(type(m).__name__ == "Linear4bit" for m in ref.model.modules())
    ref_params = dict(ref.model.named_parameters())
    with torch.no_grad():  # the same starting adapters whatever each library's RNG draws
        for name, param in ours.model.named_parameters():
            if param.requires_grad:
                assert param.dtype == ref_params[name].dtype  # QLoRA: bf16 adapters in both
                param.copy_(ref_params[name])
    ours_losses = [h["loss"] for h in train_logs(ours)]
    ref_losses = [h["loss"] for h in train_logs(ref)]
    assert len(ours_losses) == len(ref_losses) == 8
    torch.testing.assert_close(ours_losses, ref_losses, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="both as a trainer argument"):
        SFTTrainer(model=folder, args=SFTConfig(str(tmp_path / "both"), model_init_kwargs={
            "quantization_config": BitsAndBytesConfig(**options)}), train_dataset=rows,
                   quantization_config=BitsAndBytesConfig(**options))

"""total_flos of nanosft Trainer against transformers Trainer on the same run.

transformers adds 6 x input_ids elements (padding included) x the model's parameters less its
embeddings (a tied lm_head with them) for every micro-batch, and reports the sum as `total_flos`
in TrainerState and in the final train metrics. Compared: state.total_flos and the last
log_history entry's total_flos, exactly (float sums of integers), for a plain untied Llama and
for peft LoRA on a tied one (the adapters counted, the embedding not), on padded micro-batches of
varied lengths, batch 2 x GA 3, one epoch. Negative control: counting attention-mask tokens
instead of input_ids elements is another number. Hermetic: CPU, fp32, models built in-process.
Run: python -m pytest -q tests/parity/test_trainer_flops_parity.py
"""

import datasets
import peft
import pytest
import torch
import transformers
from test_trainer_parity import COMMON, CONFIG, make_rows
from tiny import one_thread  # noqa: F401 (an autouse fixture)

from nanosft.args import TrainingArguments
from nanosft.collator import DataCollatorForLanguageModeling
from nanosft.model import CausalLM, ModelConfig
from nanosft.peft import LoraConfig, get_peft_model
from nanosft.trainer import Trainer

TARGETS = ["q_proj", "v_proj", "down_proj"]


def models(tie, lora):
    config = {**CONFIG, "tie_word_embeddings": tie}
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    ours = CausalLM(ModelConfig(**config))
    ours.load_state_dict(ref.state_dict())
    if lora:
        ref = peft.get_peft_model(ref, peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
        ours = get_peft_model(ours, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    return ref, ours


@pytest.mark.parametrize(("tie", "lora"), [(False, False), (True, True)])
def test_total_flos_equals_transformers_trainer(tmp_path, tie, lora):
    rows = make_rows()
    ref_model, our_model = models(tie, lora)
    collator = DataCollatorForLanguageModeling(pad_token_id=0)
    common = {**COMMON, "num_train_epochs": 1, "logging_steps": 2}
    ref = transformers.Trainer(
        model=ref_model,
        args=transformers.TrainingArguments(str(tmp_path / "ref"), **common),
        train_dataset=datasets.Dataset.from_list(rows),
        data_collator=collator,
    )
    # nanosft counts total_flos in its throughput callback, which report_to="nanosft" turns on
    ours = Trainer(our_model, TrainingArguments(str(tmp_path / "ours"),
                                                **{**common, "report_to": "nanosft"}),
                   train_dataset=rows, data_collator=collator)
    ref.train()
    ours.train()
    assert ref.state.total_flos > 0
    assert ours.state.total_flos == ref.state.total_flos
    assert ours.state.log_history[-1]["total_flos"] == ref.state.log_history[-1]["total_flos"]
    # negative control: 6 x attention-mask tokens x N (padding left out) is another number
    batches = list(ours.get_train_dataloader())
    elements = sum(b["input_ids"].numel() for b in batches)
    tokens = sum(int(b["attention_mask"].sum()) for b in batches)
    n = ref.state.total_flos / (6 * elements)
    assert n == int(n) and 6 * tokens * n != ref.state.total_flos

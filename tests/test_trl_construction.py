"""How TRL scripts build their trainer, run on TRL and on nanosft with only their imports changed.

Compared, each script executed once as written (trl / transformers / peft imports) and once with
them pointed at nanosft: per-step losses (fp32, 1e-5), the tokenized rows, `model.model_tags`,
`trainer.aux_loss_enabled`, the tokenizer SFTTrainer loads itself from a built model's
name_or_path, and adapter_config.json's base_model_name_or_path (then each stack's adapter folder
loaded by the other: peft's AutoPeftModelForCausalLM reads the base from that field). The scripts
use what QLoRA blog posts write: `TaskType`, `prepare_model_for_kbit_training`,
`tokenizer.pad_token = tokenizer.eos_token`, `optim="paged_adamw_32bit"` (unpaged on a CPU, in
both stacks), and again with `lora_dropout=0.05` (5 steps, across an epoch). Hermetic: a tiny
Llama folder from test_trl_doc_snippets, HF_HUB_OFFLINE=1, CPU.
Run: python -m pytest -q tests/test_trl_construction.py
"""

import json

import pytest
import torch
from test_trl_doc_snippets import CAPYBARA, both_stacks, losses, processed_rows
import test_trl_doc_snippets
from test_trl_doc_snippets import offline  # noqa: F401 (an autouse fixture)
from tiny import one_thread  # noqa: F401 (an autouse fixture)

pytest.importorskip("trl")
peft = pytest.importorskip("peft")
model_dir = test_trl_doc_snippets.model_dir  # the fixture: a tiny Llama folder with a tokenizer

BUILT_MODEL = """\
from datasets import Dataset
from transformers import AutoModelForCausalLM
from trl import SFTConfig, SFTTrainer

model = AutoModelForCausalLM.from_pretrained(MODEL)
trainer = SFTTrainer(model=model, args=SFTConfig(**LOCAL), train_dataset=Dataset.from_list(ROWS))
trainer.train()
"""

QLORA_BLOG = """\
import torch
from datasets import Dataset
from peft import LoraConfig, TaskType, get_peft_model, prepare_model_for_kbit_training
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer

tokenizer = AutoTokenizer.from_pretrained(MODEL)
tokenizer.pad_token = tokenizer.eos_token
tokenizer.padding_side = "right"
model = AutoModelForCausalLM.from_pretrained(MODEL)
model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                  task_type=TaskType.CAUSAL_LM)
torch.manual_seed(0)  # LoRA A's init draws from the global RNG
model = get_peft_model(model, lora)
trainer = SFTTrainer(
    model=model,
    args=SFTConfig(optim="paged_adamw_32bit", learning_rate=1e-2, **LOCAL),
    train_dataset=Dataset.from_list(ROWS),
    processing_class=tokenizer,
)
trainer.train()
trainer.save_model(LOCAL["output_dir"] + "/adapter")
"""


def test_built_model_loads_its_own_tokenizer(model_dir, tmp_path):
    reference, ours = both_stacks(BUILT_MODEL, model_dir, tmp_path, CAPYBARA, "ROWS")
    assert ours.processing_class.get_vocab() == reference.processing_class.get_vocab()
    assert ours.processing_class.chat_template == reference.processing_class.chat_template
    assert processed_rows(ours) == processed_rows(reference)
    torch.testing.assert_close(losses(ours), losses(reference), rtol=0, atol=1e-5)
    assert ours.model.model_tags == reference.model.model_tags == ["trl", "sft"]
    assert ours.aux_loss_enabled is reference.aux_loss_enabled is False


def test_built_model_without_a_folder_is_refused_with_the_fix(tmp_path):
    from tiny import tiny_model

    from nanosft import SFTConfig, SFTTrainer

    with pytest.raises(ValueError, match="pass processing_class=AutoTokenizer.from_pretrained"):
        SFTTrainer(model=tiny_model(), args=SFTConfig(output_dir=str(tmp_path)),
                   train_dataset=[{"text": "hello"}])


def test_qlora_blog_script(model_dir, tmp_path):
    text = QLORA_BLOG
    reference, ours = both_stacks(text, model_dir, tmp_path, CAPYBARA, "ROWS")
    torch.testing.assert_close(losses(ours), losses(reference), rtol=0, atol=1e-5)
    assert losses(ours)[0] != losses(ours)[-1]  # the adapter trained
    theirs_optimizer = reference.optimizer.optimizer  # accelerate wraps it
    assert type(ours.optimizer) is type(theirs_optimizer)
    assert type(ours.optimizer).__module__.startswith("bitsandbytes")
    assert ours.optimizer.args.optim_bits == theirs_optimizer.args.optim_bits == 32
    assert ours.model.model_tags == reference.model.model_tags == ["trl", "sft"]
    configs = {}
    for name, trainer in (("reference", reference), ("nanosft", ours)):
        folder = f"{trainer.args.output_dir}/adapter"
        with open(f"{folder}/adapter_config.json") as f:
            configs[name] = json.load(f)
    assert configs["nanosft"]["base_model_name_or_path"] == model_dir
    assert configs["reference"]["base_model_name_or_path"] == model_dir
    assert configs["nanosft"]["task_type"] == configs["reference"]["task_type"] == "CAUSAL_LM"
    # each stack loads the other's adapter folder, finding the base through that field
    from nanosft.families.auto import AutoModelForCausalLM, PeftModel

    ids = torch.tensor([[5, 6, 7, 8, 9]])
    theirs = peft.AutoPeftModelForCausalLM.from_pretrained(f"{ours.args.output_dir}/adapter")
    mine = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir),
                                     f"{ours.args.output_dir}/adapter")
    with torch.no_grad():
        torch.testing.assert_close(mine(input_ids=ids).logits, theirs(input_ids=ids).logits,
                                   rtol=0, atol=1e-5)


def test_qlora_blog_script_with_dropout_gives_trls_losses(model_dir, tmp_path, monkeypatch):
    """lora_dropout=0.05, as blog scripts set it: the masks come from the global RNG, so the
    losses are TRL's step for step only if nanosft draws what TRL's stack draws, in its order (one
    mask per LoRA layer in forward order over the padded batch, one int64 per epoch's dataloader
    iterator); 5 steps cross an epoch boundary (6 rows, batch 2)."""
    monkeypatch.setitem(test_trl_doc_snippets.LOCAL, "max_steps", 5)
    text = QLORA_BLOG.replace("lora_dropout=0.0", "lora_dropout=0.05")
    reference, ours = both_stacks(text, model_dir, tmp_path, CAPYBARA, "ROWS")
    assert len(losses(reference)) == 5
    torch.testing.assert_close(losses(ours), losses(reference), rtol=0, atol=1e-5)
    print("\n[blog script, dropout 0.05] TRL", losses(reference).tolist(), "\n  nanosft",
          losses(ours).tolist())


def test_peft_names_scripts_import_from_the_top_level():
    import nanosft
    from nanosft import PromptTuningConfig, TaskType, prepare_model_for_kbit_training
    from nanosft.adapter_files import PromptTuningConfig as defined_config
    from nanosft.lora import prepare_model_for_kbit_training as defined_prepare

    assert PromptTuningConfig is defined_config
    assert prepare_model_for_kbit_training is defined_prepare
    assert {t.name: t.value for t in TaskType} == {t.name: t.value for t in peft.TaskType}
    assert TaskType.CAUSAL_LM == "CAUSAL_LM"
    names = {"TaskType", "PromptTuningConfig", "prepare_model_for_kbit_training"}
    assert names <= set(dir(nanosft))

"""A TRL QLoRA script runs on nanosft with only its imports changed, and the adapters cross over.

Compared: one script text (load a 4-bit base with a BitsAndBytesConfig, AutoTokenizer, a LoraConfig,
SFTConfig, SFTTrainer on a datasets.Dataset with an unused column, train(), save_model()) executed
twice, under the transformers + trl + peft imports and under `from nanosft import ...`; both runs
must finish their steps with finite losses. Then each saved adapter is loaded by the other stack
(peft PeftModel on a transformers model, nanosft PeftModel on a nanosft model), on the
full-precision base, and the logits of the two stacks must agree at 1e-5 (fp32) for both adapters;
a negative control shows each trained adapter moves the logits away from the bare base's.
Hermetic: a tiny Llama (hidden 64, 2 layers) and a BPE tokenizer built in the test, saved to
tmp_path; CPU, fp32, no network (HF_HUB_OFFLINE=1).
Run: python -m pytest -q tests/test_trl_script.py
"""

import peft
import pytest
import torch
import transformers
from tiny import one_thread  # noqa: F401 (an autouse fixture)

import nanosft
from nanosft.model import CausalLM, ModelConfig
from nanosft.tokenizer import Tokenizer

REFERENCE_IMPORTS = """\
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig
from trl import SFTConfig, SFTTrainer
from peft import LoraConfig
"""
NANOSFT_IMPORTS = """\
from nanosft import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig
from nanosft import SFTConfig, SFTTrainer
from nanosft import LoraConfig
"""
# The user's script, as a TRL QLoRA recipe writes it; MODEL, OUT and ROWS are set by the test.
SCRIPT = """\
import torch
from datasets import Dataset

bnb_config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                bnb_4bit_use_double_quant=True,
                                bnb_4bit_compute_dtype=torch.float32)
model = AutoModelForCausalLM.from_pretrained(MODEL, quantization_config=bnb_config,
                                             dtype=torch.float32, device_map="cpu")
tokenizer = AutoTokenizer.from_pretrained(MODEL)
peft_config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear",
                         task_type="CAUSAL_LM")
args = SFTConfig(output_dir=OUT, max_steps=4, per_device_train_batch_size=2, learning_rate=5e-3,
                 logging_steps=1, save_strategy="no", report_to="none", max_length=64,
                 gradient_checkpointing=False, bf16=False, use_cpu=True, seed=0)
trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(ROWS),
                     processing_class=tokenizer, peft_config=peft_config)
trainer.train()
trainer.save_model()
"""
QUESTIONS = [("What is two plus two?", "Four."), ("Capital of France?", "Paris."),
             ("Opposite of hot?", "Cold."), ("Colour of the sky?", "Blue."),
             ("How many legs has a cat?", "Four."), ("First letter of the alphabet?", "A.")]
ROWS = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}],
         "source": "quiz"} for q, a in QUESTIONS]  # "source": a column SFT does not use


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama folder (hidden 64: the NF4 kernels need in_features % 64 == 0) + tokenizer."""
    folder = tmp_path_factory.mktemp("model")
    texts = [q + " " + a for q, a in QUESTIONS] * 4
    tokenizer = Tokenizer.train(texts, vocab_size=320)
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    CausalLM(config).save_pretrained(folder)
    return str(folder)


def run_script(imports, model_dir, out_dir):
    """Run imports + SCRIPT in a fresh namespace; returns the namespace (trainer, model, ...)."""
    namespace = {"MODEL": model_dir, "OUT": str(out_dir), "ROWS": ROWS}
    code = compile(imports + SCRIPT, f"<script with {imports.split()[1]} imports>", "exec")
    exec(code, namespace)
    return namespace


@pytest.fixture(scope="module")
def runs(model_dir, tmp_path_factory):
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("runs")
    return {name: run_script(imports, model_dir, out / name)
            for name, imports in (("reference", REFERENCE_IMPORTS), ("nanosft", NANOSFT_IMPORTS))}


def test_the_script_runs_in_both_stacks(runs):
    reference, ours = runs["reference"]["trainer"], runs["nanosft"]["trainer"]
    assert type(reference).__module__.startswith("trl")
    assert type(ours).__module__.startswith("nanosft")
    for trainer in (reference, ours):
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        assert trainer.state.global_step == 4 and len(losses) == 4
        assert all(torch.isfinite(torch.tensor(losses)))
    # both bases really are 4-bit: the reference's bnb Linear4bit, nanosft's own Linear4bit
    assert any(type(m).__name__ == "Linear4bit" for m in runs["reference"]["model"].modules())
    assert nanosft.nf4.is_quantized(runs["nanosft"]["model"])


def _logits_both_stacks(model_dir, adapter_dir, input_ids):
    """The same adapter loaded by peft (on transformers) and by nanosft: (reference, ours, base)."""
    ref_base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ref = peft.PeftModel.from_pretrained(ref_base, adapter_dir).eval()
    our_base = nanosft.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ours = nanosft.PeftModel.from_pretrained(our_base, adapter_dir)
    with torch.no_grad():
        base = ref.get_base_model()
        with ref.disable_adapter():
            bare = base(input_ids).logits
        return ref(input_ids=input_ids).logits, ours(input_ids=input_ids).logits, bare


@pytest.mark.parametrize("trained_by", ["reference", "nanosft"])
def test_saved_adapters_load_in_each_others_stack(runs, model_dir, trained_by):
    adapter_dir = runs[trained_by]["OUT"]
    tokenizer = nanosft.AutoTokenizer.from_pretrained(model_dir)
    input_ids = torch.tensor([tokenizer.apply_chat_template(ROWS[0]["messages"])])
    ref, ours, bare = _logits_both_stacks(model_dir, adapter_dir, input_ids)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)
    # negative control: the trained adapter changes the output, so the comparison above has teeth
    assert (ref - bare).abs().max() > 1e-3

"""nanosft: a minimal, from-scratch reimplementation of the Hugging Face QLoRA SFT path.

TRL SFTTrainer -> transformers Trainer.train -> _inner_training_loop -> training_step ->
compute_loss -> PeftModelForCausalLM.forward -> LoRA Linear4bit.forward over bitsandbytes NF4,
in small modules a reader can hold beside the source walkthrough. The names a TRL script imports
(`from nanosft import AutoModelForCausalLM, SFTTrainer, LoraConfig, ...`) load on first use through
a module `__getattr__`, so `import nanosft` itself imports neither torch nor any other module.
"""

import importlib

__version__ = "0.1.0"

# top-level name -> the module defining it (imported on first access)
_LAZY_NAMES = {
    "AutoConfig": "nanosft.families.auto",
    "AutoModelForCausalLM": "nanosft.families.auto",
    "AutoTokenizer": "nanosft.families.auto",
    "PeftModel": "nanosft.families.auto",
    "BitsAndBytesConfig": "nanosft.nf4",
    "ParallelismConfig": "nanosft.parallel.mesh",
    "SFTConfig": "nanosft.args",
    "TrainingArguments": "nanosft.args",
    "SFTTrainer": "nanosft.sft",
    "Trainer": "nanosft.trainer",
    "TrainerCallback": "nanosft.trainer_callback",
    "LoraConfig": "nanosft.peft",
    "PromptEncoderConfig": "nanosft.peft",
    "PrefixTuningConfig": "nanosft.peft",
    "get_peft_model": "nanosft.peft",
    "PromptTuningConfig": "nanosft.adapter_files",
    "TaskType": "nanosft.adapter_files",
    "prepare_model_for_kbit_training": "nanosft.lora",
}
__all__ = sorted(_LAZY_NAMES)


def __getattr__(name):
    """Import the module that defines a top-level name on first access (PEP 562).
    Mirrors: transformers' _LazyModule (the same idea, one dict instead of an import structure)"""
    if name not in _LAZY_NAMES:
        raise AttributeError(f"module 'nanosft' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY_NAMES[name]), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY_NAMES))

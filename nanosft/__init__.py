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
    "PeftModel": "nanosft.peft",
    "PeftModelForCausalLM": "nanosft.peft",
    "PeftType": "nanosft.adapter_files",
    "PEFT_TYPE_TO_PREFIX_MAPPING": "nanosft.adapter_files",
    "hotswap_adapter": "nanosft.hotswap",
    "hotswap_adapter_from_state_dict": "nanosft.hotswap",
    "prepare_model_for_compiled_hotswap": "nanosft.hotswap",
    "PeftConfig": "nanosft.adapter_files",
    "PromptLearningConfig": "nanosft.adapter_files",
    "PromptTuningInit": "nanosft.adapter_files",
    "PromptEmbedding": "nanosft.prompt_learning",
    "get_peft_model_state_dict": "nanosft.adapter_files",
    "set_peft_model_state_dict": "nanosft.adapter_files",
    "get_base_model_state_dict": "nanosft.tuners",
    "set_base_model_state_dict": "nanosft.tuners",
    "inject_adapter_in_model": "nanosft.tuners",
    "BaseTunerLayer": "nanosft.tuners",
    "LoraModel": "nanosft.tuners",
    "BitsAndBytesConfig": "nanosft.nf4",
    "ParallelismConfig": "nanosft.parallel.mesh",
    "SFTConfig": "nanosft.args",
    "TrainingArguments": "nanosft.args",
    "SFTTrainer": "nanosft.sft",
    "Trainer": "nanosft.trainer",
    # transformers' Trainer surface, under its names
    "TrainerCallback": "nanosft.trainer_callback",
    "TrainerState": "nanosft.trainer_callback",
    "TrainerControl": "nanosft.trainer_callback",
    "CallbackHandler": "nanosft.trainer_callback",
    "DefaultFlowCallback": "nanosft.trainer_callback",
    "ProgressCallback": "nanosft.trainer_callback",
    "PrinterCallback": "nanosft.trainer_callback",
    "EarlyStoppingCallback": "nanosft.trainer_callback",
    "ExportableState": "nanosft.trainer_callback",
    "IntervalStrategy": "nanosft.trainer_utils",
    "EvalPrediction": "nanosft.trainer_utils",
    "PredictionOutput": "nanosft.trainer_utils",
    "TrainOutput": "nanosft.trainer_utils",
    "set_seed": "nanosft.trainer_utils",
    "default_data_collator": "nanosft.collator",
    "DataCollatorWithPadding": "nanosft.collator",
    "DataCollatorForLanguageModeling": "nanosft.collator",
    "DataCollatorForTokenClassification": "nanosft.collator",
    "get_scheduler": "nanosft.optim",
    "get_constant_schedule": "nanosft.optim",
    "get_constant_schedule_with_warmup": "nanosft.optim",
    "get_linear_schedule_with_warmup": "nanosft.optim",
    "get_cosine_schedule_with_warmup": "nanosft.optim",
    "get_polynomial_decay_schedule_with_warmup": "nanosft.optim",
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

"""nanosft: a minimal, from-scratch reimplementation of the Hugging Face QLoRA SFT path.

TRL SFTTrainer -> transformers Trainer.train -> _inner_training_loop -> training_step ->
compute_loss -> PeftModelForCausalLM.forward -> LoRA Linear4bit.forward over bitsandbytes NF4,
in small modules a reader can hold beside the source walkthrough. Import the pieces from their
modules (`nanosft.model`, `nanosft.lora`, `nanosft.trainer`, ...); nothing is imported here so
that `import nanosft` stays cheap.
"""

__version__ = "0.1.0"

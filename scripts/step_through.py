"""One QLoRA optimizer step in reference mode, small enough to walk in a debugger.

A 1-layer Llama with 4-bit (NF4) linear layers, LoRA on every linear, two one-row micro-batches
(gradient_accumulation_steps=2), max_steps=1: SFTTrainer.__init__, then trainer.train() runs the
walkthrough's chain once. README "Step through it" lists the breakpoints and the pdb commands.

Run:  python -m pdb scripts/step_through.py   (a few seconds without breakpoints)
"""

import tempfile

import torch

from nanosft.args import SFTConfig
from nanosft.model import CausalLM, ModelConfig
from nanosft.nf4 import quantize_model
from nanosft.peft import LoraConfig
from nanosft.reference import start_reference_mode
from nanosft.sft import SFTTrainer
from nanosft.tokenizer import Tokenizer

start_reference_mode()  # the walkthrough's own lines: no speed paths, no reporting callbacks
texts = ["What is 2 plus 3? 5.", "What is 7 plus 1? 8."]
tokenizer = Tokenizer.train(texts * 4, vocab_size=300, special_tokens=["<|endoftext|>"])
torch.manual_seed(0)
config = ModelConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                     num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
model = CausalLM(config)
quantize_model(model)  # every linear but lm_head becomes an nf4.Linear4bit (hidden 64: one block)
args = SFTConfig(output_dir=tempfile.mkdtemp(), max_steps=1, per_device_train_batch_size=1,
                 gradient_accumulation_steps=2, logging_steps=1, save_strategy="no", bf16=False,
                 use_cpu=True, disable_tqdm=True)
trainer = SFTTrainer(model, args=args, train_dataset=[{"text": t} for t in texts],
                     processing_class=tokenizer,
                     peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
trainer.train()  # one optimizer step of 2 micro-batches

"""Tutorial 02: SFTTrainer.__init__, everything that happens before train() (walkthrough 2.1).

The walkthrough shows only the last line:
    super().__init__(model=model, args=args, data_collator=..., train_dataset=...,
                     processing_class=...)
Before it TRL 1.16 (and nanosft.sft) makes the SFTConfig, seeds, wraps the model with LoRA (casting
the adapters to bf16 over a 4-bit base), chooses the collator (padded or padding-free), and prepares
the dataset: tokenize, append EOS, build labels with -100 on what is not trained, truncate or pack.
We build three tiny datasets (text, prompt/completion, messages), print the prepared rows and the
collator's batches, and compare the rows with TRL's own SFTTrainer when it is installed.
Run:      python tutorials/02_sfttrainer_init.py
Runtime:  about 8 s on one CPU core with trl installed (importing it is a third), 5 s without.
You should see:
  - SFTConfig's defaults that differ from TrainingArguments (learning_rate 2e-05,
    logging_steps 10, ...);
  - LoRA names under base_model.model..., lora_A in bfloat16 over Linear4bit, the DoRA magnitude
    in float32;
  - for each format, the rows with the trained tokens marked, and the collator chosen
    (padding_free or not);
  - "TRL rows == nanosft rows: True" when trl is installed, and "OK: walkthrough 2.1 checked".
"""

# %%
from nanosft.reference import start_reference_mode

start_reference_mode()  # for reading: the walkthrough's own statements run, no speed paths

import contextlib
import io
import tempfile
import warnings

import torch

from nanosft import nf4
from nanosft.args import SFTConfig, TrainingArguments
from nanosft.model import CausalLM, ModelConfig
from nanosft.peft import LoraConfig, PeftModelForCausalLM
from nanosft.sft import SFTTrainer
from nanosft.tokenizer import Tokenizer

torch.set_num_threads(1)
warnings.filterwarnings("ignore", category=FutureWarning)  # reference libraries' deprecation notes


def banner(title):
    print(f"\n{'=' * 20} {title} {'=' * 20}")


CORPUS = ["What is two plus two? Four.", "The capital of France is Paris.", "Cats say meow.",
          "What do dogs say? Woof."] * 4
tokenizer = Tokenizer.train(CORPUS, vocab_size=300)
DATASETS = {
    "language_modeling": [{"text": "Cats say meow."}, {"text": "The capital of France is Paris."}],
    "prompt_completion": [{"prompt": "What is two plus two?", "completion": " Four."},
                          {"prompt": "What do dogs say?", "completion": " Woof."}],
    "conversational": [{"messages": [{"role": "user", "content": "What is two plus two?"},
                                     {"role": "assistant", "content": "Four."}]}],
}


def tiny_model(quantized=False):
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 max_position_embeddings=64, bos_token_id=None,
                                 eos_token_id=tokenizer.eos_token_id))
    return nf4.quantize_model(model) if quantized else model


def config(**overrides):
    return SFTConfig(output_dir=tempfile.mkdtemp(), use_cpu=True, report_to="none",
                     disable_tqdm=True, save_strategy="no", **overrides)


def show_row(row):
    """The row's tokens, trained ones in [brackets] (labels != -100)."""
    pieces = [tokenizer.decode([i]) for i in row["input_ids"]]
    return "".join(f"[{p}]" if label != -100 else p for p, label in zip(pieces, row["labels"]))


# %% [markdown]
# ## args: SFTConfig
# TRL's config is TrainingArguments plus dataset options, with a few defaults changed
# for fine-tuning.

# %%
banner("2.1 SFTTrainer.__init__: args=SFTConfig(...)")
sft_args = SFTConfig(output_dir=tempfile.mkdtemp())
plain_args = TrainingArguments(output_dir=tempfile.mkdtemp())
for name in ("learning_rate", "logging_steps", "gradient_checkpointing", "bf16"):
    print(f"  {name:24s} SFTConfig {getattr(sft_args, name)!s:6s} "
          f"TrainingArguments {getattr(plain_args, name)}")
print(f"  SFT-only fields: max_length={sft_args.max_length}, packing={sft_args.packing}, "
      f"completion_only_loss={sft_args.completion_only_loss}, "
      f"assistant_only_loss={sft_args.assistant_only_loss}")
assert sft_args.learning_rate == 2e-5 and sft_args.logging_steps == 10
assert sft_args.gradient_checkpointing is True
assert sft_args.bf16 is True and plain_args.bf16 is False and sft_args.max_length == 1024

# %% [markdown]
# ## model: set_seed, get_peft_model, the QLoRA cast
# With a peft_config the model is wrapped in a PeftModelForCausalLM. Over a 4-bit base, every
# trainable parameter except DoRA's magnitude vector is cast to bfloat16. With gradient
# checkpointing on, the input embeddings get a hook making their output require grad (the frozen
# base would otherwise cut the graph).

# %%
banner("2.1 SFTTrainer.__init__: peft_config -> get_peft_model(model, peft_config)")
dora_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_dora=True)
qlora = SFTTrainer(tiny_model(quantized=True), config(),
                   train_dataset=DATASETS["prompt_completion"], processing_class=tokenizer,
                   peft_config=dora_config)
peft_model = qlora.model
layer = peft_model.base_model.model.model.layers[0].self_attn.q_proj
trainable = [(n, p) for n, p in peft_model.named_parameters() if p.requires_grad]
for name, param in trainable[:3]:
    print(f"  {name:70s} {param.dtype!s:15s} {tuple(param.shape)}")
print(f"  ... {len(trainable)} trainable tensors; "
      f"base layer of q_proj: {type(layer.base_layer).__name__}")
with torch.no_grad():
    embedded = peft_model.get_base_model().get_input_embeddings()(torch.tensor([[1, 2]]))
print("gradient_checkpointing=True -> input embeddings output requires_grad: "
      f"{embedded.requires_grad}")
assert isinstance(peft_model, PeftModelForCausalLM)
assert type(layer.base_layer).__name__ == "Linear4bit"
assert layer.lora_A["default"].weight.dtype == torch.bfloat16
assert layer.lora_magnitude_vector["default"].weight.dtype == torch.float32
assert trainable[0][0].startswith("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default")
assert embedded.requires_grad

# %% [markdown]
# ## train_dataset: _prepare_dataset, and the collator choice
# Text gets an EOS appended and trains on every token; prompt/completion trains on the completion
# only (completion_only_loss defaults to True for that format); messages go through the chat
# template (no extra EOS: the template ends each turn with <|im_end|>). Labels are made here,
# not in the collator.

# %%
banner("2.1 SFTTrainer.__init__: train_dataset = self._prepare_dataset(...)")
prepared = {}
for fmt, examples in DATASETS.items():
    trainer = SFTTrainer(tiny_model(), config(gradient_checkpointing=False), train_dataset=examples,
                         processing_class=tokenizer)
    prepared[fmt] = trainer.train_dataset
    print(f"{fmt}: completion_only_loss={trainer.completion_only_loss}")
    for row in trainer.train_dataset:
        print(f"   {show_row(row)!r}")
lm = prepared["language_modeling"][0]
pc = prepared["prompt_completion"][0]
conv = prepared["conversational"][0]
assert lm["labels"] == lm["input_ids"] and lm["input_ids"][-1] == tokenizer.eos_token_id
assert pc["labels"][0] == -100 and pc["labels"][-1] == tokenizer.eos_token_id
assert tokenizer.decode([t for t in pc["labels"] if t != -100]) == " Four.<|im_end|>"
assert conv["input_ids"] == tokenizer.apply_chat_template(DATASETS["conversational"][0]["messages"])

banner("2.1 SFTTrainer.__init__: data_collator (padded, or padding-free when packing)")
for packing in (False, True):
    trainer = SFTTrainer(tiny_model(),
                         config(gradient_checkpointing=False, packing=packing, max_length=32),
                         train_dataset=DATASETS["prompt_completion"],
                         processing_class=tokenizer)
    collator = trainer.data_collator
    batch = collator(trainer.train_dataset[:2])
    print(f"packing={packing}: {type(collator).__name__}(pad_token_id={collator.pad_token_id}, "
          f"padding_free={collator.padding_free}); rows {len(trainer.train_dataset)}; "
          f"batch keys {sorted(batch)} shape {tuple(batch['input_ids'].shape)}")
    if packing:
        print(f"   packed row seq_lengths {trainer.train_dataset[0]['seq_lengths']}, "
              f"position_ids {batch['position_ids'][0].tolist()}")
        assert collator.padding_free and "attention_mask" not in batch
        assert batch["input_ids"].shape[0] == 1
    else:
        assert not collator.padding_free and "attention_mask" in batch
assert collator.pad_token_id == tokenizer.pad_token_id

# %% [markdown]
# ## super().__init__(...)
# What is left is the Trainer of walkthrough 2.2-2.5. The optimizer and scheduler are made
# later, in train().

# %%
banner("2.1 SFTTrainer.__init__: super().__init__(model=model, args=args, data_collator=..., ...)")
print(f"type(trainer).__mro__[1] = {type(trainer).__mro__[1].__name__}; "
      f"args is {type(trainer.args).__name__}; "
      f"model_accepts_loss_kwargs={trainer.model_accepts_loss_kwargs}; "
      f"optimizer={trainer.optimizer}")
assert type(trainer).__mro__[1].__name__ == "Trainer" and trainer.optimizer is None

# %%
banner("reference: TRL SFTTrainer on the same tokenizer and examples")
try:
    import datasets
    import transformers
    import trl
except ImportError:
    print("reference check skipped: trl / transformers / datasets not installed")
else:
    datasets.disable_progress_bars()
    transformers.utils.logging.set_verbosity_error()
    folder = tempfile.mkdtemp()
    tokenizer.save_pretrained(folder)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    all_equal = True
    for fmt, examples in DATASETS.items():
        hf_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=2))
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            hf_args = trl.SFTConfig(output_dir=folder, use_cpu=True, bf16=False, report_to="none",
                                    gradient_checkpointing=False)
            reference = trl.SFTTrainer(model=hf_model, processing_class=hf_tokenizer, args=hf_args,
                                       train_dataset=datasets.Dataset.from_list(examples))
        theirs = [{"input_ids": r["input_ids"], "labels": r["labels"]}
                  for r in reference.train_dataset]
        ours = [{"input_ids": r["input_ids"], "labels": r["labels"]} for r in prepared[fmt]]
        same = theirs == ours
        print(f"{fmt:18s} TRL rows == nanosft rows: {same}   TRL collator padding_free="
              f"{reference.data_collator.padding_free}")
        all_equal &= same
    assert all_equal
    print("reference check ran: trl SFTTrainer dataset preparation")

print("\nOK: walkthrough 2.1 checked")

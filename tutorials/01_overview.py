"""Tutorial 01: the whole QLoRA SFT flow in one run, printed as the call tree of walkthrough 1.

Walkthrough 1 总体逻辑 / 核心训练逻辑: 初始化 SFTTrainer -> 执行 trainer.train()
-> 执行 inner_training_loop() -> get_batch_samples -> training_step -> compute_loss
-> PeftModelForCausalLM.forward -> Linear4bit.forward -> backward
-> (do_sync_step) optimizer.step / lr_scheduler.step / zero_grad / global_step += 1.
We build a tiny NF4-quantized Llama, wrap it with LoRA through SFTTrainer, switch on
nanosft.monitoring.trace
and run two optimizer steps: the trace prints the first one line by line, live, with the real
shapes and numbers.
Run:      python tutorials/01_overview.py
Runtime:  about 6 s on one CPU core (importing bitsandbytes is a good part of it).
You should see:
  - the SFTTrainer pieces: a PeftModelForCausalLM over Linear4bit layers, the collator, the
    prepared rows;
  - "[trace] [2.2] Trainer.train()" down to "[trace] [2.7] ... Linear4bit.forward" and
    "[2.3] optimizer.step()";
  - do_sync_step False then True (gradient_accumulation_steps=2), and global_step 1;
  - each logged loss equal to the sum of its window's micro-batch losses, the method names found
    in the transformers / peft sources, and "OK: walkthrough 1 traced end to end".
"""

# %%
from nanosft.reference import start_reference_mode

start_reference_mode()  # for reading: the walkthrough's own statements run, no speed paths

import ast
import contextlib
import importlib.util
import io
import pathlib
import re
import tempfile

import torch

from nanosft import nf4
from nanosft.monitoring import trace as walkthrough_trace
from nanosft.args import SFTConfig
from nanosft.model import CausalLM, ModelConfig
from nanosft.peft import LoraConfig, PeftModelForCausalLM
from nanosft.sft import SFTTrainer
from nanosft.tokenizer import Tokenizer

torch.set_num_threads(1)


def banner(title):
    print(f"\n{'=' * 20} {title} {'=' * 20}")


# %% [markdown]
# ## The ingredients: a tokenizer, a 4-bit base model, a few prompt/completion examples

# %%
banner("1. Prepare Train 总体逻辑 / overall logic: the ingredients")
corpus = ["What is two plus two? Four.", "What is the capital of France? Paris.",
          "Name a colour of the sky. Blue.", "What do cats say? Meow."] * 4
tokenizer = Tokenizer.train(corpus, vocab_size=300)
examples = [{"prompt": "What is two plus two?", "completion": " Four."},
            {"prompt": "What is the capital of France?", "completion": " Paris."},
            {"prompt": "Name a colour of the sky.", "completion": " Blue."},
            {"prompt": "What do cats say?", "completion": " Meow."}]
torch.manual_seed(0)
config = ModelConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=64, bos_token_id=None,
                     eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
# QLoRA: every linear but lm_head becomes an NF4 Linear4bit
model = nf4.quantize_model(CausalLM(config))
q_proj = model.model.layers[0].self_attn.q_proj
print(f"tokenizer: {len(tokenizer)} tokens; base model: {config.num_hidden_layers} layers, "
      f"hidden {config.hidden_size}")
print(f"model.model.layers[0].self_attn.q_proj is {type(q_proj).__name__}, "
      f"weight {q_proj.weight.dtype} {tuple(q_proj.weight.shape)} (two 4-bit codes per byte)")
assert nf4.is_quantized(model) and q_proj.weight.dtype == torch.uint8

# %% [markdown]
# ## 初始化 SFTTrainer (walkthrough 2.1)
# SFTTrainer tokenizes the examples, builds labels (-100 on the prompt), wraps LoRA and picks a
# collator, then calls Trainer.__init__. Batch 2 x gradient_accumulation_steps 2: one optimizer
# step = 4 examples.

# %%
banner("- 初始化 SFTTrainer / SFTTrainer.__init__")
args = SFTConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=2,
                 gradient_accumulation_steps=2, max_steps=2, learning_rate=1e-3, logging_steps=1,
                 save_strategy="no", use_cpu=True, gradient_checkpointing=False, bf16=False,
                 disable_tqdm=True, report_to="none", seed=0)
peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
trainer = SFTTrainer(model, args=args, train_dataset=examples, processing_class=tokenizer,
                     peft_config=peft_config)
print(f"trainer.model: {type(trainer.model).__name__}   "
      f"collator: {type(trainer.data_collator).__name__}")
print(f"first prepared row: input_ids {trainer.train_dataset[0]['input_ids']}")
print(f"                    labels    {trainer.train_dataset[0]['labels']}")
trainer.model.print_trainable_parameters()
# the LoRA layer over the Linear4bit
q_lora = trainer.model.base_model.model.model.layers[0].self_attn.q_proj
assert isinstance(trainer.model, PeftModelForCausalLM)
assert type(q_lora.base_layer).__name__ == "Linear4bit"
# the prompt is not trained on (completion_only_loss)
assert trainer.train_dataset[0]["labels"][0] == -100

# %% [markdown]
# ## 执行 trainer.train(), traced
# `nanosft.monitoring.trace.attach` adds one callback to this trainer and hooks on this one model
# (no method is replaced, nothing global changes) and prints one line per walkthrough step until
# the first optimizer step is done.

# %%
banner("- 执行 trainer.train() -> inner_training_loop() -> training_step -> compute_loss"
       " -> forward")
walkthrough_trace.enable_trace()
losses_seen = []


def record_forward(model, args, kwargs, outputs):
    # each micro-batch's `outputs = model(**inputs)`: its inputs, num_items_in_batch and loss
    # (= training_step's tr_loss_step: already divided by num_items_in_batch)
    losses_seen.append((kwargs, kwargs["num_items_in_batch"], outputs["loss"].detach()))


trainer.model.register_forward_hook(record_forward, with_kwargs=True)  # Trainer methods unchanged
walkthrough_trace.attach(trainer)
captured = io.StringIO()
with contextlib.redirect_stdout(captured):
    result = trainer.train()
walkthrough_trace.enable_trace(False)
printed = captured.getvalue()
# the trace lines, the "***** Running training *****" banner and the log lines
print(printed, end="")
trace_lines = [line for line in printed.splitlines() if line.startswith(walkthrough_trace.PREFIX)]

# %%
banner("核心训练逻辑 / core training logic: what the trace shows")
order = ["[2.2] Trainer.train()", "[2.3] _inner_training_loop()", "get_batch_samples",
         "[2.4] for i, inputs in enumerate(batch_samples)",
         "[2.5] compute_loss -> outputs = model(**inputs)",
         "[2.6] PeftModelForCausalLM.forward", "[2.7] Linear4bit.forward", "[2.4] loss.backward()",
         "do_sync_step=False", "do_sync_step=True", "self.optimizer.step()",
         "self.lr_scheduler.step()", "model.zero_grad()", "global_step=1"]
positions = []
for needle in order:
    start = max(positions, default=0)
    where = next((i for i, line in enumerate(trace_lines) if needle in line and i >= start), None)
    print(f"  {needle:55s} -> trace line {where}")
    assert where is not None, f"the trace has no {needle!r} after line {max(positions, default=0)}"
    positions.append(where)
assert positions == sorted(positions)  # the walkthrough's order

# the numbers in the trace are the real ones: num_items_in_batch counts shifted labels of the
# whole window
inputs0, num_items, _ = losses_seen[0]
window = [inp for inp, n, _ in losses_seen[:2]]
count = sum(int((inp["labels"][:, 1:] != -100).sum()) for inp in window)
traced = float(re.search(r"num_items_in_batch=([0-9.]+)", printed).group(1))
print(f"num_items_in_batch: traced {traced:g}, counted by hand over the 2 micro-batches {count}")
assert traced == count == num_items.item()

# %%
banner("训练结束 / training done: TrainOutput")
logged = [h for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]
for h in logged:
    print(f"  step {h['step']}: loss {h['loss']:.4f}  grad_norm {h['grad_norm']:.4f}  "
          f"lr {h['learning_rate']:.2e}")
print(f"TrainOutput(global_step={result.global_step}, training_loss={result.training_loss:.4f})")
# "tr_loss = tr_loss + tr_loss_step": each logged loss is the sum of its window's micro-batch losses
step_losses = [sum(loss.item() for _, _, loss in losses_seen[2 * s:2 * s + 2]) for s in range(2)]
for h, s in zip(logged, step_losses):
    assert abs(h["loss"] - s) < 1e-5
assert result.global_step == 2 and len(losses_seen) == 4

# %%
banner("reference: the same call tree in the transformers / peft sources")


def methods_in_source(module, class_name):
    """Method names of `class_name` in `module`'s source file, read with ast (importing transformers
    is slow)."""
    package, *parts = module.split(".")
    spec = importlib.util.find_spec(package)  # a top-level find_spec imports nothing
    if spec is None:
        raise ImportError(f"{package} is not installed")
    path = pathlib.Path(spec.submodule_search_locations[0]).joinpath(*parts).with_suffix(".py")
    tree = ast.parse(path.read_text(encoding="utf-8"))
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == class_name)
    return {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}


try:
    tree = [("transformers.trainer", "Trainer", "train", type(trainer)),
            ("transformers.trainer", "Trainer", "_inner_training_loop", type(trainer)),
            ("transformers.trainer", "Trainer", "get_batch_samples", type(trainer)),
            ("transformers.trainer", "Trainer", "training_step", type(trainer)),
            ("transformers.trainer", "Trainer", "compute_loss", type(trainer)),
            ("peft.peft_model", "PeftModelForCausalLM", "forward", PeftModelForCausalLM),
            ("peft.tuners.lora.bnb", "Linear4bit", "forward", type(q_lora))]
    for module, class_name, name, ours in tree:
        reference = f"{module}.{class_name}.{name}"
        print(f"  {reference:55s} nanosft: {ours.__name__}.{name}")
        assert name in methods_in_source(module, class_name) and hasattr(ours, name)
except ImportError:
    print("transformers / peft not installed: skipping the name check")

print("\nOK: walkthrough 1 traced end to end")

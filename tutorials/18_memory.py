"""Guide: memory. Where a fine-tuning step's bytes go, predicted by nanosft.memory and measured.

Run:  python tutorials/18_memory.py          (about 25 s on an idle 2-core CPU)
You should see:
  - QLoRA's arithmetic: 0.5 B of codes + 1/64 B of absmax + 4/16384 B of second-level absmax a
    weight = 0.5159 B/weight with double quantization (0.5625 without), as bitsandbytes stores it;
  - the ledger of full fine-tuning, LoRA, QLoRA and QLoRA + gradient checkpointing on one model,
    each row beside its measurement (tensor bytes, bytes saved for backward, RSS growth);
  - the peak RSS growth of loading a checkpoint quantized as it streams vs loaded, then quantized.
"""

# %%
import os
import subprocess
import sys
import tempfile

import torch

from nanosft import nf4
from nanosft import memory
from nanosft.args import TrainingArguments
from nanosft.model import CausalLM, ModelConfig
from nanosft.optim import create_optimizer
from nanosft.peft import LoraConfig, get_peft_model

torch.set_num_threads(1)
MiB = memory.MiB

# %% [markdown]
# ## 1. QLoRA's arithmetic: why 4 bits cost about 0.52 bytes
# NF4 packs two 4-bit codes in a byte (0.5 B/weight) and keeps one absmax per 64 weights. In fp32
# that absmax costs 4/64 = 0.0625 B/weight; double quantization stores it as uint8 (1/64 B) plus one
# fp32 absmax per 256 of those (4 / (64 * 256) B), and a few tables per layer.

# %%
print("=== QLoRA arithmetic (bytes per weight) ===")
layer = nf4.Linear4bit.from_linear(torch.nn.Linear(1024, 1024, bias=False))
n = 1024 * 1024
tables = {False: 16 * 4, True: 16 * 4 + 256 * 4 + 4}  # code maps (+ fp32 offset) per layer
for dq in (False, True):
    by_hand = 0.5 + (1 / 64 + 4 / (64 * 256) if dq else 4 / 64)
    ledger = memory.nf4_bytes(n, double_quant=dq) / n
    print(f"  double_quant={dq!s:5}: by hand {by_hand:.4f} + {tables[dq]:,} B of tables a layer "
          f"-> ledger {ledger:.5f} at {n:,} weights")
    assert abs(ledger - by_hand - tables[dq] / n) < 1e-12
measured = nf4.bytes_per_parameter(layer)  # bitsandbytes' own QuantState tensors
print(f"  bitsandbytes Linear4bit (double quant): {measured:.4f} B/weight "
      f"(fp32 4.0, bf16 2.0: {4 / measured:.1f}x smaller than fp32)")
assert memory.nf4_bytes(n) == measured * n

# %% [markdown]
# ## 2. The ledger beside a real step, four ways
# One model, one batch; per row: predicted by `estimate_memory` from the config alone, measured on
# the live run (storages of weights, grads, optimizer state; bytes saved for backward).

# %%
CONFIG = dict(vocab_size=2048, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
              num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256)
B, T = 4, 128


def storages(tensors):
    return memory.unique_bytes([t for t in tensors if t is not None])


def run(name, full=False, qlora=False, checkpointing=False):
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(**CONFIG))
    if qlora:
        nf4.quantize_model(model)
    if not full:
        model = get_peft_model(model, LoraConfig(r=8))
    if qlora:  # SFTTrainer.__init__ casts the adapters on a 4-bit base to bf16
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16) if p.requires_grad else p.data
    if checkpointing:
        model.enable_input_require_grads()
        model.gradient_checkpointing_enable()
    model.train()
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), optim="adamw_torch")
    optimizer = create_optimizer(model, args)
    ids = torch.randint(0, CONFIG["vocab_size"], (B, T))
    peak = memory.PeakMemory().start()
    with memory.count_saved_tensors(model) as saved:
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = storages([p.grad for p in model.parameters() if p.requires_grad])
    optimizer.step()
    growth = peak.stop()["cpu_peak_growth"]
    plan = memory.MemoryPlan(full=full, load_in_4bit=qlora, per_device_train_batch_size=B,
                             max_length=T, gradient_checkpointing=checkpointing,
                             optim="adamw_torch")
    ledger = memory.estimate_memory(ModelConfig(**CONFIG), plan)
    quant = [t for m in model.modules() if isinstance(m, nf4.Linear4bit)
             for t in (m.quant_state.absmax, m.quant_state.code, m.quant_state.state2.absmax,
                       m.quant_state.state2.code, m.quant_state.offset)]
    logprobs = B * T * CONFIG["vocab_size"] * 4  # the loss's saved fp32 log-probs (logits row)
    measured = {
        "base weights (frozen)": storages([p for p in model.parameters() if not p.requires_grad]
                                          + quant),
        "trainable parameters": storages([p for p in model.parameters() if p.requires_grad]),
        "gradients": grads,
        "optimizer states": storages([v for s in optimizer.state.values() for v in s.values()]),
        "activations (saved for backward)": saved.total - logprobs,
    }
    print(f"\n=== {name} ===")
    print(ledger.format(measured))
    print(f"  RSS growth of this step: {growth / MiB:.1f} MiB; ledger total "
          f"{ledger.total / MiB:.1f} MiB (RSS grows only where the allocator has no freed memory)")
    for row in ("base weights (frozen)", "trainable parameters", "gradients", "optimizer states"):
        assert ledger.rows[row] == measured[row], row
    act = measured["activations (saved for backward)"]
    assert abs(ledger.rows["activations (saved for backward)"] - act) <= 0.15 * act
    return measured


full = run("full fine-tuning (fp32, AdamW)", full=True)
lora = run("LoRA r=8 on q_proj, v_proj (fp32 base)")
qlora = run("QLoRA (NF4 base)", qlora=True)
qlora_gc = run("QLoRA + gradient checkpointing", qlora=True, checkpointing=True)
base = "base weights (frozen)"
act = "activations (saved for backward)"
print(f"\nQLoRA base weights: {qlora[base] / MiB:.2f} MiB vs LoRA's fp32 "
      f"{lora[base] / MiB:.2f} MiB; checkpointing keeps {qlora_gc[act] / MiB:.2f} of "
      f"{qlora[act] / MiB:.2f} MiB of activations")
assert qlora[base] < lora[base] / 2 and qlora_gc[act] < qlora[act] / 3
assert full["optimizer states"] > 20 * lora["optimizer states"]

# %% [markdown]
# ## 3. Quantize while loading vs load, then quantize
# Each in a fresh process: the peak RSS growth while `from_pretrained` runs. Loading in fp32 first
# needs the whole fp32 model in memory; streaming quantizes each linear weight as it is read.

# %%
LOAD = """
import sys, torch
import bitsandbytes  # imported before the measurement: its import is not the loader's memory
from nanosft import nf4
from nanosft import memory
from nanosft.model import CausalLM
torch.set_num_threads(1)
peak = memory.PeakMemory().start()
if sys.argv[2] == "stream":
    model = CausalLM.from_pretrained(sys.argv[1], quantization_config=nf4.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_use_double_quant=True))
else:
    model = nf4.quantize_model(CausalLM.from_pretrained(sys.argv[1]))
print(peak.stop()["cpu_peak_growth"])
"""
print("\n=== loading a checkpoint as NF4: peak RSS growth ===")
with tempfile.TemporaryDirectory() as folder:
    torch.manual_seed(0)
    big = dict(CONFIG, hidden_size=512, intermediate_size=1536, num_hidden_layers=6)
    CausalLM(ModelConfig(**big)).save_pretrained(folder)
    fp32_mib = os.path.getsize(os.path.join(folder, "model.safetensors")) / MiB
    peaks = {}
    for how in ("stream", "then"):
        out = subprocess.run([sys.executable, "-c", LOAD, folder, how], capture_output=True,
                             text=True, check=True).stdout
        peaks[how] = int(out.split()[-1]) / MiB
print(f"  checkpoint fp32 on disk {fp32_mib:.1f} MiB")
print(f"  quantize while loading: +{peaks['stream']:.1f} MiB; "
      f"load fp32 then quantize: +{peaks['then']:.1f} MiB")
assert peaks["stream"] < peaks["then"]
print("OK: memory ledger checked")

"""Tutorial 07: PeftModelForCausalLM.forward, its LoRA and prompt-tuning branches (walkthrough 2.6).

compute_loss (2.5) calls `outputs = model(**inputs)`; with peft that model is PeftModelForCausalLM.
For LoRA its forward passes everything straight to the base model (the LoRA layers sit inside it).
For prompt tuning it runs the seven lines of walkthrough 2.6, which we replay one by one on a tiny
2-layer model and check against nanosft.peft; peft's numbers are printed beside ours when installed.
Run:      python tutorials/07_peft_forward.py
Runtime:  a few seconds on CPU (about 10 s when transformers and peft are imported).
You should see:
  - the wrapped module names and `trainable params: ... || all params: ... || trainable%: ...`;
  - the LoRA branch loss equal to the base model's at init (B = 0), num_items_in_batch passed on;
  - inputs_embeds (2, 6, 64) -> prompts (2, 4, 64) -> (2, 10, 64), the prefix mask of ones and
    the -100 labels;
  - one extra trained target per row (the last virtual token predicts the first real one);
  - the adapter file keys, and "OK: walkthrough 2.6 replayed step by step" at the end.
"""

# %%
from nanosft.reference import start_reference_mode

start_reference_mode()  # for reading: the walkthrough's own statements run, no speed paths

import importlib.util
import tempfile
import warnings

import torch
from safetensors import safe_open

from nanosft.model import CausalLM, ModelConfig
from nanosft.peft import LoraConfig, PromptTuningConfig, get_peft_model

# transformers' deprecation notes, not ours
warnings.filterwarnings("ignore", category=FutureWarning)
HAVE_PEFT = all(importlib.util.find_spec(m) for m in ("peft", "transformers"))
TINY = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}


def banner(title):
    print(f"\n{'=' * 20} {title} {'=' * 20}")


def tiny_models():
    """Our CausalLM and, when installed, transformers' Llama with the very same weights."""
    torch.manual_seed(0)
    ours = CausalLM(ModelConfig(**TINY))
    if not HAVE_PEFT:
        return ours, None
    import transformers
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    hf.load_state_dict(ours.state_dict())  # state-dict keys are equal by design
    return ours, hf


input_ids = torch.tensor([[5, 17, 42, 8, 9, 2], [7, 33, 12, 2, 0, 0]])
attention_mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
# row 0 trains on every token (plain LM); row 1 masks its prompt and its padding with -100
labels = torch.tensor([[5, 17, 42, 8, 9, 2], [-100, 33, 12, 2, -100, -100]])
batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}

# %% [markdown]
# ## get_peft_model: wrap, freeze, count
# LoRA wraps q_proj and v_proj (peft's llama default): each becomes a LoraLinear whose frozen
# original sits at `.base_layer`; the names read `base_model.model.model.layers.0...`.

# %%
banner("get_peft_model(model, LoraConfig(r=4, lora_alpha=8))")
base, hf = tiny_models()
with torch.no_grad():
    base_loss = base(**batch).loss
torch.manual_seed(42)
model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8))
for name, p in model.named_parameters():
    if ".layers.0.self_attn.q_proj." in name:
        print(f"{name:70s} {tuple(p.shape)!s:10s} requires_grad={p.requires_grad}")
print("ours: ", end="")
model.print_trainable_parameters()
if HAVE_PEFT:
    import peft
    torch.manual_seed(42)
    ref = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM"))
    print("peft: ", end="")
    ref.print_trainable_parameters()
    assert ref.get_nb_trainable_parameters() == model.get_nb_trainable_parameters()
    assert all(torch.equal(p, dict(ref.named_parameters())[n]) for n, p in model.named_parameters())
    print("peft's initial adapter weights are bit-identical to ours (same seed, same RNG order)")

# %% [markdown]
# ## The LoRA branch: `return self.base_model(input_ids=..., attention_mask=..., labels=...,
# **kwargs)`
# Nothing is prepended; num_items_in_batch (2.3) rides along in kwargs so the loss is a sum / N.

# %%
banner("Walkthrough 2.6, LoRA branch: straight through to the base model")
with torch.no_grad():
    out = model(**batch)
    out_n = model(**batch, num_items_in_batch=torch.tensor(4))
print(f"logits shape: {tuple(out.logits.shape)}  loss: {out.loss.item():.6f}  "
      f"base loss: {base_loss.item():.6f}")
targets = int((labels[:, 1:] != -100).sum())
print(f"{targets} targets; with num_items_in_batch=4 the loss is sum/4 = {out_n.loss.item():.6f}"
      f" = mean * {targets}/4 = {out.loss.item() * targets / 4:.6f}")
assert torch.allclose(out.loss, base_loss, atol=1e-6)  # B = 0: the adapter starts as the identity
assert torch.allclose(out_n.loss, out.loss * targets / 4, atol=1e-5)
if HAVE_PEFT:
    with torch.no_grad():
        print(f"peft loss: {ref(**batch).loss.item():.6f}")

# %% [markdown]
# ## The prompt-tuning branch, line by line
# Four trainable "virtual token" embeddings go in front of every row. We replay each line of
# walkthrough 2.6 by hand, then compare with `model(**batch)`.

# %%
banner("Walkthrough 2.6, prompt tuning: "
       "get_peft_model(model, PromptTuningConfig(num_virtual_tokens=4))")
base, hf = tiny_models()
pt = get_peft_model(base, PromptTuningConfig(num_virtual_tokens=4))
pt.print_trainable_parameters()
n = pt.peft_config["default"].num_virtual_tokens

banner("batch_size = _get_batch_size(input_ids, inputs_embeds)")
batch_size = input_ids.shape[0]
print("batch_size:", batch_size)

banner("prefix_attention_mask = torch.ones(batch_size, num_virtual_tokens); "
       "attention_mask = cat(...)")
prefix_attention_mask = torch.ones(batch_size, n).to(attention_mask.device)
mask = torch.cat((prefix_attention_mask, attention_mask), dim=1)
print(mask)

banner("inputs_embeds = self.word_embeddings(input_ids)")
inputs_embeds = pt.word_embeddings(input_ids)
print("inputs_embeds shape:", tuple(inputs_embeds.shape))

banner("prefix_labels = torch.full((batch_size, num_virtual_tokens), -100); labels = cat(...)")
prefix_labels = torch.full((batch_size, n), -100).to(labels.device)
full_labels = torch.cat((prefix_labels, labels), dim=1)
print(full_labels)

banner("prompts = self.get_prompt(batch_size); inputs_embeds = cat((prompts, inputs_embeds))")
prompts = pt.get_prompt(batch_size=batch_size).to(inputs_embeds.dtype)
print("prompts shape:", tuple(prompts.shape))
inputs_embeds = torch.cat((prompts, inputs_embeds), dim=1)
print("inputs_embeds after cat:", tuple(inputs_embeds.shape))

banner("return self.base_model(inputs_embeds=inputs_embeds, **kwargs)")
with torch.no_grad():
    draft = pt.base_model(inputs_embeds=inputs_embeds, attention_mask=mask, labels=full_labels)
    real = pt(**batch)
print(f"logits shape: {tuple(real.logits.shape)} "
      f"(num_virtual_tokens + T = {n} + {input_ids.shape[1]})")
print(f"draft loss {draft.loss.item():.6f} == nanosft loss {real.loss.item():.6f}")
assert real.logits.shape == (2, n + 6, TINY["vocab_size"])
assert torch.equal(draft.logits, real.logits) and torch.equal(draft.loss, real.loss)
# after the shift, position n-1 (the last virtual token) predicts the first real token:
extra = int((full_labels[:, 1:] != -100).sum()) - targets
print(
    f"trained targets: {targets} without the prefix, {targets + extra} with it "
    "(+1 per row whose first label is kept)"
)
assert extra == int((labels[:, 0] != -100).sum())
if HAVE_PEFT:
    ref_pt = peft.get_peft_model(
        hf, peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    )
    with torch.no_grad():
        ref_pt.prompt_encoder["default"].embedding.weight.copy_(pt.prompt_encoder["default"].embedding.weight)
        ref_out = ref_pt(**batch)
    diff = (ref_out.logits - real.logits).abs().max().item()
    print(f"peft loss: {ref_out.loss.item():.6f}  max |logits diff| vs peft: {diff:.2e}")
    assert diff < 1e-5

# %% [markdown]
# ## save_pretrained: the adapter alone, in peft's format

# %%
banner("save_pretrained: adapter_model.safetensors + adapter_config.json")
with tempfile.TemporaryDirectory() as d:
    model.save_pretrained(d)
    with safe_open(f"{d}/adapter_model.safetensors", "pt") as f:
        keys = sorted(f.keys())
    pt.save_pretrained(f"{d}/pt")
    with safe_open(f"{d}/pt/adapter_model.safetensors", "pt") as f:
        pt_keys = list(f.keys())
print("\n".join(keys[:4]), f"\n... {len(keys)} LoRA tensors; prompt tuning saves {pt_keys}")
assert keys[0] == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" and pt_keys == [
    "prompt_embeddings"
]

print("\nOK: walkthrough 2.6 replayed step by step")

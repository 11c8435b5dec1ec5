"""Tutorial 07: PeftModelForCausalLM.forward, LoRA and prompt learning (walkthrough 2.6).

compute_loss (2.5) calls `outputs = model(**inputs)`; with peft that model is PeftModelForCausalLM.
For LoRA its forward passes everything straight to the base model (the LoRA layers sit inside it).
For prompt tuning it runs the seven lines of walkthrough 2.6, which we replay one by one on a tiny
2-layer model and check against nanosft.peft; P-tuning runs the same lines with an MLP inside
get_prompt; prefix tuning hands every layer trained keys and values as its cache instead.
peft's numbers are printed beside ours when installed.
Run:      python tutorials/07_peft_forward.py
Runtime:  a few seconds on CPU (about 10 s when transformers and peft are imported).
You should see:
  - the wrapped module names and `trainable params: ... || all params: ... || trainable%: ...`;
  - the LoRA branch loss equal to the base model's at init (B = 0), num_items_in_batch passed on;
  - inputs_embeds (2, 6, 64) -> prompts (2, 4, 64) -> (2, 10, 64), the prefix mask of ones and
    the -100 labels;
  - one extra trained target per row (the last virtual token predicts the first real one);
  - P-tuning: prompts = mlp_head(embedding(0..3)); prefix tuning: 2 layers of (2, 2, 2, 4, 16)
    keys/values and logits (2, 6, 96), each beside peft's;
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
from nanosft.peft import (LoraConfig, PrefixTuningConfig, PromptEncoderConfig, PromptTuningConfig,
                          get_peft_model)

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
# ## P-tuning: the same lines, an encoder inside `self.get_prompt(...)`
# PromptEncoderConfig reparameterizes the virtual tokens: `get_prompt` runs their embedding rows
# through an MLP (or a bidirectional LSTM, then an MLP), so the prompts are a function of trained
# weights, not the rows themselves. Everything after `get_prompt` is the prompt-tuning branch above.

# %%
banner("Walkthrough 2.6, P-tuning: prompts = self.get_prompt(batch_size) runs mlp_head(embedding)")
base, hf = tiny_models()
torch.manual_seed(42)
pe = get_peft_model(base, PromptEncoderConfig(num_virtual_tokens=4, encoder_hidden_size=32))
pe.print_trainable_parameters()
encoder = pe.prompt_encoder["default"]
prompt_tokens = torch.arange(4)[None]  # self.prompt_tokens: one row, the output is repeated
draft_prompts = encoder.mlp_head(encoder.embedding(prompt_tokens)).repeat(batch_size, 1, 1)
print("P-tuning prompts shape:", tuple(draft_prompts.shape), "= mlp_head(embedding(0..3))")
with torch.no_grad():
    assert torch.equal(draft_prompts, pe.get_prompt(batch_size=batch_size))
    pe_out = pe(**batch)
assert pe_out.logits.shape == (2, 4 + 6, TINY["vocab_size"])
if HAVE_PEFT:
    torch.manual_seed(42)  # the same draws: peft's encoder starts bit-identical to ours
    ref_pe = peft.get_peft_model(hf, peft.PromptEncoderConfig(
        task_type="CAUSAL_LM", num_virtual_tokens=4, encoder_hidden_size=32))
    with torch.no_grad():
        ref_pe_out = ref_pe(**batch)
    diff = (ref_pe_out.logits - pe_out.logits).abs().max().item()
    print(f"peft loss: {ref_pe_out.loss.item():.6f}  ours: {pe_out.loss.item():.6f}  "
          f"max |logits diff| vs peft (P-tuning): {diff:.2e}")
    assert diff < 1e-5

# %% [markdown]
# ## Prefix tuning: `kwargs["past_key_values"] = self.get_prompt(batch_size)`
# Nothing is prepended to the input: every attention layer gets num_virtual_tokens trained keys
# and values as if they were a cache of earlier tokens. The mask still gains the ones (the real
# tokens may attend to the prefix), the labels stay as they are (no new positions), and the real
# tokens' positions start at num_virtual_tokens.

# %%
banner("Walkthrough 2.6, prefix tuning: past_key_values = self.get_prompt(batch_size)")
base, hf = tiny_models()
torch.manual_seed(42)
px = get_peft_model(base, PrefixTuningConfig(num_virtual_tokens=4))
config = px.peft_config["default"]
# GQA: the prefix is made for the 2 KV heads of 16 dims, token_dim = 32 (not hidden_size 64)
print(f"token_dim = num_key_value_heads x head_dim = {config.token_dim}, "
      f"num_attention_heads (KV) = {config.num_attention_heads}")
flat = px.prompt_encoder["default"](torch.arange(4).expand(batch_size, -1))
print("encoder output:", tuple(flat.shape), "= (B, n, num_layers * 2 * token_dim)")
L, KV = config.num_layers, config.num_attention_heads
draft_past = flat.view(batch_size, 4, L * 2, KV, config.token_dim // KV)
draft_past = draft_past.permute(2, 0, 3, 1, 4).split(2)  # per layer: [0] keys, [1] values
print(f"prefix past_key_values: {len(draft_past)} layers x {tuple(draft_past[0].shape)}")
with torch.no_grad():
    # `mask`: the batch's mask behind 4 ones, built in the prompt-tuning branch above
    draft = px.get_base_model()(input_ids=input_ids, attention_mask=mask, labels=labels,
                                past_key_values=draft_past)
    px_out = px(**batch)
print("prefix logits shape:", tuple(px_out.logits.shape), "(T only: the prefix is not an input)")
assert torch.equal(draft.logits, px_out.logits) and torch.equal(draft.loss, px_out.loss)
assert px_out.logits.shape == (2, 6, TINY["vocab_size"])
if HAVE_PEFT:
    torch.manual_seed(42)
    ref_px = peft.get_peft_model(hf, peft.PrefixTuningConfig(task_type="CAUSAL_LM",
                                                             num_virtual_tokens=4))
    with torch.no_grad():
        ref_px_out = ref_px(**batch)
    diff = (ref_px_out.logits - px_out.logits).abs().max().item()
    print(f"peft loss: {ref_px_out.loss.item():.6f}  ours: {px_out.loss.item():.6f}  "
          f"max |logits diff| vs peft (prefix tuning): {diff:.2e}")
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
    px.save_pretrained(f"{d}/px")
    with safe_open(f"{d}/px/adapter_model.safetensors", "pt") as f:
        px_shape = tuple(f.get_tensor("prompt_embeddings").shape)
print("\n".join(keys[:4]), f"\n... {len(keys)} LoRA tensors; prompt tuning saves {pt_keys}")
print(f"prefix tuning saves prompt_embeddings {px_shape}: the encoder's output, flat")
assert px_shape == (4, L * 2 * config.token_dim)
assert keys[0] == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" and pt_keys == [
    "prompt_embeddings"
]

print("\nOK: walkthrough 2.6 replayed step by step")

"""Tutorial 00: the two objects SFTTrainer.__init__ receives, a tokenizer and a causal LM.

Walkthrough 2.1 (SFTTrainer.__init__: `model=model`, `processing_class=processing_class`) and the
forward/loss of 2.5 (`outputs = model(**inputs)`, `loss = outputs["loss"]`), on toy sizes.
Run:      python tutorials/00_model_and_tokenizer.py
Runtime:  a few seconds on one CPU core (a little more when transformers is installed).
You should see:
  - a byte-level BPE vocabulary of ~300 tokens whose special tokens are single ids 0, 1, 2;
  - a chat rendered as ChatML and the tokens its assistant mask keeps;
  - a 2-layer model, its parameter count and the shape of every tensor on the way;
  - the loss of an untrained model close to ln(vocab_size), and transformers' numbers beside ours.
"""

# %%
import math
import tempfile

import torch
import torch.nn.functional as F

from nanosft.model import CausalLM, ModelConfig
from nanosft.tokenizer import Tokenizer


def banner(title):
    print(f"\n{'=' * 20} {title} {'=' * 20}")


torch.manual_seed(0)

# %% [markdown]
# ## processing_class: train a tiny tokenizer
# Byte-level BPE: the 256 byte symbols guarantee any text round-trips; merges learned from the
# corpus make frequent words single tokens. Special tokens come first and are never split.

# %%
banner("Walkthrough 2.1 SFTTrainer.__init__: processing_class (the tokenizer)")
corpus = [
    "The cat sat on the mat.",
    "The dog sat on the log.",
    "What is two plus two? Two plus two is four.",
    "What is the capital of France? The capital of France is Paris.",
] * 8
tokenizer = Tokenizer.train(corpus, vocab_size=300)
print(f"vocab size: {len(tokenizer)} (3 special + 256 bytes + {len(tokenizer) - 259} merges)")
print(f"pad_token={tokenizer.pad_token!r} id {tokenizer.pad_token_id}, "
      f"eos_token={tokenizer.eos_token!r} id {tokenizer.eos_token_id}, "
      f"bos_token={tokenizer.bos_token}")
text = "The cat sat on the log.<|im_end|>"
ids = tokenizer.encode(text)
print(f"encode({text!r}) -> {ids}")
print("tokens:", [tokenizer.id_to_token(i) for i in ids])
assert tokenizer.decode(ids) == text and ids[-1] == tokenizer.eos_token_id

# %% [markdown]
# ## The chat template: messages -> one string -> ids
# `apply_chat_template` renders ChatML and tokenizes it with add_special_tokens=False; the
# assistant mask marks the tokens an assistant-only loss trains on.

# %%
banner("chat template: apply_chat_template(messages)")
messages = [
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "Two plus two is four."},
]
rendered = tokenizer.apply_chat_template(messages, tokenize=False)
print("rendered chat:")
print(rendered, end="")
chat = tokenizer.apply_chat_template(messages, return_assistant_tokens_mask=True)
input_ids, assistant_mask = chat["input_ids"], chat["assistant_masks"]
print(f"input_ids ({len(input_ids)} tokens): {input_ids}")
print(f"assistant_masks: {assistant_mask}")
trained_text = tokenizer.decode([i for i, m in zip(input_ids, assistant_mask) if m])
print(f"tokens under the mask decode to: {trained_text!r}")
assert trained_text == "Two plus two is four.<|im_end|>\n"

# %% [markdown]
# ## model: a tiny Llama-family CausalLM
# Same parameter names as transformers' LlamaForCausalLM, so the state dict reads the same.

# %%
banner("Walkthrough 2.1 SFTTrainer.__init__: model (a tiny CausalLM)")
config = ModelConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=128, bos_token_id=None,
                     eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
model = CausalLM(config)
for name, tensor in model.state_dict().items():
    if ".layers.1." not in name:  # layer 1 repeats layer 0
        print(f"  {name:45s} {tuple(tensor.shape)}")
n_params = model.num_parameters()
print(f"parameters: {n_params:,}")
V, C = config.vocab_size, config.hidden_size
L, I = config.num_hidden_layers, config.intermediate_size
kv = config.num_key_value_heads * config.head_dim
per_layer = C * C * 2 + C * kv * 2 + 3 * C * I + 2 * C  # q,o + k,v + gate,up,down + 2 norms
# embeddings + lm_head (untied) + layers + final norm
assert n_params == 2 * V * C + L * per_layer + C

# %% [markdown]
# ## outputs = model(**inputs), loss = outputs["loss"]
# Labels are the input ids with -100 where no loss is wanted (here: outside the assistant mask);
# the model shifts them by one inside the loss.

# %%
banner('Walkthrough 2.5 compute_loss: outputs = model(**inputs); loss = outputs["loss"]')
inputs = {
    "input_ids": torch.tensor([input_ids]),
    "attention_mask": torch.ones(1, len(input_ids), dtype=torch.long),
    "labels": torch.tensor([[i if m else -100 for i, m in zip(input_ids, assistant_mask)]]),
}
for key, value in inputs.items():
    print(f"inputs[{key!r}]: shape {tuple(value.shape)}")
with torch.no_grad():
    outputs = model(**inputs)
print(f"logits shape: {tuple(outputs.logits.shape)}  (B, T, V)")
loss = outputs["loss"]
print(f"loss: {loss.item():.4f}   ln(vocab_size) = {math.log(V):.4f} "
      "(an untrained model guesses uniformly)")
assert outputs.logits.shape == (1, len(input_ids), V)
# The same number by hand: predict token t+1 from position t, average over the labelled targets.
by_hand = F.cross_entropy(outputs.logits[0, :-1], inputs["labels"][0, 1:], ignore_index=-100)
torch.testing.assert_close(loss, by_hand, rtol=1e-6, atol=1e-6)
assert abs(loss.item() - math.log(V)) < 0.1  # initial logits have std ~0.1, so loss ~ ln V

# %% [markdown]
# ## The same folder in transformers
# Save both objects the Hugging Face way and load them with transformers, when it is installed.

# %%
banner("reference: transformers AutoTokenizer / LlamaForCausalLM on the saved folder")
try:
    import transformers
except ImportError:
    transformers = None
    print("reference check skipped: transformers is not installed")
if transformers is not None:
    transformers.utils.logging.disable_progress_bar()  # keep the printout readable
    with tempfile.TemporaryDirectory() as folder:
        tokenizer.save_pretrained(folder)
        model.save_pretrained(folder)
        hf_tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
        hf_model = transformers.LlamaForCausalLM.from_pretrained(folder).eval()
        hf_ids = hf_tokenizer.apply_chat_template(messages, return_dict=False)
        with torch.no_grad():
            hf_loss = hf_model(**inputs).loss
    print(f"chat ids equal: {hf_ids == input_ids}")
    print(f"loss  nanosft {loss.item():.6f}   transformers {hf_loss.item():.6f}")
    assert hf_ids == input_ids
    torch.testing.assert_close(loss, hf_loss, rtol=1e-5, atol=1e-5)
    print("reference check ran: transformers AutoTokenizer + LlamaForCausalLM")

print("\nOK: tokenizer and model agree on ids, shapes and loss")

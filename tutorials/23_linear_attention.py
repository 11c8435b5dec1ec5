"""Tutorial 23: linear attention by hand, from softmax attention to Qwen3.5's gated delta rule.

Four steps on one toy batch (1 head, 8 tokens, head dim 4), each a few lines and each asserted:
softmax attention (what every other family runs: cost grows with T^2, the cache with T); linear
attention (drop the softmax: the same output from a (D, D) state updated once a token); the delta
rule (write only what the state does not yet predict: a key written with beta = 1 reads back its
value exactly); the gated delta rule (decay the state first). The recurrent form (one token at a
time, as generation runs it) equals the chunked form (a chunk at a time, as training runs it),
equals transformers' torch implementation; then Qwen3.5's whole Gated DeltaNet layer in nanosft
equals transformers' on the same weights, and a packed row restarts its state per document.
Run:      python tutorials/23_linear_attention.py
Runtime:  about 6 s on a 2-core CPU, most of it importing transformers.
You should see:
  - "softmax attention", "linear attention", "delta rule", "gated delta rule" banners, each with a
    largest difference of at most 1e-5 between its two forms;
  - the delta rule reading back the value it wrote (error ~1e-6, rounding) where linear
    attention reads back a mixture of every write (error ~1);
  - the chunked form by hand (a triangular solve per chunk) equal to the token loop; nanosft's
    recurrent vs chunked for chunk sizes 2, 4 and 8 (T sequential steps vs T / C), and both
    against transformers' torch_recurrent_gated_delta_rule / torch_chunk_gated_delta_rule;
  - "Qwen3.5 linear_attn layer: nanosft vs transformers" at most 1e-5, then
    "OK: linear attention checked against transformers".
"""

# %%
import tempfile
import warnings

import torch
import torch.nn.functional as F
import transformers
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf_qwen3_5

from nanosft.families.gated_deltanet import (chunk_gated_delta_rule, l2norm,
                                             recurrent_gated_delta_rule)
from nanosft.families.auto import AutoModelForCausalLM

torch.set_num_threads(1)
transformers.utils.logging.disable_progress_bar()
transformers.utils.logging.set_verbosity_error()  # "falling back to the torch implementation"
warnings.filterwarnings("ignore")

T, D = 8, 4
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(T, D, generator=g) for _ in range(3))  # one head: (T, D) each
k = l2norm(k)  # unit keys: what the delta rule (and Qwen3.5) use
causal = torch.ones(T, T, dtype=torch.bool).tril()  # query t sees keys s <= t


def banner(title):
    print(f"\n===== {title} =====")


def report(label, a, b):
    diff = (a - b).abs().max().item()
    print(f"{label}: max difference {diff:.2e}")
    assert diff <= 1e-5, label
    return diff


# %% 1. softmax attention: weights softmax(q k^T), every key kept (a cache growing with T)
banner("softmax attention")
scores = (q @ k.T / D**0.5).masked_fill(~causal, float("-inf"))  # (T, T): T^2 work
o_softmax = scores.softmax(-1) @ v
report("by hand vs F.scaled_dot_product_attention", o_softmax,
       F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True)[0])

# %% 2. linear attention: no softmax, so o_t = q_t^T (sum_s k_s v_s^T) = q_t^T S_t
banner("linear attention")
o_quadratic = ((q @ k.T) * causal) @ v  # the (T, T) form
S = torch.zeros(D, D)  # the whole memory: (D, D), whatever T is
o_linear = []
for t in range(T):
    S = S + torch.outer(k[t], v[t])  # write: add k_t v_t^T
    o_linear.append(q[t] @ S)  # read: q_t^T S
o_linear = torch.stack(o_linear)
report("(Q K^T * causal) V vs the state S updated once a token", o_quadratic, o_linear)
readback = (k[T - 1] @ S - v[T - 1]).abs().max().item()  # S^T k_t: v_t plus every other write
print(f"reading the last key back from S: error {readback:.3f} (the other writes interfere)")

# %% 3. the delta rule: write beta (v_t - S^T k_t): only what S does not predict yet
banner("delta rule")
beta = torch.rand(T, generator=g)
S = torch.zeros(D, D)
o_delta = []
for t in range(T):
    u = beta[t] * (v[t] - k[t] @ S)  # the correction
    S = S + torch.outer(k[t], u)
    o_delta.append(q[t] @ S)
o_delta = torch.stack(o_delta)
S1 = S + torch.outer(k[0], v[0] - k[0] @ S)  # one more write of (k_0, v_0) with beta = 1
exact = (k[0] @ S1 - v[0]).abs().max().item()
print(f"after writing (k_0, v_0) with beta = 1, S^T k_0 - v_0 = {exact:.1e}")
assert exact <= 1e-5
# as a product: S_t = (I - beta k k^T) S_{t-1} + beta k v^T, a Householder-like update
S_prod = torch.zeros(D, D)
for t in range(T):
    S_prod = (torch.eye(D) - beta[t] * torch.outer(k[t], k[t])) @ S_prod \
        + beta[t] * torch.outer(k[t], v[t])
report("correction form vs (I - beta k k^T) S + beta k v^T", S, S_prod)

# %% 4. the gated delta rule: decay the state by a_t = exp(g_t) first (forget), then the delta
banner("gated delta rule")
decay = -torch.rand(T, generator=g)  # g_t <= 0 (log space)
q_scaled = l2norm(q) * D**-0.5  # Qwen3.5 l2-normalizes q as k, then scales it by 1 / sqrt(D)
S = torch.zeros(D, D)
o_gated = []
for t in range(T):
    S = decay[t].exp() * S  # forget a little
    S = S + torch.outer(k[t], beta[t] * (v[t] - k[t] @ S))  # then the delta write
    o_gated.append(q_scaled[t] @ S)
o_gated = torch.stack(o_gated)
# the chunked form by hand, C tokens at a time: inside a chunk the T sequential writes become
# one triangular solve; only the state crosses chunk borders (T / C sequential steps)
C = 4
S = torch.zeros(D, D)
o_chunked = []
for c in range(0, T, C):
    qc, kc, vc, bc = q_scaled[c:c + C], k[c:c + C], v[c:c + C], beta[c:c + C, None]
    G = decay[c:c + C].cumsum(0)  # log decay from the chunk start, (C,)
    gamma = (G[:, None] - G[None, :]).exp() * torch.ones(C, C).tril()  # decay from s to t
    A = (bc * (kc @ kc.T) * gamma).tril(-1)  # how write s < t changes what t must correct
    # the corrections U of all C tokens at once: (I + A) U = beta V - beta e^G K S
    U = torch.linalg.solve_triangular(torch.eye(C) + A, bc * vc - bc * G.exp()[:, None] * kc @ S,
                                      upper=False)
    o_chunked.append(G.exp()[:, None] * qc @ S + (qc @ kc.T * gamma) @ U)  # old state + chunk
    S = G[-1].exp() * S + (kc * (G[-1] - G).exp()[:, None]).T @ U  # the state at the chunk end
report(f"by hand: recurrent ({T} steps) vs chunked ({T // C} steps of {C})", o_gated,
       torch.cat(o_chunked))
# nanosft's forms take (B, T, H, D) (and do the l2 norms and the scale themselves)
args = (q[None, :, None], k[None, :, None], v[None, :, None], decay[None, :, None],
        beta[None, :, None])
o_rec, _ = recurrent_gated_delta_rule(*args)
report("by hand vs nanosft recurrent_gated_delta_rule", o_gated, o_rec[0, :, 0])
want_rec, _ = hf_qwen3_5.torch_recurrent_gated_delta_rule(*args, use_qk_l2norm_in_kernel=True)
report("nanosft recurrent vs transformers torch_recurrent_gated_delta_rule", o_rec, want_rec)
for C in (2, 4, 8):
    o_chunk, _ = chunk_gated_delta_rule(*args, chunk_size=C)
    report(f"chunk_size {C}: {T} sequential steps -> {T // C}; recurrent vs chunked", o_rec,
           o_chunk)
want_chunk, _ = hf_qwen3_5.torch_chunk_gated_delta_rule(*args, chunk_size=4,
                                                        use_qk_l2norm_in_kernel=True)
report("nanosft chunked vs transformers torch_chunk_gated_delta_rule",
       chunk_gated_delta_rule(*args, chunk_size=4)[0], want_chunk)

# %% 5. Qwen3.5's linear_attn layer: conv -> gated delta rule -> gated RMSNorm, whole
banner("Qwen3.5's Gated DeltaNet layer")
config = transformers.Qwen3_5TextConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_key_head_dim=8,
    linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
    layer_types=["linear_attention", "full_attention"])
torch.manual_seed(0)
hf = transformers.AutoModelForCausalLM.from_config(config).eval()
with tempfile.TemporaryDirectory() as folder:
    hf.save_pretrained(folder)
    ours = AutoModelForCausalLM.from_pretrained(folder).eval()
mixer = type(ours.model.layers[0].linear_attn).__name__
print("layer types:", ours.config.layer_types, "-> layer 0 runs", mixer)
x = torch.randn(2, 12, 32, generator=g)
with torch.no_grad():
    want = hf.model.layers[0].linear_attn(x)
    got, (conv_state, state) = ours.model.layers[0].linear_attn(x)
print(f"cache after 12 tokens: conv window {tuple(conv_state.shape)}, state {tuple(state.shape)}")
report("Qwen3.5 linear_attn layer: nanosft vs transformers", got, want)
ids = torch.randint(3, 64, (1, 10), generator=g)
with torch.no_grad():  # a packed row of two documents: the state restarts where positions do
    packed = ours(ids, position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5]])).logits
    alone = torch.cat([hf(ids[:, :4]).logits, hf(ids[:, 4:]).logits], dim=1)
report("packed row of 4 + 6 tokens vs each document alone (transformers)", packed, alone)
print("\nOK: linear attention checked against transformers")

"""Tutorial 22: mixture of experts, one batch through a tiny Qwen3-MoE by hand.

An MoE layer replaces the MLP by E expert MLPs and a router that sends each token to k of them.
A tiny random Qwen3-MoE (4 experts, top 2, hidden 64) is built with transformers' config class,
saved, and loaded back with nanosft's `AutoModelForCausalLM.from_pretrained`. One 6-token batch
then goes through layer 0's MoE block by hand: the router's probabilities, the top-k choice and its
renormalised weights, which tokens each expert gets, the weighted combine, the load-balancing
auxiliary loss over both layers, and LoRA on one expert (peft's target_parameters layout). Every
step is asserted against the tensors transformers computes inside its forward and against
nanosft's (nanosft.families.moe, nanosft.expert_lora).
Run:      python tutorials/22_mixture_of_experts.py
Runtime:  about 10 s on a 2-core CPU, most of it importing transformers and peft.
You should see:
  - a table of router probabilities per token, the two experts each token picks and their
    weights, with "by hand vs transformers ..., vs nanosft ..." lines at most 1e-5;
  - "expert e gets tokens [...]" for each expert, and the combined output's differences;
  - the auxiliary loss as E * sum_e f_e * P_e beside transformers' and nanosft's aux_loss;
  - one expert's LoRA delta rebuilt from peft's lora_A / lora_B rows and columns, and
    "OK: one MoE batch checked against transformers and peft".
"""

# %%
import tempfile
import warnings

import peft
import torch
import torch.nn.functional as F
import transformers

from nanosft.families.auto import AutoModelForCausalLM
from nanosft.peft import LoraConfig, get_peft_model

torch.set_num_threads(1)
transformers.utils.logging.disable_progress_bar()
warnings.filterwarnings("ignore")  # peft's notes on the rank pattern it adds for gate_up_proj

E, K, C, I = 4, 2, 64, 32  # experts, top-k, hidden size, each expert's intermediate size
X = torch.tensor([[5, 17, 42, 7, 99, 23]])  # (B, T) = (1, 6): six tokens to route
config = transformers.Qwen3MoeConfig(
    vocab_size=128, hidden_size=C, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=E,
    num_experts_per_tok=K, moe_intermediate_size=I, norm_topk_prob=True, pad_token_id=0)
torch.manual_seed(0)
hf = transformers.AutoModelForCausalLM.from_config(config).eval()
folder = tempfile.mkdtemp()
hf.save_pretrained(folder)
ours = AutoModelForCausalLM.from_pretrained(folder).eval()
print(f"transformers {type(hf).__name__} -> nanosft {type(ours).__name__}")


def check(label, mine, theirs, nanosft):
    a, b = (mine - theirs).abs().max().item(), (mine - nanosft).abs().max().item()
    print(f"{label}: by hand vs transformers {a:.2e}, vs nanosft {b:.2e}")
    assert a <= 1e-5 and b <= 1e-5, label


def capture(model):
    """Layer 0's MoE block: its input x (N, C), router outputs and block output (N, C)."""
    seen = {}
    block = model.model.layers[0].mlp
    hooks = [block.register_forward_hook(
                 lambda m, args, out: seen.update(x=args[0].reshape(-1, C), y=out.reshape(-1, C))),
             block.gate.register_forward_hook(lambda m, args, out: seen.update(router=out))]
    with torch.no_grad():
        seen["out"] = model(X, output_router_logits=True)
    for h in hooks:
        h.remove()
    return seen


theirs, mine = capture(hf), capture(ours)
x = theirs["x"]  # (N, C) = (6, 64): the normed hidden states entering the MoE block

# %% [markdown]
# ## 1. The router: logits -> softmax over E -> top k -> renormalise
# %%
print("\n== router ==")
W_gate = ours.model.layers[0].mlp.gate.weight  # (E, C)
logits = x @ W_gate.T  # (N, E)
probs = logits.softmax(-1)
top_p, top_e = probs.topk(K, dim=-1)  # (N, K): the k largest probabilities and their experts
weights = top_p / top_p.sum(-1, keepdim=True)  # norm_topk_prob: each token's k weights sum to 1
print("token  " + "  ".join(f"p(e{e})" for e in range(E)) + "   experts  weights")
for n in range(len(x)):
    row = "  ".join(f"{p:.3f}" for p in probs[n].tolist())
    print(f"{X[0, n].item():>5}  {row}   {top_e[n].tolist()}   "
          f"{[round(w, 3) for w in weights[n].tolist()]}")
check("router logits", logits, theirs["router"][0], mine["router"][0])
check("top-k weights", weights, theirs["router"][1], mine["router"][1])
assert torch.equal(top_e, theirs["router"][2]) and torch.equal(top_e, mine["router"][2])
print(f"each token's weights sum to 1: {torch.allclose(weights.sum(-1), torch.ones(len(x)))}; "
      f"without renormalising they sum to {[round(s, 3) for s in top_p.sum(-1).tolist()]}")

# %% [markdown]
# ## 2. Dispatch: which tokens each expert gets; 3. combine: sum of k weighted expert outputs
# %%
print("\n== dispatch and combine ==")
experts = ours.model.layers[0].mlp.experts  # gate_up_proj (E, 2 I, C), down_proj (E, C, I)
print(f"gate_up_proj {tuple(experts.gate_up_proj.shape)} = (E, 2 x I, C), "
      f"down_proj {tuple(experts.down_proj.shape)} = (E, C, I)")


def expert(e, rows, gate_up, down):
    gate, up = (rows @ gate_up[e].T).chunk(2, dim=-1)  # [gate | up] along the 2 I rows
    return (F.silu(gate) * up) @ down[e].T


y = torch.zeros_like(x)
for e in range(E):
    tokens, slot = torch.where(top_e == e)  # the rows routed to expert e, and which of their k
    print(f"expert {e} gets tokens {X[0, tokens].tolist()} (rows {tokens.tolist()})")
    out = expert(e, x[tokens], experts.gate_up_proj, experts.down_proj)
    y.index_add_(0, tokens, out * weights[tokens, slot, None])  # back into each token's row
check("combined MoE output", y, theirs["y"], mine["y"])

# %% [markdown]
# ## 4. The load-balancing loss: E * sum_e f_e * P_e over every MoE layer's router
# %%
print("\n== auxiliary loss ==")
f = torch.zeros(E)  # how many of each token's k picks went to expert e, summed over layers
P = torch.zeros(E)  # router probability of expert e, summed over tokens and layers
for layer_logits in mine["out"].router_logits:  # one (N, E) per MoE layer
    p = layer_logits.softmax(-1)
    f += F.one_hot(p.topk(K).indices, E).sum((0, 1))
    P += p.sum(0)
rows = len(x) * len(mine["out"].router_logits)
aux = E * ((f / rows) * (P / rows)).sum()
print(f"f_e = {[round(v, 3) for v in (f / rows).tolist()]} (sums to k = {K}), "
      f"P_e = {[round(v, 3) for v in (P / rows).tolist()]}")
print(f"aux_loss = E x sum f_e P_e = {aux.item():.6f}; transformers "
      f"{theirs['out'].aux_loss.item():.6f}, nanosft {mine['out'].aux_loss.item():.6f}; "
      f"perfectly balanced would be k = {K}")
check("aux_loss", aux, theirs["out"].aux_loss, mine["out"].aux_loss)

# %% [markdown]
# ## 5. LoRA on one expert: peft's target_parameters on the 3-D gate_up_proj
# %%
print("\n== LoRA on the experts ==")
lora = {"r": 2, "lora_alpha": 4, "target_modules": "all-linear"}
ref = peft.get_peft_model(hf, peft.LoraConfig(task_type="CAUSAL_LM", **lora))
ours_lora = get_peft_model(ours, LoraConfig(**lora))
converted = ref.peft_config["default"]
print(f"peft rewrote all-linear: target_parameters {sorted(converted.target_parameters)}, "
      f"rank_pattern {converted.rank_pattern}")
g = torch.Generator().manual_seed(1)
theirs_params = dict(ref.named_parameters())
with torch.no_grad():  # the same random adapters (B non-zero) on both sides
    for name, p in ours_lora.named_parameters():
        if "lora_" in name:
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            theirs_params[name].copy_(p)
down_wrapper = ours_lora.base_model.model.model.layers[0].mlp.experts  # wraps down_proj ...
wrapper = down_wrapper.base_layer  # ... around gate_up_proj's wrapper, around the Experts
A, B = wrapper.lora_A["default"].weight, wrapper.lora_B["default"].weight
r, s = wrapper.r["default"], wrapper.scaling["default"]
print(f"gate_up_proj: rank {r} per expert (2 x 2: gate and up fused), lora_A {tuple(A.shape)} = "
      f"(r x E, C), lora_B {tuple(B.shape)} = (2 I, r x E), scaling {s}")
e = 1
A_e = A[e * r:(e + 1) * r]  # expert e's rows of A
B_e = B[:, [i * E + e for i in range(r)]]  # its columns of B: r_i x E + e
delta = s * B_e @ A_e  # (2 I, C), added to gate_up_proj[e] during the forward
lhs, rhs, _ = wrapper.get_delta_factors("default")  # every expert's B_e, A_e at once
print(f"expert {e}: A rows {e * r}..{(e + 1) * r - 1}, B columns "
      f"{[i * E + e for i in range(r)]}; |delta| max {delta.abs().max().item():.4f}, "
      f"== nanosft's factors: {torch.allclose(delta, s * lhs[e] @ rhs[e])}")
assert torch.allclose(delta, s * lhs[e] @ rhs[e])
theirs_lora, mine_lora = capture(ref.base_model.model), capture(ours_lora.base_model.model)
gate_up = (experts.gate_up_proj + s * lhs @ rhs).detach()
lhs, rhs, s_down = down_wrapper.get_delta_factors("default")
down = (experts.down_proj + s_down * lhs @ rhs).detach()  # down_proj has its LoRA too
x_lora, (_, w_lora, e_lora) = mine_lora["x"], mine_lora["router"]  # the router has one too
assert torch.equal(e_lora, theirs_lora["router"][2])
y_lora = torch.zeros_like(x_lora)
for expert_id in range(E):
    tokens, slot = torch.where(e_lora == expert_id)
    out = expert(expert_id, x_lora[tokens], gate_up, down)
    y_lora.index_add_(0, tokens, out * w_lora[tokens, slot, None])
check("MoE output with LoRA'd experts", y_lora, theirs_lora["y"], mine_lora["y"])
diff = (mine_lora["out"].logits - theirs_lora["out"].logits).abs().max().item()
print(f"the same adapter weights in peft: max |logits - peft| = {diff:.2e}")
assert diff <= 1e-5
print("\nOK: one MoE batch checked against transformers and peft")

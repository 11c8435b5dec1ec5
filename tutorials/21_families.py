"""Tutorial 21: model families, what changes from Llama (Llama, Qwen3, Gemma 3, Phi-3).

nanosft.model is the Llama decoder; nanosft.families changes a few of its lines per family. Four
tiny random models are built with transformers' own config classes, saved, loaded back with
`AutoModelForCausalLM.from_pretrained` (which picks the family from config.json's model_type), and
run on the
same 8-token prompt. Then each difference is rebuilt by hand beside the Llama line it replaces,
and checked against the tensor transformers computed inside its forward and against nanosft's:
Qwen3's q_norm / k_norm; Gemma 3's embedding scale, (1 + w) RMSNorm, GeGLU, four norms a layer and
sliding-window layers (the mask drawn); Phi-3's fused qkv_proj / gate_up_proj, partial RoPE, and
what LoRA's "all-linear" wraps in it (the same modules as peft).
Run:      python tutorials/21_families.py
Runtime:  about 8 s on a 2-core CPU, most of it importing transformers and peft.
You should see:
  - per family, the class nanosft loaded and the logits' largest difference to transformers (at
    most 1e-5; 0 on a CPU, where both run the same fp32 operations);
  - for each difference a "Llama :" line, the family's line, and "by hand vs transformers ...,
    vs nanosft ..." with both differences at most 1e-5;
  - the sliding-window mask of 8 tokens, window 3, beside the full causal mask;
  - LoRA on Phi-3 wrapping qkv_proj and gate_up_proj whole, as peft does, and
    "OK: four families checked against transformers".
"""

# %%
import copy
import math
import tempfile
import warnings

import peft
import torch
import torch.nn.functional as F
import transformers
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.models.gemma3 import modeling_gemma3 as hf_gemma3
from transformers.models.llama import modeling_llama as hf_llama
from transformers.models.phi3 import modeling_phi3 as hf_phi3

from nanosft.families.auto import AutoModelForCausalLM
from nanosft.families.gemma3 import Gemma3RMSNorm, Gemma3ScaledEmbedding
from nanosft.families.phi3 import apply_partial_rotary
from nanosft.families.sliding_window import sliding_window_mask
from nanosft.masking import build_attention_mask
from nanosft.model import RMSNorm, rotate_half
from nanosft.peft import LoraConfig, find_target_modules, get_peft_model

torch.set_num_threads(1)
transformers.utils.logging.disable_progress_bar()  # "Writing model shards" on every save
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")  # peft on transformers

PROMPT = torch.tensor([[1, 17, 42, 7, 99, 23, 64, 5]])  # (B, T) = (1, 8), the same for all four
WINDOW = 3  # Gemma 3's sliding window here: short enough to see in an 8-token mask
TINY = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 64, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
FAMILIES = {  # model_type: transformers config, only what differs from the shared TINY
    "llama": transformers.LlamaConfig(**TINY),
    "qwen3": transformers.Qwen3Config(**TINY),
    # query_pre_attn_scalar 24: the attention scale is not head_dim ** -0.5 = 16 ** -0.5
    "gemma3_text": transformers.Gemma3TextConfig(**TINY, query_pre_attn_scalar=24,
                                                 sliding_window=WINDOW,
                                                 layer_types=["sliding_attention",
                                                              "full_attention"]),
    "phi3": transformers.Phi3Config(**TINY, partial_rotary_factor=0.5),
}
B, T = PROMPT.shape
C, H, KV, D = (TINY[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                 "head_dim"))


def banner(title):
    print(f"\n{'=' * 20} {title} {'=' * 20}")


def beside(family, llama_line, family_line):
    """The Llama line and the family's line that replaces it, one above the other."""
    print(f"  {'Llama':<6}: {llama_line}\n  {family:<6}: {family_line}")


def check(label, by_hand, hf_tensor, our_tensor, atol=1e-5):
    """Print and assert: a hand computation equals transformers' tensor and nanosft's."""
    d_theirs = (by_hand - hf_tensor).abs().max().item()
    d_ours = (by_hand - our_tensor).abs().max().item()
    print(f"{label}: by hand vs transformers {d_theirs:.1e}, vs nanosft {d_ours:.1e}")
    torch.testing.assert_close(hf_tensor, by_hand, rtol=0, atol=atol)
    torch.testing.assert_close(our_tensor, by_hand, rtol=0, atol=atol)


def rms_normalize(x, eps):
    """x / rms(x) over the last dim: the step every RMSNorm here shares (the weight differs)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def forward_recording(model, names):
    """Run PROMPT through `model`; per named submodule, what it got and gave in that forward:
    {name: (positional inputs, keyword inputs, output)}. The names are the checkpoint names, the
    same in transformers and in nanosft."""
    seen = {}

    def keep(name):
        def hook(module, args, kwargs, output):
            out = output[0] if isinstance(output, tuple) else output  # attention: (out, extra)
            seen[name] = (args, kwargs, out)
        return hook

    handles = [model.get_submodule(n).register_forward_hook(keep(n), with_kwargs=True)
               for n in names]
    with torch.no_grad():
        model(PROMPT)
    for handle in handles:
        handle.remove()
    return seen


def randomize_vectors(model):
    """Norm weights are built as ones (Gemma: zeros): nudge every vector so a mix-up shows."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model


# %% [markdown]
# ## Four families, one prompt
# Each model is made by transformers from its config class (fp32, seed 0), saved as a Hub folder
# would be, and loaded by nanosft's `AutoModelForCausalLM.from_pretrained`: config.json's
# model_type picks the nanosft class (families/auto.py), and the checkpoint keys load with no
# rename.

# %%
banner("Four tiny models, the same prompt")
print(f"prompt ids {PROMPT.tolist()[0]}; every model: hidden {C}, {H} heads x {D}, {KV} kv "
      f"heads, {TINY['num_hidden_layers']} layers, vocab {TINY['vocab_size']}, fp32")
folders = tempfile.TemporaryDirectory()
hf_models, our_models, prompt_logits = {}, {}, {}
for model_type, config in FAMILIES.items():
    torch.manual_seed(0)
    hf = randomize_vectors(transformers.AutoModelForCausalLM.from_config(config)).eval()
    hf.save_pretrained(f"{folders.name}/{model_type}")
    ours = AutoModelForCausalLM.from_pretrained(f"{folders.name}/{model_type}").eval()
    with torch.no_grad():
        want, got = hf(PROMPT).logits, ours(PROMPT).logits  # (B, T, V)
    diff = (got - want).abs().max().item()
    next_ids = (want[0, -1].argmax().item(), got[0, -1].argmax().item())
    print(f"{model_type:<12} {type(hf).__name__:<17} -> nanosft {type(ours).__name__:<17} "
          f"next token {next_ids[0]} / {next_ids[1]}   max |logits - transformers| = {diff:.3e}")
    assert sorted(ours.state_dict()) == sorted(hf.state_dict())  # the same names, no rename map
    assert diff <= 1e-5 and next_ids[0] == next_ids[1]
    hf_models[model_type], our_models[model_type] = hf, ours
    prompt_logits[model_type] = want

# %% [markdown]
# ## Qwen3: an RMSNorm on each head's query and key, before RoPE
# `q_norm` and `k_norm` each hold one weight of head_dim values, shared by all heads. They keep
# q . k from growing with the weights (the logits of the softmax stay in range).

# %%
banner("Qwen3: q_norm and k_norm before RoPE")
beside("Qwen3", "q = q_proj(x).view(B, T, H, D)", "q = q_norm(q_proj(x).view(B, T, H, D))")
beside("Qwen3", "k = k_proj(x).view(B, T, KV, D)", "k = k_norm(k_proj(x).view(B, T, KV, D))")
hf, ours = hf_models["qwen3"], our_models["qwen3"]
attn = "model.layers.0.self_attn"
names = [f"{attn}.{n}" for n in ("q_proj", "k_proj", "q_norm", "k_norm")]
theirs = forward_recording(hf, names)
mine = forward_recording(ours, names)
eps = hf.config.rms_norm_eps
for qk in ("q", "k"):
    projected = theirs[f"{attn}.{qk}_proj"][2].view(B, T, -1, D)  # (B, T, H or KV, D)
    weight = hf.get_submodule(f"{attn}.{qk}_norm").weight  # (D,): one weight for every head
    by_hand = rms_normalize(projected, eps) * weight  # Qwen3 norms over D, head by head
    check(f"{qk}_norm over {projected.shape[2]} heads x {D}", by_hand,
          theirs[f"{attn}.{qk}_norm"][2], mine[f"{attn}.{qk}_norm"][2])
q = theirs[f"{attn}.q_proj"][2].view(B, T, H, D)
normed = theirs[f"{attn}.q_norm"][2] / hf.get_submodule(f"{attn}.q_norm").weight
rms_before, rms_after = q[0, 3, 0].pow(2).mean().sqrt(), normed[0, 3, 0].pow(2).mean().sqrt()
print(f"token 3, head 0: rms(q) = {rms_before:.3f} -> rms(q_norm(q) / q_norm.weight) = "
      f"{rms_after:.3f}")
assert abs(rms_after - 1) < 1e-4

# %% [markdown]
# ## Gemma 3: embeddings times sqrt(hidden_size), in the compute dtype
# The scale is cast to the embedding's dtype before the multiply: in bf16, sqrt(C) is rounded
# first, and transformers multiplies by the rounded value.

# %%
banner("Gemma 3: embeddings scaled by sqrt(hidden_size)")
beside("Gemma", "h = embed_tokens(input_ids)",
       "h = embed_tokens(input_ids) * torch.tensor(sqrt(C)).to(dtype)")
hf, ours = hf_models["gemma3_text"], our_models["gemma3_text"]
layer = "model.layers.0"
names = ["model.embed_tokens", f"{layer}.input_layernorm", f"{layer}.self_attn", f"{layer}.mlp",
         layer]
theirs = forward_recording(hf, names)
mine = forward_recording(ours, names)
table = hf.model.embed_tokens.weight  # (V, C)
check(f"embeddings x sqrt({C}) = x {math.sqrt(C):g}",
      table[PROMPT] * torch.tensor(math.sqrt(C)).to(table.dtype),
      theirs["model.embed_tokens"][2], mine["model.embed_tokens"][2])
# Gemma 3 1B's width, 1152: sqrt(1152) is not a bf16 number
wide = 1152
scale = torch.tensor(math.sqrt(wide))
print(f"sqrt({wide}) = {scale.item():.4f} -> bfloat16 {scale.to(torch.bfloat16).item():.4f}, "
      "the factor a bf16 Gemma 3 1B multiplies by")
torch.manual_seed(0)
their_embed = hf_gemma3.Gemma3TextScaledWordEmbedding(4, wide, 0, embed_scale=math.sqrt(wide))
our_embed = Gemma3ScaledEmbedding(4, wide, padding_idx=0)
our_embed.load_state_dict(their_embed.state_dict())
their_embed, our_embed = their_embed.to(torch.bfloat16), our_embed.to(torch.bfloat16)
ids = torch.tensor([[1, 2, 3]])
by_hand = their_embed.weight[ids] * scale.to(torch.bfloat16)
unrounded = (their_embed.weight[ids].float() * scale).to(torch.bfloat16)  # scale kept in fp32
print(f"bf16 embeddings: by hand == transformers: {torch.equal(by_hand, their_embed(ids))}, "
      f"== nanosft: {torch.equal(by_hand, our_embed(ids))}; with the fp32 scale "
      f"{(unrounded != by_hand).sum().item()} of {by_hand.numel()} values would differ")
assert torch.equal(by_hand, their_embed(ids)) and torch.equal(by_hand, our_embed(ids))
assert (unrounded != by_hand).any()

# %% [markdown]
# ## Gemma 3: RMSNorm times (1 + w)
# Gemma stores each norm weight as an offset from 1 (built as zeros): the same function as Llama's
# at initialisation, a different one on a checkpoint's weights. It also multiplies in fp32 and
# casts last (Llama casts, then multiplies).

# %%
banner("Gemma 3: RMSNorm times (1 + w)")
beside("Gemma", "y = w * (x / rms(x)).to(dtype)          # w built as ones",
       "y = ((1 + w) * (x / rms(x))).to(dtype)  # w built as zeros")
(h,), _, out = theirs[f"{layer}.input_layernorm"]
w = hf.get_submodule(f"{layer}.input_layernorm").weight  # (C,), around 0
eps = hf.config.rms_norm_eps
check("input_layernorm (1 + w)", rms_normalize(h, eps) * (1 + w), out,
      mine[f"{layer}.input_layernorm"][2])
llama_line = rms_normalize(h, eps) * w  # Llama's line on Gemma's stored weights
print(f"rms of the output: Gemma's line {out.pow(2).mean().sqrt():.3f}, Llama's line on the "
      f"same weights {llama_line.pow(2).mean().sqrt():.3f} (w is stored around 0)")
assert (llama_line - out).abs().max() > 0.1
fresh_gemma, fresh_llama = hf_gemma3.Gemma3RMSNorm(C, eps), hf_llama.LlamaRMSNorm(C, eps)
with torch.no_grad():
    same = [torch.equal(fresh_gemma(h), fresh_llama(h)),
            torch.equal(Gemma3RMSNorm(C, eps)(h), RMSNorm(C, eps)(h))]
print(f"fresh norms (w = 0 vs w = 1) agree: transformers {same[0]}, nanosft {same[1]}")
assert all(same)
# in bf16 the order shows: Gemma multiplies in fp32 and rounds once; Llama rounds, then multiplies
name = f"{layer}.input_layernorm"
their_norm = copy.deepcopy(hf.get_submodule(name)).to(torch.bfloat16)
our_norm = copy.deepcopy(ours.get_submodule(name)).to(torch.bfloat16)
h16, w16 = h.to(torch.bfloat16), their_norm.weight
with torch.no_grad():
    by_hand = (rms_normalize(h16.float(), eps) * (1 + w16.float())).to(torch.bfloat16)
    llama_order = (1 + w16) * rms_normalize(h16.float(), eps).to(torch.bfloat16)
    same = [torch.equal(by_hand, their_norm(h16)), torch.equal(by_hand, our_norm(h16))]
print(f"bf16 (1 + w) norm: by hand == transformers: {same[0]}, == nanosft: {same[1]}; rounded "
      f"before the multiply {(llama_order != by_hand).sum().item()} of {by_hand.numel()} differ")
assert all(same) and (llama_order != by_hand).any()

# %% [markdown]
# ## Gemma 3: GeGLU, four norms a layer, the attention scale
# The MLP's gate goes through gelu (tanh approximation) instead of silu. Each sublayer's output is
# normed before it joins the residual stream, so a layer has four norms; Gemma's
# `post_attention_layernorm` norms the attention output (Llama's norms the MLP input).

# %%
banner("Gemma 3: GeGLU, four norms a layer, query_pre_attn_scalar")
beside("Gemma", "mlp(x) = down_proj(silu(gate_proj(x)) * up_proj(x))",
       "mlp(x) = down_proj(gelu_tanh(gate_proj(x)) * up_proj(x))")
(x,), _, out = theirs[f"{layer}.mlp"]
mlp = hf.get_submodule(f"{layer}.mlp")
gate, up = F.linear(x, mlp.gate_proj.weight), F.linear(x, mlp.up_proj.weight)  # (B, T, I)
geglu = F.linear(F.gelu(gate, approximate="tanh") * up, mlp.down_proj.weight)
check("GeGLU mlp", geglu, out, mine[f"{layer}.mlp"][2])
swiglu = F.linear(F.silu(gate) * up, mlp.down_proj.weight)
print(f"the same weights through SwiGLU: max difference {(swiglu - out).abs().max():.4f} "
      f"(outputs up to {out.abs().max():.4f})")
assert (swiglu - out).abs().max() > 1e-3
beside("Gemma", "h = h + attn(input_layernorm(h))",
       "h = h + post_attention_layernorm(attn(input_layernorm(h)))")
beside("Gemma", "h = h + mlp(post_attention_layernorm(h))",
       "h = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))")
block = hf.get_submodule(layer)
h0, a = theirs[layer][0][0], theirs[f"{layer}.self_attn"][2]  # layer input, attention output
with torch.no_grad():
    h1 = h0 + block.post_attention_layernorm(a)
    by_hand = h1 + block.post_feedforward_layernorm(block.mlp(block.pre_feedforward_layernorm(h1)))
    llama_wiring = h0 + a + block.mlp(block.post_attention_layernorm(h0 + a))
check("layer 0 output, four norms", by_hand, theirs[layer][2], mine[layer][2])
print(f"Llama's two-norm wiring on the same modules: max difference "
      f"{(llama_wiring - theirs[layer][2]).abs().max():.3f}")
assert (llama_wiring - theirs[layer][2]).abs().max() > 1e-3
scalar = hf.config.query_pre_attn_scalar
beside("Gemma", f"scaling = head_dim ** -0.5 = {D ** -0.5:.4f}",
       f"scaling = query_pre_attn_scalar ** -0.5 = {scalar} ** -0.5 = {scalar ** -0.5:.4f}")
their_scaling = block.self_attn.scaling
our_scaling = ours.get_submodule(layer).self_attn.scaling
print(f"scaling: transformers {their_scaling:.4f}, nanosft {our_scaling:.4f}")
assert their_scaling == our_scaling == scalar**-0.5

# %% [markdown]
# ## Gemma 3: sliding-window layers
# `layer_types` says which layers see every earlier key ("full_attention") and which only the
# last `sliding_window` ("sliding_attention"): key j is seen by query i when i - window < j <= i.
# transformers builds that mask once per forward; nanosft's sliding layers narrow their mask in
# `attend` with `sliding_window_mask`. Both hand a full layer no mask at all: SDPA's is_causal.

# %%
banner(f"Gemma 3: sliding window {WINDOW} beside full attention, {T} tokens")
beside("Gemma", "every layer: causal, key j <= query i",
       f"sliding layers: i - {WINDOW} < j <= i")
rope_bases = {t: p["rope_theta"] for t, p in ours.config.rope_parameters.items()}
print(f"layer_types {ours.config.layer_types}; RoPE base per layer type {rope_bases}")
assert ours.config.layer_types == hf.config.layer_types
assert rope_bases == {t: p["rope_theta"] for t, p in hf.config.rope_parameters.items()}
assert [block.self_attn.sliding_window for block in ours.model.layers] == [WINDOW, None]
query, key = torch.arange(T)[:, None], torch.arange(T)[None, :]
causal = key <= query  # (T, T)
windowed = causal & (key > query - WINDOW)
print(f"query  {'full_attention':<{2 * T}} sliding_attention (window {WINDOW})")
for i in range(T):
    row_full = " ".join("x" if seen else "." for seen in causal[i].tolist())
    row_window = " ".join("x" if seen else "." for seen in windowed[i].tolist())
    print(f"{i:>5}  {row_full}  {row_window}")
embeds = hf.model.embed_tokens(PROMPT)
positions = torch.arange(T)[None]
theirs_full = create_causal_mask(hf.config, embeds, None, None, positions,
                                 allow_is_causal_skip=False)[0, 0]
theirs_window = create_sliding_window_causal_mask(hf.config, embeds, None, None, positions,
                                                  allow_is_causal_skip=False)[0, 0]
ours_window = sliding_window_mask(None, T, 0, WINDOW, "cpu")[0, 0]  # what `attend` builds
print(f"drawn masks == transformers' masks: full {torch.equal(causal, theirs_full)}, sliding "
      f"{torch.equal(windowed, theirs_window)}; == nanosft's sliding_window_mask: "
      f"{torch.equal(windowed, ours_window)}")
assert torch.equal(causal, theirs_full) and torch.equal(windowed, theirs_window)
assert torch.equal(windowed, ours_window)
# the masks each library handed layer 0 (sliding) and layer 1 (full) in the prompt's forward
decoder_layers = ["model.layers.0", "model.layers.1"]
their_masks = forward_recording(hf, decoder_layers)
handed = [their_masks[n][1]["attention_mask"] for n in decoder_layers]
assert torch.equal(handed[0][0, 0], windowed) and handed[1] is None
our_masks = forward_recording(ours, decoder_layers)  # a layer's args: (h, cos, sin, mask, past)
assert [our_masks[n][0][3] for n in decoder_layers] == [None, None]
assert build_attention_mask(None, positions, T, 0) is None  # plain causal: SDPA's is_causal
print("in the forward: transformers handed layer 0 the sliding mask, layer 1 None (is_causal); "
      "nanosft hands both None, and layer 0 narrows it")
window_attention = ours.model.layers[0].self_attn
window_attention.sliding_window = None  # negative control: layer 0 sees every key
with torch.no_grad():
    no_window = (ours(PROMPT).logits - hf(PROMPT).logits).abs().amax(-1)[0]  # (T,)
window_attention.sliding_window = WINDOW
print(f"without the window: max logit difference per position {no_window.numpy().round(4)}")
assert no_window[:WINDOW].max() < 1e-5 and no_window[WINDOW:].min() > 1e-4

# %% [markdown]
# ## Phi-3: fused qkv_proj and gate_up_proj
# Phi-3 stores q_proj, k_proj and v_proj as one linear (its rows stacked [q | k | v]), and
# gate_proj, up_proj as one [gate | up]: one matmul each, split after it.

# %%
banner("Phi-3: fused projections")
hf, ours = hf_models["phi3"], our_models["phi3"]
attn, mlp_name = "model.layers.0.self_attn", "model.layers.0.mlp"
names = [f"{attn}.qkv_proj", attn, mlp_name]
theirs = forward_recording(hf, names)
mine = forward_recording(ours, names)
qkv_weight = hf.get_submodule(f"{attn}.qkv_proj").weight  # ((H + 2 KV) D, C)
print(f"qkv_proj.weight {tuple(qkv_weight.shape)} = ((H + 2 KV) x D, C) = (({H} + 2 x {KV}) x "
      f"{D}, {C}), split into q {H * D}, k {KV * D}, v {KV * D}")
beside("Phi-3", "q, k, v = q_proj(x), k_proj(x), v_proj(x)",
       "q, k, v = qkv_proj(x).split((H * D, KV * D, KV * D), dim=-1)")
(x,), _, qkv = theirs[f"{attn}.qkv_proj"]
q, k, v = qkv.split((H * D, KV * D, KV * D), dim=-1)
q_proj_weight = qkv_weight[:H * D]  # the q_proj a Llama checkpoint would store
print(f"q from the split == a q_proj holding the first {H * D} rows: "
      f"{torch.allclose(q, F.linear(x, q_proj_weight), rtol=0, atol=1e-6)}")
assert torch.allclose(q, F.linear(x, q_proj_weight), rtol=0, atol=1e-6)
gate_up_weight = hf.get_submodule(f"{mlp_name}.gate_up_proj").weight  # (2 I, C)
I = TINY["intermediate_size"]
print(f"gate_up_proj.weight {tuple(gate_up_weight.shape)} = (2 x I, C): gate {I}, up {I}")
beside("Phi-3", "gate, up = gate_proj(x), up_proj(x)",
       "gate, up = gate_up_proj(x).chunk(2, dim=-1)")
(m_in,), _, m_out = theirs[mlp_name]
gate, up = F.linear(m_in, gate_up_weight).chunk(2, dim=-1)  # (B, T, I) each
down_weight = hf.get_submodule(f"{mlp_name}.down_proj").weight
check("fused SwiGLU mlp", F.linear(F.silu(gate) * up, down_weight), m_out, mine[mlp_name][2])

# %% [markdown]
# ## Phi-3: partial RoPE
# Only the first rotary_dim = head_dim x partial_rotary_factor dims of each head are turned; the
# rest pass through unchanged, so cos and sin are rotary_dim wide.

# %%
banner("Phi-3: partial RoPE")
factor = hf.config.rope_parameters["partial_rotary_factor"]
rotary_dim = int(D * factor)
print(f"rotary_dim = head_dim x partial_rotary_factor = {D} x {factor} = {rotary_dim}")
beside("Phi-3", "q = q * cos + rotate_half(q) * sin                  # all D dims",
       f"q = cat(q[..., :{rotary_dim}] * cos + rotate_half(q[..., :{rotary_dim}]) * sin, "
       f"q[..., {rotary_dim}:])")
theta = hf.config.rope_parameters["rope_theta"]
inv_freq = 1.0 / theta ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)  # (rotary_dim/2,)
angles = positions[..., None].float() * inv_freq  # (1, T, rotary_dim / 2)
cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
their_cos, their_sin = hf.model.rotary_emb(x, positions)  # (1, T, rotary_dim)
our_cos, our_sin = ours.model.rotary(positions, x.dtype)  # (1, 1, T, rotary_dim)
check(f"cos, sin ({rotary_dim} wide)", torch.cat((cos, sin)), torch.cat((their_cos, their_sin)),
      torch.cat((our_cos[:, 0], our_sin[:, 0])))
q = q.view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
k = k.view(B, T, KV, D).transpose(1, 2)  # (B, KV, T, D)
v = v.view(B, T, KV, D).transpose(1, 2)


def partial_rope(t):
    """RoPE on the first rotary_dim dims of t (B, heads, T, D); the rest pass."""
    turned, passed = t[..., :rotary_dim], t[..., rotary_dim:]
    return torch.cat((turned * cos[:, None] + rotate_half(turned) * sin[:, None], passed), -1)


q_rot, k_rot = partial_rope(q), partial_rope(k)
their_q, their_k = hf_phi3.apply_rotary_pos_emb(q, k, their_cos, their_sin)
check("partial RoPE on q and k", torch.cat((q_rot, k_rot), 1), torch.cat((their_q, their_k), 1),
      torch.cat((apply_partial_rotary(q, our_cos, our_sin),
                 apply_partial_rotary(k, our_cos, our_sin)), 1))
kept = torch.equal(q_rot[..., rotary_dim:], q[..., rotary_dim:])
moved = bool((q_rot[..., 1:, :rotary_dim] != q[..., 1:, :rotary_dim]).any(-1).all())
print(f"dims {rotary_dim}..{D - 1} pass through unchanged: {kept}; dims 0..{rotary_dim - 1} "
      f"turned at every position > 0: {moved}")
assert kept and moved
# the whole attention by hand from the fused output: causal softmax, kv heads shared by H / KV
scores = q_rot @ k_rot.repeat_interleave(H // KV, 1).transpose(-1, -2) * D**-0.5  # (B, H, T, T)
weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)  # causal: the mask drawn above
y = (weights @ v.repeat_interleave(H // KV, 1)).transpose(1, 2).reshape(B, T, H * D)
o_proj_weight = hf.get_submodule(f"{attn}.o_proj").weight
check("attention output from qkv_proj", F.linear(y, o_proj_weight), theirs[attn][2],
      mine[attn][2])

# %% [markdown]
# ## Phi-3: what LoRA targets in fused projections
# target_modules names modules, and Phi-3 has no q_proj or v_proj: the usual Llama recipe finds
# nothing. "all-linear" wraps qkv_proj and gate_up_proj whole, one adapter each, so q, k and v
# share one lora_A (and one rank) where Llama's all-linear puts a separate adapter on each.

# %%
banner("Phi-3: LoRA on qkv_proj and gate_up_proj")
r, lora_alpha = 2, 4
llama_targets = find_target_modules(our_models["llama"],
                                    LoraConfig(r=r, target_modules="all-linear"))
print(f"Llama all-linear, layer 0: {[n.rsplit('.', 1)[1] for n in llama_targets if '.0.' in n]}")
try:
    get_peft_model(ours, LoraConfig(r=r, target_modules=["q_proj", "v_proj"]))
except ValueError as err:
    print(f'target_modules=["q_proj", "v_proj"] on Phi-3, nanosft: ValueError: {err}')
else:
    raise AssertionError("q_proj, v_proj matched a module of Phi-3")
try:
    peft.get_peft_model(hf, peft.LoraConfig(r=r, target_modules=["q_proj", "v_proj"]))
except ValueError as err:  # peft's NoMatchingPeftModuleError is a ValueError
    print(f"  and peft: {type(err).__name__}")
    assert "not found" in str(err)
else:
    raise AssertionError("peft found q_proj, v_proj in Phi-3")
config = {"r": r, "lora_alpha": lora_alpha, "target_modules": "all-linear"}
ours_lora = get_peft_model(ours, LoraConfig(**config))
their_lora = peft.get_peft_model(hf, peft.LoraConfig(task_type="CAUSAL_LM", **config))
ours_wrapped = [n for n, m in ours_lora.named_modules() if hasattr(m, "lora_A")]
their_wrapped = [n for n, m in their_lora.named_modules() if hasattr(m, "lora_A")]
print(f"Phi-3 all-linear, layer 0: {[n.rsplit('.', 1)[1] for n in ours_wrapped if '.0.' in n]}")
print(f"wrapped modules: nanosft {len(ours_wrapped)}, peft {len(their_wrapped)}, the same names: "
      f"{ours_wrapped == their_wrapped}")
assert ours_wrapped == their_wrapped
qkv_lora = ours_lora.get_submodule(f"base_model.model.{attn}.qkv_proj")
lora_A, lora_B = qkv_lora.lora_A["default"].weight, qkv_lora.lora_B["default"].weight
fused = lora_A.numel() + lora_B.numel()
separate = sum(r * (C + out) for out in (H * D, KV * D, KV * D))
print(f"qkv_proj's adapter: lora_A {tuple(lora_A.shape)}, lora_B {tuple(lora_B.shape)}: "
      f"{fused} parameters (q, k, v as three adapters of rank {r}: {separate})")
assert lora_B.shape == (qkv_weight.shape[0], r) and fused == r * (C + qkv_weight.shape[0])
torch.manual_seed(1)
with torch.no_grad():  # lora_B starts at zero: give it values so the adapters count
    for name, p in ours_lora.named_parameters():
        if "lora_B" in name:
            p.normal_(std=0.1)
assert sorted(ours_lora.state_dict()) == sorted(their_lora.state_dict())
their_lora.load_state_dict(ours_lora.state_dict())
with torch.no_grad():
    lora_logits = ours_lora(PROMPT).logits
    diff = (lora_logits - their_lora(PROMPT).logits).abs().max().item()
shift = (lora_logits - prompt_logits["phi3"]).abs().max().item()
print(f"the same adapter weights in peft: max |logits - peft| = {diff:.3e} (the adapters moved "
      f"the logits by up to {shift:.3f})")
assert diff <= 1e-5 and shift > 1e-3

folders.cleanup()
print("\nOK: four families checked against transformers")

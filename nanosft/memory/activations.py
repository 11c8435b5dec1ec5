"""What one training step saves for backward, predicted per tensor from the config alone.

Activations, with and without gradient checkpointing. `layer_saved_bytes` walks one decoder layer op
by op (RMSNorm, the LoRA / DoRA / NF4 linears, SDPA, SwiGLU) and names each tensor autograd keeps,
so one saved by several ops counts once; `head_saved_bytes` does the same for the final norm,
lm_head and loss. nanosft.memory sums them into the ledger's activations row.
Paper: activation recomputation 1604.06174.
"""

import torch

from nanosft.fast import attention
from nanosft.memory.plan import (
    DTYPE_BYTES, FFN_NORM_TYPES, FUSED_TYPES, QK_NORM_TYPES, layer_linears, lora_targets,
    nf4_quantizable, parameter_shapes,
)
from nanosft.reference import reference_mode_enabled


class _Saved:
    """Tensors saved for backward, by name, so a tensor saved by several ops is counted once."""

    def __init__(self):
        self.bytes = {}

    def add(self, name, numel, nbytes):
        self.bytes[name] = numel * nbytes


def sdpa_bytes(plan, device_type, q_bytes, s):
    """Bytes per element of what SDPA keeps for backward, and whether it runs through
    nanosft.fast.attention's fp32 kernel (short half-precision CPU rows, training, not in reference
    mode): that path keeps fp32 copies of q, k, v and its fp32 output, and o_proj then reads the
    output cast back to q's dtype, a new tensor. q_bytes: q's element size as it reaches SDPA
    (half: the weights' dtype, or the autocast one); s: SDPA's dtype without the path."""
    if q_bytes != 2 or reference_mode_enabled():
        return s, False
    half = plan.dtype if DTYPE_BYTES[plan.dtype] == 2 else "bfloat16"
    if attention.takes_fp32(getattr(torch, half), plan.max_length, device_type):
        return 4, True
    return s, False


def _norm(saved, tag, N, C, rg, trainable, wd):
    # RMSNorm is recomputed in backward (nanosft.fast.recompute): only its input stays saved
    if rg or trainable:
        saved.add(f"{tag}.input", N * C, wd)
    return rg or trainable


def _layer_norm(saved, tag, N, C, rg, trainable, x_bytes, fp32_copies):
    """A LayerNorm's saves. nn.LayerNorm keeps its input and the (N,) mean and 1 / std;
    Cohere's hand-written one (fp32, no bias) keeps the centred input and 1 / std, and, for its
    weight's gradient, the normalised copy."""
    if not (rg or trainable):
        return False
    if fp32_copies:
        saved.add(f"{tag}.centred", N * C, 4)
        saved.add(f"{tag}.rstd", N, 4)
        if trainable:
            saved.add(f"{tag}.normalized", N * C, 4)
    else:
        saved.add(f"{tag}.input", N * C, x_bytes)
        saved.add(f"{tag}.mean_rstd", 2 * N, 4)
    return True


def _linear(saved, ctx, lin, x_name, x_bytes, in_f, out_f, rg_in):
    """Saves of one (LoRA) linear on input `x_name`; returns whether its output needs grad."""
    N, plan, ad, wd = ctx["N"], ctx["plan"], ctx["ad"], ctx["wd"]
    trains_base, has_lora = plan.full, lin in ctx["targets"]
    float_base = plan.full or not ctx["nf4"].get(lin, False)
    cb = ad or wd  # a float base computes in the autocast dtype, else in its own
    if trains_base:  # weight grad needs the input: the same tensor, or its autocast copy
        if cb == x_bytes:
            saved.add(x_name, N * in_f, x_bytes)
        else:
            saved.add(f"{lin}.input_cast", N * in_f, cb)
    if float_base and ad and ad != wd and (rg_in or trains_base):
        saved.add(f"{lin}.weight_cast", out_f * in_f, ad)  # autocast's copy of the weight
    if has_lora:
        ab = DTYPE_BYTES[plan.adapter_dtype]
        ca = ad or ab
        r = plan.r
        # peft's layer casts x to the adapters' dtype unless CUDA's autocast is on (it asks
        # CUDA's only): DoRA, which no speed path takes, then reads that cast (x's dtype
        # under CUDA autocast), and under CPU autocast lora_A casts it back, a copy of x
        x_dora = x_bytes if ad and ctx["device_type"] != "cpu" else ab
        if ca == x_bytes and not (plan.use_dora and x_dora != x_bytes):
            saved.add(x_name, N * in_f, x_bytes)  # lora_A reads the same input
        else:
            saved.add(f"{lin}.lora_input_cast", N * in_f, ca)  # one cast copy per adapter
        saved.add(f"{lin}.lora_A_out", N * r, ca)
        if ad and ad != DTYPE_BYTES[plan.adapter_dtype]:  # autocast's copies of the adapters:
            # lora_B's for lora_A's output; lora_A's only where its input needs grad
            saved.add(f"{lin}.lora_weight_cast", r * ((in_f if rg_in else 0) + out_f), ad)
        if plan.use_dora:  # m / ||W + s B A|| scales the base and LoRA outputs: the norm (its
            # B A through an identity is detached, so dropped), the (1, out) fp32 scale, and the
            # scale less one for the base output's gradient
            saved.add(f"{lin}.dora_weight_norm", out_f, x_dora)
            saved.add(f"{lin}.dora_scale", out_f, 4)
            if rg_in or trains_base:
                saved.add(f"{lin}.dora_scale_minus_one", out_f, 4)
            rb = cb if float_base else x_bytes  # W x; less its bias (weights' dtype), promoted
            saved.add(f"{lin}.dora_base_result", N * out_f,
                      max(rb, wd) if lin in ctx["biased"] else rb)
            saved.add(f"{lin}.dora_lora_result", N * out_f, ca)
    return rg_in or trains_base or has_lora


def _biased_linears(config):
    """Short names of the decoder layers' linears with a bias."""
    return {name.split(".")[-2] for name, _ in parameter_shapes(config)
            if ".layers." in name and name.endswith(".bias")}


def _sliding_window(config, layer_idx):
    types = getattr(config, "layer_types", None)
    if types and types[layer_idx] == "sliding_attention":
        return config.sliding_window
    return None


def layer_saved_bytes(config, plan, first=False, device_type="cpu", layer_idx=0):
    """Bytes one decoder layer saves for backward, by tensor (shared ones once), no checkpointing.
    Mirrors: autograd's saves in transformers LlamaDecoderLayer (and the families' layers)
    Assumes flash / memory-efficient SDPA (no (T, T) scores), as nanosft's causal batches use: a
    sliding window then saves no bytes of scores, and costs its layer one (T, T) mask."""
    C, I, T = config.hidden_size, config.intermediate_size, plan.max_length
    H, KV, D = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    B = plan.per_device_train_batch_size
    N, wd = B * T, DTYPE_BYTES[plan.dtype]
    ad = 2 if plan.bf16 else None
    fused = config.model_type in FUSED_TYPES  # Phi-3: qkv_proj and gate_up_proj
    in_features = {"o_proj": H * D, "down_proj": I}
    nf4 = {lin: plan.load_in_4bit and nf4_quantizable((0, in_features.get(lin, C)), device_type)
           for lin in layer_linears(config)}
    ctx = {"N": N, "plan": plan, "ad": ad, "wd": wd, "nf4": nf4,
           "targets": lora_targets(config, plan), "device_type": device_type,
           "biased": _biased_linears(config)}

    def out_bytes(lin):  # a float base computes in the autocast dtype; a 4-bit one returns x's
        return (ad or wd) if (plan.full or not nf4[lin]) else wd

    saved = _Saved()
    # the first layer's input needs no grad unless the embedding trains
    rg = plan.full or not first
    n_rg = _norm(saved, "input_layernorm", N, C, rg, plan.full, wd)
    if fused:  # one linear; q, k, v are views of its (N, (H + 2 KV) D) output
        q_rg = k_rg = v_rg = _linear(saved, ctx, "qkv_proj", "normed_1", wd, C, (H + 2 * KV) * D,
                                     n_rg)
    else:
        q_rg, k_rg, v_rg = (_linear(saved, ctx, lin, "normed_1", wd, C, o, n_rg) for lin, o in
                            (("q_proj", H * D), ("k_proj", KV * D), ("v_proj", KV * D)))
    if config.model_type in QK_NORM_TYPES:  # q_norm, k_norm keep their inputs, as RMSNorm does
        _norm(saved, "q_norm", N * H, D, q_rg, plan.full, out_bytes("q_proj"))
        _norm(saved, "k_norm", N * KV, D, k_rg, plan.full, out_bytes("k_proj"))
    attn_rg = q_rg or k_rg or v_rg
    s = ad or wd  # SDPA works in the autocast dtype, else in the stream's
    # the cos / sin tables are shared by every layer: the first whose RoPE products need grad
    # keeps them (the first layer's q or k needs grad only with LoRA on q_proj or k_proj; every
    # later layer's input needs grad once the first layer holds LoRA)
    qk_lora = plan.full or bool({"q_proj", "k_proj", "qkv_proj"} & ctx["targets"])
    if (q_rg or k_rg) and layer_idx == (0 if qk_lora else 1):
        saved.add("rope_cos_sin", 2 * T * D, wd)
    # RoPE's product with the (weights' dtype) tables gives q in the weights' dtype
    sb, fp32 = sdpa_bytes(plan, device_type, wd, s)
    if attn_rg:
        saved.add("sdpa.q", N * H * D, sb)
        saved.add("sdpa.k", N * KV * D, sb)
        # v is not copied on its way to SDPA: with qkv fused, it keeps the whole output alive,
        # unless autocast (or the fp32 path) hands SDPA a copy (a 4-bit base returns float32)
        whole = fused and out_bytes("qkv_proj") == sb
        saved.add("sdpa.v", N * ((H + 2 * KV) if whole else KV) * D, sb)
        saved.add("sdpa.out", N * H * D, sb)
        saved.add("sdpa.logsumexp", B * H * T, 4)
        window = _sliding_window(config, layer_idx)
        if window is not None and T > window:  # full rows: one (1, 1, T, T) mask, in SDPA's dtype
            saved.add("sdpa.window_mask", T * T, sb)
    # SDPA's output is laid out as its q: (B, T, H, D) in memory when q is a transposed view, so
    # o_proj reads it as is; Phi-3's partial RoPE concatenates q (B, H, T, D), and o_proj's
    # (B, T, H * D) input is then a copy
    o_input = "o_proj.input" if fused else "sdpa.out_cast" if fp32 else "sdpa.out"
    o_rg = _linear(saved, ctx, "o_proj", o_input, s, H * D, C, attn_rg)
    h_rg = rg or o_rg
    if config.model_type in FFN_NORM_TYPES:  # Gemma 3 norms the attention output before the add
        # o_proj's output is in SDPA's dtype: a float base's under autocast, a 4-bit one's as x
        _norm(saved, "post_attention_layernorm", N, C, o_rg, plan.full, s)
        n2_rg = _norm(saved, "pre_feedforward_layernorm", N, C, h_rg, plan.full, wd)
    else:
        n2_rg = _norm(saved, "post_attention_layernorm", N, C, h_rg, plan.full, wd)
    if fused:
        g_rg = u_rg = _linear(saved, ctx, "gate_up_proj", "normed_2", wd, C, 2 * I, n2_rg)
        g = out_bytes("gate_up_proj")
    else:
        g_rg = _linear(saved, ctx, "gate_proj", "normed_2", wd, C, I, n2_rg)
        u_rg = _linear(saved, ctx, "up_proj", "normed_2", wd, C, I, n2_rg)
        g = out_bytes("gate_proj")
    if g_rg or u_rg:  # act(gate) * up is recomputed in backward from its two inputs
        saved.add("mlp.gate_out", N * I, g)
        saved.add("mlp.up_out", N * I, g)
    d_rg = _linear(saved, ctx, "down_proj", "mlp.act_product", g, I, C, g_rg or u_rg)
    if config.model_type in FFN_NORM_TYPES:  # ... and the feed-forward output too
        _norm(saved, "post_feedforward_layernorm", N, C, d_rg, plan.full, out_bytes("down_proj"))
    return saved.bytes


def head_saved_bytes(config, plan):
    """Bytes saved for backward outside the decoder layers (ids, final norm, lm_head input),
    and the loss's fp32 log-probabilities (N, V), which the logits row reports.
    Mirrors: transformers ForCausalLMLoss (logits.float(), cross_entropy)"""
    C, V = config.hidden_size, config.vocab_size
    N, wd = plan.per_device_train_batch_size * plan.max_length, DTYPE_BYTES[plan.dtype]
    ad = 2 if plan.bf16 else None
    saved = _Saved()
    if plan.full:
        saved.add("embed_tokens.input_ids", N, 8)
    if config.model_type in ("cohere2", "gpt_neox"):  # a LayerNorm (Cohere's: fp32 copies)
        _layer_norm(saved, "norm", N, C, True, plan.full, wd, config.model_type == "cohere2")
    else:
        _norm(saved, "norm", N, C, True, plan.full, wd)
    if plan.full:  # (Cohere 2: h times logit_scale, a new tensor of the same size)
        saved.add("lm_head.input", N * C, ad or wd)
    if ad and ad != wd:
        saved.add("lm_head.weight_cast", V * C, ad)
    saved.add("loss.labels", N, 8)
    saved.add("loss.total_weight", 1, 4)
    return saved.bytes, N * V * 4

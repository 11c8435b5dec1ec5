"""What one decoder layer saves for backward in the families whose layers are not Llama's shape.

OLMo 3 (post-norm, q/k norms over whole projections), Cohere 2 (parallel attention and MLP under
one LayerNorm), GPT-NeoX (parallel residual, LayerNorms with bias, fused query_key_value, gelu
MLP) and the mixture-of-experts families (Qwen3-MoE, GLM-4-MoE, gpt-oss): `layer_saved_bytes`
walks the layer op by op as nanosft.memory.activations does for Llama's, and `moe_saved` the MoE
block: the router's probabilities and top-k choice, then the T * top_k rows the experts get (each
row's input, gate_up output, activation products, the expert output and its weighted copy). The
rows add up to N * top_k however the router splits them, so the bytes need no routing.
Papers: Switch Transformer 2101.03961, GPT-NeoX-20B 2204.06745, OLMo 2 2501.00656.
"""

from nanosft.memory.activations import _layer_norm, _linear, _norm, _Saved, _sliding_window
from nanosft.memory.plan import (
    DTYPE_BYTES, expert_size, is_moe_layer, layer_linears, lora_targets, nf4_quantizable,
    parameter_targets,
)

MODELLED = ("olmo3", "cohere2", "gpt_neox", "qwen3_moe", "glm4_moe", "gpt_oss")


def _rope_owner(config, layer_idx):
    """Whether this layer is the first to read its cos / sin tables (each table counts once)."""
    t = config.model_type
    types = getattr(config, "layer_types", None)
    if t == "olmo3":  # one table per layer type
        return types.index(types[layer_idx]) == layer_idx
    if t == "cohere2":  # only the sliding layers rotate
        return types[layer_idx] == "sliding_attention" and types.index(types[layer_idx]) == \
            layer_idx
    return layer_idx == 0


def _attention(saved, ctx, config, layer_idx, x_name, x_rg):
    """Saves of one attention block reading `x_name`; returns whether its output needs grad."""
    plan, N, wd, ad = ctx["plan"], ctx["N"], ctx["wd"], ctx["ad"]
    C, T, B = config.hidden_size, plan.max_length, plan.per_device_train_batch_size
    H, KV, D = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    t, s = config.model_type, ad or wd
    if t == "gpt_neox":  # one linear; q, k come out of partial RoPE new, v stays a view of it
        rg = _linear(saved, ctx, "query_key_value", x_name, wd, C, 3 * C, x_rg)
        q_rg = k_rg = v_rg = rg
    else:
        q_rg, k_rg, v_rg = (_linear(saved, ctx, lin, x_name, wd, C, o, x_rg) for lin, o in
                            (("q_proj", H * D), ("k_proj", KV * D), ("v_proj", KV * D)))
    out = ctx["out_bytes"]
    if t == "olmo3":  # RMSNorm over the whole (N, H * D) and (N, KV * D) projections
        _norm(saved, "q_norm", N, H * D, q_rg, plan.full, out("q_proj"))
        _norm(saved, "k_norm", N, KV * D, k_rg, plan.full, out("k_proj"))
    elif t == "qwen3_moe" or t == "glm4_moe" and config.use_qk_norm:  # per head
        _norm(saved, "q_norm", N * H, D, q_rg, plan.full, out("q_proj"))
        _norm(saved, "k_norm", N * KV, D, k_rg, plan.full, out("k_proj"))
    attn_rg = q_rg or k_rg or v_rg
    if not attn_rg:
        return False
    partial = getattr(config, "partial_rotary_factor", None) if t in ("gpt_neox",
                                                                      "glm4_moe") else None
    rope = _sliding_window(config, layer_idx) is not None if t == "cohere2" else True
    if rope and _rope_owner(config, layer_idx):
        rot = int(D * partial) if partial else D
        saved.add("rope_cos_sin", 2 * T * rot, wd)
    window = _sliding_window(config, layer_idx)
    if t == "gpt_oss":  # eager softmax with a sink column: the (T, T + 1) probabilities stay
        if k_rg:  # q @ k^T: each side kept for the other's gradient
            saved.add("attn.q", N * H * D, s)
        if q_rg:
            saved.add("attn.k_repeated", N * H * D, s)  # repeat_interleave copies of the kv heads
        if q_rg or k_rg:
            saved.add("attn.mask", T * T, 1)  # the causal or windowed (T, T) boolean mask
            saved.add("attn.max_index", B * H * T, 8)
            # the sinks (weights' dtype) join the scores: the softmax runs in the wider dtype,
            # and its probabilities are cast back to v's for the product
            pd = max(s, wd)
            saved.add("attn.probs", B * H * T * (T + 1), pd)
            if pd != s:
                saved.add("attn.probs_cast", B * H * T * T, s)
            saved.add("attn.v_repeated", N * H * D, s)
        o_input = "o_proj.input"  # (B, H, T, D) out, transposed to (B, T, H * D): a copy
    else:
        saved.add("sdpa.q", N * H * D, s)
        saved.add("sdpa.k", N * KV * D, s)
        # GPT-NeoX's v is a view of the fused (N, 3 C) output and keeps all of it alive, unless
        # autocast hands SDPA a copy (a 4-bit base returns float32)
        whole = t == "gpt_neox" and out("query_key_value") == s
        saved.add("sdpa.v", N * (3 * C if whole else KV * D), s)
        saved.add("sdpa.out", N * H * D, s)
        saved.add("sdpa.logsumexp", B * H * T, 4)
        if window is not None and T > window:
            saved.add("sdpa.window_mask", T * T, s)
        # partial RoPE concatenates q (B, H, T, D): o_proj's (B, T, H * D) input is then a copy
        o_input = "o_proj.input" if partial else "sdpa.out"
    o_lin = "dense" if t == "gpt_neox" else "o_proj"
    return _linear(saved, ctx, o_lin, o_input, s, H * D, C, attn_rg)


def _swiglu(saved, ctx, x_name, x_rg, C, I):
    """Llama's MLP (gate_proj, up_proj, down_proj) of width I reading `x_name`."""
    g_rg = _linear(saved, ctx, "gate_proj", x_name, ctx["wd"], C, I, x_rg)
    u_rg = _linear(saved, ctx, "up_proj", x_name, ctx["wd"], C, I, x_rg)
    g = ctx["out_bytes"]("gate_proj")
    if g_rg or u_rg:  # act(gate) * up is recomputed in backward from its two inputs
        saved.add(f"{x_name}.gate_out", ctx["N"] * I, g)
        saved.add(f"{x_name}.up_out", ctx["N"] * I, g)
    return _linear(saved, ctx, "down_proj", f"{x_name}.act_product", g, I, C, g_rg or u_rg)


def moe_saved(saved, ctx, config, x_name, x_rg):
    """Saves of a sparse MoE block on the (N, C) tokens `x_name`: router, dispatch, experts,
    combine (and GLM's shared experts). Under bf16 autocast over float32 weights each expert's
    slice W[e] is cast anew (no autocast cache for a view), so every expert's bf16 copy is kept.
    Left out: what GLM's group choice saves (its ops end in integer ids, so those saves are freed
    when the router returns: 0.6% of a tiny layer).
    Mirrors: autograd's saves in nanosft.families.moe SparseMoeBlock (Qwen3MoeSparseMoeBlock,
    Glm4MoeMoE, GptOssMLP)"""
    plan, N, wd, ad = ctx["plan"], ctx["N"], ctx["wd"], ctx["ad"]
    C, E, k, Ie = config.hidden_size, config.num_experts, config.num_experts_per_tok, \
        expert_size(config)
    t, R = config.model_type, N * config.num_experts_per_tok
    cast = ad is not None and ad != wd  # autocast makes copies of inputs and weights
    mm = ad or wd  # a matmul's output dtype
    # GLM's router runs in fp32 (autocast still casts its matmul); gpt-oss's biases return the
    # expert outputs to the weights' dtype
    rd = (ad or 4) if t == "glm4_moe" else mm
    ed = wd if t == "gpt_oss" else mm
    ptargets = ctx["param_targets"]
    router = "router.weight" if t == "gpt_oss" else "gate.weight"
    router_trains = plan.full or router in ptargets
    gate_up_trains = plan.full or "gate_up_proj" in ptargets
    down_trains = plan.full or "down_proj" in ptargets
    shared_rg = False
    if t == "glm4_moe" and config.n_shared_experts:  # a dense SwiGLU every token passes
        shared_rg = _swiglu(saved, ctx, x_name, x_rg, C, Ie * config.n_shared_experts)
    if not (x_rg or router_trains or gate_up_trains or down_trains):
        return shared_rg
    # the router: (N, E) logits, top k of them (ids (N, k) int64), their weights
    if router_trains:  # its weight's gradient reads the input (a cast copy of it)
        if cast:
            saved.add("router.input_cast", N * C, ad)
        elif t == "glm4_moe" and wd != 4:
            saved.add("router.input_fp32", N * C, 4)
        else:
            saved.add(x_name, N * C, wd)
    if x_rg and (cast or t == "glm4_moe" and wd != 4):
        saved.add("router.weight_cast", E * C, rd)
    elif x_rg and router in ptargets:  # W + B A, a new (E, C) tensor
        saved.add("router.weight_plus_delta", E * C, wd)
    saved.add("router.top_k_index", N * k, 8)
    if t == "gpt_oss":  # softmax over the k chosen logits only
        saved.add("router.top_k_weights", N * k, mm)
    else:  # softmax (Qwen, in fp32) or sigmoid (GLM) over all E
        saved.add("router.probs", N * E, 4 if t == "qwen3_moe" else rd)
        if config.norm_topk_prob:  # the k weights and their (N, 1) sum, for the division
            nd = 4 if t == "qwen3_moe" else rd
            saved.add("router.top_k_values", N * k, nd)
            saved.add("router.top_k_sum", N, nd)
    # dispatch: each of the R = N k (token, choice) rows, expert by expert
    saved.add("experts.row_ids", R * 2, 8)  # torch.where's (token, slot) pairs, int64
    if gate_up_trains:
        saved.add("experts.input_rows", R * C, mm)
    if cast and x_rg:  # the bf16 copy of each expert's slice, for the input's gradient
        saved.add("experts.gate_up_proj_cast", E * 2 * Ie * C, ad)
        saved.add("experts.down_proj_cast", E * C * Ie, ad)
    saved.add("experts.gate_up_out", R * 2 * Ie, ed)
    if t == "gpt_oss":  # clamped gate, sigmoid(alpha gate), up + 1, and the glu product
        for name in ("clamped_gate", "sigmoid", "up_plus_one", "glu"):
            saved.add(f"experts.{name}", R * Ie, ed)
    else:
        saved.add("experts.silu", R * Ie, ed)
    if down_trains:
        saved.add("experts.act_product", R * Ie, mm)  # (gpt-oss: the cast copy under autocast)
    saved.add("experts.route_weight", R, rd)  # (R, 1) slice of the top-k weights
    saved.add("experts.out", R * C, ed)  # times the weight: both saved
    saved.add("experts.weighted_out", R * C, wd)  # index_add_ keeps its source, in x's dtype
    if not plan.full:  # LoRA on the 3-D experts: W + B A is a new (E, out, in) tensor per forward
        ab = DTYPE_BYTES[plan.adapter_dtype]
        for name, out_f, in_f in (("gate_up_proj", 2 * Ie, C), ("down_proj", C, Ie)):
            if name not in ptargets:
                continue
            if not cast:  # (under autocast only its per-expert bf16 copies are kept)
                saved.add(f"experts.{name}_plus_delta", E * out_f * in_f, wd)
            if ab != wd:  # the adapters cast to the experts' dtype for the baddbmm
                saved.add(f"experts.{name}_factors", E * (out_f + in_f) * ptargets[name], wd)
    return True


def layer_saved_bytes(config, plan, first=False, device_type="cpu", layer_idx=0):
    """Bytes one decoder layer of these families saves for backward, by tensor, no checkpointing.
    Mirrors: autograd's saves in nanosft.families' olmo3, cohere2, gpt_neox, qwen3_moe, glm4_moe
    and gpt_oss decoder layers"""
    C, I, T = config.hidden_size, config.intermediate_size, plan.max_length
    H, D = config.num_attention_heads, config.head_dim
    N, wd = plan.per_device_train_batch_size * T, DTYPE_BYTES[plan.dtype]
    ad = 2 if plan.bf16 else None
    t = config.model_type
    moe = is_moe_layer(config, layer_idx)
    in_features = {"o_proj": H * D, "dense": C, "down_proj": I, "dense_4h_to_h": I}
    if t == "glm4_moe" and moe:
        in_features["down_proj"] = expert_size(config) * config.n_shared_experts
    nf4 = {lin: plan.load_in_4bit and nf4_quantizable((0, in_features.get(lin, C)), device_type)
           for lin in layer_linears(config)}

    def out_bytes(lin):  # a float base computes in the autocast dtype; a 4-bit one returns x's
        return (ad or wd) if (plan.full or not nf4[lin]) else wd

    ctx = {"N": N, "plan": plan, "ad": ad, "wd": wd, "nf4": nf4, "out_bytes": out_bytes,
           "targets": lora_targets(config, plan), "param_targets": parameter_targets(config, plan)}
    saved = _Saved()
    rg = plan.full or not first  # the first layer's input needs no grad unless the embedding trains
    if t == "olmo3":  # post-norm: h + norm(attn(h)), then h + norm(mlp(h)); no input norm
        a_rg = _attention(saved, ctx, config, layer_idx, "layer_input", rg)
        _norm(saved, "post_attention_layernorm", N, C, a_rg, plan.full, out_bytes("o_proj"))
        m_rg = _swiglu(saved, ctx, "mlp_input", rg or a_rg, C, I)
        _norm(saved, "post_feedforward_layernorm", N, C, m_rg, plan.full, out_bytes("down_proj"))
    elif t == "cohere2":  # h + attn(ln(h)) + mlp(ln(h))
        n_rg = _layer_norm(saved, "input_layernorm", N, C, rg, plan.full, wd, True)
        _attention(saved, ctx, config, layer_idx, "normed", n_rg)
        _swiglu(saved, ctx, "normed", n_rg, C, I)
    elif t == "gpt_neox":  # h + attn(ln1(h)) + mlp(ln2(h)), or sequential
        n_rg = _layer_norm(saved, "input_layernorm", N, C, rg, plan.full, wd, False)
        a_rg = _attention(saved, ctx, config, layer_idx, "normed_1", n_rg)
        if config.use_parallel_residual:  # both norms read h: its storage counts once
            n2_rg = _layer_norm(saved, "input_layernorm", N, C, rg, plan.full, wd, False)
            if n2_rg:
                saved.add("post_attention_layernorm.mean_rstd", 2 * N, 4)
        else:
            n2_rg = _layer_norm(saved, "post_attention_layernorm", N, C, rg or a_rg, plan.full,
                                wd, False)
        h_rg = _linear(saved, ctx, "dense_h_to_4h", "normed_2", wd, C, I, n2_rg)
        g = out_bytes("dense_h_to_4h")
        if h_rg:
            saved.add("mlp.gelu_input", N * I, g)
        _linear(saved, ctx, "dense_4h_to_h", "mlp.gelu_out", g, I, C, h_rg)
    else:  # the MoE families: Llama's pre-norm layer with an MoE block (or a dense MLP)
        n_rg = _norm(saved, "input_layernorm", N, C, rg, plan.full, wd)
        a_rg = _attention(saved, ctx, config, layer_idx, "normed_1", n_rg)
        n2_rg = _norm(saved, "post_attention_layernorm", N, C, rg or a_rg, plan.full, wd)
        if moe:
            moe_saved(saved, ctx, config, "normed_2", n2_rg)
        else:
            _swiglu(saved, ctx, "normed_2", n2_rg, C, I)
    return saved.bytes

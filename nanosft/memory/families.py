"""What one decoder layer saves for backward in the families whose layers are not Llama's shape.

OLMo 3 (post-norm, q/k norms over whole projections), Cohere 2 (parallel attention and MLP under
one LayerNorm), GPT-NeoX (parallel residual, LayerNorms with bias, fused query_key_value, gelu
MLP) and the mixture-of-experts families (Qwen3-MoE, GLM-4-MoE, gpt-oss): `layer_saved_bytes`
walks the layer op by op as nanosft.memory.activations does for Llama's, and `moe_saved` the MoE
block: the router's probabilities and top-k choice, then the T * top_k rows the experts get (each
row's input, gate_up output, activation products, the expert output and its weighted copy). The
rows add up to N * top_k however the router splits them, so the bytes need no routing. Then the
hybrid and newer layers: LFM2's gated short convolution, Qwen3.5's Gated DeltaNet (through the
chunked delta rule) and gated attention (Qwen3.5-MoE: those layers with the MoE block and a
sigmoid-gated shared expert), Gemma 4's layer (fp32 norms by hand, shared keys and values,
per-layer inputs, the experts beside the MLP under enable_moe_block) and its saves outside the
layers. Where a layer's input needs no grad (the first layer, or one after layers LoRA leaves
frozen) the walks (but Gemma 4's) keep only what the branches LoRA makes need grad ask for: o_proj's
LoRA input alone, the router's saves alone, the RoPE tables in the first layer rotating a q or k
that needs grad.
Papers: Switch Transformer 2101.03961, GPT-NeoX-20B 2204.06745, OLMo 2 2501.00656, Gated DeltaNet
2412.06464.
"""

from nanosft.memory.activations import (
    _biased_linears, _layer_norm, _linear, _norm, _Saved, _sliding_window, sdpa_bytes,
)
from nanosft.memory.plan import (
    DTYPE_BYTES, GATED_DELTANET_LINEARS, expert_size, is_moe_layer, layer_linears, lora_targets,
    nf4_quantizable, parameter_targets,
)

HEAD_TYPES = ("gemma4_text",)  # their own saves outside the layers
MODELLED = ("olmo3", "cohere2", "gpt_neox", "qwen3_moe", "glm4_moe", "gpt_oss", "lfm2",
            "gemma4_text", "qwen3_5_text", "qwen3_5_moe_text")
SOFTMAX_ROUTERS = ("qwen3_moe", "qwen3_5_moe_text")  # fp32 softmax, renormalised in fp32


def _rope_table(config, layer_idx):
    """Which cos / sin table a layer rotates q and k with (None: no RoPE in this layer)."""
    t, kind = config.model_type, (getattr(config, "layer_types", None) or [None] * (
        layer_idx + 1))[layer_idx]
    if t == "olmo3":  # one table per layer type
        return kind
    if t in ("lfm2", "qwen3_5_text", "qwen3_5_moe_text"):  # only the attention layers rotate
        return "rope" if kind == "full_attention" else None
    if t == "cohere2":  # only the sliding layers rotate
        return "rope" if kind == "sliding_attention" else None
    return "rope"


def _rope_saved_first(config, ctx, layer_idx):
    """Whether this layer is the first to keep its cos / sin table (each table counts once): the
    first rotating with it whose q or k needs grad (LoRA on q_proj / k_proj / query_key_value,
    or an input that needs grad)."""
    table = _rope_table(config, layer_idx)
    if table is None:
        return False
    qk_lora = ctx["plan"].full or bool({"q_proj", "k_proj", "query_key_value"} & ctx["targets"])
    for j in range(config.num_hidden_layers):
        if _rope_table(config, j) == table and (qk_lora or _earlier_layer_trains(config, ctx, j)):
            return j == layer_idx
    return False


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
    elif t in ("qwen3_moe", "lfm2") or t == "glm4_moe" and config.use_qk_norm:  # per head
        _norm(saved, "q_norm", N * H, D, q_rg, plan.full, out("q_proj"))
        _norm(saved, "k_norm", N * KV, D, k_rg, plan.full, out("k_proj"))
    attn_rg = q_rg or k_rg or v_rg
    partial = getattr(config, "partial_rotary_factor", None) if t in ("gpt_neox",
                                                                      "glm4_moe") else None
    if (q_rg or k_rg) and _rope_saved_first(config, ctx, layer_idx):  # RoPE reads q and k only
        rot = int(D * partial) if partial else D
        saved.add("rope_cos_sin", 2 * T * rot, wd)
    window = _sliding_window(config, layer_idx)
    if t == "gpt_oss":  # eager softmax with a sink column: the (T, T + 1) probabilities stay
        if k_rg:  # q @ k^T: each side kept for the other's gradient
            saved.add("attn.q", N * H * D, s)
        if q_rg:
            saved.add("attn.k_repeated", N * H * D, s)  # repeat_interleave copies of the kv heads
        # the sinks (weights' dtype) join the scores: the softmax runs in the wider dtype, and
        # its probabilities are cast back to v's for the product
        pd = max(s, wd)
        if q_rg or k_rg:
            saved.add("attn.mask", T * T, 1)  # the causal or windowed (T, T) boolean mask
            saved.add("attn.max_index", B * H * T, 8)
            saved.add("attn.probs", B * H * T * (T + 1), pd)  # softmax keeps its output
            saved.add("attn.v_repeated", N * H * D, s)  # probs @ v: v for the probs' gradient
        if v_rg:  # ... and the probabilities v's gradient reads (their cast copy, or a view)
            if pd != s:
                saved.add("attn.probs_cast", B * H * T * T, s)
            else:
                saved.add("attn.probs", B * H * T * (T + 1), pd)
        o_input = "o_proj.input"  # (B, H, T, D) out, transposed to (B, T, H * D): a copy
    else:
        # q reaches SDPA in the weights' dtype (RoPE's tables are in it); Cohere 2 casts back
        q_bytes = out("q_proj") if t == "cohere2" else wd
        sb, fp32 = sdpa_bytes(plan, ctx["device_type"], q_bytes, s)
        if attn_rg:  # SDPA keeps all it reads once any of q, k, v needs grad
            saved.add("sdpa.q", N * H * D, sb)
            saved.add("sdpa.k", N * KV * D, sb)
            # GPT-NeoX's v is a view of the fused (N, 3 C) output and keeps all of it alive,
            # unless autocast (or the fp32 path) hands SDPA a copy (a 4-bit base returns float32)
            whole = t == "gpt_neox" and out("query_key_value") == sb
            saved.add("sdpa.v", N * (3 * C if whole else KV * D), sb)
            saved.add("sdpa.out", N * H * D, sb)
            saved.add("sdpa.logsumexp", B * H * T, 4)
            if window is not None and T > window:
                saved.add("sdpa.window_mask", T * T, sb)
        # partial RoPE concatenates q (B, H, T, D): o_proj's (B, T, H * D) input is then a copy
        o_input = "o_proj.input" if partial else "sdpa.out_cast" if fp32 else "sdpa.out"
    o_lin = {"gpt_neox": "dense", "lfm2": "out_proj"}.get(t, "o_proj")
    # with nothing before it needing grad, o_proj's own LoRA still keeps its input
    return _linear(saved, ctx, o_lin, o_input, s, H * D, C, attn_rg)


def _swiglu(saved, ctx, x_name, x_rg, C, I, names=("gate_proj", "up_proj", "down_proj"),
            recomputed=True):
    """Llama's MLP (gate_proj, up_proj, down_proj: LFM2's w1, w3, w2) of width I on `x_name`.
    `recomputed`: act(gate) * up recomputed in backward (nanosft.fast.recompute, MLP.forward);
    LFM2's own forward keeps silu(gate) too, for up's gradient."""
    gate, up, down = names
    g_rg = _linear(saved, ctx, gate, x_name, ctx["wd"], C, I, x_rg)
    u_rg = _linear(saved, ctx, up, x_name, ctx["wd"], C, I, x_rg)
    g = ctx["out_bytes"](gate)
    if g_rg or u_rg:  # act(gate) * up is recomputed in backward from its two inputs
        saved.add(f"{x_name}.gate_out", ctx["N"] * I, g)
        saved.add(f"{x_name}.up_out", ctx["N"] * I, g)
    if u_rg and not recomputed:
        saved.add(f"{x_name}.act_out", ctx["N"] * I, g)
    return _linear(saved, ctx, down, f"{x_name}.act_product", g, I, C, g_rg or u_rg)


def _short_conv(saved, ctx, config, x_name, x_rg):
    """Saves of LFM2's gated short convolution out_proj(C * conv(B * x)) on `x_name`: the three
    (N, C) gates are views of in_proj's (N, 3 C) output, which both products keep; conv1d keeps its
    input B * x, and C * y the conv's (B, C, T + K - 1) output."""
    N, wd, ad, plan = ctx["N"], ctx["wd"], ctx["ad"], ctx["plan"]
    C, B, K = config.hidden_size, plan.per_device_train_batch_size, config.conv_L_cache
    rg = _linear(saved, ctx, "in_proj", x_name, ctx["wd"], C, 3 * C, x_rg)
    conv_trains = plan.full
    g = ctx["out_bytes"]("in_proj")
    if not (rg or conv_trains):  # a frozen branch: only out_proj's own LoRA keeps its input
        return _linear(saved, ctx, "out_proj", "conv.out_proj.input", g, C, C, False)
    s = ad or wd  # conv1d works in the autocast dtype
    saved.add("conv.in_proj_out", N * 3 * C, g)  # b * h and c * y read their views
    saved.add("conv.Bx", N * C, s if s != g else g)  # conv1d's input (a cast copy under autocast)
    if rg and ad and ad != wd:  # ... and its (C, 1, K) weight's copy, for the input's gradient
        saved.add("conv.weight_cast", C * K, ad)
    if g == s:  # c * y keeps y: the padded conv output, sliced
        saved.add("conv.y", B * C * (plan.max_length + K - 1), s)
    else:  # (a 4-bit in_proj under autocast: y cast back to Bx's float32, a copy)
        saved.add("conv.y", B * C * plan.max_length, g)
    return _linear(saved, ctx, "out_proj", "conv.out_proj.input", g, C, C, True)


def moe_saved(saved, ctx, config, x_name, x_rg):
    """Saves of a sparse MoE block on the (N, C) tokens `x_name`: router, dispatch, experts,
    combine (and GLM's shared experts). Under bf16 autocast over float32 weights each expert's
    slice W[e] is cast anew (no autocast cache for a view), so every expert's bf16 copy is kept.
    NF4 experts (nf4_experts.DequantizedLinear) save no weight: each chosen expert is dequantized
    in forward and again in backward; what LoRA's delta D adds (x @ D[e]^T) saves as on float.
    On an input that needs no grad, each part keeps what the parts LoRA trains ask for: the
    router's saves for its logits, each expert's for its gate_up output or its own output.
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
    gate_up_trains = plan.experts_train() or "gate_up_proj" in ptargets
    down_trains = plan.experts_train() or "down_proj" in ptargets
    shared_rg = False
    if t == "glm4_moe" and config.n_shared_experts:  # a dense SwiGLU every token passes
        shared_rg = _swiglu(saved, ctx, x_name, x_rg, C, Ie * config.n_shared_experts)
    if t == "qwen3_5_moe_text":  # the same, times sigmoid(shared_expert_gate(x))
        shared_rg = _gated_shared_expert(saved, ctx, config, x_name, x_rg)
    w_rg = x_rg or router_trains  # the router's logits, so the routing weights
    gu_rg = x_rg or gate_up_trains  # each expert's gate_up output
    d_rg = gu_rg or down_trains  # each expert's output
    if not (w_rg or d_rg):
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
    if cast and router in ptargets and DTYPE_BYTES[plan.adapter_dtype] != ad:
        # B @ A runs under autocast: it keeps both factors' bf16 copies, (E, r) and (r, C)
        saved.add("router.lora_factors_cast", (E + C) * ptargets[router], ad)
    if w_rg:
        saved.add("router.top_k_index", N * k, 8)
        if t == "gpt_oss":  # softmax over the k chosen logits only
            saved.add("router.top_k_weights", N * k, mm)
        else:  # softmax (Qwen, in fp32) or sigmoid (GLM) over all E
            saved.add("router.probs", N * E, 4 if t in SOFTMAX_ROUTERS else rd)
            if config.norm_topk_prob:  # the k weights and their (N, 1) sum, for the division
                nd = 4 if t in SOFTMAX_ROUTERS else rd
                saved.add("router.top_k_values", N * k, nd)
                saved.add("router.top_k_sum", N, nd)
    # dispatch: each of the R = N k (token, choice) rows, expert by expert; index_add_ keeps the
    # rows' ids (torch.where's (token, slot) pairs, one int64 storage) and its source, the
    # weighted output, in x's dtype
    saved.add("experts.row_ids", R * 2, 8)
    saved.add("experts.weighted_out", R * C, wd)
    if gate_up_trains:
        saved.add("experts.input_rows", R * C, mm)
    for name, numel, in_rg in (("gate_up_proj", E * 2 * Ie * C, x_rg),
                               ("down_proj", E * C * Ie, gu_rg)):
        # the bf16 copy of each expert's slice, for the input's gradient; NF4 experts dequantize
        # again in backward, and only a LoRA delta's slice is cast and kept
        if cast and in_rg and (not plan.nf4_experts or name in ptargets):
            saved.add(f"experts.{name}_cast", numel, ad)
        # LoRA on the 3-D experts: W + B A is a new (E, out, in) tensor per forward (under
        # autocast only its per-expert bf16 copies are kept)
        if not plan.full and not cast and in_rg and name in ptargets:
            saved.add(f"experts.{name}_plus_delta", numel, wd)
        if not plan.full and name in ptargets and DTYPE_BYTES[plan.adapter_dtype] != wd:
            # the adapters cast to the experts' dtype for the baddbmm
            out_f, in_f = (2 * Ie, C) if name == "gate_up_proj" else (C, Ie)
            saved.add(f"experts.{name}_factors", E * (out_f + in_f) * ptargets[name], wd)
    if gu_rg:
        saved.add("experts.gate_up_out", R * 2 * Ie, ed)
        if t == "gpt_oss":  # clamped gate, sigmoid(alpha gate), up + 1, and the glu product
            for name in ("clamped_gate", "sigmoid", "up_plus_one", "glu"):
                saved.add(f"experts.{name}", R * Ie, ed)
        else:
            saved.add("experts.silu", R * Ie, ed)
    if down_trains:
        saved.add("experts.act_product", R * Ie, mm)  # (gpt-oss: the cast copy under autocast)
    if d_rg:  # out * weight: the weight for the output's gradient, and the output for its own
        saved.add("experts.route_weight", R, rd)  # (R, 1) slice of the top-k weights
    if w_rg:
        saved.add("experts.out", R * C, ed)
    return True


def _gated_shared_expert(saved, ctx, config, x_name, x_rg):
    """Saves of Qwen3.5-MoE's shared expert on `x_name`: the SwiGLU of
    shared_expert_intermediate_size, the (N, 1) gate linear, its sigmoid's output (which the
    product also reads) and, for the gate's gradient, the expert's (N, C) output.
    Mirrors: autograd's saves in nanosft.families.qwen3_5_moe Qwen3_5MoeSparseMoeBlock.forward"""
    N, C, out = ctx["N"], config.hidden_size, ctx["out_bytes"]
    d_rg = _swiglu(saved, ctx, x_name, x_rg, C, config.shared_expert_intermediate_size)
    g_rg = _linear(saved, ctx, "shared_expert_gate", x_name, ctx["wd"], C, 1, x_rg)
    if g_rg or d_rg:
        saved.add("shared_expert.gate_sigmoid", N, out("shared_expert_gate"))
    if g_rg:
        saved.add("shared_expert.out", N * C, out("down_proj"))
    return g_rg or d_rg


def _gated_deltanet(saved, ctx, config, x_name, x_rg):
    """Saves of Qwen3.5's Gated DeltaNet on `x_name`: the projections, the decay's softplus, the
    conv over q, k, v and its silu, the l2-normed q and k, the chunked rule (_delta_rule_saved)
    and the gated RMSNorm. On a frozen input only the branches whose projection carries LoRA
    (q, k, v; beta; the decay; the gate z) need grad, and each op keeps what those ask for.
    Mirrors: autograd's saves in nanosft.families.gated_deltanet GatedDeltaNet.forward"""
    plan, N, wd, ad, full = ctx["plan"], ctx["N"], ctx["wd"], ctx["ad"], ctx["plan"].full
    C, T, B, K = (config.hidden_size, plan.max_length, plan.per_device_train_batch_size,
                  config.linear_conv_kernel_dim)
    Hv, Dk, Dv = config.linear_num_value_heads, config.linear_key_head_dim, \
        config.linear_value_head_dim
    Kd, Vd = config.linear_num_key_heads * Dk, Hv * Dv
    Cd, out = 2 * Kd + Vd, ctx["out_bytes"]
    qkv_rg, z_rg, b_rg, a_rg = (_linear(saved, ctx, lin, x_name, wd, C, o, x_rg) for lin, o in
                                (("in_proj_qkv", Cd), ("in_proj_z", Vd), ("in_proj_b", Hv),
                                 ("in_proj_a", Hv)))
    c_rg = qkv_rg or full  # q, k, v after the conv (its weight trains in full fine-tuning)
    g_rg = a_rg or full  # the decay g = -exp(A_log) * softplus(a + dt_bias), in fp32
    if b_rg:
        saved.add("gdn.beta", N * Hv, out("in_proj_b"))  # sigmoid keeps its output
    if g_rg:
        saved.add("gdn.softplus_in", N * Hv, 4)
        saved.add("gdn.neg_A_exp", Hv, 4)
    if full:  # A_log trains: its exp, and softplus's output for the product's gradient
        saved.add("gdn.A_exp", Hv, 4)
        saved.add("gdn.softplus_out", N * Hv, 4)
    if c_rg:
        # conv1d's input: in_proj_qkv's output, or under autocast the bf16 copy of its fp32
        # cast, beside the weight's copy; silu's input is the conv's output before the slice
        saved.add("gdn.qkv_out", N * Cd, ad or out("in_proj_qkv"))
        if ad and ad != wd:
            saved.add("gdn.conv_weight_cast", Cd * K, ad)
        saved.add("gdn.conv_out", B * Cd * (T + K - 1), ad or wd)
        R = B * Hv
        for name in ("q", "k"):  # fp32 copies after repeat / transpose, and l2norm's 1 / norm
            saved.add(f"gdn.{name}_prepared", R * T * Dk, 4)
            saved.add(f"gdn.{name}_rnorm", R * T, 4)
    o_rg = c_rg or b_rg or g_rg
    if o_rg:
        _delta_rule_saved(saved, config, plan, ad, c_rg, b_rg, g_rg)
    # gated RMSNorm over (N Hv, Dv): fp32 o and 1 / rms, (the normed o for its weight), the
    # gate z (fp32) and silu(z), weight * normed o
    od = ad or wd  # the rule's output returns to the conv's dtype
    if o_rg:
        saved.add("gdn.o", N * Vd, 4)
        saved.add("gdn.norm_rstd", N * Hv, 4)
    if full:
        saved.add("gdn.norm_xn", N * Vd, od)
    if z_rg:  # silu's input, and what it multiplies
        saved.add("gdn.z", N * Vd, 4)
        saved.add("gdn.weight_xn", N * Vd, max(wd, od))
    if o_rg or full:
        saved.add("gdn.silu_z", N * Vd, 4)
    return _linear(saved, ctx, "out_proj", "gdn.norm_out", wd, Vd, C, o_rg or z_rg or full)


def _delta_rule_saved(saved, config, plan, ad, c_rg, b_rg, g_rg):
    """Saves of chunk_gated_delta_rule, op by op, T padded to whole chunks: the (C, C) decay,
    k k^T and q k^T per chunk, the two triangular solves, the chunk loop. `c_rg`: q, k, v need
    grad; `b_rg`: beta; `g_rg`: the decay. Each product keeps one side for the other's gradient,
    under autocast a bf16 copy of it (the triangular solves stay fp32). The last chunk's state
    update feeds only the final state, which a training forward drops: what it alone saved is
    freed when the forward ends."""
    from nanosft.families.gated_deltanet import CHUNK_SIZE

    B, T, Hv = plan.per_device_train_batch_size, plan.max_length, config.linear_num_value_heads
    Dk, Dv = config.linear_key_head_dim, config.linear_value_head_dim
    R, Cc = B * Hv, CHUNK_SIZE  # rows of value heads; the chunk
    n = -(-T // Cc)
    Tp = n * Cc
    sq, kd, vd, S = R * n * Cc * Cc, R * Tp * Dk, R * Tp * Dv, R * Dk * Dv
    any_rg, qk_rg = c_rg or b_rg or g_rg, c_rg or g_rg
    later = (n - 1) / n  # the share of chunks whose state update is kept
    m = ad or 4  # a matmul's saved operand: the fp32 tensor, or its bf16 copy
    rows = (  # (name, numel, bytes, kept when)
        ("later_mask", Cc * Cc, 1, g_rg),  # masked_fill's (C, C) bool mask
        ("decay", sq, 4, any_rg),  # exp keeps its output; both products read it
        ("beta_pad", R * Tp, 4, c_rg),  # b * k and b * v
        # b * k; (b k) @ k^T and q @ k^T in fp32; k_write = k e^(G_C - G)
        ("k_pad", kd, 4, b_rg or (not ad and c_rg) or (g_rg and n > 1)),
        ("kT_cast", kd, ad, ad and (b_rg or c_rg)),  # (b k) @ k^T
        ("beta_k", kd, m, c_rg),
        ("k_kT", sq, m, g_rg),  # times the decay
        ("v_pad", vd, 4, b_rg),
        ("A", sq, 4, any_rg),  # both solves read A and keep their outputs
        ("W", vd, 4, any_rg),
        ("Kc", kd, 4, any_rg),
        ("exp_G", R * Tp, 4, any_rg),  # b k e^G
        ("beta_k_2", kd, 4, g_rg),
        ("kT_cast_2", kd, ad, ad and c_rg),  # q @ k^T
        ("q_cast", kd, ad, ad and c_rg),
        ("q_kT", sq, m, g_rg),  # times the decay
        ("q_pad", kd, 4, g_rg or (not ad and c_rg)),  # q e^G
        ("exp_G_2", R * Tp, 4, qk_rg),
        ("scores", sq, m, any_rg),  # scores @ U
        ("U", vd, m, qk_rg),
        # the state updates of chunks 0 .. n - 2: k_write = k e^(G_C - G), its copy and U's
        ("exp_to_end", R * Tp, 4, qk_rg and n > 1),
        ("k_write", kd * (later if ad else 1), m, any_rg and n > 1),
        ("U_cast_2", vd * later, ad, ad and qk_rg),
        ("exp_chunk_end", R * ((n - 1) if g_rg else max(n - 2, 0)), 4, any_rg),
        # the states: S0 (zeros) and S_1 .. S_{n-1} read by Kc @ S and q_read @ S (two bf16
        # copies each under autocast), and by S e^(G_C); from chunk 1 on S carries grad, so
        # Kc and q_read are kept for it
        ("S0", S, 4, any_rg and (not ad or g_rg and n > 1)),
        ("states", (n - 1) * S if not ad else max(n - 2, 0) * S if g_rg else 0, 4, any_rg),
        ("S_casts", n * S * (2 if qk_rg else 1), ad, ad and any_rg),
        ("q_read", kd * (later if ad else 1), m, any_rg and n > 1),
        ("Kc_cast", kd * later, ad, ad and any_rg),
    )
    for name, numel, nbytes, kept in rows:
        if kept and numel:
            saved.add(f"gdn.{name}", int(numel), nbytes)


def _gated_attention(saved, ctx, config, layer_idx, x_name, x_rg):
    """Saves of Qwen3.5's full attention: q_proj's (N, 2 H D) output (q and the gate are views),
    per-head q/k norms, partial RoPE, SDPA, the (B, T, H D) copy of its output times
    sigmoid(gate)."""
    plan, N, wd, ad = ctx["plan"], ctx["N"], ctx["wd"], ctx["ad"]
    C, T, B = config.hidden_size, plan.max_length, plan.per_device_train_batch_size
    H, KV, D = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    s, out = ad or wd, ctx["out_bytes"]
    q_rg = _linear(saved, ctx, "q_proj", x_name, wd, C, 2 * H * D, x_rg)
    k_rg = _linear(saved, ctx, "k_proj", x_name, wd, C, KV * D, x_rg)
    v_rg = _linear(saved, ctx, "v_proj", x_name, wd, C, KV * D, x_rg)
    _norm(saved, "q_norm", N * 2 * H, D, q_rg, plan.full, out("q_proj"))  # (its input: the view)
    _norm(saved, "k_norm", N * KV, D, k_rg, plan.full, out("k_proj"))
    attn_rg = q_rg or k_rg or v_rg
    if (q_rg or k_rg) and _rope_saved_first(config, ctx, layer_idx):  # RoPE reads q and k only
        saved.add("rope_cos_sin", 2 * T * rotary_dim(config), wd)
    sb, _ = sdpa_bytes(plan, ctx["device_type"], wd, s)  # (its output is copied below anyway)
    if attn_rg:  # SDPA keeps all it reads once any of q, k, v needs grad
        saved.add("sdpa.q", N * H * D, sb)
        saved.add("sdpa.k", N * KV * D, sb)
        saved.add("sdpa.v", N * KV * D, sb)
        saved.add("sdpa.out", N * H * D, sb)
        saved.add("sdpa.logsumexp", B * H * T, 4)
        saved.add("attn.gate_sigmoid", N * H * D, out("q_proj"))  # (y's gradient reads it)
    if q_rg:  # the gate's gradient reads SDPA's output transposed to (B, T, H D): a copy
        saved.add("attn.y", N * H * D, s)
    return _linear(saved, ctx, "o_proj", "o_proj.input", s, H * D, C, attn_rg)


def rotary_dim(config):
    """Width of the cos / sin tables every (checkpointed) layer receives: head_dim, or for
    Qwen3.5 its partial_rotary_factor share (a quarter: (T, 64) tables beside 256-wide heads)."""
    if config.model_type in ("qwen3_5_text", "qwen3_5_moe_text"):
        return int(config.head_dim * config.partial_rotary_factor)
    return config.head_dim


def _gemma4_norm(saved, tag, rows, D, rg, trainable, x_name, x_bytes, scale=True):
    """Gemma 4's RMSNorm, in fp32 by hand: its fp32 input (x itself, or a copy), mean(x^2) + eps
    and its pow(-0.5), and, for a weight that trains, the normalised x the weight multiplies."""
    if rg:
        if x_bytes == 4:  # (a storage counted already, such as the first layer's, stays)
            saved.bytes.setdefault(x_name, rows * D * 4)
        else:
            saved.add(f"{tag}.input_fp32", rows * D, 4)
        saved.add(f"{tag}.mean_square", rows, 4)
        saved.add(f"{tag}.rstd", rows, 4)
    if trainable and scale:
        saved.add(f"{tag}.normalized", rows * D, 4)
    return rg or trainable and scale


def _gemma4_layer(saved, ctx, config, i, first):
    """Saves of one Gemma 4 layer: attention at this layer's head_dim (a KV-shared layer reads
    the keys and values an earlier layer saved), Gemma 3's four norms and GeGLU (and the experts
    branch beside it), and the gated per-layer input (its (N, C + L P) embeddings storage counted
    in the first layer)."""
    plan, N, wd, ad = ctx["plan"], ctx["N"], ctx["wd"], ctx["ad"]
    C, H, P, T = (config.hidden_size, config.num_attention_heads,
                  config.hidden_size_per_layer_input, plan.max_length)
    B, L, full = plan.per_device_train_batch_size, config.num_hidden_layers, plan.full
    D, KV = config.layer_config(i)
    kind, out = config.layer_types[i], ctx["out_bytes"]
    shared = config.kv_sharing_modes[i] == "reuse"
    s = ad or wd
    sb, fp32 = sdpa_bytes(plan, ctx["device_type"], wd, s)
    I = config.intermediate_size * (2 if config.use_double_wide_mlp and shared else 1)
    rg = full or not first
    # the first layer's input is a view of cat(embeddings, per-layer inputs): that storage
    pli_rg = full or "per_layer_model_projection" in ctx["targets"]
    if first and (rg or P):
        saved.add("layer_input", N * (C + L * P), wd)
    n_rg = _gemma4_norm(saved, "input_layernorm", N, C, rg, full, "layer_input", wd)
    q_rg = _linear(saved, ctx, "q_proj", "normed_1", wd, C, H * D, n_rg)
    _gemma4_norm(saved, "q_norm", N * H, D, q_rg, full, "q_proj.out", out("q_proj"))
    if q_rg and config.layer_types.index(kind) == i:  # each type's cos / sin tables, once
        saved.add(f"rope_cos_sin.{kind}", 2 * T * D, wd)
    attn_rg = q_rg
    if not shared:
        k_rg = _linear(saved, ctx, "k_proj", "normed_1", wd, C, KV * D, n_rg)
        _gemma4_norm(saved, "k_norm", N * KV, D, k_rg, full, "k_proj.out", out("k_proj"))
        if config.attention_k_eq_v and kind == "full_attention":  # v is k_proj's output too
            v_rg, v_name = k_rg, "k_proj.out"
        else:
            v_rg = _linear(saved, ctx, "v_proj", "normed_1", wd, C, KV * D, n_rg)
            v_name = "v_proj.out"
        _gemma4_norm(saved, "v_norm", N * KV, D, v_rg, full, v_name, out("k_proj"), scale=False)
        attn_rg = q_rg or k_rg or v_rg
        if attn_rg:
            saved.add("sdpa.k", N * KV * D, sb)
            saved.add("sdpa.v", N * KV * D, sb)
    elif attn_rg and fp32:  # the fp32 path copies the shared k and v anew in every layer
        saved.add("sdpa.k", N * KV * D, sb)
        saved.add("sdpa.v", N * KV * D, sb)
    elif attn_rg and s != max(out("k_proj"), wd):  # SDPA casts the shared (RoPE'd) k anew
        saved.add("sdpa.k_cast_again", N * KV * D, s)
    if attn_rg:
        saved.add("sdpa.q", N * H * D, sb)
        saved.add("sdpa.out", N * H * D, sb)
        saved.add("sdpa.logsumexp", B * H * T, 4)
        if kind == "sliding_attention" and T > config.sliding_window:
            saved.add("sdpa.window_mask", T * T, sb)
    o_input = "sdpa.out_cast" if fp32 else "sdpa.out"
    o_rg = _linear(saved, ctx, "o_proj", o_input, s, H * D, C, attn_rg)
    _gemma4_norm(saved, "post_attention_layernorm", N, C, o_rg, full, "o_proj.out", out("o_proj"))
    h_rg = rg or o_rg
    n2_rg = _gemma4_norm(saved, "pre_feedforward_layernorm", N, C, h_rg, full, "h_mid", wd)
    d_rg = _swiglu(saved, ctx, "normed_2", n2_rg, C, I)
    if config.enable_moe_block:  # norm_1(mlp) + norm_2(experts(norm(h))), then normed again
        m_rg = _gemma4_norm(saved, "post_feedforward_layernorm_1", N, C, d_rg, full,
                            "down_proj.out", out("down_proj"))
        d_rg = _gemma4_moe(saved, ctx, config, h_rg) or m_rg
        _gemma4_norm(saved, "post_feedforward_layernorm", N, C, d_rg, full, "ffn_sum",
                     max(out("down_proj"), wd))
    else:
        _gemma4_norm(saved, "post_feedforward_layernorm", N, C, d_rg, full, "down_proj.out",
                     out("down_proj"))
    if not P:
        return
    h_rg = h_rg or d_rg
    g_rg = _linear(saved, ctx, "per_layer_input_gate", "h_out", wd, C, P, h_rg)
    if g_rg and pli_rg:  # gelu(gate) * input: the gelu input, and its output for the input
        saved.add("per_layer.gate_out", N * P, out("per_layer_input_gate"))
        saved.add("per_layer.gelu_out", N * P, out("per_layer_input_gate"))
    elif g_rg:
        saved.add("per_layer.gate_out", N * P, out("per_layer_input_gate"))
    p_rg = _linear(saved, ctx, "per_layer_projection", "per_layer.product",
                   out("per_layer_input_gate"), P, C, g_rg or pli_rg)
    _gemma4_norm(saved, "post_per_layer_input_norm", N, C, p_rg, full, "per_layer_projection.out",
                 out("per_layer_projection"))


def _gemma4_moe(saved, ctx, config, h_rg):
    """Saves of Gemma 4's experts branch on the residual h ("h_mid", (N, C)): the router (its
    scale-free fp32 norm, the scaled input proj reads, fp32 softmax, top-k, the renormalising
    division, the per_expert_scale product), pre_feedforward_layernorm_2, the N * top_k rows the
    experts get (as moe_saved counts them, GeGLU in place of SwiGLU) and
    post_feedforward_layernorm_2 over their combined (N, C) output. Returns whether that output
    needs grad.
    Mirrors: autograd's saves in nanosft.families.gemma4_moe moe_block"""
    plan, N, wd, ad, full = ctx["plan"], ctx["N"], ctx["wd"], ctx["ad"], ctx["plan"].full
    C, E, k, Ie = config.hidden_size, config.num_experts, config.top_k_experts, \
        config.moe_intermediate_size
    R, ptargets = N * k, ctx["param_targets"]
    cast = ad is not None and ad != wd  # autocast makes copies of inputs and weights
    mm = ad or wd  # a matmul's output dtype
    gate_up_trains = plan.experts_train() or "gate_up_proj" in ptargets
    down_trains = plan.experts_train() or "down_proj" in ptargets
    r_rg = _gemma4_norm(saved, "router.norm", N, C, h_rg, False, "h_mid", wd, scale=False)
    if full:  # norm(h) * scale: the normed h for scale's gradient
        saved.add("router.normalized", N * C, wd)
    p_rg = _linear(saved, ctx, "proj", "router.scaled", wd, C, E, r_rg or full)
    if not (p_rg or gate_up_trains or down_trains):
        return False
    saved.add("router.probs", N * E, 4)  # softmax in fp32 keeps its output
    saved.add("router.top_k_index", N * k, 8)
    saved.add("router.top_k_values", N * k, 4)  # the division keeps both sides
    saved.add("router.top_k_sum", N, 4)
    saved.add("router.expert_scale", N * k, wd)  # per_expert_scale[top_k_index]
    if full:
        saved.add("router.top_k_normalized", N * k, 4)
    x_rg = _gemma4_norm(saved, "pre_feedforward_layernorm_2", N, C, h_rg, full, "h_mid", wd)
    saved.add("experts.row_ids", R * 2, 8)  # torch.where's (token, slot) pairs, int64
    if gate_up_trains:
        saved.add("experts.input_rows", R * C, mm)
    for name, numel in (("gate_up_proj", E * 2 * Ie * C), ("down_proj", E * C * Ie)):
        if cast and x_rg and (not plan.nf4_experts or name in ptargets):
            saved.add(f"experts.{name}_cast", numel, ad)  # each expert's slice cast anew
    saved.add("experts.gate_up_out", R * 2 * Ie, mm)  # gelu reads the gate half of it
    saved.add("experts.gelu", R * Ie, mm)
    if down_trains:
        saved.add("experts.act_product", R * Ie, mm)
    saved.add("experts.route_weight", R, 4)  # (R, 1) slice of the fp32 top-k weights
    saved.add("experts.out", R * C, mm)
    saved.add("experts.weighted_out", R * C, wd)  # index_add_ keeps its source, in x's dtype
    if not full:  # LoRA on the 3-D experts: W + B A is a new (E, out, in) tensor per forward
        ab = DTYPE_BYTES[plan.adapter_dtype]
        for name, out_f, in_f in (("gate_up_proj", 2 * Ie, C), ("down_proj", C, Ie)):
            if name not in ptargets:
                continue
            if not cast:
                saved.add(f"experts.{name}_plus_delta", E * out_f * in_f, wd)
            if ab != wd:  # the adapters cast to the experts' dtype for the baddbmm
                saved.add(f"experts.{name}_factors", E * (out_f + in_f) * ptargets[name], wd)
    _gemma4_norm(saved, "post_feedforward_layernorm_2", N, C, True, full, "experts.combined",
                 wd)
    return True


def gemma4_head_saved(config, plan, saved, ctx):
    """Gemma 4's saves outside the layers: the two scaled embeddings' scales, the per-layer
    projection and its norm (rows N L of P), the final norm, and the soft-capped logits' tanh.
    Under checkpointing the Trainer makes a LoRA model's embedding output need grad
    (enable_input_require_grads), so the per-layer projection keeps what its input's gradient
    reads (under autocast, the bf16 copy of its frozen float weight)."""
    N, wd, full = ctx["N"], ctx["wd"], plan.full
    C, P, L = config.hidden_size, config.hidden_size_per_layer_input, config.num_hidden_layers
    if full:
        saved.add("embed_tokens.input_ids", N, 8)
        saved.add("embed_scales", 2 if P else 1, wd)
    if P:
        x_rg = full or plan.gradient_checkpointing
        rg = _linear(saved, ctx, "per_layer_model_projection", "embeddings", wd, C, L * P, x_rg)
        _gemma4_norm(saved, "per_layer_projection_norm", N * L, P, rg, full,
                     "per_layer_model_projection.out", ctx["out_bytes"](
                         "per_layer_model_projection"))
    _gemma4_norm(saved, "norm", N, C, True, full, "final_input", wd)
    if full:
        saved.add("lm_head.input", N * C, ctx["ad"] or wd)
    if ctx["ad"] and ctx["ad"] != wd:
        saved.add("lm_head.weight_cast", config.vocab_size * C, ctx["ad"])
    if config.final_logit_softcapping is not None:  # tanh keeps its (N, V) output
        saved.add("softcap.tanh", N * config.vocab_size, 2 if plan.bf16 else wd)


def gemma4_checkpointed_saved(config, plan, device_type="cpu"):
    """{tensor: bytes} a checkpointed Gemma 4 step holds between forward and backward inside the
    layers (the saves outside them are gemma4_head_saved's). torch.utils.checkpoint saves each
    layer's tensor arguments: h, the first layer's a view of cat(embeddings, per-layer inputs),
    the (N, C + L P) storage every layer's per_layer_input also views. Its other arguments stay in
    the recompute closure until that layer's backward, alive but outside autograd's saves
    ("held."): the {layer type: (1, 1, T, D)} cos / sin tables, and the (k, v) each KV-shared
    layer reads from the last earlier layer of its type (k after RoPE, so in the tables' dtype
    or wider; v the v_norm output).
    Mirrors: what Gemma4Model.forward hands checkpoint() (nanosft.families.gemma4)"""
    C, L, P, T = (config.hidden_size, config.num_hidden_layers,
                  config.hidden_size_per_layer_input, plan.max_length)
    N, wd = plan.per_device_train_batch_size * T, DTYPE_BYTES[plan.dtype]
    types, modes = config.layer_types, config.kv_sharing_modes
    saved = _Saved()
    saved.add("layer_input.first", N * (C + L * P), wd)
    saved.add("layer_input.later", (L - 1) * N * C, wd)
    for kind in sorted(set(types)):  # each type's tables, computed once in the model's dtype
        saved.add(f"held.rope_cos_sin.{kind}", 2 * T * config.layer_config(types.index(kind))[0],
                  wd)
    for i, mode in enumerate(modes):
        if mode != "store" or not any(m == "reuse" and types[j] == types[i]
                                      for j, m in enumerate(modes)):
            continue
        D, KV = config.layer_config(i)
        out = _context(config, plan, i, device_type, config.intermediate_size)["out_bytes"]
        v_lin = "k_proj" if config.attention_k_eq_v and types[i] == "full_attention" else "v_proj"
        saved.add(f"held.shared_k.{i}", N * KV * D, max(out("k_proj"), wd))
        saved.add(f"held.shared_v.{i}", N * KV * D, out(v_lin))
    return saved.bytes


def _context(config, plan, layer_idx, device_type, I):
    """The walk's shared context for one layer: token count, dtypes, NF4 and LoRA targets."""
    C, H, D = config.hidden_size, config.num_attention_heads, config.head_dim
    if config.model_type == "gemma4_text":
        D = config.layer_config(layer_idx)[0]
    N, wd = plan.per_device_train_batch_size * plan.max_length, DTYPE_BYTES[plan.dtype]
    ad = 2 if plan.bf16 else None
    t, kind = config.model_type, (getattr(config, "layer_types", None) or [None] * (
        layer_idx + 1))[layer_idx]
    out_in = {"conv": C, "linear_attention": getattr(config, "linear_num_value_heads", 0)
              * getattr(config, "linear_value_head_dim", 0)}.get(kind, H * D)
    in_features = {"o_proj": H * D, "dense": C, "down_proj": I, "dense_4h_to_h": I, "w2": I,
                   "out_proj": out_in,
                   "per_layer_projection": getattr(config, "hidden_size_per_layer_input", 0)}
    if t == "glm4_moe" and is_moe_layer(config, layer_idx):  # the shared experts' width
        in_features["down_proj"] = expert_size(config) * config.n_shared_experts
    if t == "qwen3_5_moe_text":
        in_features["down_proj"] = config.shared_expert_intermediate_size
    nf4 = {lin: plan.load_in_4bit and nf4_quantizable((0, in_features.get(lin, C)), device_type)
           for lin in layer_linears(config)}

    def out_bytes(lin):  # a float base computes in the autocast dtype; a 4-bit one returns x's
        return (ad or wd) if (plan.full or not nf4[lin]) else wd

    return {"N": N, "plan": plan, "ad": ad, "wd": wd, "nf4": nf4, "out_bytes": out_bytes,
            "targets": lora_targets(config, plan), "param_targets": parameter_targets(config, plan),
            "device_type": device_type, "biased": _biased_linears(config)}


def head_saved_bytes(config, plan):
    """Bytes saved outside the decoder layers (Gemma 4), and the loss's fp32 log-probabilities."""
    saved = _Saved()
    ctx = _context(config, plan, 0, "cpu", config.intermediate_size)
    gemma4_head_saved(config, plan, saved, ctx)
    saved.add("loss.labels", ctx["N"], 8)
    saved.add("loss.total_weight", 1, 4)
    return saved.bytes, ctx["N"] * config.vocab_size * 4


def _layer_lora_linears(config, j):
    """The LoRA-able linears decoder layer j holds. The hybrid families' mixers have their own
    linears; an MoE layer holds the SwiGLU three only as shared experts (GLM's)."""
    t = config.model_type
    if t in ("lfm2", "qwen3_5_text", "qwen3_5_moe_text"):
        lfm2 = t == "lfm2"
        mixers = {"linear_attention": GATED_DELTANET_LINEARS, "conv": ("in_proj", "out_proj"),
                  "full_attention": ("q_proj", "k_proj", "v_proj",
                                     "out_proj" if lfm2 else "o_proj")}
        ffn = ("w1", "w3", "w2") if lfm2 else ("gate_proj", "up_proj", "down_proj",
                                              "shared_expert_gate")
        return mixers[config.layer_types[j]] + ffn
    shared = t == "glm4_moe" and config.n_shared_experts
    if is_moe_layer(config, j) and not shared:
        return tuple(lin for lin in layer_linears(config)
                     if lin not in ("gate_proj", "up_proj", "down_proj"))
    return layer_linears(config)


def _earlier_layer_trains(config, ctx, layer_idx):
    """Whether a layer before `layer_idx` holds LoRA, so this layer's input needs grad: LoRA on
    attention only leaves a first Gated DeltaNet or short-conv layer frozen and the next layer's
    input without grad; LoRA on the experts only, GLM's dense first layers."""
    for j in range(layer_idx):
        if is_moe_layer(config, j) and ctx["param_targets"]:
            return True
        if any(lin in ctx["targets"] for lin in _layer_lora_linears(config, j)):
            return True
    return False


def layer_saved_bytes(config, plan, first=False, device_type="cpu", layer_idx=0):
    """Bytes one decoder layer of these families saves for backward, by tensor, no checkpointing.
    Mirrors: autograd's saves in nanosft.families' olmo3, cohere2, gpt_neox, qwen3_moe, glm4_moe
    and gpt_oss decoder layers (and LFM2's, Gemma 4's, Qwen3.5's)"""
    C, I, T = config.hidden_size, config.intermediate_size, plan.max_length
    N, wd = plan.per_device_train_batch_size * T, DTYPE_BYTES[plan.dtype]
    t = config.model_type
    moe = is_moe_layer(config, layer_idx)
    if t == "lfm2":
        from nanosft.families.lfm2 import lfm2_intermediate_size

        I = lfm2_intermediate_size(config)
    ctx = _context(config, plan, layer_idx, device_type, I)
    out_bytes = ctx["out_bytes"]
    saved = _Saved()
    # the first layer's input needs no grad unless the embedding trains; a later one's, unless
    # a layer before it holds LoRA
    rg = plan.full or _earlier_layer_trains(config, ctx, layer_idx)
    if t == "olmo3":  # post-norm: h + norm(attn(h)), then h + norm(mlp(h)); no input norm
        a_rg = _attention(saved, ctx, config, layer_idx, "layer_input", rg)
        # o_proj's output is in SDPA's dtype (a 4-bit base returns its input's)
        _norm(saved, "post_attention_layernorm", N, C, a_rg, plan.full, ctx["ad"] or wd)
        m_rg = _swiglu(saved, ctx, "mlp_input", rg or a_rg, C, I)
        _norm(saved, "post_feedforward_layernorm", N, C, m_rg, plan.full, out_bytes("down_proj"))
    elif t == "gemma4_text":
        _gemma4_layer(saved, ctx, config, layer_idx, first)
    elif t in ("qwen3_5_text", "qwen3_5_moe_text"):  # pre-norm; Gated DeltaNet or attention
        n_rg = _norm(saved, "input_layernorm", N, C, rg, plan.full, wd)
        if config.layer_types[layer_idx] == "linear_attention":
            a_rg = _gated_deltanet(saved, ctx, config, "normed_1", n_rg)
        else:
            a_rg = _gated_attention(saved, ctx, config, layer_idx, "normed_1", n_rg)
        n2_rg = _norm(saved, "post_attention_layernorm", N, C, rg or a_rg, plan.full, wd)
        if moe:  # Qwen3.5-MoE: the sparse block and its gated shared expert
            moe_saved(saved, ctx, config, "normed_2", n2_rg)
        else:
            _swiglu(saved, ctx, "normed_2", n2_rg, C, I)
    elif t == "lfm2":  # pre-norm; the mixer a gated short convolution or attention
        n_rg = _norm(saved, "operator_norm", N, C, rg, plan.full, wd)
        if config.layer_types[layer_idx] == "conv":
            a_rg = _short_conv(saved, ctx, config, "normed_1", n_rg)
        else:
            a_rg = _attention(saved, ctx, config, layer_idx, "normed_1", n_rg)
        n2_rg = _norm(saved, "ffn_norm", N, C, rg or a_rg, plan.full, wd)
        _swiglu(saved, ctx, "normed_2", n2_rg, C, I, ("w1", "w3", "w2"), recomputed=False)
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

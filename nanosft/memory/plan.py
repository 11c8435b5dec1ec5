"""What the memory ledger is asked about: a run's plan and the model's parameters.

`MemoryPlan` holds a run's method, batch shape and precision under SFTConfig /
LoraConfig names; `parameter_shapes` lists a config's parameters under transformers' names (Llama's
and the families' extra norms), `lora_targets` the layer linears LoRA wraps and `nf4_quantizable`
those kept in NF4. Read by nanosft.memory (the ledger) and nanosft.memory.activations (bytes saved
for backward).
"""

import dataclasses
import re

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
OPTIMIZERS = ("adamw_torch_fused", "adamw_torch", "adamw_bnb_8bit", "paged_adamw_8bit", "sgd")
LAYER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Phi-3 keeps q/k/v and gate/up fused in one linear each (transformers Phi3Attention / Phi3MLP):
# its own names, which LoRA targets and NF4 quantizes as one weight.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
FUSED_TYPES = ("phi3",)
ATTN_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")
# Families whose attention normalizes each head of q and k (a (D,) weight each) before RoPE, and
# those with Gemma's two extra norms around the feed-forward block.
QK_NORM_TYPES = ("qwen3", "gemma3_text")
FFN_NORM_TYPES = ("gemma3_text",)
# GPT-NeoX's own names: the fused query_key_value, the output `dense`, the gelu MLP's two
NEOX_LINEARS = ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h")
ATTN_ONLY = ("q_proj", "k_proj", "v_proj", "o_proj")
# LFM2's own names: attention's out_proj, the conv's in_proj / out_proj, the SwiGLU w1 w3 w2
LFM2_LINEARS = ("q_proj", "k_proj", "v_proj", "out_proj", "in_proj", "w1", "w3", "w2")
MOE_TYPES = ("qwen3_moe", "glm4_moe", "gpt_oss")
# Qwen3.5's Gated DeltaNet layers: q, k, v fused, the output gate z, beta, the decay, the output
GATED_DELTANET_LINEARS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
# Gemma 4's per-layer inputs: a gate and a projection in each layer, one projection in the model
GEMMA4_PER_LAYER = ("per_layer_input_gate", "per_layer_projection", "per_layer_model_projection")
# the parameters LoRA may target in an MoE layer (peft target_parameters), under mlp.
EXPERT_PARAMETERS = ("experts.gate_up_proj", "experts.down_proj", "gate.weight", "router.weight")


def _fail(field, value, fix):
    raise ValueError(f"{field}={value!r} is invalid: {fix}")


@dataclasses.dataclass
class MemoryPlan:
    """What a run keeps in memory: method, batch shape, precision (SFTConfig / LoraConfig names).
    Mirrors: trl SFTConfig, peft LoraConfig, transformers BitsAndBytesConfig
    Differs: `fsdp` is the number of ranks sharding the model (transformers takes a strategy)."""

    full: bool = False  # full fine-tuning; otherwise LoRA / DoRA adapters on a frozen base
    load_in_4bit: bool = False  # NF4 base linears (QLoRA)
    bnb_4bit_use_double_quant: bool = True
    use_dora: bool = False
    r: int = 8
    target_modules: list | str | None = None  # None -> peft's default for the model type
    # peft's target_parameters (LoRA on the 3-D experts, the router): names, or {name: rank}
    target_parameters: list | dict | None = None
    dtype: str = "float32"  # base weights as loaded (from_pretrained dtype)
    per_device_train_batch_size: int = 8
    max_length: int = 1024
    gradient_checkpointing: bool = False
    optim: str = "adamw_torch_fused"
    optim_args: str | None = None
    bf16: bool = False  # bf16 autocast (mixed precision): weights stay in `dtype`
    fsdp: int = 1
    # experts stored as NF4 by families.nf4_experts.quantize_experts (frozen; double quantization
    # as bnb_4bit_use_double_quant)
    nf4_experts: bool = False
    # SFTTrainer's speed path (nanosft.fast.lm_head): lm_head over 256 supervised tokens at a time,
    # no (B, T, V) logits; False: transformers' path, the full logits and the loss's log-probs
    fused_lm_head: bool = False
    # TrainingArguments.nf4_dequantize="per_step": every 4-bit weight dequantized once per step
    # and held until the optimizer step (nanosft.fast.nf4.hold_dequantized)
    nf4_held: bool = False

    def __post_init__(self):
        for name in ("per_device_train_batch_size", "max_length", "r", "fsdp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                _fail(name, value, "it must be a whole number >= 1")
        if self.dtype not in DTYPE_BYTES:
            _fail("dtype", self.dtype, f"choose one of {', '.join(DTYPE_BYTES)}")
        if self.optim not in OPTIMIZERS:
            _fail("optim", self.optim, f"choose one of {', '.join(OPTIMIZERS)}")
        if self.full and (self.load_in_4bit or self.use_dora):
            _fail("full", True, "full fine-tuning trains every weight, so it takes no 4-bit base "
                  "and no DoRA; drop --qlora / --dora or --full")

    def experts_train(self):
        """Whether the 3-D expert weights themselves train (full, and not frozen NF4 codes)."""
        return self.full and not self.nf4_experts

    @property
    def adapter_dtype(self):
        """bf16 adapters on a 4-bit base (SFTTrainer casts them), else the base dtype."""
        return "bfloat16" if self.load_in_4bit else self.dtype


def layer_linears(config):
    """Short names of the decoder layers' linears: Llama's seven, Phi-3's four (fused), GPT-NeoX's
    four; an MoE model's attention four plus the SwiGLU three where a dense MLP or shared experts
    exist (the 3-D experts and the router are parameters, not linears)."""
    if config.model_type in FUSED_TYPES:
        return ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    if config.model_type == "gpt_neox":
        return NEOX_LINEARS
    if config.model_type == "qwen3_moe":
        dense = any(not config.is_sparse(i) for i in range(config.num_hidden_layers))
        return LAYER_LINEARS if dense else ATTN_ONLY
    if config.model_type == "glm4_moe":
        dense = config.first_k_dense_replace > 0 or config.n_shared_experts > 0
        return LAYER_LINEARS if dense else ATTN_ONLY
    if config.model_type == "gpt_oss":
        return ATTN_ONLY
    if config.model_type == "lfm2":
        return LFM2_LINEARS
    if config.model_type == "qwen3_5_text":
        return LAYER_LINEARS + GATED_DELTANET_LINEARS
    if config.model_type == "qwen3_5_moe_text":  # the shared expert's three and its gate
        return LAYER_LINEARS + GATED_DELTANET_LINEARS + ("shared_expert_gate",)
    if config.model_type == "gemma4_text":  # (the MoE block's router: one more linear, proj)
        return (LAYER_LINEARS + (GEMMA4_PER_LAYER if config.hidden_size_per_layer_input else ())
                + (("proj",) if config.enable_moe_block else ()))
    return LAYER_LINEARS


def is_moe_layer(config, i):
    """Whether decoder layer i has routed experts (the families' own rule)."""
    if config.model_type == "qwen3_moe":
        return config.is_sparse(i)
    if config.model_type == "glm4_moe":
        return i >= config.first_k_dense_replace
    return config.model_type in ("gpt_oss", "qwen3_5_moe_text")


def expert_size(config):
    """Each routed expert's intermediate size: gpt-oss's intermediate_size, else
    moe_intermediate_size."""
    if config.model_type == "gpt_oss":
        return config.intermediate_size
    return config.moe_intermediate_size


def _swiglu(p, C, I, bias=False):
    shapes = [(p + "gate_proj.weight", (I, C)), (p + "up_proj.weight", (I, C)),
              (p + "down_proj.weight", (C, I))]
    if bias:
        shapes += [(p + "gate_proj.bias", (I,)), (p + "up_proj.bias", (I,)),
                   (p + "down_proj.bias", (C,))]
    return shapes


def _lfm2_layer_shapes(config, i):
    """One LFM2 layer: a gated short convolution or attention (q/k norms per head, out_proj),
    then SwiGLU w1 / w3 / w2. Mirrors: transformers Lfm2DecoderLayer"""
    from nanosft.families.lfm2 import lfm2_intermediate_size

    C, I, K = config.hidden_size, lfm2_intermediate_size(config), config.conv_L_cache
    H, KV, D = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    p = f"model.layers.{i}."
    if config.layer_types[i] == "conv":
        c = p + "conv."
        shapes = [(c + "conv.weight", (C, 1, K)), (c + "in_proj.weight", (3 * C, C)),
                  (c + "out_proj.weight", (C, C))]
        if config.conv_bias:
            shapes += [(c + "conv.bias", (C,)), (c + "in_proj.bias", (3 * C,)),
                       (c + "out_proj.bias", (C,))]
    else:
        a = p + "self_attn."
        shapes = [(a + "q_proj.weight", (H * D, C)), (a + "k_proj.weight", (KV * D, C)),
                  (a + "v_proj.weight", (KV * D, C)), (a + "out_proj.weight", (C, H * D)),
                  (a + "q_layernorm.weight", (D,)), (a + "k_layernorm.weight", (D,))]
    f = p + "feed_forward."
    return shapes + [(f + "w1.weight", (I, C)), (f + "w3.weight", (I, C)),
                     (f + "w2.weight", (C, I)), (p + "operator_norm.weight", (C,)),
                     (p + "ffn_norm.weight", (C,))]


def _qwen3_5_layer_shapes(config, i):
    """One Qwen3.5 layer: Gated DeltaNet (conv1d over q, k, v; decay and gate parameters; gated
    norm; five projections) or attention whose q_proj also yields the output gate (2 H D); then
    the SwiGLU MLP, or Qwen3.5-MoE's router, 3-D experts, shared expert and its (1, C) gate.
    Mirrors: transformers Qwen3_5DecoderLayer, Qwen3_5MoeDecoderLayer"""
    C, I, H, KV, D = (config.hidden_size, config.intermediate_size, config.num_attention_heads,
                      config.num_key_value_heads, config.head_dim)
    p = f"model.layers.{i}."
    if config.layer_types[i] == "linear_attention":
        a, Hv = p + "linear_attn.", config.linear_num_value_heads
        Kd = config.linear_num_key_heads * config.linear_key_head_dim
        Vd = Hv * config.linear_value_head_dim
        shapes = [(a + "dt_bias", (Hv,)), (a + "A_log", (Hv,)),
                  (a + "conv1d.weight", (2 * Kd + Vd, 1, config.linear_conv_kernel_dim)),
                  (a + "norm.weight", (config.linear_value_head_dim,)),
                  (a + "out_proj.weight", (C, Vd)), (a + "in_proj_qkv.weight", (2 * Kd + Vd, C)),
                  (a + "in_proj_z.weight", (Vd, C)), (a + "in_proj_b.weight", (Hv, C)),
                  (a + "in_proj_a.weight", (Hv, C))]
    else:
        a = p + "self_attn."
        shapes = [(a + "q_proj.weight", (2 * H * D, C)), (a + "k_proj.weight", (KV * D, C)),
                  (a + "v_proj.weight", (KV * D, C)), (a + "o_proj.weight", (C, H * D)),
                  (a + "q_norm.weight", (D,)), (a + "k_norm.weight", (D,))]
        if config.attention_bias:
            shapes += [(a + "q_proj.bias", (2 * H * D,)), (a + "k_proj.bias", (KV * D,)),
                       (a + "v_proj.bias", (KV * D,)), (a + "o_proj.bias", (C,))]
    m = p + "mlp."
    if config.model_type == "qwen3_5_moe_text":
        E, Ie = config.num_experts, config.moe_intermediate_size
        shapes += [(m + "gate.weight", (E, C)), (m + "experts.gate_up_proj", (E, 2 * Ie, C)),
                   (m + "experts.down_proj", (E, C, Ie))]
        shapes += _swiglu(m + "shared_expert.", C, config.shared_expert_intermediate_size)
        shapes.append((m + "shared_expert_gate.weight", (1, C)))
    else:
        shapes += _swiglu(m, C, I)
    return shapes + [(p + "input_layernorm.weight", (C,)),
                     (p + "post_attention_layernorm.weight", (C,))]


def _gemma4_layer_shapes(config, i):
    """One Gemma 4 layer: its own head_dim and kv heads, no k/v projections in a KV-shared layer
    (none for v in a full layer under attention_k_eq_v), a scale-free v_norm, Gemma 3's four
    norms, the per-layer input's gate, projection and norm. Mirrors: transformers
    Gemma4TextDecoderLayer"""
    C, I, H, P = (config.hidden_size, config.intermediate_size, config.num_attention_heads,
                  config.hidden_size_per_layer_input)
    D, KV = config.layer_config(i)
    p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
    shared = config.kv_sharing_modes[i] == "reuse"
    if config.use_double_wide_mlp and shared:
        I = 2 * I
    shapes = [(a + "q_proj.weight", (H * D, C)), (a + "q_norm.weight", (D,))]
    if not shared:
        shapes += [(a + "k_norm.weight", (D,)), (a + "k_proj.weight", (KV * D, C))]
        if not (config.attention_k_eq_v and config.layer_types[i] == "full_attention"):
            shapes.append((a + "v_proj.weight", (KV * D, C)))
    shapes.append((a + "o_proj.weight", (C, H * D)))
    if config.attention_bias:
        shapes += [(n.replace(".weight", ".bias"), (sh[0],)) for n, sh in shapes
                   if n.endswith("proj.weight")]
    shapes += _swiglu(p + "mlp.", C, I)
    shapes += [(p + n + ".weight", (C,)) for n in ("input_layernorm", "post_attention_layernorm",
                                                   "pre_feedforward_layernorm",
                                                   "post_feedforward_layernorm")]
    if P:
        shapes += [(p + "per_layer_input_gate.weight", (P, C)),
                   (p + "per_layer_projection.weight", (C, P)),
                   (p + "post_per_layer_input_norm.weight", (C,))]
    if config.enable_moe_block:  # router, 3-D experts, three more norms (families.gemma4_moe)
        E, Ie = config.num_experts, config.moe_intermediate_size
        shapes += [(p + "router.scale", (C,)), (p + "router.per_expert_scale", (E,)),
                   (p + "router.proj.weight", (E, C)), (p + "experts.gate_up_proj", (E, 2 * Ie, C)),
                   (p + "experts.down_proj", (E, C, Ie))]
        shapes += [(p + n + ".weight", (C,)) for n in ("post_feedforward_layernorm_1",
                                                       "post_feedforward_layernorm_2",
                                                       "pre_feedforward_layernorm_2")]
    return shapes


def _family_layer_shapes(config, i):
    """One layer's (name, shape) for OLMo 3, Cohere 2, GPT-NeoX and the MoE families.
    Mirrors: transformers Olmo3DecoderLayer, Cohere2DecoderLayer, GPTNeoXLayer,
    Qwen3MoeDecoderLayer, Glm4MoeDecoderLayer, GptOssDecoderLayer"""
    C, I = config.hidden_size, config.intermediate_size
    H, KV, D = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    t = config.model_type
    if t == "lfm2":
        return _lfm2_layer_shapes(config, i)
    if t == "gemma4_text":
        return _gemma4_layer_shapes(config, i)
    if t in ("qwen3_5_text", "qwen3_5_moe_text"):
        return _qwen3_5_layer_shapes(config, i)
    if t == "gpt_neox":
        p, b = f"gpt_neox.layers.{i}.", config.attention_bias
        norms = ("input_layernorm", "post_attention_layernorm")
        shapes = [(p + n + leaf, (C,)) for leaf in (".weight", ".bias") for n in norms]
        shapes += [(p + "attention.query_key_value.weight", (3 * C, C)),
                   (p + "attention.dense.weight", (C, C)),
                   (p + "mlp.dense_h_to_4h.weight", (I, C)), (p + "mlp.dense_h_to_4h.bias", (I,)),
                   (p + "mlp.dense_4h_to_h.weight", (C, I)), (p + "mlp.dense_4h_to_h.bias", (C,))]
        if b:
            shapes += [(p + "attention.query_key_value.bias", (3 * C,)),
                       (p + "attention.dense.bias", (C,))]
        return shapes
    p = f"model.layers.{i}."
    a, bias = p + "self_attn.", config.attention_bias
    shapes = [(a + "q_proj.weight", (H * D, C)), (a + "k_proj.weight", (KV * D, C)),
              (a + "v_proj.weight", (KV * D, C)), (a + "o_proj.weight", (C, H * D))]
    if bias:
        shapes += [(a + "q_proj.bias", (H * D,)), (a + "k_proj.bias", (KV * D,)),
                   (a + "v_proj.bias", (KV * D,))]
        if t != "glm4_moe":  # GLM's o_proj has no bias
            shapes.append((a + "o_proj.bias", (C,)))
    if t == "olmo3":  # norms over the whole projections, on the sublayer outputs
        shapes += [(a + "q_norm.weight", (H * D,)), (a + "k_norm.weight", (KV * D,)),
                   (p + "post_attention_layernorm.weight", (C,)),
                   (p + "post_feedforward_layernorm.weight", (C,))]
        return shapes + _swiglu(p + "mlp.", C, I, config.mlp_bias)
    shapes.append((p + "input_layernorm.weight", (C,)))
    if t == "cohere2":  # one LayerNorm feeds attention and MLP side by side
        return shapes + _swiglu(p + "mlp.", C, I, config.mlp_bias)
    shapes.append((p + "post_attention_layernorm.weight", (C,)))
    if t == "qwen3_moe" or t == "glm4_moe" and config.use_qk_norm:
        shapes += [(a + "q_norm.weight", (D,)), (a + "k_norm.weight", (D,))]
    if t == "gpt_oss":
        shapes.append((a + "sinks", (H,)))
    if not is_moe_layer(config, i):
        return shapes + _swiglu(p + "mlp.", C, I)
    E, Ie, m = config.num_experts, expert_size(config), p + "mlp."
    if t == "gpt_oss":  # transposed (E, in, out), with biases; the router has a bias
        return shapes + [(m + "router.weight", (E, C)), (m + "router.bias", (E,)),
                         (m + "experts.gate_up_proj", (E, C, 2 * Ie)),
                         (m + "experts.gate_up_proj_bias", (E, 2 * Ie)),
                         (m + "experts.down_proj", (E, Ie, C)),
                         (m + "experts.down_proj_bias", (E, C))]
    shapes += [(m + "gate.weight", (E, C)), (m + "experts.gate_up_proj", (E, 2 * Ie, C)),
               (m + "experts.down_proj", (E, C, Ie))]
    if t == "glm4_moe":
        shapes += _swiglu(m + "shared_experts.", C, Ie * config.n_shared_experts)
    return shapes


FAMILY_SHAPE_TYPES = ("olmo3", "cohere2", "gpt_neox", "lfm2", "gemma4_text",
                      "qwen3_5_text", "qwen3_5_moe_text") + MOE_TYPES


def parameter_shapes(config):
    """(name, shape) of every parameter under transformers' names; a tied lm_head once. Llama's,
    plus the per-head q/k norms (Qwen3, Gemma 3), Gemma 3's feed-forward norms and Phi-3's fused
    qkv_proj ((H + 2 KV) * D, C) and gate_up_proj (2 I, C).
    Mirrors: transformers LlamaForCausalLM.state_dict keys (Qwen3, Gemma3ForCausalLM)"""
    C, V, I = config.hidden_size, config.vocab_size, config.intermediate_size
    H, KV, D = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    out = {"q_proj": H * D, "k_proj": KV * D, "v_proj": KV * D, "o_proj": C, "gate_proj": I,
           "up_proj": I, "down_proj": C, "qkv_proj": (H + 2 * KV) * D, "gate_up_proj": 2 * I}
    inp = {"q_proj": C, "k_proj": C, "v_proj": C, "o_proj": H * D, "gate_proj": C, "up_proj": C,
           "down_proj": I, "qkv_proj": C, "gate_up_proj": C}
    if config.model_type in FAMILY_SHAPE_TYPES:
        top = "gpt_neox." if config.model_type == "gpt_neox" else "model."
        shapes = [(top + ("embed_in" if top == "gpt_neox." else "embed_tokens") + ".weight",
                   (V, C))]
        for i in range(config.num_hidden_layers):
            shapes += _family_layer_shapes(config, i)
        if config.model_type == "gpt_neox":
            shapes += [("gpt_neox.final_layer_norm.weight", (C,)),
                       ("gpt_neox.final_layer_norm.bias", (C,))]
        else:  # (LFM2's final norm: embedding_norm)
            final = "embedding_norm" if config.model_type == "lfm2" else "norm"
            shapes.append((f"model.{final}.weight", (C,)))
        P = getattr(config, "hidden_size_per_layer_input", 0) if config.model_type == \
            "gemma4_text" else 0
        if P:  # Gemma 4's second embedding and the projection mixed into it
            L = config.num_hidden_layers
            shapes += [("model.embed_tokens_per_layer.weight",
                        (config.vocab_size_per_layer_input, L * P)),
                       ("model.per_layer_model_projection.weight", (L * P, C)),
                       ("model.per_layer_projection_norm.weight", (P,))]
        if not config.tie_word_embeddings:
            shapes.append(("lm_head.weight", (V, C)))
        return shapes
    shapes = [("model.embed_tokens.weight", (V, C))]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.append((p + "input_layernorm.weight", (C,)))
        for lin in layer_linears(config):
            block = "self_attn." if lin in ATTN_LINEARS else "mlp."
            shapes.append((p + block + lin + ".weight", (out[lin], inp[lin])))
            bias = config.mlp_bias if block == "mlp." else config.attention_bias
            if bias and not (lin == "o_proj" and config.model_type == "qwen2"):
                shapes.append((p + block + lin + ".bias", (out[lin],)))
        if config.model_type in QK_NORM_TYPES:
            shapes += [(p + "self_attn.q_norm.weight", (D,)), (p + "self_attn.k_norm.weight", (D,))]
        shapes.append((p + "post_attention_layernorm.weight", (C,)))
        if config.model_type in FFN_NORM_TYPES:
            shapes += [(p + "pre_feedforward_layernorm.weight", (C,)),
                       (p + "post_feedforward_layernorm.weight", (C,))]
    shapes.append(("model.norm.weight", (C,)))
    if not config.tie_word_embeddings:
        shapes.append(("lm_head.weight", (V, C)))
    return shapes


def _resolved_target(config, plan):
    """(target_modules as peft matches them, {targeted parameter: rank}) after the rewrite peft
    applies to Qwen3-MoE / GLM-4-MoE configs (expert and router names -> target_parameters)."""
    from types import SimpleNamespace

    from nanosft.expert_lora import moe_target_conversion
    from nanosft.peft import DEFAULT_TARGET_MODULES

    target = plan.target_modules
    if target is None and config.model_type in DEFAULT_TARGET_MODULES:
        target = DEFAULT_TARGET_MODULES[config.model_type]
    elif target is None and plan.target_parameters:  # no default: the parameters alone, as peft
        target = []
    elif target is None:
        _fail("target_modules", None, f"there is no default for model_type="
              f"{config.model_type!r}; set target_modules (e.g. all-linear) or target_parameters")
    given = plan.target_parameters or {}
    given = given if isinstance(given, dict) else {name: plan.r for name in given}
    lora = SimpleNamespace(target_modules=target, target_parameters=None, rank_pattern={},
                           alpha_pattern={}, r=plan.r, lora_alpha=plan.r)
    moe_target_conversion(lora, config.model_type, layer_linears(config))
    ranks = {name: plan.r * (2 if name == "gate_up_proj" and lora.rank_pattern else 1)
             for name in lora.target_parameters or []}
    for name, rank in given.items():  # "gate_up_proj", "experts.down_proj", "mlp.gate.weight"
        for leaf in EXPERT_PARAMETERS:
            if leaf == name or leaf.endswith("." + name) or name.endswith("." + leaf):
                ranks[leaf.removeprefix("experts.")] = rank
    return lora.target_modules, ranks


def lora_targets(config, plan):
    """Short names of the layer linears LoRA wraps: target_modules, "all-linear", or peft's default.
    Mirrors: peft check_target_module_exists (list: suffix match, str: regex)"""
    if plan.full:
        return set()
    linears = layer_linears(config)
    target, _ = _resolved_target(config, plan)
    if isinstance(target, str) and target.lower() == "all-linear":
        return set(linears)
    if isinstance(target, str):
        return {lin for lin in linears if re.fullmatch(target, f"model.layers.0.x.{lin}")}
    return {lin for lin in linears if any(t == lin or t.endswith("." + lin) for t in target)}


def parameter_targets(config, plan):
    """{parameter: LoRA rank} of the parameters peft wraps (ParamWrapper): for Qwen3-MoE and
    GLM-4-MoE the experts' gate_up_proj (rank doubled: gate and up fused) and down_proj, and the
    router's gate.weight, as peft rewrites their target_modules. Mirrors: peft
    _convert_peft_config_moe"""
    return {} if plan.full else _resolved_target(config, plan)[1]


def nf4_quantizable(shape, device_type):
    """Whether nf4.quantize_model stores a linear weight of `shape` (out, in) in NF4 on this
    device: it keeps a CPU linear in float where bitsandbytes' CPU kernel decodes wrongly.
    Differs: restates nanosft.nf4.cpu_kernels_decode (blocksize 64) on shapes"""
    return device_type != "cpu" or shape[1] % 64 == 0 or shape[1] % 2 == 1

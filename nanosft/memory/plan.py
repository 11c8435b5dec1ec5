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
    dtype: str = "float32"  # base weights as loaded (from_pretrained dtype)
    per_device_train_batch_size: int = 8
    max_length: int = 1024
    gradient_checkpointing: bool = False
    optim: str = "adamw_torch_fused"
    optim_args: str | None = None
    bf16: bool = False  # bf16 autocast (mixed precision): weights stay in `dtype`
    fsdp: int = 1

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

    @property
    def adapter_dtype(self):
        """bf16 adapters on a 4-bit base (SFTTrainer casts them), else the base dtype."""
        return "bfloat16" if self.load_in_4bit else self.dtype


def layer_linears(config):
    """Short names of one decoder layer's linears: Llama's seven, or Phi-3's four (fused)."""
    if config.model_type in FUSED_TYPES:
        return ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    return LAYER_LINEARS


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


def lora_targets(config, plan):
    """Short names of the layer linears LoRA wraps: target_modules, "all-linear", or peft's default.
    Mirrors: peft check_target_module_exists (list: suffix match, str: regex)"""
    from nanosft.peft import DEFAULT_TARGET_MODULES

    if plan.full:
        return set()
    linears = layer_linears(config)
    target = plan.target_modules
    if target is None:
        if config.model_type not in DEFAULT_TARGET_MODULES:
            _fail("target_modules", None, f"there is no default for model_type="
                  f"{config.model_type!r}; set target_modules (e.g. all-linear)")
        target = DEFAULT_TARGET_MODULES[config.model_type]
    if isinstance(target, str) and target.lower() == "all-linear":
        return set(linears)
    if isinstance(target, str):
        return {lin for lin in linears if re.fullmatch(target, f"model.layers.0.x.{lin}")}
    return {lin for lin in linears if any(t == lin or t.endswith("." + lin) for t in target)}


def nf4_quantizable(shape, device_type):
    """Whether nf4.quantize_model stores a linear weight of `shape` (out, in) in NF4 on this
    device: it keeps a CPU linear in float where bitsandbytes' CPU kernel decodes wrongly.
    Differs: restates nanosft.nf4.cpu_kernels_decode (blocksize 64) on shapes"""
    return device_type != "cpu" or shape[1] % 64 == 0 or shape[1] % 2 == 1

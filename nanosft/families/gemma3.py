"""Gemma 3 text (`gemma3_text`): Llama with Gemma's norms, GeGLU and two kinds of layer.

What changes: the embeddings are scaled by sqrt(hidden_size); every RMSNorm multiplies by
(1 + weight) (weights stored around 0); four norms per layer, the attention and MLP outputs normed
too; GeGLU (gelu, tanh approximation) instead of SwiGLU; Qwen3's q_norm / k_norm; the attention
scale is query_pre_attn_scalar ** -0.5; `layer_types` mixes sliding-window layers (local RoPE,
base 10,000) and full-attention layers (global RoPE, base 1,000,000, optionally linearly scaled).
Paper: Gemma 3 technical report 2503.19786.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nanosft.configuration import ModelConfig
from nanosft.families.qwen3 import Qwen3Attention
from nanosft.model import MLP, CausalLM, DecoderLayer, DecoderModel, RMSNorm
from nanosft.rope import check_rope, rope_cos_sin, standardize_rope

LAYER_TYPES = ("sliding_attention", "full_attention")
DEFAULT_THETA = {"sliding_attention": 10_000.0, "full_attention": 1_000_000.0}


@dataclass
class Gemma3Config(ModelConfig):
    """ModelConfig plus Gemma 3's fields, with Gemma3TextConfig's defaults.
    Mirrors: transformers Gemma3TextConfig
    Differs: rope_parameters is always per layer type; softcapping and bidirectional attention
    (both off in Gemma 3 checkpoints) are refused."""

    ARCHITECTURES = {"gemma3_text": "Gemma3ForCausalLM"}
    UNREAD_FIELDS = ("hidden_act", "mlp_bias")  # transformers never reads these
    model_type: str = "gemma3_text"
    vocab_size: int = 262_208
    hidden_size: int = 2304
    intermediate_size: int = 9216
    num_hidden_layers: int = 26
    num_attention_heads: int = 8
    num_key_value_heads: int | None = 4
    head_dim: int | None = 256
    hidden_activation: str = "gelu_pytorch_tanh"
    max_position_embeddings: int = 131_072
    tie_word_embeddings: bool = True
    pad_token_id: int | None = 0
    eos_token_id: int | list | None = 1
    bos_token_id: int | None = 2
    query_pre_attn_scalar: float = 256
    sliding_window: int | None = 4096
    sliding_window_pattern: int = 6  # default layer_types: every 6th layer full
    layer_types: list | None = None
    # {"sliding_attention": {"rope_type", "rope_theta", ...}, "full_attention": {...}}
    rope_parameters: dict | None = None
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    use_bidirectional_attention: bool | None = False

    def __post_init__(self):
        super().__post_init__()
        for name in ("final_logit_softcapping", "attn_logit_softcapping"):
            if getattr(self, name) is not None:
                raise ValueError(f"config: {name}={getattr(self, name)} is not supported "
                                 "(Gemma 3 checkpoints leave it null)")
        if self.use_bidirectional_attention:
            raise ValueError("config: use_bidirectional_attention=true is not supported")
        if self.hidden_activation != "gelu_pytorch_tanh":
            raise ValueError(f"config: hidden_activation={self.hidden_activation!r} is not "
                             "supported; Gemma 3 uses 'gelu_pytorch_tanh'")
        if self.layer_types is None:
            self.layer_types = ["full_attention" if (i + 1) % self.sliding_window_pattern == 0
                                else "sliding_attention" for i in range(self.num_hidden_layers)]
        rope = self.rope_parameters or {}
        self.rope_parameters = {t: {"rope_theta": DEFAULT_THETA[t], **(rope.get(t) or {})}
                                for t in LAYER_TYPES}
        for t, p in self.rope_parameters.items():  # any type: default .. llama3 (nanosft.rope)
            self.rope_parameters[t] = standardize_rope(p, self.max_position_embeddings)
            check_rope(f"rope_parameters[{t!r}]", self.rope_parameters[t], self.head_dim)

    @classmethod
    def from_dict(cls, d):
        """ModelConfig.from_dict, reading transformers-4's rope_theta (global), rope_scaling
        (global) and rope_local_base_freq into rope_parameters per layer type.
        Mirrors: transformers Gemma3TextConfig.convert_rope_params_to_dict"""
        if isinstance(d, dict) and "_sliding_window_pattern" in d:  # transformers writes it so
            d = {"sliding_window_pattern": d["_sliding_window_pattern"], **d}
        if isinstance(d, dict) and not d.get("rope_parameters"):
            d = dict(d)
            full = {**(d.pop("rope_scaling", None) or {}),
                    "rope_theta": d.pop("rope_theta", DEFAULT_THETA["full_attention"])}
            local = d.pop("rope_local_base_freq", DEFAULT_THETA["sliding_attention"])
            d["rope_parameters"] = {"full_attention": full, "sliding_attention":
                                    {"rope_type": "default", "rope_theta": local}}
        # ModelConfig reads the per-type dict as a scaling without rope_type (default): harmless
        return super().from_dict(d)

    def to_dict(self):
        """The transformers-5 config.json dict, rope_parameters per layer type."""
        d = super().to_dict()
        d.pop("hidden_act")  # Gemma's field is hidden_activation
        d.update(rope_parameters=self.rope_parameters)
        return d


class Gemma3RMSNorm(RMSNorm):
    """RMSNorm times (1 + weight), all in fp32, then cast (Llama: weight times the cast).
    Weights are built as zeros. Mirrors: transformers Gemma3RMSNorm"""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__(hidden_size, eps)
        nn.init.zeros_(self.weight)

    def _normalize(self, x):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3ScaledEmbedding(nn.Embedding):
    """nn.Embedding whose output is multiplied by sqrt(hidden_size), the scale first cast to the
    weight dtype (so in bf16 it is rounded, as in transformers).
    Mirrors: transformers Gemma3TextScaledWordEmbedding"""

    def __init__(self, num_embeddings, embedding_dim, padding_idx=None):
        super().__init__(num_embeddings, embedding_dim, padding_idx=padding_idx)
        self.embed_scale = embedding_dim**0.5

    def forward(self, input_ids):
        """(B, T) ids -> (B, T, C) embeddings * sqrt(C)."""
        scale = torch.tensor(self.embed_scale).to(self.weight.dtype)
        return super().forward(input_ids) * scale.to(self.weight.device)


class Gemma3Attention(Qwen3Attention):
    """Qwen3's attention (q_norm, k_norm before RoPE, the window from layer_types) with Gemma's
    norms, scale query_pre_attn_scalar ** -0.5 and the RoPE of its layer type.
    Mirrors: transformers Gemma3Attention"""

    def __init__(self, config, layer_idx=0):
        super().__init__(config, layer_idx)
        self.layer_type = config.layer_types[layer_idx]
        self.scaling = config.query_pre_attn_scalar**-0.5  # Llama: head_dim ** -0.5
        self.q_norm = Gemma3RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = Gemma3RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x, cos, sin, mask, past=None):
        """Qwen3Attention.forward with this layer type's cos, sin (dicts by layer type)."""
        return super().forward(x, cos[self.layer_type], sin[self.layer_type], mask, past)


class Gemma3MLP(MLP):
    """GeGLU: down_proj(gelu_tanh(gate_proj(x)) * up_proj(x)) (Llama: silu).
    Mirrors: transformers Gemma3MLP"""

    def _glu(self, gate, up):
        return F.gelu(gate, approximate="tanh") * up  # Llama: F.silu(gate) * up


class Gemma3DecoderLayer(DecoderLayer):
    """Four norms: each sublayer's input and output are normed before the residual add.
    Mirrors: transformers Gemma3DecoderLayer"""

    attention_class = Gemma3Attention
    mlp_class = Gemma3MLP

    def __init__(self, config, layer_idx=0):
        super().__init__(config, layer_idx)
        C, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = Gemma3RMSNorm(C, eps)
        # Gemma: post_attention_layernorm norms the attention *output* (Llama: the MLP input)
        self.post_attention_layernorm = Gemma3RMSNorm(C, eps)
        self.pre_feedforward_layernorm = Gemma3RMSNorm(C, eps)
        self.post_feedforward_layernorm = Gemma3RMSNorm(C, eps)

    def forward(self, h, cos, sin, mask, past=None):
        """(B, T, C) residual stream in and out, plus this layer's (k, v)."""
        a, kv = self.self_attn(self.input_layernorm(h), cos, sin, mask, past)
        h = h + self.post_attention_layernorm(a)
        m = self.mlp(self.pre_feedforward_layernorm(h))
        return h + self.post_feedforward_layernorm(m), kv


class Gemma3Model(DecoderModel):
    """Scaled embeddings, Gemma's final norm, and one RoPE per layer type.
    Mirrors: transformers Gemma3TextModel"""

    layer_class = Gemma3DecoderLayer

    def __init__(self, config):
        super().__init__(config)
        self.embed_tokens = Gemma3ScaledEmbedding(config.vocab_size, config.hidden_size,
                                                  padding_idx=config.pad_token_id)
        self.norm = Gemma3RMSNorm(config.hidden_size, config.rms_norm_eps)

    def rotary(self, position_ids, dtype):
        """{layer type: cos}, {layer type: sin}, each (B|1, 1, T, D): local and global RoPE.
        Mirrors: transformers Gemma3RotaryEmbedding.forward"""
        c, cos, sin = self.config, {}, {}
        for t, p in c.rope_parameters.items():
            # transformers reads YaRN's `truncate` from the outer dict, so a per-type one is unread
            p = {k: v for k, v in p.items() if k != "truncate"}
            cos[t], sin[t] = rope_cos_sin(p, c.head_dim, c.max_position_embeddings, position_ids,
                                          dtype)
        return cos, sin


class Gemma3ForCausalLM(CausalLM):
    """Mirrors: transformers Gemma3ForCausalLM"""

    config_class = Gemma3Config
    model_class = Gemma3Model

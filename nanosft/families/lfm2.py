"""LFM2 (`lfm2`): gated short-convolution layers beside grouped-query attention layers.

What changes from Llama: `layer_types` (from `full_attn_idxs`) makes each layer "full_attention"
or "conv"; a conv layer is families.short_conv.ShortConv (C * conv(B * x), a window of
conv_L_cache tokens cached in place of (k, v)). The attention has q_layernorm / k_layernorm (Qwen3's
q_norm / k_norm) and names its output `out_proj`; the MLP is SwiGLU named w1 (gate), w3 (up),
w2 (down), its width rounded as `block_auto_adjust_ff_dim` says; the layer norms are
operator_norm and ffn_norm, the final one embedding_norm. The layers run under families.hybrid.
"""

from dataclasses import dataclass

from torch import nn

from nanosft.configuration import ModelConfig
from nanosft.families.hybrid import HybridModel
from nanosft.families.short_conv import ShortConv
from nanosft.model import MLP, Attention, CausalLM, RMSNorm, rotate_half

LAYER_TYPES = ("full_attention", "conv")


@dataclass
class Lfm2Config(ModelConfig):
    """ModelConfig plus LFM2's conv and MLP-width fields, with Lfm2Config's defaults.
    Mirrors: transformers Lfm2Config"""

    ARCHITECTURES = {"lfm2": "Lfm2ForCausalLM"}
    # transformers never reads these
    UNREAD_FIELDS = ("attention_bias", "hidden_act", "mlp_bias", "rms_norm_eps")
    model_type: str = "lfm2"
    vocab_size: int = 65_536
    hidden_size: int = 2560
    intermediate_size: int = 12_288
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 8
    max_position_embeddings: int = 128_000
    norm_eps: float = 1e-5  # LFM2's name for rms_norm_eps
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = True
    pad_token_id: int | None = 0
    conv_bias: bool = False
    conv_L_cache: int = 3
    block_multiple_of: int = 256
    block_ffn_dim_multiplier: float | None = 1.0
    block_auto_adjust_ff_dim: bool = True
    full_attn_idxs: list | None = None
    layer_types: list | None = None

    def __post_init__(self):
        super().__post_init__()
        self.rms_norm_eps = self.norm_eps
        if self.layer_types is None:
            idxs = self.full_attn_idxs
            idxs = range(self.num_hidden_layers) if idxs is None else idxs
            self.layer_types = ["full_attention" if i in idxs else "conv"
                                for i in range(self.num_hidden_layers)]
        if (len(self.layer_types) != self.num_hidden_layers
                or not set(self.layer_types) <= set(LAYER_TYPES)
                or "full_attention" not in self.layer_types):
            raise ValueError(f"config: layer_types={self.layer_types} must name each of the "
                             f"{self.num_hidden_layers} layers one of {LAYER_TYPES}, at least "
                             "one full_attention; fix config.json")

    @classmethod
    def from_dict(cls, d):
        """ModelConfig.from_dict, reading LFM2's older names block_ff_dim (intermediate_size) and
        tie_embedding (tie_word_embeddings) as transformers does.
        Mirrors: transformers Lfm2Config.__post_init__"""
        if isinstance(d, dict):
            aliases = {"block_ff_dim": "intermediate_size", "tie_embedding": "tie_word_embeddings"}
            d = {**d, **{new: d[old] for old, new in aliases.items() if old in d}}
        return super().from_dict(d)

    def to_dict(self):
        """ModelConfig.to_dict under LFM2's names (norm_eps; no hidden_act)."""
        d = super().to_dict()
        d.pop("rms_norm_eps"), d.pop("hidden_act")
        return d


def lfm2_intermediate_size(config):
    """The MLP width: 2/3 of intermediate_size, times the multiplier, rounded up to a multiple of
    block_multiple_of, when block_auto_adjust_ff_dim. Mirrors: transformers Lfm2MLP.__init__"""
    size = config.intermediate_size
    if config.block_auto_adjust_ff_dim:
        size = int(2 * size / 3)
        if config.block_ffn_dim_multiplier is not None:
            size = int(config.block_ffn_dim_multiplier * size)
            m = config.block_multiple_of
            size = m * ((size + m - 1) // m)
    return size


class Lfm2Attention(Attention):
    """Llama's attention with q_layernorm / k_layernorm before RoPE and o_proj named out_proj.
    Mirrors: transformers Lfm2Attention"""

    def __init__(self, config, layer_idx=0):
        super().__init__(config, layer_idx)
        del self.o_proj  # transformers' name: out_proj (the property below serves attend)
        self.out_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.q_layernorm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_layernorm = RMSNorm(self.head_dim, config.rms_norm_eps)

    @property
    def o_proj(self):
        return self.out_proj

    def forward(self, x, cos, sin, mask, past=None):
        """(B, T, C) -> (B, T, C) and the (k, v) cache."""
        B, T, _ = x.shape
        q = self.q_layernorm(self.q_proj(x).view(B, T, -1, self.head_dim)).transpose(1, 2)
        k = self.k_layernorm(self.k_proj(x).view(B, T, -1, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, KV, T, D)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        return self.attend(q, k, v, mask, past)


class Lfm2MLP(MLP):
    """SwiGLU as w2(silu(w1(x)) * w3(x)), the width from lfm2_intermediate_size.
    Mirrors: transformers Lfm2MLP"""

    def __init__(self, config):
        nn.Module.__init__(self)  # not MLP's: its linears are named otherwise
        C, I = config.hidden_size, lfm2_intermediate_size(config)
        self.w1, self.w3 = nn.Linear(C, I, bias=False), nn.Linear(C, I, bias=False)
        self.w2 = nn.Linear(I, C, bias=False)

    def forward(self, x):
        """(B, T, C) -> (B, T, I) -> (B, T, C)."""
        return self.w2(self._glu(self.w1(x), self.w3(x)))


class Lfm2DecoderLayer(nn.Module):
    """Pre-norm block whose token mixer is `self_attn` or `conv` by layer type.
    Mirrors: transformers Lfm2DecoderLayer"""

    def __init__(self, config, layer_idx=0):
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        if self.layer_type == "conv":  # transformers' order: mixer, feed_forward, norms
            self.conv = ShortConv(config, layer_idx)
        else:
            self.self_attn = Lfm2Attention(config, layer_idx)
        self.feed_forward = Lfm2MLP(config)
        self.operator_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h, cos, sin, mask, past=None):
        """(B, T, C) residual stream in and out, plus this layer's cache entry."""
        x = self.operator_norm(h)
        if self.layer_type == "conv":
            a, entry = self.conv(x, mask, past)
        else:
            a, entry = self.self_attn(x, cos, sin, mask, past)
        h = h + a
        return h + self.feed_forward(self.ffn_norm(h)), entry


class Lfm2Model(HybridModel):
    """The final norm is `embedding_norm`. Mirrors: transformers Lfm2Model"""

    layer_class = Lfm2DecoderLayer
    norm_name = "embedding_norm"

    def __init__(self, config):
        super().__init__(config)
        del self.norm
        self.embedding_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Lfm2ForCausalLM(CausalLM):
    """Mirrors: transformers Lfm2ForCausalLM"""

    config_class = Lfm2Config
    model_class = Lfm2Model

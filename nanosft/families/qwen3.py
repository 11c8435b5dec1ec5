"""Qwen3: Llama with an RMSNorm on each head's query and key before RoPE (`q_norm`, `k_norm`).

Also an explicit `head_dim` (num_attention_heads * head_dim need not equal hidden_size) and no
q/k/v bias; the optional sliding window is Qwen2's (families.sliding_window).
"""

from dataclasses import dataclass

from nanosft.configuration import ModelConfig
from nanosft.families.sliding_window import SlidingWindowAttention, layer_types
from nanosft.model import CausalLM, DecoderLayer, DecoderModel, RMSNorm, rotate_half


@dataclass
class Qwen3Config(ModelConfig):
    """ModelConfig plus Qwen3's window fields. Mirrors: transformers Qwen3Config"""

    ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM"}
    UNREAD_FIELDS = ("mlp_bias",)  # transformers never reads these
    model_type: str = "qwen3"
    head_dim: int | None = 128
    use_sliding_window: bool = False
    sliding_window: int | None = 4096
    max_window_layers: int = 28
    layer_types: list | None = None

    def __post_init__(self):
        super().__post_init__()
        self.sliding_window = self.sliding_window if self.use_sliding_window else None
        if self.layer_types is None:
            self.layer_types = layer_types(self, lambda i: i >= self.max_window_layers)


class Qwen3Attention(SlidingWindowAttention):
    """Llama's attention with q_norm and k_norm: one RMSNorm weight over head_dim each, shared by
    all heads, applied before RoPE. Mirrors: transformers Qwen3Attention"""

    def __init__(self, config, layer_idx=0):
        super().__init__(config, layer_idx)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x, cos, sin, mask, past=None):
        """Attention.forward with the two norms: (B, T, C) -> (B, T, C) and the (k, v) cache."""
        B, T, _ = x.shape
        # Qwen3: normalize each head's q and k over D (Llama: q_proj(x) straight into RoPE)
        q = self.q_norm(self.q_proj(x).view(B, T, -1, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, T, -1, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, KV, T, D)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        return self.attend(q, k, v, mask, past)


class Qwen3DecoderLayer(DecoderLayer):
    """Mirrors: transformers Qwen3DecoderLayer"""

    attention_class = Qwen3Attention


class Qwen3Model(DecoderModel):
    """Mirrors: transformers Qwen3Model"""

    layer_class = Qwen3DecoderLayer


class Qwen3ForCausalLM(CausalLM):
    """Mirrors: transformers Qwen3ForCausalLM"""

    config_class = Qwen3Config
    model_class = Qwen3Model

"""OLMo 3 (`olmo3`): Llama with post-norm layers, q/k norms over the whole projection, windows.

What changes: no input norm; each sublayer's *output* is normed before the residual add
(`post_attention_layernorm`, `post_feedforward_layernorm`); `q_norm` and `k_norm` are RMSNorms over
all heads at once (H * D and KV * D wide, before the split into heads; Qwen3's are per head); the
RMSNorm multiplies by its weight in fp32 before the cast; `layer_types` mixes sliding-window and
full layers (default: every 4th full), each type with its own RoPE parameters (as Gemma 3; OLMo 3's
released configs give the full layers YaRN).
Paper: OLMo 2 2501.00656 (the post-norm and QK-norm recipe OLMo 3 keeps).
"""

from dataclasses import dataclass

import torch

from nanosft.configuration import ModelConfig
from nanosft.families.gemma3 import Gemma3Model
from nanosft.families.sliding_window import SlidingWindowAttention
from nanosft.model import CausalLM, DecoderLayer, DecoderModel, RMSNorm, rotate_half
from nanosft.rope import check_rope, standardize_rope

LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass
class Olmo3Config(ModelConfig):
    """ModelConfig plus the window, layer types and per-type RoPE, Olmo3Config's defaults.
    Mirrors: transformers Olmo3Config"""

    ARCHITECTURES = {"olmo3": "Olmo3ForCausalLM"}
    UNREAD_FIELDS = ("mlp_bias",)  # transformers never reads these
    model_type: str = "olmo3"
    vocab_size: int = 50_304
    hidden_size: int = 4096
    intermediate_size: int = 11_008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    rms_norm_eps: float = 1e-5
    pad_token_id: int | None = 1
    bos_token_id: int | None = None
    eos_token_id: int | list | None = 50_279
    sliding_window: int | None = 4096
    layer_types: list | None = None
    rope_parameters: dict | None = None  # {"sliding_attention": {...}, "full_attention": {...}}

    def __post_init__(self):
        super().__post_init__()
        if self.layer_types is None:
            self.layer_types = ["sliding_attention" if (i + 1) % 4 else "full_attention"
                                for i in range(self.num_hidden_layers)]
        rope = self.rope_parameters or {}
        if not any(t in rope for t in LAYER_TYPES):  # one flat dict: both layer types
            rope = {t: rope for t in LAYER_TYPES}
        self.rope_parameters = {t: {"rope_theta": 500_000.0, **(rope.get(t) or {})}
                                for t in LAYER_TYPES}
        for t, p in self.rope_parameters.items():  # any type: default .. llama3 (YaRN: OLMo 3's)
            self.rope_parameters[t] = standardize_rope(p, self.max_position_embeddings)
            check_rope(f"rope_parameters[{t!r}]", self.rope_parameters[t], self.head_dim)

    @classmethod
    def from_dict(cls, d):
        """ModelConfig.from_dict, with transformers-4's rope_theta / rope_scaling read into the
        full layers' rope_parameters.
        Mirrors: transformers Olmo3Config.convert_rope_params_to_dict"""
        if isinstance(d, dict) and not d.get("rope_parameters"):
            d = dict(d)
            theta = d.pop("rope_theta", 500_000.0)
            full = dict(d.pop("rope_scaling", None) or {})
            # transformers pops rope_theta for the full layers only: the sliding ones keep 500,000
            d["rope_parameters"] = {"full_attention": {**full, "rope_theta": theta},
                                    "sliding_attention": {"rope_type": "default",
                                                          "rope_theta": 500_000.0}}
        return super().from_dict(d)

    def to_dict(self):
        """The transformers-5 config.json dict, rope_parameters per layer type."""
        return {**super().to_dict(), "rope_parameters": self.rope_parameters}


class Olmo3RMSNorm(RMSNorm):
    """RMSNorm whose weight multiplies in fp32, then the cast (Llama: the cast, then the weight).
    Mirrors: transformers Olmo3RMSNorm"""

    def _normalize(self, x):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32).to(x.dtype)


class Olmo3Attention(SlidingWindowAttention):
    """Llama's attention with q_norm / k_norm over the whole q and k projections, the RoPE of its
    layer type, and the window in sliding layers. Mirrors: transformers Olmo3Attention"""

    def __init__(self, config, layer_idx=0):
        super().__init__(config, layer_idx)
        self.layer_type = config.layer_types[layer_idx]
        H, KV, D = self.num_heads, self.num_kv_heads, self.head_dim
        self.q_norm = Olmo3RMSNorm(H * D, config.rms_norm_eps)  # Qwen3: RMSNorm(D), per head
        self.k_norm = Olmo3RMSNorm(KV * D, config.rms_norm_eps)

    def forward(self, x, cos, sin, mask, past=None):
        """(B, T, C) -> (B, T, C) and the (k, v) cache; cos, sin: dicts by layer type."""
        B, T, _ = x.shape
        cos, sin = cos[self.layer_type], sin[self.layer_type]
        # OLMo: norm the whole projection (B, T, H * D), then split into heads
        q = self.q_norm(self.q_proj(x)).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.k_norm(self.k_proj(x)).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, KV, T, D)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        return self.attend(q, k, v, mask, past)


class Olmo3DecoderLayer(DecoderLayer):
    """Post-norm: h + norm(attn(h)), then h + norm(mlp(h)); no input norm.
    Mirrors: transformers Olmo3DecoderLayer"""

    attention_class = Olmo3Attention

    def __init__(self, config, layer_idx=0):
        super().__init__(config, layer_idx)
        del self.input_layernorm  # OLMo norms the sublayer outputs only
        C, eps = config.hidden_size, config.rms_norm_eps
        self.post_attention_layernorm = Olmo3RMSNorm(C, eps)  # Llama: the MLP's input norm
        self.post_feedforward_layernorm = Olmo3RMSNorm(C, eps)

    def forward(self, h, cos, sin, mask, past=None):
        """(B, T, C) residual stream in and out, plus this layer's (k, v)."""
        a, kv = self.self_attn(h, cos, sin, mask, past)
        h = h + self.post_attention_layernorm(a)
        return h + self.post_feedforward_layernorm(self.mlp(h)), kv


class Olmo3Model(DecoderModel):
    """OLMo's final norm and one RoPE per layer type. Mirrors: transformers Olmo3Model"""

    layer_class = Olmo3DecoderLayer
    rotary = Gemma3Model.rotary  # {layer type: cos}, {layer type: sin}

    def __init__(self, config):
        super().__init__(config)
        self.norm = Olmo3RMSNorm(config.hidden_size, config.rms_norm_eps)


class Olmo3ForCausalLM(CausalLM):
    """Mirrors: transformers Olmo3ForCausalLM"""

    config_class = Olmo3Config
    model_class = Olmo3Model

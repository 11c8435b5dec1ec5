"""Cohere 2 (`cohere2`, Command R7B / A): parallel attention and MLP, LayerNorm, logit scale.

What changes from Llama: one norm per layer, a LayerNorm without bias (mean subtracted, fp32),
whose output feeds the attention and the MLP side by side: h + attn(norm(h)) + mlp(norm(h));
RoPE rotates interleaved pairs (dims 2i, 2i + 1; Llama: i and i + D/2) and only in the
sliding-window layers, the full-attention layers (default: every 4th) have no position encoding;
the logits are multiplied by `logit_scale` (tied embeddings by default).
"""

from dataclasses import dataclass

import torch
from torch import nn

from nanosft.configuration import ModelConfig
from nanosft.families.sliding_window import SlidingWindowAttention
from nanosft.model import CausalLM, DecoderLayer, DecoderModel, rope_dict
from nanosft.rope import rope_cos_sin


@dataclass
class Cohere2Config(ModelConfig):
    """ModelConfig plus the logit scale, LayerNorm epsilon, window and layer types, with
    Cohere2Config's defaults. Mirrors: transformers Cohere2Config"""

    ARCHITECTURES = {"cohere2": "Cohere2ForCausalLM"}
    UNREAD_FIELDS = ("mlp_bias", "rms_norm_eps")  # transformers never reads these
    model_type: str = "cohere2"
    vocab_size: int = 256_000
    hidden_size: int = 8192
    intermediate_size: int = 22_528
    num_hidden_layers: int = 40
    num_attention_heads: int = 64
    max_position_embeddings: int = 8192
    logit_scale: float = 0.0625
    layer_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    pad_token_id: int | None = 0
    bos_token_id: int | None = 5
    eos_token_id: int | list | None = 255_001
    sliding_window: int | None = 4096
    sliding_window_pattern: int = 4  # the default layer_types: every 4th layer full
    layer_types: list | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.layer_types is None:
            self.layer_types = ["sliding_attention" if (i + 1) % self.sliding_window_pattern
                                else "full_attention" for i in range(self.num_hidden_layers)]

    def to_dict(self):
        """ModelConfig.to_dict without the Llama norm's epsilon (Cohere's is layer_norm_eps)."""
        d = super().to_dict()
        d.pop("rms_norm_eps")
        return d


class Cohere2LayerNorm(nn.Module):
    """LayerNorm without a bias, computed in fp32: (x - mean) / sqrt(var + eps) * weight.
    Mirrors: transformers Cohere2LayerNorm"""

    def __init__(self, hidden_size, eps=1e-5):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(hidden_size)), eps

    def forward(self, x):
        """(..., C) -> (..., C)."""
        x32 = x.float()
        centred = x32 - x32.mean(-1, keepdim=True)
        x32 = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x32).to(x.dtype)


def rotate_interleaved(x):
    """(x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...): pairs of neighbours.
    Mirrors: transformers Cohere2 rotate_half"""
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


class Cohere2Attention(SlidingWindowAttention):
    """Llama's attention; in sliding layers RoPE on interleaved pairs (in fp32) and the window, in
    full layers no position encoding at all. Mirrors: transformers Cohere2Attention"""

    def forward(self, x, cos, sin, mask, past=None):
        """(B, T, C) -> (B, T, C) and the (k, v) cache; cos, sin: (B|1, 1, T, D) interleaved."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, KV, T, D)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        if self.sliding_window is not None:  # Cohere 2: the full layers go without RoPE
            q32, k32 = q.float(), k.float()
            q = (q32 * cos + rotate_interleaved(q32) * sin).to(q.dtype)
            k = (k32 * cos + rotate_interleaved(k32) * sin).to(k.dtype)
        return self.attend(q, k, v, mask, past)


class Cohere2DecoderLayer(DecoderLayer):
    """Parallel block: h + attn(norm(h)) + mlp(norm(h)), one LayerNorm.
    Mirrors: transformers Cohere2DecoderLayer"""

    attention_class = Cohere2Attention

    def __init__(self, config, layer_idx=0):
        super().__init__(config, layer_idx)
        del self.post_attention_layernorm  # the MLP reads the same normed input
        self.input_layernorm = Cohere2LayerNorm(config.hidden_size, config.layer_norm_eps)

    def forward(self, h, cos, sin, mask, past=None):
        """(B, T, C) residual stream in and out, plus this layer's (k, v)."""
        x = self.input_layernorm(h)
        a, kv = self.self_attn(x, cos, sin, mask, past)
        return h + a + self.mlp(x), kv


class Cohere2Model(DecoderModel):
    """Cohere's final LayerNorm, interleaved RoPE, and the logit scale applied to the final hidden
    state (lm_head is linear: lm_head(s * h) = s * lm_head(h), so the fused head sees it too).
    Mirrors: transformers Cohere2Model, Cohere2ForCausalLM.forward (logits * logit_scale)
    Differs: the scale multiplies h, not the logits: equal up to fp32 rounding."""

    layer_class = Cohere2DecoderLayer

    def __init__(self, config):
        super().__init__(config)
        self.norm = Cohere2LayerNorm(config.hidden_size, config.layer_norm_eps)

    def rotary(self, position_ids, dtype):
        """cos, sin (B|1, 1, T, D), each frequency repeated for a pair of neighbouring dims.
        Mirrors: transformers Cohere2RotaryEmbedding.forward"""
        c = self.config  # interleave: Llama's are the two halves, cat((freqs, freqs))
        return rope_cos_sin(rope_dict(c), c.head_dim, c.max_position_embeddings, position_ids,
                            dtype, interleave=True)

    def forward(self, *args, **kwargs):
        """DecoderModel.forward, the final hidden state times logit_scale."""
        h, cache = super().forward(*args, **kwargs)
        return h * self.config.logit_scale, cache


class Cohere2ForCausalLM(CausalLM):
    """Mirrors: transformers Cohere2ForCausalLM"""

    config_class = Cohere2Config
    model_class = Cohere2Model

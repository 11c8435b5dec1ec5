"""Qwen3.5 text (`qwen3_5_text`): Gated DeltaNet layers interleaved with gated full attention.

What changes from Llama: `layer_types` (by default three "linear_attention" layers, then one
"full_attention") picks each layer's token mixer: Gated DeltaNet (families.gated_deltanet, its
state in the cache) or attention whose q_proj also yields an output gate (o_proj reads
attn * sigmoid(gate)), with Qwen3's q_norm / k_norm and RoPE on the first partial_rotary_factor
(0.25) of each head; every RMSNorm but the gated one multiplies by (1 + weight). The layers run
under families.hybrid's forward. The MoE variant (`qwen3_5_moe_text`) is families.qwen3_5_moe.
"""

from dataclasses import dataclass

import torch
from torch import nn

from nanosft.configuration import ModelConfig
from nanosft.families.gated_deltanet import GatedDeltaNet
from nanosft.families.gemma3 import Gemma3RMSNorm
from nanosft.families.hybrid import HybridModel
from nanosft.families.phi3 import apply_partial_rotary
from nanosft.model import MLP, Attention, CausalLM, rope_dict
from nanosft.rope import check_rope, rope_cos_sin, standardize_rope

LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass
class Qwen3_5Config(ModelConfig):
    """ModelConfig plus Qwen3.5's linear-attention fields, with Qwen3_5TextConfig's defaults.
    Mirrors: transformers Qwen3_5TextConfig
    Differs: rope_parameters' mrope fields are kept but unused (text positions: plain RoPE)."""

    ARCHITECTURES = {"qwen3_5_text": "Qwen3_5ForCausalLM"}
    UNREAD_FIELDS = ("mlp_bias",)  # transformers never reads these
    model_type: str = "qwen3_5_text"
    vocab_size: int = 248_320
    hidden_size: int = 4096
    intermediate_size: int = 12_288
    num_hidden_layers: int = 32
    num_attention_heads: int = 16
    num_key_value_heads: int | None = 4
    head_dim: int | None = 256
    max_position_embeddings: int = 32_768
    bos_token_id: int | None = None
    eos_token_id: int | list | None = None
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    layer_types: list | None = None
    full_attention_interval: int = 4  # default layer_types: every 4th layer full attention
    partial_rotary_factor: float = 0.25  # transformers 5 keeps it in rope_parameters

    def __post_init__(self):
        rope = dict(self.rope_scaling or {})
        self.rope_scaling = None  # ModelConfig's check knows no partial RoPE
        super().__post_init__()
        self.partial_rotary_factor = rope.get("partial_rotary_factor", self.partial_rotary_factor)
        self.rope_scaling = standardize_rope({**rope, "partial_rotary_factor":
                                              self.partial_rotary_factor},
                                             self.max_position_embeddings)
        check_rope("rope_parameters", self.rope_scaling,  # any type (mrope fields kept, unused)
                   int(self.head_dim * self.partial_rotary_factor))
        if self.layer_types is None:
            self.layer_types = ["full_attention" if (i + 1) % self.full_attention_interval == 0
                                else "linear_attention" for i in range(self.num_hidden_layers)]
        if (len(self.layer_types) != self.num_hidden_layers
                or not set(self.layer_types) <= set(LAYER_TYPES)
                or "full_attention" not in self.layer_types):
            raise ValueError(f"config: layer_types={self.layer_types} must name each of the "
                             f"{self.num_hidden_layers} layers one of {LAYER_TYPES}, at least "
                             "one full_attention; fix config.json")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"config: linear_num_value_heads={self.linear_num_value_heads} is "
                             "not a multiple of linear_num_key_heads="
                             f"{self.linear_num_key_heads}")

    def to_dict(self):
        """ModelConfig.to_dict with partial_rotary_factor inside rope_parameters only."""
        d = super().to_dict()
        d.pop("partial_rotary_factor"), d.pop("full_attention_interval")
        return d


class Qwen3_5Attention(Attention):
    """Qwen3's attention (q_norm, k_norm, zero-centred) with an output gate from q_proj's second
    half per head and RoPE on the first rotary dims only. Mirrors: transformers Qwen3_5Attention"""

    def __init__(self, config, layer_idx=0):
        super().__init__(config, layer_idx)
        H, D = self.num_heads, self.head_dim
        # per head [query | gate]: 2 D outputs (Llama: D)
        self.q_proj = nn.Linear(config.hidden_size, H * D * 2, bias=config.attention_bias)
        self.q_norm = Gemma3RMSNorm(D, config.rms_norm_eps)  # (1 + weight), as Qwen3_5RMSNorm
        self.k_norm = Gemma3RMSNorm(D, config.rms_norm_eps)

    def forward(self, x, cos, sin, mask, past=None):
        """(B, T, C) -> (B, T, C) and the (k, v) cache; cos, sin: (B|1, 1, T, rotary_dim)."""
        B, T, _ = x.shape
        q, gate = self.q_proj(x).view(B, T, -1, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q).transpose(1, 2)  # (B, H, T, D)
        k = self.k_norm(self.k_proj(x).view(B, T, -1, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, KV, T, D)
        q, k = apply_partial_rotary(q, cos, sin), apply_partial_rotary(k, cos, sin)
        if past is not None:
            k, v = torch.cat((past[0], k), dim=2), torch.cat((past[1], v), dim=2)
        if isinstance(mask, list):  # document lengths of one unpadded row
            docs = zip(*(t.split(mask, dim=2) for t in (q, k, v)))
            y = torch.cat([self.sdpa(*qkv, is_causal=True) for qkv in docs], 2)
        else:
            y = self.sdpa(q, k, v, mask, is_causal=mask is None and past is None and T > 1)
        y = y.transpose(1, 2).reshape(B, T, -1) * torch.sigmoid(gate.reshape(B, T, -1))
        return self.o_proj(y), (k, v)


class Qwen3_5DecoderLayer(nn.Module):
    """Pre-norm block whose token mixer is `linear_attn` (Gated DeltaNet) or `self_attn` by
    layer type; zero-centred norms. Mirrors: transformers Qwen3_5DecoderLayer"""

    mlp_class = MLP  # built as mlp_class(config) (qwen3_5_moe: its sparse MoE block)

    def __init__(self, config, layer_idx=0):
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        if self.layer_type == "linear_attention":  # transformers' order: mixer, mlp, norms
            self.linear_attn = GatedDeltaNet(config, layer_idx)
        else:
            self.self_attn = Qwen3_5Attention(config, layer_idx)
        self.mlp = self.mlp_class(config)
        self.input_layernorm = Gemma3RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = Gemma3RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h, cos, sin, mask, past=None):
        """(B, T, C) residual stream in and out, plus this layer's cache entry."""
        x = self.input_layernorm(h)
        if self.layer_type == "linear_attention":
            a, entry = self.linear_attn(x, mask, past)
        else:
            a, entry = self.self_attn(x, cos, sin, mask, past)
        h = h + a
        return h + self.mlp(self.post_attention_layernorm(h)), entry


class Qwen3_5Model(HybridModel):
    """Mirrors: transformers Qwen3_5TextModel"""

    layer_class = Qwen3_5DecoderLayer

    def __init__(self, config):
        super().__init__(config)
        self.norm = Gemma3RMSNorm(config.hidden_size, config.rms_norm_eps)

    def rotary(self, position_ids, dtype):
        """cos, sin (B|1, 1, T, rotary_dim), rotary_dim = head_dim * partial_rotary_factor.
        Mirrors: transformers Qwen3_5TextRotaryEmbedding (text positions: its three mrope
        sections see the same ids, so it is plain RoPE)"""
        c = self.config
        return rope_cos_sin(rope_dict(c), int(c.head_dim * c.partial_rotary_factor),
                            c.max_position_embeddings, position_ids, dtype)


class Qwen3_5ForCausalLM(CausalLM):
    """Mirrors: transformers Qwen3_5ForCausalLM"""

    config_class = Qwen3_5Config
    _keys_to_ignore_on_load_unexpected = (r"^mtp\.",)  # the multi-token-prediction head
    model_class = Qwen3_5Model

"""Phi-3 / Phi-4-mini: Llama with fused projections, partial RoPE and LongRoPE.

`qkv_proj` is q_proj, k_proj and v_proj in one linear ((H + 2 KV) * D outputs, split after it) and
`gate_up_proj` is gate_proj and up_proj in one (2 * I outputs, chunked after it); both stay fused so
checkpoints and LoRA adapters keep transformers' keys. RoPE turns only the first
head_dim * partial_rotary_factor dims of each head. LongRoPE (rope_type "longrope") divides each
frequency by a short or a long factor, long when the batch's largest position reaches
original_max_position_embeddings, and scales cos and sin by an attention factor. An optional
`sliding_window` is Mistral's (families.sliding_window). Paper: LongRoPE 2402.13753.
"""

from dataclasses import dataclass

import torch
from torch import nn

from nanosft import generation
from nanosft.configuration import ModelConfig
from nanosft.families.sliding_window import SlidingWindowAttention
from nanosft.model import MLP, CausalLM, DecoderLayer, DecoderModel, rope_dict, rotate_half
from nanosft.reference import fast_path
from nanosft.rope import rope_cos_sin


@dataclass
class Phi3Config(ModelConfig):
    """ModelConfig plus partial RoPE, LongRoPE's original length and the window.
    Mirrors: transformers Phi3Config"""

    ARCHITECTURES = {"phi3": "Phi3ForCausalLM"}
    UNREAD_FIELDS = ("attention_bias", "mlp_bias")  # transformers never reads these
    model_type: str = "phi3"
    vocab_size: int = 32064
    hidden_size: int = 3072
    intermediate_size: int = 8192
    max_position_embeddings: int = 4096
    original_max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5
    eos_token_id: int | list | None = 32000
    pad_token_id: int | None = 32000
    partial_rotary_factor: float = 1.0  # transformers 5 keeps it in rope_parameters
    sliding_window: int | None = None

    def __post_init__(self):
        rope = dict(self.rope_scaling or {})
        self.rope_scaling = None  # ModelConfig's check knows no longrope nor partial RoPE
        super().__post_init__()
        rope_type = rope.pop("type", None) or rope.get("rope_type", "default")
        rope_type = "longrope" if rope_type in ("su", "yarn") else rope_type  # as transformers
        self.partial_rotary_factor = rope.get("partial_rotary_factor", self.partial_rotary_factor)
        half = int(self.head_dim * self.partial_rotary_factor) // 2  # frequencies per head
        if rope_type not in ("default", "longrope") or rope_type == "longrope" and not all(
                len(rope.get(f) or ()) == half for f in ("short_factor", "long_factor")):
            raise ValueError(f"config: rope {rope_type} {rope} is not supported for phi3; use "
                             f"default, or longrope with {half} short_factor and long_factor")
        if rope_type == "longrope":  # transformers: the top-level field wins
            rope["original_max_position_embeddings"] = self.original_max_position_embeddings
        self.rope_scaling = {**rope, "rope_type": rope_type,
                             "partial_rotary_factor": self.partial_rotary_factor}

    @property
    def layer_types(self):
        """Every layer sliding when there is a window, as MistralConfig."""
        kind = "full_attention" if self.sliding_window is None else "sliding_attention"
        return [kind] * self.num_hidden_layers

    def to_dict(self):
        """ModelConfig.to_dict with partial_rotary_factor inside rope_parameters only."""
        d = super().to_dict()
        d.pop("partial_rotary_factor")
        return d


def apply_partial_rotary(x, cos, sin):
    """RoPE on the first rotary_dim = cos.shape[-1] dims of x (B, H, T, D); the rest pass.
    Mirrors: transformers Phi3 apply_rotary_pos_emb"""
    rotary_dim = cos.shape[-1]
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)


class Phi3Attention(SlidingWindowAttention):
    """Llama's attention with q, k, v from one fused `qkv_proj`, and partial RoPE.
    Mirrors: transformers Phi3Attention"""

    def __init__(self, config, layer_idx=0):
        super().__init__(config, layer_idx)
        del self.q_proj, self.k_proj, self.v_proj, self.o_proj  # Phi-3 fuses q, k, v
        H, KV, D = self.num_heads, self.num_kv_heads, self.head_dim
        # transformers' order (o_proj first): module order is peft's "all-linear" order
        self.o_proj = nn.Linear(H * D, config.hidden_size, bias=False)
        self.qkv_proj = nn.Linear(config.hidden_size, (H + 2 * KV) * D, bias=False)

    def forward(self, x, cos, sin, mask, past=None):
        """(B, T, C) -> (B, T, C) and the (k, v) cache; cos, sin: (B|1, 1, T, rotary_dim)."""
        B, T, _ = x.shape
        H, KV, D = self.num_heads, self.num_kv_heads, self.head_dim
        # Phi-3: one matmul, split as [q | k | v] (Llama: q_proj, k_proj, v_proj)
        q, k, v = self.qkv_proj(x).split((H * D, KV * D, KV * D), dim=-1)
        q = q.view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, KV, D).transpose(1, 2)  # (B, KV, T, D)
        v = v.view(B, T, KV, D).transpose(1, 2)
        q, k = apply_partial_rotary(q, cos, sin), apply_partial_rotary(k, cos, sin)
        return self.attend(q, k, v, mask, past)


class Phi3MLP(MLP):
    """SwiGLU with gate and up from one fused `gate_up_proj`, chunked [gate | up].
    Mirrors: transformers Phi3MLP"""

    def __init__(self, config):
        super().__init__(config)
        del self.gate_proj, self.up_proj, self.down_proj  # Phi-3 fuses gate and up
        C, I = config.hidden_size, config.intermediate_size
        # transformers' order: module order is peft's "all-linear" order
        self.gate_up_proj = nn.Linear(C, 2 * I, bias=False)
        self.down_proj = nn.Linear(I, C, bias=False)

    def forward(self, x):
        """(B, T, C) -> (B, T, 2 I) -> gate, up (B, T, I) -> (B, T, C)."""
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        if (recomputed := fast_path("recomputed")) is not None:  # speed path: silu redone backward
            return self.down_proj(recomputed(self._glu, gate, up))
        return self.down_proj(self._glu(gate, up))


class Phi3DecoderLayer(DecoderLayer):
    """Mirrors: transformers Phi3DecoderLayer (its residual dropouts are 0 in every checkpoint)"""

    attention_class = Phi3Attention
    mlp_class = Phi3MLP


class Phi3Model(DecoderModel):
    """Mirrors: transformers Phi3Model"""

    layer_class = Phi3DecoderLayer

    def rotary(self, position_ids, dtype):
        """cos, sin (B|1, 1, T, rotary_dim), times LongRoPE's attention factor, in fp32 then cast.
        One choice of long or short factors for the whole batch, by its largest position.
        Mirrors: transformers Phi3RotaryEmbedding.forward (dynamic_rope_update)"""
        c = self.config  # LongRoPE: nanosft.rope
        return rope_cos_sin(rope_dict(c), int(c.head_dim * c.partial_rotary_factor),
                            c.max_position_embeddings, position_ids, dtype)


class Phi3ForCausalLM(CausalLM):
    """Mirrors: transformers Phi3ForCausalLM"""

    config_class = Phi3Config
    model_class = Phi3Model

    def generate(self, input_ids, attention_mask=None, max_new_tokens=None, temperature=None,
                 top_k=None, top_p=None, eos_token_id=None, pad_token_id=None, streamer=None,
                 **kwargs):
        """CausalLM.generate, with the cache dropped once, when the ids first outgrow
        original_max_position_embeddings: the keys cached under short factors are re-encoded.
        Mirrors: transformers Phi3ForCausalLM.prepare_inputs_for_generation
        Differs: a row that ended before the re-encoding streams tokens after it (ids: pads)."""
        max_new_tokens, temperature, top_k, top_p = generation.resolve_decoding(
            input_ids.shape[1], max_new_tokens, temperature=temperature, top_k=top_k,
            top_p=top_p, **kwargs)
        if hasattr(streamer, "put"):  # a transformers streamer: the prompt and end() once
            streamer.put(input_ids.cpu())
            ids = self.generate(input_ids, attention_mask, max_new_tokens, temperature, top_k,
                                top_p, eos_token_id, pad_token_id, generation.stream_to(streamer))
            streamer.end()
            return ids
        args = (temperature, top_k, top_p, eos_token_id, pad_token_id, streamer)
        n = self.config.original_max_position_embeddings + 1 - input_ids.shape[1]
        if not 0 < n < max_new_tokens:  # the prompt is past it already, or the ids never get there
            return generation.generate(self, input_ids, attention_mask, max_new_tokens, *args)
        first = generation.generate(self, input_ids, attention_mask, n, *args)
        if first.shape[1] < input_ids.shape[1] + n:  # every row ended
            return first
        if attention_mask is not None:
            attention_mask = torch.cat((attention_mask, attention_mask.new_ones(len(first), n)), 1)
        ids = generation.generate(self, first, attention_mask, max_new_tokens - n, *args)
        eos = self.config.eos_token_id if eos_token_id is None else eos_token_id
        eos = torch.tensor([] if eos is None else eos, dtype=torch.long).reshape(-1)
        pads = (pad_token_id, self.config.pad_token_id, *eos.tolist(), 0)  # generation's choice
        ended = torch.isin(first[:, input_ids.shape[1]:], eos.to(ids.device)).any(-1)
        ids[ended, first.shape[1]:] = next(p for p in pads if p is not None)  # rows that ended pad
        return ids

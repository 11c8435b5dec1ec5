"""GPT-NeoX (`gpt_neox`: Pythia, the GPT-NeoX-20B line): parallel residual, LayerNorm, fused qkv.

What changes from Llama: LayerNorms with a bias; `query_key_value` is one linear whose output is
laid out per head as [q | k | v] (H, 3 D) and `dense` the output projection, both with biases; no
grouped-query heads; RoPE on the first head_dim * partial_rotary_factor dims only (0.25 by
default); the MLP is dense_h_to_4h -> gelu -> dense_4h_to_h (no gate); with
`use_parallel_residual` a layer adds attn(ln1(h)) and mlp(ln2(h)) to h side by side. transformers'
names are kept (`gpt_neox.embed_in`, `layers.N.attention`, `final_layer_norm`), so the files need no
rename but the Hub's `embed_out.weight` (transformers' lm_head). Paper: GPT-NeoX-20B 2204.06745.
"""

import re
from dataclasses import dataclass

import torch.nn.functional as F
from torch import nn

from nanosft.configuration import ModelConfig
from nanosft.families.phi3 import apply_partial_rotary
from nanosft.model import Attention, CausalLM, DecoderLayer, DecoderModel, rope_dict
from nanosft.rope import rope_cos_sin

GELU = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}  # -> F.gelu approximate


@dataclass
class GPTNeoXConfig(ModelConfig):
    """ModelConfig plus the parallel residual, LayerNorm epsilon and partial rotary factor, with
    GPTNeoXConfig's defaults. Mirrors: transformers GPTNeoXConfig"""

    ARCHITECTURES = {"gpt_neox": "GPTNeoXForCausalLM"}
    # transformers never reads these
    UNREAD_FIELDS = ("head_dim", "mlp_bias", "num_key_value_heads", "rms_norm_eps")
    model_type: str = "gpt_neox"
    vocab_size: int = 50_432
    hidden_size: int = 6144
    num_hidden_layers: int = 44
    num_attention_heads: int = 64
    intermediate_size: int = 24_576
    hidden_act: str = "gelu"
    layer_norm_eps: float = 1e-5
    bos_token_id: int | None = 0
    eos_token_id: int | list | None = 2
    use_parallel_residual: bool = True
    attention_bias: bool = True
    partial_rotary_factor: float = 0.25  # transformers 5 keeps it in rope_parameters

    def __post_init__(self):
        # not GPTNeoXConfig fields: transformers keeps them as attributes nothing reads (TRL's tiny
        # GPT-NeoX carries num_key_value_heads=2), every head is hidden_size / heads wide
        self.num_key_value_heads = self.head_dim = None
        act, rope = self.hidden_act, dict(self.rope_scaling or {})
        self.partial_rotary_factor = rope.pop("partial_rotary_factor", self.partial_rotary_factor)
        self.hidden_act, self.rope_scaling = "silu", rope or None  # ModelConfig checks the rest
        super().__post_init__()
        self.hidden_act = act
        if act not in GELU:
            raise ValueError(f"config: hidden_act={act!r} is not supported for gpt_neox; use one "
                             f"of {list(GELU)}")

    @classmethod
    def from_dict(cls, d):
        """ModelConfig.from_dict, with the older rotary_pct and rotary_emb_base (Pythia's files).
        Mirrors: GPTNeoXConfig.convert_rope_params_to_dict"""
        if isinstance(d, dict) and not d.get("rope_parameters"):
            d = {**d, "rope_theta": d.get("rotary_emb_base", d.get("rope_theta", 10000.0)),
                 "partial_rotary_factor": d.get("rotary_pct", 0.25)}
        return super().from_dict(d)

    def to_dict(self):
        """ModelConfig.to_dict, partial_rotary_factor inside rope_parameters, no Llama fields."""
        d = super().to_dict()
        for name in ("partial_rotary_factor", "rms_norm_eps", "mlp_bias", "num_key_value_heads"):
            d.pop(name)
        d["rope_parameters"]["partial_rotary_factor"] = self.partial_rotary_factor
        return d


class EmbedOutFiles:
    """GPT-NeoX files name the output head `embed_out` (the Hub's and transformers 5's
    save_pretrained), the model `lm_head`: renamed on load and back on save.
    Mirrors: transformers conversion_mapping "GPTNeoXForCausalLM" (reversed on save)"""

    @staticmethod
    def model_index(index):
        """The file index under the model's keys."""
        return {re.sub(r"^embed_out\.", "lm_head.", k): v for k, v in index.items()}

    @staticmethod
    def merge(tensors, index):
        """(key, tensor) pairs under the model's keys."""
        return ((re.sub(r"^embed_out\.", "lm_head.", k), t) for k, t in tensors)

    @staticmethod
    def split(state_dict):
        """The state dict under the files' keys."""
        return {re.sub(r"^lm_head\.", "embed_out.", k): t for k, t in state_dict.items()}


class GPTNeoXAttention(Attention):
    """Attention over one fused `query_key_value` (per head [q | k | v]) with partial RoPE, out
    through `dense`. Mirrors: transformers GPTNeoXAttention"""

    o_proj = property(lambda self: self.dense)  # what Attention.attend ends in

    def __init__(self, config, layer_idx=0):
        super().__init__(config, layer_idx)
        del self.q_proj, self.k_proj, self.v_proj, self.o_proj
        C, bias = config.hidden_size, config.attention_bias
        self.query_key_value = nn.Linear(C, 3 * C, bias=bias)
        self.dense = nn.Linear(C, C, bias=bias)

    def forward(self, x, cos, sin, mask, past=None):
        """(B, T, C) -> (B, T, C) and the (k, v) cache; cos, sin: (B|1, 1, T, rotary_dim)."""
        B, T, _ = x.shape
        # NeoX: (B, T, H, 3 D) per head, then q, k, v (Phi-3's qkv_proj: [all q | all k | all v])
        qkv = self.query_key_value(x).view(B, T, -1, 3 * self.head_dim).transpose(1, 2)
        q, k, v = qkv.chunk(3, dim=-1)  # (B, H, T, D) each
        q, k = apply_partial_rotary(q, cos, sin), apply_partial_rotary(k, cos, sin)
        return self.attend(q, k, v, mask, past)


class GPTNeoXMLP(nn.Module):
    """dense_4h_to_h(gelu(dense_h_to_4h(x))), biases on. Mirrors: transformers GPTNeoXMLP"""

    def __init__(self, config):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(config.hidden_size, config.intermediate_size)
        self.dense_4h_to_h = nn.Linear(config.intermediate_size, config.hidden_size)
        self.approximate = GELU[config.hidden_act]

    def forward(self, x):
        """(B, T, C) -> (B, T, I) -> (B, T, C)."""
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x), approximate=self.approximate))


class GPTNeoXLayer(DecoderLayer):
    """h + attn(ln1(h)) + mlp(ln2(h)) (parallel residual), or Llama's sequential order with
    LayerNorms. Mirrors: transformers GPTNeoXLayer (its dropouts are 0 in every checkpoint)"""

    self_attn = property(lambda self: self.attention)  # DecoderLayer's name for it

    def __init__(self, config, layer_idx=0):
        nn.Module.__init__(self)  # transformers' names, not DecoderLayer's
        self.use_parallel_residual = config.use_parallel_residual
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attention = GPTNeoXAttention(config, layer_idx)
        self.mlp = GPTNeoXMLP(config)

    def forward(self, h, cos, sin, mask, past=None):
        """(B, T, C) residual stream in and out, plus this layer's (k, v)."""
        a, kv = self.attention(self.input_layernorm(h), cos, sin, mask, past)
        if self.use_parallel_residual:  # both sublayers read h
            return self.mlp(self.post_attention_layernorm(h)) + a + h, kv
        a = a + h
        return self.mlp(self.post_attention_layernorm(a)) + a, kv


class GPTNeoXModel(DecoderModel):
    """embed_in, the layers, final_layer_norm, partial RoPE. Mirrors: transformers GPTNeoXModel"""

    embed_tokens = property(lambda self: self.embed_in)  # DecoderModel's names
    norm = property(lambda self: self.final_layer_norm)

    def __init__(self, config):
        nn.Module.__init__(self)
        self.config = config
        self.embed_in = nn.Embedding(config.vocab_size, config.hidden_size)  # no padding row
        self.layers = nn.ModuleList(GPTNeoXLayer(config, i)
                                    for i in range(config.num_hidden_layers))
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.gradient_checkpointing, self.checkpoint_kwargs = False, {}

    def rotary(self, position_ids, dtype):
        """cos, sin (B|1, 1, T, rotary_dim), rotary_dim = head_dim * partial_rotary_factor.
        Mirrors: transformers GPTNeoXRotaryEmbedding.forward"""
        c = self.config
        return rope_cos_sin(rope_dict(c), int(c.head_dim * c.partial_rotary_factor),
                            c.max_position_embeddings, position_ids, dtype)


class GPTNeoXForCausalLM(CausalLM):
    """The decoder under transformers' name `gpt_neox` (CausalLM's `model` reads it).
    Mirrors: transformers GPTNeoXForCausalLM"""

    config_class = GPTNeoXConfig
    # Pythia's saved attention mask buffers, which transformers drops on load
    _keys_to_ignore_on_load_unexpected = (r"attention\.bias$", r"attention\.masked_bias$")
    model_class = GPTNeoXModel
    checkpoint_conversion = EmbedOutFiles
    model = property(lambda self: self.gpt_neox)

    def __init__(self, config):
        nn.Module.__init__(self)  # CausalLM.__init__ with the decoder named gpt_neox
        self.config = config
        self.gpt_neox = GPTNeoXModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        self.tie_weights()
        self._input_grad_hook = None

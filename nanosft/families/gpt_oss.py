"""gpt-oss (`gpt_oss`): attention sinks, alternating sliding / full layers, YaRN RoPE, and MoE
MLPs with a clamped SwiGLU and biases.

What changes from Llama: every head has a learned sink logit that joins each query's softmax and
is dropped after it (attention can rest on "nothing"), so the attention is computed eagerly;
layers alternate a 128-token sliding window and full attention; RoPE is YaRN (frequencies blended
between interpolated and original by a linear ramp, cos and sin scaled by an attention factor);
q, k, v, o carry biases; RMSNorm multiplies by its weight before the cast; the MLP is an MoE
block whose router has a bias, takes the top k of the raw logits and softmaxes only those; its
experts are held transposed ((E, C, 2 I): x @ W) with gate and up interleaved (columns 0, 2, ...
and 1, 3, ...), biases, gate clamped to <= limit and up to [-limit, limit], out = (up + 1) *
gate * sigmoid(alpha * gate). The files hold the same 3-D names (bf16 checkpoints; the Hub's
MXFP4 `*_blocks` / `*_scales` are refused). Papers: gpt-oss model card 2508.10925, YaRN 2309.00071.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nanosft.configuration import ModelConfig
from nanosft.families.moe import Experts, MoeCausalLM, SparseMoeBlock, TopKRouter
from nanosft.families.olmo3 import Olmo3RMSNorm
from nanosft.families.sliding_window import SlidingWindowAttention
from nanosft.model import DecoderLayer, DecoderModel, rope_dict
from nanosft.rope import rope_cos_sin

YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 4096}


@dataclass
class GptOssConfig(ModelConfig):
    """ModelConfig plus experts, SwiGLU clamp, window, layer types and YaRN, GptOssConfig's
    defaults. Mirrors: transformers GptOssConfig"""

    ARCHITECTURES = {"gpt_oss": "GptOssForCausalLM"}
    UNREAD_FIELDS = ("mlp_bias",)  # transformers never reads these
    model_type: str = "gpt_oss"
    num_hidden_layers: int = 36
    num_local_experts: int = 128
    vocab_size: int = 201_088
    hidden_size: int = 2880
    intermediate_size: int = 2880  # each expert's
    head_dim: int | None = 64
    num_attention_heads: int = 64
    num_key_value_heads: int | None = 8
    sliding_window: int | None = 128
    max_position_embeddings: int = 131_072
    rms_norm_eps: float = 1e-5
    rope_theta: float = 150_000.0
    num_experts_per_tok: int = 4
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    router_aux_loss_coef: float = 0.001
    output_router_logits: bool = False
    layer_types: list | None = None
    attention_bias: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | list | None = None

    def __post_init__(self):
        self.rope_scaling = self.rope_scaling or YARN  # ModelConfig checks any rope type
        super().__post_init__()
        if self.layer_types is None:
            self.layer_types = ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                for i in range(self.num_hidden_layers)]

    @property
    def num_experts(self):
        """transformers' attribute_map: num_experts is num_local_experts."""
        return self.num_local_experts

    @property
    def norm_topk_prob(self):
        return False  # the top-k are softmaxed among themselves: no renormalisation to add


class GptOssFiles:
    """gpt-oss files hold the model's own keys; MXFP4 experts (the Hub's originals) are refused."""

    @staticmethod
    def model_index(index):
        packed = [k for k in index if k.endswith(("_blocks", "_scales"))]
        if packed:
            raise ValueError(f"{packed[0]} (and {len(packed) - 1} more): MXFP4-quantized experts "
                             "are not supported; load the model with transformers' "
                             "Mxfp4Config(dequantize=True) and save_pretrained it in bfloat16")
        return index

    @staticmethod
    def merge(tensors, index):
        return tensors

    @staticmethod
    def split(state_dict):
        return state_dict


class GptOssAttention(SlidingWindowAttention):
    """Attention with a learned sink per head, computed eagerly (SDPA has no sink), biases on.
    Mirrors: transformers GptOssAttention, eager_attention_forward (with s_aux)"""

    def __init__(self, config, layer_idx=0):
        super().__init__(config, layer_idx)
        H = config.num_attention_heads
        self.sinks = nn.Parameter(torch.empty(H).normal_(0.0, config.initializer_range))

    def sdpa(self, q, k, v, mask=None, is_causal=False):
        """softmax([q k^T * scale | sink]) without the sink's column, times v: (B, H, T, D)."""
        B, H, T, _ = q.shape
        k = k.repeat_interleave(H // k.shape[1], dim=1)  # grouped-query heads, as repeat_kv
        v = v.repeat_interleave(H // v.shape[1], dim=1)
        scores = (q @ k.transpose(2, 3)) * self.scaling  # (B, H, T, S)
        S = scores.shape[-1]
        if is_causal:
            mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
        if mask is not None:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        sinks = self.sinks.reshape(1, -1, 1, 1).expand(B, -1, T, -1)  # (B, H, T, 1)
        logits = torch.cat([scores, sinks], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]  # the sink's share drops
        return probs.to(v.dtype) @ v


class GptOssTopKRouter(TopKRouter):
    """Linear with a bias; the top k raw logits, softmaxed among themselves.
    Mirrors: transformers GptOssTopKRouter"""

    def __init__(self, config):
        super().__init__(config)
        self.bias = nn.Parameter(torch.zeros(config.num_experts))

    def forward(self, x):
        """(N, C) -> router_logits (N, E), top-k weights (N, k), top-k expert ids (N, k)."""
        router_logits = F.linear(x, self.weight, self.bias)
        top_value, top_index = torch.topk(router_logits, self.top_k, dim=-1)
        return router_logits, F.softmax(top_value, dim=1, dtype=top_value.dtype), top_index


class GptOssExperts(Experts):
    """E experts held transposed with biases: gate_up_proj (E, C, 2 I) with gate and up
    interleaved, down_proj (E, I, C); the clamped SwiGLU. Mirrors: transformers GptOssExperts"""

    is_transposed = True  # peft's ParamWrapper reads it: W[e] is (in, out)

    def __init__(self, config):
        nn.Module.__init__(self)
        E, C, I = config.num_experts, config.hidden_size, config.intermediate_size
        self.num_experts = E
        self.gate_up_proj = nn.Parameter(torch.empty(E, C, 2 * I))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(E, 2 * I))
        self.down_proj = nn.Parameter(torch.empty(E, I, C))
        self.down_proj_bias = nn.Parameter(torch.zeros(E, C))
        self.alpha, self.limit = config.swiglu_alpha, config.swiglu_limit

    def linear(self, x, name, e):
        """x through expert e's (in, out) slice of `name`: (n, in) -> (n, out)."""
        return x @ getattr(self, name)[e]

    def expert(self, x, e):
        """Expert e on its tokens: (n, C) -> (n, C)."""
        gate_up = self.linear(x, "gate_up_proj", e) + self.gate_up_proj_bias[e]
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]  # interleaved (Qwen3-MoE: halves)
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        return self.linear((up + 1) * glu, "down_proj", e) + self.down_proj_bias[e]


class GptOssMLP(SparseMoeBlock):
    """The router (with a bias) and the experts. Mirrors: transformers GptOssMLP"""

    def __init__(self, config):
        nn.Module.__init__(self)
        self.router = GptOssTopKRouter(config)
        self.experts = GptOssExperts(config)
        self.router_logits = None

    def forward(self, h):
        """(B, T, C) -> (B, T, C)."""
        B, T, C = h.shape
        x = h.reshape(-1, C)
        router_logits, top_k_weights, top_k_index = self.router(x)
        self.keep(router_logits)
        return self.experts(x, top_k_index, top_k_weights).reshape(B, T, C)


class GptOssDecoderLayer(DecoderLayer):
    """Llama's pre-norm layer with gpt-oss's norms, attention and MoE MLP.
    Mirrors: transformers GptOssDecoderLayer"""

    attention_class = GptOssAttention
    mlp_class = GptOssMLP

    def __init__(self, config, layer_idx=0):
        super().__init__(config, layer_idx)
        self.input_layernorm = Olmo3RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = Olmo3RMSNorm(config.hidden_size, config.rms_norm_eps)


class GptOssModel(DecoderModel):
    """YaRN RoPE and gpt-oss's final norm. Mirrors: transformers GptOssModel"""

    layer_class = GptOssDecoderLayer

    def __init__(self, config):
        super().__init__(config)
        self.norm = Olmo3RMSNorm(config.hidden_size, config.rms_norm_eps)

    def rotary(self, position_ids, dtype):
        """cos, sin (B|1, 1, T, D) times YaRN's attention factor, in fp32 then cast.
        Mirrors: transformers GptOssRotaryEmbedding.forward"""
        c = self.config
        return rope_cos_sin(rope_dict(c), c.head_dim, c.max_position_embeddings, position_ids,
                            dtype)


class GptOssForCausalLM(MoeCausalLM):
    """Mirrors: transformers GptOssForCausalLM"""

    config_class = GptOssConfig
    model_class = GptOssModel
    checkpoint_conversion = GptOssFiles

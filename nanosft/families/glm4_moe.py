"""GLM-4-MoE (`glm4_moe`: GLM-4.5, GLM-4.5-Air): a sigmoid router with a correction bias, shared
experts, dense first layers and partial RoPE.

What changes from Qwen3-MoE: the router scores each expert with a sigmoid (in fp32); a learned
`e_score_correction_bias` is added only to *choose* the experts (the weights are the unbiased
scores), within the `topk_group` best of `n_group` expert groups (a group's score: its two best);
the k weights are renormalised and times `routed_scaling_factor`; every MoE layer adds
`shared_experts` (a dense SwiGLU of n_shared_experts * moe_intermediate_size) that every token
passes; the first `first_k_dense_replace` layers are dense; RoPE turns the first half of each head
(partial_rotary_factor 0.5); optional per-head q/k norms; no bias on o_proj. transformers' forward
returns no auxiliary loss for it (DeepSeek-V3's bias balancing needs none), and neither does this.
Paper: DeepSeek-V3 2412.19437 (the auxiliary-loss-free router GLM-4.5 uses).
"""

import re
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from nanosft.configuration import ModelConfig
from nanosft.families.gpt_neox import GPTNeoXModel
from nanosft.families.moe import MoeCausalLM, PerExpertFiles, SparseMoeBlock, TopKRouter
from nanosft.families.phi3 import apply_partial_rotary
from nanosft.model import MLP, Attention, DecoderLayer, DecoderModel, RMSNorm


@dataclass
class Glm4MoeConfig(ModelConfig):
    """ModelConfig plus the router, shared experts and partial RoPE, Glm4MoeConfig's defaults.
    Mirrors: transformers Glm4MoeConfig"""

    ARCHITECTURES = {"glm4_moe": "Glm4MoeForCausalLM"}
    UNREAD_FIELDS = ("mlp_bias",)  # transformers never reads these
    model_type: str = "glm4_moe"
    vocab_size: int = 151_552
    hidden_size: int = 4096
    intermediate_size: int = 10_944
    num_hidden_layers: int = 46
    num_attention_heads: int = 96
    num_key_value_heads: int | None = 8
    max_position_embeddings: int = 131_072
    rms_norm_eps: float = 1e-5
    bos_token_id: int | None = None
    eos_token_id: int | list | None = None
    moe_intermediate_size: int = 1408
    num_experts_per_tok: int = 8
    output_router_logits: bool = False
    n_shared_experts: int = 1
    n_routed_experts: int = 128
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    first_k_dense_replace: int = 1
    norm_topk_prob: bool = True
    use_qk_norm: bool = False
    partial_rotary_factor: float = 0.5  # transformers 5 keeps it in rope_parameters

    def __post_init__(self):
        rope = dict(self.rope_scaling or {})
        self.partial_rotary_factor = rope.pop("partial_rotary_factor", self.partial_rotary_factor)
        self.rope_scaling = rope or None
        super().__post_init__()
        E, G = self.n_routed_experts, self.n_group
        if E % G or not 0 < self.topk_group <= G or self.num_experts_per_tok > E // G * \
                self.topk_group:
            raise ValueError(f"config: n_routed_experts={E} in n_group={G} groups, topk_group="
                             f"{self.topk_group}, num_experts_per_tok={self.num_experts_per_tok} "
                             "do not fit: the groups must split the experts evenly and the chosen "
                             "groups hold at least num_experts_per_tok experts")

    @property
    def num_experts(self):
        """The routed experts (transformers' attribute_map: num_local_experts)."""
        return self.n_routed_experts

    @classmethod
    def from_dict(cls, d):
        """ModelConfig.from_dict; num_local_experts is n_routed_experts."""
        if isinstance(d, dict) and "num_local_experts" in d and "n_routed_experts" not in d:
            d = {**d, "n_routed_experts": d["num_local_experts"]}
        return super().from_dict(d)

    def to_dict(self):
        """ModelConfig.to_dict with partial_rotary_factor inside rope_parameters."""
        d = super().to_dict()
        d["rope_parameters"]["partial_rotary_factor"] = d.pop("partial_rotary_factor")
        return d


class Glm4MoeFiles(PerExpertFiles):
    """PerExpertFiles without the multi-token-prediction layers GLM checkpoints append
    (model.layers.{num_hidden_layers}...), which transformers does not load either.
    Mirrors: transformers Glm4MoePreTrainedModel._keys_to_ignore_on_load_unexpected"""

    def __init__(self, num_hidden_layers):
        self.num_hidden_layers = num_hidden_layers

    def _kept(self, key):
        m = re.match(r"model\.layers\.(\d+)\.", key)
        return m is None or int(m[1]) < self.num_hidden_layers

    def model_index(self, index):
        return super().model_index({k: v for k, v in index.items() if self._kept(k)})

    def merge(self, tensors, index):
        kept = {k: v for k, v in index.items() if self._kept(k)}
        return super().merge(((k, t) for k, t in tensors if self._kept(k)), kept)


class Glm4MoeTopkRouter(TopKRouter):
    """Sigmoid scores; the correction bias picks the top-k (inside the best groups), the plain
    scores weight them. Mirrors: transformers Glm4MoeTopkRouter"""

    def __init__(self, config):
        super().__init__(config)
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.routed_scaling_factor = config.routed_scaling_factor
        self.register_buffer("e_score_correction_bias",
                             torch.zeros(config.num_experts, dtype=torch.float32))

    def forward(self, x):
        """(N, C) -> router_logits (N, E) fp32, top-k weights (N, k) fp32, expert ids (N, k)."""
        E, G = self.num_experts, self.n_group
        router_logits = F.linear(x.float(), self.weight.float())
        scores = router_logits.sigmoid()
        choice = scores + self.e_score_correction_bias  # steers the choice, not the weights
        group_scores = choice.view(-1, G, E // G).topk(2, dim=-1)[0].sum(-1)  # (N, G)
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask[:, :, None].expand(-1, G, E // G).reshape(-1, E)
        choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
        top_index = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        top_value = scores.gather(1, top_index)
        if self.norm_topk_prob:
            top_value = top_value / (top_value.sum(dim=-1, keepdim=True) + 1e-20)
        return router_logits, top_value * self.routed_scaling_factor, top_index


class Glm4MoeMoE(SparseMoeBlock):
    """SparseMoeBlock with GLM's router, plus shared experts every token passes.
    Mirrors: transformers Glm4MoeMoE"""

    def __init__(self, config):
        super().__init__(config)
        self.gate = Glm4MoeTopkRouter(config)
        shared = config.moe_intermediate_size * config.n_shared_experts
        self.shared_experts = MLP(SimpleNamespace(hidden_size=config.hidden_size,
                                                  intermediate_size=shared, mlp_bias=False))

    def forward(self, h):
        """(B, T, C) -> routed experts' sum + shared experts' output."""
        return super().forward(h) + self.shared_experts(h)


class Glm4MoeAttention(Attention):
    """Llama's attention with partial RoPE, optional per-head q/k norms and no o_proj bias.
    Mirrors: transformers Glm4MoeAttention"""

    def __init__(self, config, layer_idx=0):
        super().__init__(config, layer_idx)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.use_qk_norm = config.use_qk_norm
        if self.use_qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x, cos, sin, mask, past=None):
        """(B, T, C) -> (B, T, C) and the (k, v) cache; cos, sin: (B|1, 1, T, rotary_dim)."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, -1, self.head_dim)
        k = self.k_proj(x).view(B, T, -1, self.head_dim)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, KV, T, D)
        if self.use_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        q, k = apply_partial_rotary(q, cos, sin), apply_partial_rotary(k, cos, sin)
        return self.attend(q, k, v, mask, past)


class Glm4MoeDecoderLayer(DecoderLayer):
    """Llama's layer; an MoE block from layer first_k_dense_replace on.
    Mirrors: transformers Glm4MoeDecoderLayer"""

    attention_class = Glm4MoeAttention

    def __init__(self, config, layer_idx=0):
        super().__init__(config, layer_idx)
        if layer_idx >= config.first_k_dense_replace:
            self.mlp = Glm4MoeMoE(config)


class Glm4MoeModel(DecoderModel):
    """Mirrors: transformers Glm4MoeModel"""

    layer_class = Glm4MoeDecoderLayer
    rotary = GPTNeoXModel.rotary  # partial: rotary_dim = head_dim * partial_rotary_factor


class Glm4MoeForCausalLM(MoeCausalLM):
    """Mirrors: transformers Glm4MoeForCausalLM"""

    config_class = Glm4MoeConfig
    model_class = Glm4MoeModel
    _keep_in_fp32_modules_strict = ["e_score_correction_bias"]  # read in fp32 under bf16 / fp16

    @property
    def checkpoint_conversion(self):
        return Glm4MoeFiles(self.config.num_hidden_layers)

"""Qwen3.5-MoE text (`qwen3_5_moe_text`, e.g. Qwen3.5-35B-A3B): Qwen3.5's hybrid layers with a
sparse mixture-of-experts block as every layer's MLP.

What changes from Qwen3.5 (families.qwen3_5): each layer's MLP is families.moe's SparseMoeBlock
(softmax router over `num_experts`, the top `num_experts_per_tok` always renormalised to sum 1,
3-D experts of `moe_intermediate_size`) plus a `shared_expert`, a dense SwiGLU of
`shared_expert_intermediate_size` every token passes, scaled per token by
sigmoid(shared_expert_gate(x)) (a linear to one output); there is no dense MLP and no
`intermediate_size`. The output carries the routers' load-balancing loss (families.moe
MoeCausalLM). The multimodal folder (`qwen3_5_moe`) loads its language model, as `qwen3_5` does.
Paper: Qwen2 technical report 2407.10671 (fine-grained experts beside a gated shared expert).
"""

from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import nn

from nanosft.families.moe import MoeCausalLM, SparseMoeBlock
from nanosft.families import qwen3_5
from nanosft.families.qwen3_5 import Qwen3_5Config, Qwen3_5DecoderLayer, Qwen3_5Model
from nanosft.model import MLP

LAYER_TYPES = qwen3_5.LAYER_TYPES  # configuration.check_fields reads the config's module's


@dataclass
class Qwen3_5MoeConfig(Qwen3_5Config):
    """Qwen3_5Config plus the experts' fields, with Qwen3_5MoeTextConfig's defaults.
    Mirrors: transformers Qwen3_5MoeTextConfig"""

    ARCHITECTURES = {"qwen3_5_moe_text": "Qwen3_5MoeForCausalLM"}
    model_type: str = "qwen3_5_moe_text"
    hidden_size: int = 2048
    num_hidden_layers: int = 40
    num_key_value_heads: int | None = 2
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    num_experts_per_tok: int = 8
    num_experts: int = 256
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001

    def __post_init__(self):
        super().__post_init__()
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"config: num_experts_per_tok={self.num_experts_per_tok} must be "
                             f"between 1 and num_experts={self.num_experts}; fix config.json")

    @property
    def norm_topk_prob(self):
        """Always: Qwen3_5MoeTopKRouter divides the k weights by their sum (no config field)."""
        return True

    def to_dict(self):
        """Qwen3_5Config.to_dict less intermediate_size, which no layer of this family reads."""
        d = super().to_dict()
        d.pop("intermediate_size")
        return d


class Qwen3_5MoeSparseMoeBlock(SparseMoeBlock):
    """SparseMoeBlock (always-renormalised softmax router, 3-D experts) plus the shared expert,
    gated per token: routed(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x).
    Mirrors: transformers Qwen3_5MoeSparseMoeBlock"""

    def __init__(self, config):
        super().__init__(config)
        self.experts = self._modules.pop("experts")  # after the router: transformers' order
        self.shared_expert = MLP(SimpleNamespace(
            hidden_size=config.hidden_size, mlp_bias=False,
            intermediate_size=config.shared_expert_intermediate_size))
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, h):
        """(B, T, C) -> (B, T, C)."""
        gate = torch.sigmoid(self.shared_expert_gate(h))  # (B, T, 1)
        return super().forward(h) + gate * self.shared_expert(h)


class Qwen3_5MoeDecoderLayer(Qwen3_5DecoderLayer):
    """Mirrors: transformers Qwen3_5MoeDecoderLayer"""

    mlp_class = Qwen3_5MoeSparseMoeBlock


class Qwen3_5MoeModel(Qwen3_5Model):
    """Mirrors: transformers Qwen3_5MoeTextModel"""

    layer_class = Qwen3_5MoeDecoderLayer


class Qwen3_5MoeForCausalLM(MoeCausalLM):
    """Mirrors: transformers Qwen3_5MoeForCausalLM"""

    config_class = Qwen3_5MoeConfig
    _keys_to_ignore_on_load_unexpected = (r"^mtp\.",)  # the multi-token-prediction head
    model_class = Qwen3_5MoeModel

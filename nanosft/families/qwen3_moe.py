"""Qwen3-MoE (`qwen3_moe`): Qwen3 whose MLPs are sparse mixture-of-experts blocks.

What changes from Qwen3: each layer's MLP is families.moe's SparseMoeBlock (softmax router, top
`num_experts_per_tok` of `num_experts`, renormalised when `norm_topk_prob`), except the layers in
`mlp_only_layers` or off the `decoder_sparse_step` stride, which keep a dense SwiGLU MLP of
`intermediate_size`; the output carries the auxiliary load-balancing loss. With
`use_sliding_window` every layer is windowed (no max_window_layers here).
"""

from dataclasses import dataclass

from nanosft.configuration import ModelConfig
from nanosft.families.moe import MoeCausalLM, SparseMoeBlock
from nanosft.families.qwen3 import Qwen3Attention
from nanosft.model import DecoderLayer, DecoderModel


@dataclass
class Qwen3MoeConfig(ModelConfig):
    """ModelConfig plus the experts' and the window's fields, Qwen3MoeConfig's defaults.
    Mirrors: transformers Qwen3MoeConfig"""

    ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM"}
    UNREAD_FIELDS = ("mlp_bias",)  # transformers never reads these
    model_type: str = "qwen3_moe"
    vocab_size: int = 151_936
    hidden_size: int = 2048
    intermediate_size: int = 6144
    num_hidden_layers: int = 24
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 4
    max_position_embeddings: int = 32_768
    bos_token_id: int | None = None
    eos_token_id: int | list | None = None
    use_sliding_window: bool = False
    sliding_window: int | None = 4096
    decoder_sparse_step: int = 1
    moe_intermediate_size: int = 768
    num_experts_per_tok: int = 8
    num_experts: int = 128
    norm_topk_prob: bool = False
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001
    mlp_only_layers: list | None = None

    def __post_init__(self):
        super().__post_init__()
        self.sliding_window = self.sliding_window if self.use_sliding_window else None
        self.mlp_only_layers = list(self.mlp_only_layers or [])
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"config: num_experts_per_tok={self.num_experts_per_tok} must be "
                             f"between 1 and num_experts={self.num_experts}; fix config.json")

    @classmethod
    def from_dict(cls, d):
        """ModelConfig.from_dict; transformers writes num_experts as num_local_experts."""
        if isinstance(d, dict) and "num_local_experts" in d and "num_experts" not in d:
            d = {**d, "num_experts": d["num_local_experts"]}
        return super().from_dict(d)

    @property
    def layer_types(self):
        """Every layer windowed when there is a window (transformers' sliding-window mask)."""
        kind = "full_attention" if self.sliding_window is None else "sliding_attention"
        return [kind] * self.num_hidden_layers

    def is_sparse(self, layer_idx):
        """Whether layer layer_idx has experts. Mirrors: transformers Qwen3MoeDecoderLayer"""
        return (layer_idx not in self.mlp_only_layers and self.num_experts > 0
                and (layer_idx + 1) % self.decoder_sparse_step == 0)


class Qwen3MoeDecoderLayer(DecoderLayer):
    """Qwen3's layer with a SparseMoeBlock as its MLP where config.is_sparse(layer_idx).
    Mirrors: transformers Qwen3MoeDecoderLayer"""

    attention_class = Qwen3Attention

    def __init__(self, config, layer_idx=0):
        super().__init__(config, layer_idx)
        if config.is_sparse(layer_idx):
            self.mlp = SparseMoeBlock(config)  # Llama: the dense MLP


class Qwen3MoeModel(DecoderModel):
    """Mirrors: transformers Qwen3MoeModel"""

    layer_class = Qwen3MoeDecoderLayer


class Qwen3MoeForCausalLM(MoeCausalLM):
    """Mirrors: transformers Qwen3MoeForCausalLM"""

    config_class = Qwen3MoeConfig
    model_class = Qwen3MoeModel

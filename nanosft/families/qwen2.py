"""Qwen2: Llama with q/k/v biases (o_proj has none) and an optional sliding window.

With `use_sliding_window`, layers from `max_window_layers` on attend over the last
`sliding_window` keys (families.sliding_window); off, the window is None as in transformers.
"""

from dataclasses import dataclass

from torch import nn

from nanosft.configuration import ModelConfig
from nanosft.families.sliding_window import SlidingWindowAttention, layer_types
from nanosft.model import CausalLM, DecoderLayer, DecoderModel


@dataclass
class Qwen2Config(ModelConfig):
    """ModelConfig plus Qwen2's window fields. Mirrors: transformers Qwen2Config"""

    ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM"}
    UNREAD_FIELDS = ("attention_bias", "mlp_bias")  # transformers never reads these
    model_type: str = "qwen2"
    attention_bias: bool = True  # Qwen2: always on q, k, v (transformers has no such field)
    use_sliding_window: bool = False
    sliding_window: int | None = 4096
    max_window_layers: int = 28
    layer_types: list | None = None

    def __post_init__(self):
        super().__post_init__()
        self.attention_bias = True
        self.sliding_window = self.sliding_window if self.use_sliding_window else None
        if self.layer_types is None:
            self.layer_types = layer_types(self, lambda i: i >= self.max_window_layers)


class Qwen2Attention(SlidingWindowAttention):
    """Llama's attention with biases on q_proj, k_proj, v_proj and none on o_proj.
    Mirrors: transformers Qwen2Attention"""

    def __init__(self, config, layer_idx=0):
        super().__init__(config, layer_idx)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)


class Qwen2DecoderLayer(DecoderLayer):
    """Mirrors: transformers Qwen2DecoderLayer"""

    attention_class = Qwen2Attention


class Qwen2Model(DecoderModel):
    """Mirrors: transformers Qwen2Model"""

    layer_class = Qwen2DecoderLayer


class Qwen2ForCausalLM(CausalLM):
    """Mirrors: transformers Qwen2ForCausalLM"""

    config_class = Qwen2Config
    model_class = Qwen2Model

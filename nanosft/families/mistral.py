"""Mistral with `sliding_window`: Llama whose every layer attends over the last window keys.

Without a window Mistral is Llama (configuration.ModelConfig loads it so); with one, each layer's
mask is narrowed by families.sliding_window.
"""

from dataclasses import dataclass

from nanosft.configuration import ModelConfig
from nanosft.families.sliding_window import SlidingWindowAttention
from nanosft.model import CausalLM, DecoderLayer, DecoderModel


@dataclass
class MistralConfig(ModelConfig):
    """ModelConfig plus `sliding_window` (every layer). Mirrors: transformers MistralConfig"""

    ARCHITECTURES = {"mistral": "MistralForCausalLM"}
    UNREAD_FIELDS = ("attention_bias", "mlp_bias")  # transformers never reads these
    model_type: str = "mistral"
    sliding_window: int | None = 4096

    @property
    def layer_types(self):
        """Every layer sliding when there is a window (transformers' Mistral has no such field)."""
        kind = "full_attention" if self.sliding_window is None else "sliding_attention"
        return [kind] * self.num_hidden_layers


class MistralDecoderLayer(DecoderLayer):
    """Mirrors: transformers MistralDecoderLayer"""

    attention_class = SlidingWindowAttention


class MistralModel(DecoderModel):
    """Mirrors: transformers MistralModel"""

    layer_class = MistralDecoderLayer


class MistralForCausalLM(CausalLM):
    """Mirrors: transformers MistralForCausalLM"""

    config_class = MistralConfig
    model_class = MistralModel

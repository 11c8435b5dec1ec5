"""SmolLM3: Llama where every `no_rope_layer_interval`-th layer has no RoPE (NoPE layers).

`no_rope_layers[i] == 1` means layer i *uses* RoPE (transformers' SmolLM3Config: the default is
int((i + 1) % 4 != 0), so layers 3, 7, 11, ... go without). A NoPE layer is a rotation by angle 0:
cos = 1 and sin = 0 leave q and k exactly as they are. Sliding windows, when switched on, apply to
the NoPE layers only.
"""

from dataclasses import dataclass

import torch

from nanosft.configuration import ModelConfig
from nanosft.families.sliding_window import SlidingWindowAttention, layer_types
from nanosft.model import CausalLM, DecoderLayer, DecoderModel


@dataclass
class SmolLM3Config(ModelConfig):
    """ModelConfig plus the NoPE layers and window fields. Mirrors: transformers SmolLM3Config"""

    ARCHITECTURES = {"smollm3": "SmolLM3ForCausalLM"}
    model_type: str = "smollm3"
    rope_theta: float = 2000000.0
    tie_word_embeddings: bool = True
    no_rope_layers: list | None = None
    no_rope_layer_interval: int = 4
    use_sliding_window: bool = False
    sliding_window: int | None = None
    layer_types: list | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.no_rope_layers is None:
            self.no_rope_layers = [int((i + 1) % self.no_rope_layer_interval != 0)
                                   for i in range(self.num_hidden_layers)]
        if self.layer_types is None:
            window = self.use_sliding_window and self.sliding_window is not None
            self.layer_types = layer_types(self, lambda i: window and not self.no_rope_layers[i])


class SmolLM3Attention(SlidingWindowAttention):
    """Llama's attention, without RoPE where no_rope_layers[layer_idx] is 0.
    Mirrors: transformers SmolLM3Attention"""

    def __init__(self, config, layer_idx=0):
        super().__init__(config, layer_idx)
        self.use_rope = bool(config.no_rope_layers[layer_idx])
        if not (config.use_sliding_window and self.sliding_window):
            self.sliding_window = None  # transformers: the window only with use_sliding_window

    def forward(self, x, cos, sin, mask, past=None):
        """Attention.forward; a NoPE layer rotates by angle 0 (cos 1, sin 0: q, k unchanged)."""
        if not self.use_rope:
            cos, sin = torch.ones_like(cos), torch.zeros_like(sin)
        return super().forward(x, cos, sin, mask, past)


class SmolLM3DecoderLayer(DecoderLayer):
    """Mirrors: transformers SmolLM3DecoderLayer"""

    attention_class = SmolLM3Attention


class SmolLM3Model(DecoderModel):
    """Mirrors: transformers SmolLM3Model"""

    layer_class = SmolLM3DecoderLayer


class SmolLM3ForCausalLM(CausalLM):
    """Mirrors: transformers SmolLM3ForCausalLM"""

    config_class = SmolLM3Config
    model_class = SmolLM3Model

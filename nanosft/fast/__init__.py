"""Speed paths: where they apply, the same numbers as the teaching core's own lines, faster or in
less memory. The core reaches them only through nanosft.reference.fast_path(name), which returns
None in reference mode (NANOSFT_REFERENCE=1). Each is tested equal to reference mode.
"""

from nanosft.fast import unpad
from nanosft.fast.attention import scaled_dot_product_attention
from nanosft.fast.lm_head import fused_lm_head_outputs
from nanosft.fast.lora import add_lora, bf16_adapter_linear, link_shared_inputs, lora_addmm
from nanosft.fast.nf4 import matmul_4bit
from nanosft.fast.recompute import recomputed

__all__ = ["add_lora", "bf16_adapter_linear", "fused_lm_head_outputs", "link_shared_inputs",
           "lora_addmm", "matmul_4bit", "recomputed", "scaled_dot_product_attention", "unpad"]

"""Model families beyond Llama, one small module each: only what the family changes.

Each module subclasses the pieces of model.py that differ (an Attention, and the DecoderLayer /
DecoderModel / CausalLM that name it through their `attention_class`, `layer_class` and
`model_class`) and ModelConfig (the family's extra config.json fields). `config_from_dict` and
`causal_lm_class` pick them by `model_type`, so `CausalLM.from_pretrained(folder)` builds the
right one; model.py itself stays the Llama decoder.
"""

from nanosft.configuration import ARCHITECTURES, ModelConfig
from nanosft.families.cohere2 import Cohere2Config, Cohere2ForCausalLM
from nanosft.families.gemma3 import Gemma3Config, Gemma3ForCausalLM
from nanosft.families.glm4_moe import Glm4MoeConfig, Glm4MoeForCausalLM
from nanosft.families.gpt_neox import GPTNeoXConfig, GPTNeoXForCausalLM
from nanosft.families.gpt_oss import GptOssConfig, GptOssForCausalLM
from nanosft.families.mistral import MistralConfig, MistralForCausalLM
from nanosft.families.olmo3 import Olmo3Config, Olmo3ForCausalLM
from nanosft.families.phi3 import Phi3Config, Phi3ForCausalLM
from nanosft.families.qwen2 import Qwen2Config, Qwen2ForCausalLM
from nanosft.families.qwen3 import Qwen3Config, Qwen3ForCausalLM
from nanosft.families.qwen3_moe import Qwen3MoeConfig, Qwen3MoeForCausalLM
from nanosft.families.smollm3 import SmolLM3Config, SmolLM3ForCausalLM
from nanosft.model import CausalLM

# model_type -> (config class, model class); llama (and mistral without a window) are model.py's
FAMILIES = {
    "cohere2": (Cohere2Config, Cohere2ForCausalLM),
    "gemma3_text": (Gemma3Config, Gemma3ForCausalLM),
    "glm4_moe": (Glm4MoeConfig, Glm4MoeForCausalLM),
    "gpt_neox": (GPTNeoXConfig, GPTNeoXForCausalLM),
    "gpt_oss": (GptOssConfig, GptOssForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "olmo3": (Olmo3Config, Olmo3ForCausalLM),
    "phi3": (Phi3Config, Phi3ForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    "smollm3": (SmolLM3Config, SmolLM3ForCausalLM),
}

# families TRL's tests train that nanosft refuses by name, and why
OUT_OF_SCOPE = {"nemotron_h": "its hybrid Mamba-2 state-space layers are not implemented"}


def supported_model_types():
    """Every model_type CausalLM.from_pretrained loads."""
    return sorted(set(ARCHITECTURES) | set(FAMILIES))


def config_from_dict(d):
    """The config a config.json dict asks for: a family's where it has one, else ModelConfig.
    Mirrors: transformers AutoConfig.for_model (CONFIG_MAPPING by model_type)"""
    model_type = d.get("model_type", "llama") if isinstance(d, dict) else None
    if model_type in OUT_OF_SCOPE:
        raise ValueError(f"config: model_type={model_type!r} is not supported: "
                         f"{OUT_OF_SCOPE[model_type]}; nanosft loads {supported_model_types()}")
    if model_type is not None and model_type not in supported_model_types():
        raise ValueError(f"config: model_type={model_type!r} is not supported; use one of "
                         f"{supported_model_types()}")
    if model_type not in FAMILIES or model_type == "mistral" and d.get("sliding_window") is None:
        return ModelConfig.from_dict(d)  # Llama (Mistral without a window is Llama)
    return FAMILIES[model_type][0].from_dict(d)


def causal_lm_class(config, cls=CausalLM):
    """The model class for `config`: `cls` when the caller named a subclass, else the family's.
    Mirrors: transformers AutoModelForCausalLM (MODEL_FOR_CAUSAL_LM_MAPPING by config class)"""
    if cls is not CausalLM:
        return cls
    for config_class, model_class in FAMILIES.values():
        if type(config) is config_class:
            return model_class
    return CausalLM


def from_config(config):
    """A randomly initialised model of `config`'s family.
    Mirrors: transformers AutoModelForCausalLM.from_config"""
    return causal_lm_class(config)(config)

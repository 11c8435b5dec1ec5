"""Model families beyond Llama, one small module each: only what the family changes.

Each module subclasses the pieces of model.py that differ (an Attention, and the DecoderLayer /
DecoderModel / CausalLM that name it through their `attention_class`, `layer_class` and
`model_class`) and ModelConfig (the family's extra config.json fields). `config_from_dict` and
`causal_lm_class` pick them by `model_type`, so `CausalLM.from_pretrained(folder)` builds the
right one; model.py itself stays the Llama decoder.
"""

import re

import torch

from nanosft.configuration import ARCHITECTURES, ModelConfig
from nanosft.families.cohere2 import Cohere2Config, Cohere2ForCausalLM
from nanosft.families.gemma3 import Gemma3Config, Gemma3ForCausalLM
from nanosft.families.gemma4 import Gemma4Config, Gemma4ForCausalLM
from nanosft.families.glm4_moe import Glm4MoeConfig, Glm4MoeForCausalLM
from nanosft.families.gpt_neox import GPTNeoXConfig, GPTNeoXForCausalLM
from nanosft.families.gpt_oss import GptOssConfig, GptOssForCausalLM
from nanosft.families.lfm2 import Lfm2Config, Lfm2ForCausalLM
from nanosft.families.mistral import MistralConfig, MistralForCausalLM
from nanosft.families.olmo3 import Olmo3Config, Olmo3ForCausalLM
from nanosft.families.phi3 import Phi3Config, Phi3ForCausalLM
from nanosft.families.qwen2 import Qwen2Config, Qwen2ForCausalLM
from nanosft.families.qwen3 import Qwen3Config, Qwen3ForCausalLM
from nanosft.families.qwen3_5 import Qwen3_5Config, Qwen3_5ForCausalLM
from nanosft.families.qwen3_5_moe import Qwen3_5MoeConfig, Qwen3_5MoeForCausalLM
from nanosft.families.qwen3_moe import Qwen3MoeConfig, Qwen3MoeForCausalLM
from nanosft.families.smollm3 import SmolLM3Config, SmolLM3ForCausalLM
from nanosft.model import CausalLM

# model_type -> (config class, model class); llama (and mistral without a window) are model.py's
FAMILIES = {
    "cohere2": (Cohere2Config, Cohere2ForCausalLM),
    "gemma3_text": (Gemma3Config, Gemma3ForCausalLM),
    "gemma4_text": (Gemma4Config, Gemma4ForCausalLM),
    "glm4_moe": (Glm4MoeConfig, Glm4MoeForCausalLM),
    "gpt_neox": (GPTNeoXConfig, GPTNeoXForCausalLM),
    "gpt_oss": (GptOssConfig, GptOssForCausalLM),
    "lfm2": (Lfm2Config, Lfm2ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "olmo3": (Olmo3Config, Olmo3ForCausalLM),
    "phi3": (Phi3Config, Phi3ForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "qwen3_5_text": (Qwen3_5Config, Qwen3_5ForCausalLM),
    "qwen3_5_moe_text": (Qwen3_5MoeConfig, Qwen3_5MoeForCausalLM),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    "smollm3": (SmolLM3Config, SmolLM3ForCausalLM),
}

# model_type -> why it is refused (the families' blocks it would need are not built here)
REFUSED = {
    "nemotron_h": "its hybrid Mamba-2 state-space layers are not implemented",
}

# a multimodal model_type whose folder holds a text model of a family: (its model_type, the prefix
# of its keys in the checkpoint); the other towers' weights are not read. The model loaded is the
# text model (its model_type, peft's defaults and adapter keys are the text model's)
TEXT_MODELS = {
    "qwen3_5": ("qwen3_5_text", "model.language_model."),
    "qwen3_5_moe": ("qwen3_5_moe_text", "model.language_model."),
    "gemma4": ("gemma4_text", "model.language_model."),
}


# model_type -> patterns (re.search) of checkpoint keys the model never reads, which transformers
# drops on load (_keys_to_ignore_on_load_unexpected): Qwen3.5's multi-token-prediction head,
# Pythia's attention mask buffers; and for every family the per-layer rotary inv_freq buffers
# older checkpoints saved
IGNORED_KEYS = {"qwen3_5_text": (r"^mtp\.",), "qwen3_5_moe_text": (r"^mtp\.",),
                "gpt_neox": (r"attention\.bias$", r"attention\.masked_bias$")}
ALWAYS_IGNORED_KEYS = (r"rotary_emb\.inv_freq$",)  # (GLM-4.5's MTP layers: glm4_moe.py)


def _ignored(config, key):
    patterns = (*IGNORED_KEYS.get(config.model_type, ()), *ALWAYS_IGNORED_KEYS)
    return any(re.search(p, key) for p in patterns)


def text_model_index(config, index):
    """The checkpoint index under the text model's keys (model.language_model.X -> model.X, the
    other towers dropped) when config came from a multimodal folder, less the keys the family
    ignores. Mirrors: transformers conversion_mapping PrefixChange (qwen3_5_text),
    _keys_to_ignore_on_load_unexpected, _adjust_missing_and_unexpected_keys (inv_freq)"""
    index = {k: info for k, info in index.items() if not _ignored(config, k)}
    prefix = getattr(config, "checkpoint_prefix", None)
    if prefix is None:
        return index
    return {("model." + k[len(prefix):] if k.startswith(prefix) else k): info
            for k, info in index.items() if k.startswith(prefix) or k == "lm_head.weight"}


def keep_in_fp32(model, dtype):
    """The pattern of checkpoint keys read in float32 when `dtype` (fp16 or bf16) loads the rest,
    from the model's `_keep_in_fp32_modules_strict` names (GLM-4-MoE's router correction bias: a
    bf16 copy would move the expert choice); None: every key in dtype.
    Mirrors: transformers PreTrainedModel._get_dtype_plan (its names searched in each key)
    Differs: `_keep_in_fp32_modules` (fp16 only; gpt-oss's norms) is not read."""
    names = getattr(model, "_keep_in_fp32_modules_strict", None) or []
    if not names or dtype not in (torch.float16, torch.bfloat16):
        return None
    return re.compile("|".join(names))


def supported_model_types():
    """Every model_type CausalLM.from_pretrained loads."""
    return sorted(set(ARCHITECTURES) | set(FAMILIES))


def config_from_dict(d):
    """The config a config.json dict asks for: a family's where it has one, else ModelConfig.
    Mirrors: transformers AutoConfig.for_model (CONFIG_MAPPING by model_type)"""
    model_type = d.get("model_type", "llama") if isinstance(d, dict) else None
    if model_type in REFUSED:
        raise ValueError(f"config: model_type={model_type!r} is not supported: "
                         f"{REFUSED[model_type]}; nanosft loads {supported_model_types()}")
    if model_type in TEXT_MODELS:  # the language model inside a multimodal folder
        text_type, prefix = TEXT_MODELS[model_type]
        text = d.get("text_config") or {}
        outer = {k: d[k] for k in ("tie_word_embeddings", "dtype", "torch_dtype") if k in d}
        config = config_from_dict({**outer, **text, "model_type": text_type})
        config.checkpoint_prefix = prefix
        return config
    if model_type is not None and model_type not in supported_model_types():
        if "auto_map" in d:  # transformers' own word for it: "custom code" (trust_remote_code)
            raise ValueError(f"config: model_type={model_type!r} is defined by custom code in the "
                             f"model folder (auto_map {d['auto_map']}), which must be executed to "
                             "load the model; transformers runs it with trust_remote_code=True, "
                             "nanosft never runs a repository's code: it loads "
                             f"{supported_model_types()}")
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

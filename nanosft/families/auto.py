"""The Auto layer: the one place that reads `model_type`. AutoConfig and AutoModelForCausalLM pick
a family's classes by it (config.json's `model_type`, the text model of a multimodal folder), as
transformers' models/auto/ does; AutoTokenizer and PeftModel are the other loaders a TRL script
calls by name. Each takes a local folder or a Hub id (resolved from the local Hugging Face cache,
see hub.resolve_pretrained_path) and returns nanosft's own object, so a script written for
transformers + peft runs with only its imports changed. Keyword arguments transformers accepts but
nanosft has no use for are listed and ignored; any other is an error naming it.
"""

import os

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
from nanosft.io import hub
from nanosft.model import CausalLM

# from_pretrained keywords that change nothing here (one attention path, no remote code)
IGNORED_KWARGS = {"attn_implementation", "low_cpu_mem_usage", "use_cache", "token", "use_fast",
                  "trust_remote_code", "use_safetensors", "local_files_only"}


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


def supported_model_types():
    """Every model_type AutoModelForCausalLM loads."""
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
        config.checkpoint_prefix = prefix  # model.text_model_index reads the text model's keys
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


def causal_lm_class(config):
    """The model class for `config`: the family's, else model.py's Llama CausalLM.
    Mirrors: transformers AutoModelForCausalLM (MODEL_FOR_CAUSAL_LM_MAPPING by config class)"""
    for config_class, model_class in FAMILIES.values():
        if type(config) is config_class:
            return model_class
    return CausalLM


def from_config(config):
    """A randomly initialised model of `config`'s family.
    Mirrors: transformers AutoModelForCausalLM.from_config"""
    return causal_lm_class(config)(config)


class AutoConfig:
    """The config class config.json's model_type names, read from a folder or Hub id.
    Mirrors: transformers AutoConfig"""

    @staticmethod
    def from_pretrained(pretrained_model_name_or_path, *, revision=None, **kwargs):
        """The folder's config.json as its family's config. Mirrors: AutoConfig.from_pretrained"""
        _check_kwargs(kwargs, "AutoConfig.from_pretrained")
        folder = hub.resolve_pretrained_path(pretrained_model_name_or_path, revision, "model")
        path = os.path.join(folder, "config.json")
        try:
            return config_from_dict(hub.read_json(path))
        except ValueError as error:  # the message names the field; this adds the file
            raise ValueError(f"{path}: {error}") from None

    @staticmethod
    def for_model(model_type, **kwargs):
        """A config of `model_type` with the given fields. Mirrors: AutoConfig.for_model"""
        return config_from_dict({"model_type": model_type, **kwargs})


def _check_kwargs(kwargs, where, ignored=IGNORED_KWARGS):
    unknown = sorted(set(kwargs) - ignored)
    if unknown:
        raise TypeError(f"{where}: unsupported keyword argument(s) {unknown}; nanosft takes "
                        "dtype=, quantization_config=, device_map=, revision= (and ignores "
                        f"{sorted(ignored)})")
    if kwargs.get("trust_remote_code"):
        raise ValueError(f"{where}: trust_remote_code=True asks for the repo's own modeling code; "
                         "nanosft runs only its built-in Llama-family model, so drop the flag")


def _device_from_map(device_map):
    """torch device string for transformers' simple device maps: None, "cpu", "cuda", "auto",
    an int or {"": int} (a QLoRA recipe's whole model on one GPU)."""
    import torch

    if isinstance(device_map, dict) and set(device_map) == {""}:
        device_map = device_map[""]
    if device_map is None or device_map == "cpu":
        return "cpu"
    if device_map == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if isinstance(device_map, int) or str(device_map).startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"device_map={device_map!r}: no CUDA device is visible to torch; "
                             'use device_map="cpu"')
        return f"cuda:{device_map}" if isinstance(device_map, int) else device_map
    raise ValueError(f"device_map={device_map!r} is not supported; nanosft puts the whole model on "
                     'one device: None, "cpu", "cuda", "auto", an int or {"": int}')


def _check_quantization_config(config):
    """nf4.BitsAndBytesConfig from ours, a dict or transformers' BitsAndBytesConfig; NF4 only."""
    from nanosft import nf4

    config = nf4.BitsAndBytesConfig.from_any(config)  # refuses 8-bit and unknown options by name
    if config.bnb_4bit_quant_type != "nf4":
        raise ValueError(f"quantization_config: bnb_4bit_quant_type={config.bnb_4bit_quant_type!r} "
                         'is not supported here; use "nf4" (transformers\' default is "fp4")')
    return config


class AutoModelForCausalLM:
    """Load nanosft's CausalLM from a folder or Hub id, 4-bit when a BitsAndBytesConfig asks.
    Mirrors: transformers AutoModelForCausalLM.from_pretrained
    Differs: the families nanosft builds (FAMILIES); device_map puts the whole model on one
    device."""

    @staticmethod
    def from_pretrained(pretrained_model_name_or_path, *, dtype=None, quantization_config=None,
                        device_map=None, revision=None, torch_dtype=None, tp_plan=None,
                        device_mesh=None, **kwargs):
        """The model in eval() mode, as transformers returns it. dtype None means "auto" (the dtype
        in config.json, as transformers 5); torch_dtype is its old name. tp_plan="auto" (under
        torchrun) splits the decoder layers over the ranks (parallel.tensor_parallel), or over
        the 1-D `device_mesh` (a parallelism config's mesh["tp"]).
        Mirrors: transformers PreTrainedModel.from_pretrained"""
        _check_kwargs(kwargs, "AutoModelForCausalLM.from_pretrained")
        if device_mesh is not None and tp_plan is None:
            raise ValueError("device_mesh= is the mesh tp_plan splits the model over; pass "
                             'tp_plan="auto" with it, or drop device_mesh')
        dtype = dtype if dtype is not None else (torch_dtype if torch_dtype is not None else "auto")
        folder = hub.resolve_pretrained_path(pretrained_model_name_or_path, revision, "model")
        device = _device_from_map(device_map)
        if quantization_config is not None:
            quantization_config = _check_quantization_config(quantization_config)
        config = AutoConfig.from_pretrained(folder)
        # streamed: each linear weight is quantized as it is read, on the target device
        model = causal_lm_class(config).from_pretrained(
            folder, config=config, dtype=dtype, device_map=device,
            quantization_config=quantization_config)
        model.name_or_path = str(pretrained_model_name_or_path)  # the id as given, as transformers
        if tp_plan is not None:  # applied to the loaded model, not by it (model.py sees no ranks)
            from nanosft.parallel.tensor_parallel import apply_tensor_parallel

            apply_tensor_parallel(model, tp_plan, mesh=device_mesh)
        return model.eval()

    @staticmethod
    def from_config(config):
        """A randomly initialised model of `config`'s family.
        Mirrors: transformers AutoModelForCausalLM.from_config"""
        return from_config(config)


class AutoTokenizer:
    """Load nanosft's Tokenizer (tokenizer.json + chat template) from a folder or Hub id.
    Mirrors: transformers AutoTokenizer.from_pretrained"""

    @staticmethod
    def from_pretrained(pretrained_model_name_or_path, *, revision=None, **kwargs):
        """The folder's fast tokenizer. Mirrors: transformers AutoTokenizer.from_pretrained"""
        from nanosft.tokenizer import Tokenizer

        _check_kwargs(kwargs, "AutoTokenizer.from_pretrained")
        folder = hub.resolve_pretrained_path(pretrained_model_name_or_path, revision, "tokenizer")
        return Tokenizer.from_pretrained(folder)


class PeftModel:
    """Put a saved adapter (folder or Hub id) on a model; returns a PeftModelForCausalLM.
    Mirrors: peft PeftModel.from_pretrained
    Differs: a loader only (the top-level `nanosft.PeftModel` is nanosft.peft's class, which
    wraps any module and loads the same folders and Hub ids)."""

    @staticmethod
    def from_pretrained(model, model_id, adapter_name="default", is_trainable=False, *,
                        revision=None, **kwargs):
        """Wrap `model` with the adapter; frozen and eval() unless is_trainable.
        Mirrors: peft PeftModel.from_pretrained"""
        from nanosft.peft import PeftModelForCausalLM

        _check_kwargs(kwargs, "PeftModel.from_pretrained", ignored={"token", "local_files_only"})
        folder = hub.resolve_pretrained_path(model_id, revision, "adapter")
        return PeftModelForCausalLM.from_pretrained(model, folder, adapter_name=adapter_name,
                                                    is_trainable=is_trainable)

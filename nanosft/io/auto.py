"""The loaders a TRL script calls by name: AutoModelForCausalLM, AutoTokenizer, PeftModel.

They build the model, tokenizer and adapter SFTTrainer.__init__ receives. Each takes a local
folder or a Hub id (resolved from the local Hugging Face cache, see hub.resolve_pretrained_path) and
returns nanosft's own object, so a script written for transformers + peft runs with only its imports
changed. Keyword arguments transformers accepts but nanosft has no use for are listed and ignored;
any other is an error naming it.
"""

from nanosft.io import hub

# from_pretrained keywords that change nothing here (one attention path, no remote code)
IGNORED_KWARGS = {"attn_implementation", "low_cpu_mem_usage", "use_cache", "token", "use_fast",
                  "trust_remote_code", "use_safetensors", "local_files_only"}


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
    Differs: Llama-family only; device_map puts the whole model on one device."""

    @staticmethod
    def from_pretrained(pretrained_model_name_or_path, *, dtype=None, quantization_config=None,
                        device_map=None, revision=None, torch_dtype=None, **kwargs):
        """The model in eval() mode, as transformers returns it. dtype None means "auto" (the dtype
        in config.json, as transformers 5); torch_dtype is its old name.
        Mirrors: transformers PreTrainedModel.from_pretrained"""
        from nanosft.model import CausalLM

        _check_kwargs(kwargs, "AutoModelForCausalLM.from_pretrained")
        dtype = dtype if dtype is not None else (torch_dtype if torch_dtype is not None else "auto")
        folder = hub.resolve_pretrained_path(pretrained_model_name_or_path, revision, "model")
        device = _device_from_map(device_map)
        if quantization_config is not None:
            quantization_config = _check_quantization_config(quantization_config)
        # streamed: each linear weight is quantized as it is read, on the target device
        model = CausalLM.from_pretrained(folder, dtype=dtype, device_map=device,
                                         quantization_config=quantization_config)
        model.name_or_path = str(pretrained_model_name_or_path)  # the id as given, as transformers
        return model.eval()


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
    Differs: a loader only; isinstance checks use nanosft.peft.PeftModelForCausalLM."""

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

"""PEFT wrapping of a CausalLM: LoRA injection, prompt tuning, adapter save/load in peft's format.

`get_peft_model` swaps every targeted linear for a `LoraLinear` (or adds virtual prompt tokens) and
freezes the base; `PeftModelForCausalLM.forward` is walkthrough 2.6 line by line. Parameter names,
adapter_config.json and adapter_model.safetensors keys equal peft 0.21.2's, so adapters move both ways.
Papers: LoRA (2106.09685), rsLoRA (2312.03732), DoRA (2402.09353), prompt tuning (2104.08691).
"""

import contextlib
import copy
import dataclasses
import os
import re
import warnings

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from nanosft import hub
from nanosft.lora import LoraLinear
from nanosft.nf4 import Linear4bit, is_quantized

PEFT_FORMAT_VERSION = "0.21.2"  # the peft release whose adapter files we read and write
DEFAULT_TARGET_MODULES = {"llama": ["q_proj", "v_proj"], "mistral": ["q_proj", "v_proj"], "qwen2": ["q_proj", "v_proj"]}
# adapter_config.json keys of peft features nanosft does not implement, with peft's defaults (written as-is)
_LORA_UNUSED = {
    "alora_invocation_tokens": None, "alpha_pattern": {}, "arrow_config": None, "auto_mapping": None,
    "corda_config": None, "ensure_weight_tying": False, "eva_config": None, "exclude_modules": None,
    "fan_in_fan_out": False, "kasa_config": None, "layer_replication": None, "layers_pattern": None,
    "layers_to_transform": None, "loftq_config": {}, "lora_bias": False, "lora_ga_config": None,
    "megatron_config": None, "megatron_core": "megatron.core", "monteclora_config": None, "qalora_group_size": 16,
    "rank_pattern": {}, "revision": None, "target_parameters": None, "trainable_token_indices": None,
    "use_bdlora": None, "use_qalora": False, "velora_config": None}
_HARMLESS = {"auto_mapping", "revision", "megatron_core", "qalora_group_size", "loftq_config", "ensure_weight_tying"}
_PROMPT_UNUSED = {"auto_mapping": None, "modules_to_save": None, "revision": None, "tokenizer_kwargs": None}


def _check_unused(d, defaults, source):
    # a peft-only feature switched on would load silently wrong: refuse it, naming the file and the key
    for key, value in d.items():
        if key in defaults and key not in _HARMLESS and value and value != defaults[key]:
            raise ValueError(f"{source} sets {key}={value!r}, a peft feature nanosft does not implement; "
                             f"remove it or use peft itself")


@dataclasses.dataclass
class LoraConfig:
    """LoRA hyper-parameters with peft's field names and defaults (target_modules None -> q_proj, v_proj).
    Walkthrough 2.1 peft_config | Mirrors: peft LoraConfig
    Differs: task_type defaults to "CAUSAL_LM"; init_lora_weights only True, False or "gaussian"."""
    r: int = 8
    lora_alpha: int = 8
    lora_dropout: float = 0.0
    target_modules: list | str | None = None
    use_rslora: bool = False
    use_dora: bool = False
    bias: str = "none"
    modules_to_save: list | None = None
    task_type: str | None = "CAUSAL_LM"
    init_lora_weights: bool | str = True
    base_model_name_or_path: str | None = None
    inference_mode: bool = False
    peft_type: str = "LORA"

    def __post_init__(self):
        if not isinstance(self.r, int) or self.r <= 0:
            raise ValueError(f"LoraConfig.r must be a positive integer (the adapter rank), got r={self.r!r}")
        if self.bias not in ("none", "all", "lora_only"):
            raise ValueError(f"LoraConfig.bias must be 'none', 'all' or 'lora_only', got {self.bias!r}")
        if self.init_lora_weights not in (True, False, "gaussian"):
            raise ValueError(f"LoraConfig.init_lora_weights={self.init_lora_weights!r} is not implemented; "
                             "use True (peft's default), False or 'gaussian'")
        if isinstance(self.target_modules, (set, tuple)):
            self.target_modules = sorted(self.target_modules)

    def to_dict(self):
        """The adapter_config.json dict, key for key as peft writes it.
        Walkthrough 2.6 | Mirrors: peft PeftConfig.to_dict"""
        return {**_LORA_UNUSED, **dataclasses.asdict(self), "peft_version": PEFT_FORMAT_VERSION}

    @classmethod
    def from_dict(cls, d, source="adapter config"):
        """Build from an adapter_config.json dict; peft keys we do not model must hold their defaults.
        Walkthrough 2.6 | Mirrors: peft PeftConfig.from_peft_type"""
        _check_unused(d, _LORA_UNUSED, source)
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


@dataclasses.dataclass
class PromptTuningConfig:
    """Prompt tuning: `num_virtual_tokens` trainable embeddings put before the input (RANDOM or TEXT init).
    Walkthrough 2.6 | Mirrors: peft PromptTuningConfig
    Differs: TEXT init takes a `tokenizer` object (anything with `encode`) or a nanosft tokenizer folder."""
    num_virtual_tokens: int | None = None
    prompt_tuning_init: str = "RANDOM"
    prompt_tuning_init_text: str | None = None
    tokenizer_name_or_path: str | None = None
    tokenizer: object = dataclasses.field(default=None, repr=False, compare=False)
    token_dim: int | None = None
    num_transformer_submodules: int | None = 1
    num_attention_heads: int | None = None
    num_layers: int | None = None
    task_type: str | None = "CAUSAL_LM"
    base_model_name_or_path: str | None = None
    inference_mode: bool = False
    peft_type: str = "PROMPT_TUNING"

    def __post_init__(self):
        if not isinstance(self.num_virtual_tokens, int) or self.num_virtual_tokens <= 0:
            raise ValueError("PromptTuningConfig.num_virtual_tokens must be a positive int, "
                             f"got {self.num_virtual_tokens!r}")
        if self.prompt_tuning_init not in ("RANDOM", "TEXT"):
            raise ValueError(f"prompt_tuning_init must be 'RANDOM' or 'TEXT', got {self.prompt_tuning_init!r}")
        text_ok = self.prompt_tuning_init_text and (self.tokenizer or self.tokenizer_name_or_path)
        if self.prompt_tuning_init == "TEXT" and not self.inference_mode and not text_ok:  # loading needs no text
            raise ValueError("prompt_tuning_init='TEXT' needs prompt_tuning_init_text and a tokenizer "
                             "(tokenizer=... or tokenizer_name_or_path=...)")

    def to_dict(self):
        """The adapter_config.json dict as peft writes it (the tokenizer object is not saved).
        Walkthrough 2.6 | Mirrors: peft PeftConfig.to_dict"""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "tokenizer"}
        return {**_PROMPT_UNUSED, **d, "peft_version": PEFT_FORMAT_VERSION}

    @classmethod
    def from_dict(cls, d, source="adapter config"):
        """Build from an adapter_config.json dict.
        Walkthrough 2.6 | Mirrors: peft PeftConfig.from_peft_type"""
        _check_unused(d, _PROMPT_UNUSED, source)
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d and f.name != "tokenizer"})


def peft_config_from_dict(d, source="adapter config"):
    """LoraConfig or PromptTuningConfig from an adapter_config.json dict, chosen by its `peft_type`.
    Walkthrough 2.6 | Mirrors: peft PeftConfig.from_pretrained"""
    kinds = {"LORA": LoraConfig, "PROMPT_TUNING": PromptTuningConfig}
    if d.get("peft_type") not in kinds:
        raise ValueError(f"{source} has peft_type={d.get('peft_type')!r}; nanosft reads {sorted(kinds)}")
    return kinds[d["peft_type"]].from_dict(d, source)


# ----------------------------------------------------------------------------- LoRA injection

def _is_linear(module):
    return isinstance(module, (nn.Linear, Linear4bit))


def _linear_names(model):
    # linears a LoRA may wrap: not the output head, not a LoRA's own A/B
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return [n for n, m in model.named_modules() if _is_linear(m) and m is not head and ".lora_" not in n]


def _key_matches(target, name):
    # peft check_target_module_exists: a str is a regex fullmatch, a list entry matches `name` or `*.name`
    if isinstance(target, str):
        return re.fullmatch(target, name) is not None
    return any(name == t or name.endswith("." + t) for t in target)


def resolve_target_modules(model, config):
    """`target_modules` as saved: None -> the architecture default, "all-linear" -> every linear's full name.
    Walkthrough 2.1 | Mirrors: peft _maybe_include_all_linear_layers,
    TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING"""
    target = config.target_modules
    if target is None:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        if model_type not in DEFAULT_TARGET_MODULES:
            raise ValueError(f"no default target_modules for model_type={model_type!r}; set LoraConfig.target_modules")
        return list(DEFAULT_TARGET_MODULES[model_type])
    if isinstance(target, str) and target.lower() == "all-linear":
        return _linear_names(model)  # lm_head excluded
    return target


def find_target_modules(model, config):
    """Names of the modules LoRA wraps, in `model.named_modules()` order (the order peft draws their init in).
    Walkthrough 2.1 | Mirrors: peft BaseTuner.inject_adapter, check_target_module_exists
    Differs: a list entry that matches nothing is an error (peft only errors when nothing matches at all)."""
    target, skip = resolve_target_modules(model, config), config.modules_to_save or []
    names = [n for n, _ in model.named_modules() if _key_matches(target, n) and not _key_matches(skip, n)]
    linear = sorted({n.rsplit(".", 1)[-1] for n in _linear_names(model)})
    for t in [target] if isinstance(target, str) else target:
        if not any(_key_matches(t if isinstance(target, str) else [t], n) for n in names):
            raise ValueError(f"LoraConfig.target_modules entry {t!r} matches no module of {type(model).__name__} "
                             f"(searched all {len(list(model.named_modules()))} module names); "
                             f"its linear layers are named {linear}")
    for n in names:
        if not _is_linear(model.get_submodule(n)):
            raise ValueError(f"target module {n!r} is a {type(model.get_submodule(n)).__name__}, not a linear layer; "
                             f"LoRA wraps nn.Linear / Linear4bit only, e.g. {linear}")
    return names


def _replace_module(model, name, new):
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


class ModulesToSaveWrapper(nn.Module):
    """Keeps the frozen `original_module` and trains a full copy under `modules_to_save.<adapter>`.
    Walkthrough 2.1 | Mirrors: peft ModulesToSaveWrapper"""

    def __init__(self, module, adapter_name, trainable=True):
        super().__init__()
        self.original_module = module.requires_grad_(False)
        self.modules_to_save = nn.ModuleDict({adapter_name: copy.deepcopy(module).requires_grad_(trainable)})
        self.active_adapter = adapter_name

    @property
    def weight(self):
        """The trained copy's weight, for code that reads `lm_head.weight`.
        Mirrors: peft ModulesToSaveWrapper.weight"""
        return self.modules_to_save[self.active_adapter].weight

    def forward(self, *args, **kwargs):
        """Run the trained copy, never the original.
        Mirrors: peft ModulesToSaveWrapper.forward"""
        return self.modules_to_save[self.active_adapter](*args, **kwargs)


def inject_adapter(model, config, adapter_name="default"):
    """Swap every target module for a `LoraLinear` (in place), in named_modules order so the RNG stream equals peft's.
    Walkthrough 2.7 (what the forward then runs) | Mirrors: peft BaseTuner.inject_adapter,
    LoraModel._create_and_replace"""
    names = find_target_modules(model, config)
    config.target_modules = resolve_target_modules(model, config)  # saved resolved, as peft does
    for name in names:
        layer = LoraLinear(model.get_submodule(name), adapter_name, r=config.r, lora_alpha=config.lora_alpha,
                           lora_dropout=config.lora_dropout, use_rslora=config.use_rslora, use_dora=config.use_dora,
                           init_lora_weights=config.init_lora_weights)
        _replace_module(model, name, layer)


def mark_only_adapters_as_trainable(model, config, adapter_name="default"):
    """Freeze the base (bias per `config.bias`), wrap `modules_to_save`, keep fp16/bf16 adapters in fp32.
    Walkthrough 2.1 | Mirrors: peft _mark_only_adapters_as_trainable, _set_trainable, cast_adapter_dtype"""
    trainable = not config.inference_mode
    for n, p in model.named_parameters():
        bias = n.endswith(".bias") and (config.bias == "all" or (config.bias == "lora_only" and ".base_layer." in n))
        p.requires_grad = ("lora_" in n or bias) and trainable
        if "lora_" in n and p.dtype in (torch.float16, torch.bfloat16):
            p.data = p.data.float()  # peft autocast_adapter_dtype: the adapter trains in fp32
    for name, module in list(model.named_modules()):
        if config.modules_to_save and _key_matches(config.modules_to_save, name) and ".lora_" not in name:
            _replace_module(model, name, ModulesToSaveWrapper(module, adapter_name, trainable))


class LoraModel(nn.Module):
    """Holds the CausalLM as `.model` after LoRA injection, so names read `base_model.model.model.layers...`.
    Walkthrough 2.6 | Mirrors: peft LoraModel"""

    def __init__(self, model, peft_config, adapter_name="default"):
        super().__init__()
        self.model, self.peft_config, self.active_adapter = model, peft_config, adapter_name
        inject_adapter(model, peft_config[adapter_name], adapter_name)
        mark_only_adapters_as_trainable(model, peft_config[adapter_name], adapter_name)

    def lora_layers(self):
        """Every LoraLinear inside the model, in module order.
        Mirrors: peft BaseTuner (its loops over BaseTunerLayer modules)"""
        return [m for m in self.model.modules() if isinstance(m, LoraLinear)]

    def forward(self, *args, **kwargs):
        """The CausalLM's forward; the LoRA layers inside it do the rest. Mirrors: peft BaseTuner.forward"""
        return self.model(*args, **kwargs)


# ----------------------------------------------------------------------------- prompt tuning

class PromptEmbedding(nn.Module):
    """The virtual tokens' embedding table, [num_virtual_tokens, token_dim], fp32.
    Walkthrough 2.6 get_prompt | Mirrors: peft PromptEmbedding"""

    def __init__(self, config, word_embeddings):
        super().__init__()
        total = config.num_virtual_tokens * config.num_transformer_submodules
        self.embedding = nn.Embedding(total, config.token_dim)  # RANDOM: nn.Embedding's N(0, 1)
        if config.prompt_tuning_init == "TEXT" and not config.inference_mode:
            ids = _init_text_ids(config, total)
            with torch.no_grad():  # copy the words' embeddings, in fp32
                self.embedding.weight.copy_(word_embeddings(torch.tensor(ids, device=word_embeddings.weight.device)))

    def forward(self, indices):
        """Look up the virtual tokens' rows.
        Walkthrough 2.6 get_prompt | Mirrors: peft PromptEmbedding.forward"""
        return self.embedding(indices)  # (B, n_virtual) -> (B, n_virtual, C)


def _init_text_ids(config, total):
    tokenizer = config.tokenizer
    if tokenizer is None:
        from nanosft.tokenizer import Tokenizer
        tokenizer = Tokenizer.from_pretrained(config.tokenizer_name_or_path)
    ids = list(tokenizer.encode(config.prompt_tuning_init_text))
    if not ids:
        raise ValueError(f"prompt_tuning_init_text={config.prompt_tuning_init_text!r} encodes to no tokens")
    return (ids * -(-total // len(ids)))[:total]  # truncate, or repeat up to the virtual length


# ----------------------------------------------------------------------------- adapter state dict

def _saved_key(key, adapter_name):
    # peft _remove_adapter_name_from_state_dict_key: lora_A.default.weight -> lora_A.weight, ...
    a = re.escape(adapter_name)
    key = re.sub(rf"\.lora_magnitude_vector\.{a}\.weight$", ".lora_magnitude_vector", key)
    key = re.sub(rf"\.modules_to_save\.{a}\.", ".", key)
    return re.sub(rf"\.(lora_A|lora_B)\.{a}\.", r".\1.", key)


def _adapter_keys(model, adapter_name):
    # {saved key: model state-dict key} for every tensor the adapter file holds
    config, keys = model.peft_config[adapter_name], {}
    for k in model.state_dict():
        is_lora = "lora_" in k and f".{adapter_name}." in k
        is_bias = k.endswith(".bias") and ".original_module." not in k and (
            config.bias == "all" or (config.bias == "lora_only" and ".base_layer." in k))
        if is_lora or is_bias or f".modules_to_save.{adapter_name}." in k:
            keys[_saved_key(k, adapter_name)] = k
    return keys


def get_peft_model_state_dict(model, state_dict=None, adapter_name="default"):
    """The adapter's tensors under peft's saved keys (no adapter name; `prompt_embeddings` for prompt tuning).
    Walkthrough 2.6 | Mirrors: peft get_peft_model_state_dict"""
    if model.peft_config[adapter_name].peft_type == "PROMPT_TUNING":
        return {"prompt_embeddings": model.prompt_encoder[adapter_name].embedding.weight.detach()}
    state_dict = model.state_dict() if state_dict is None else state_dict
    return {saved: state_dict[k].detach() for saved, k in _adapter_keys(model, adapter_name).items()}


def set_peft_model_state_dict(model, state_dict, adapter_name="default", source="state_dict"):
    """Copy adapter tensors saved under peft's keys into `model`; any key or shape that does not fit is an error.
    Walkthrough 2.6 | Mirrors: peft set_peft_model_state_dict
    Differs: peft warns about unexpected/missing adapter keys; we raise, naming them."""
    if model.peft_config[adapter_name].peft_type == "PROMPT_TUNING":
        keys = {"prompt_embeddings": f"prompt_encoder.{adapter_name}.embedding.weight"}
    else:
        keys = _adapter_keys(model, adapter_name)
    unexpected, missing = sorted(set(state_dict) - set(keys)), sorted(set(keys) - set(state_dict))
    if unexpected:
        raise ValueError(f"{source}: tensor {unexpected[0]!r} (and {len(unexpected) - 1} more) fits no module of this "
                         f"model; was the adapter trained on another base model or with other target_modules?")
    if missing:
        raise ValueError(f"{source}: adapter tensor {missing[0]!r} (and {len(missing) - 1} more) is missing")
    own = model.state_dict()
    for saved, k in keys.items():
        if state_dict[saved].shape != own[k].shape:
            raise ValueError(f"{source}: tensor {saved!r} has shape {tuple(state_dict[saved].shape)} but this model "
                             f"expects {tuple(own[k].shape)}; the adapter was made for another base model or rank")
    model.load_state_dict({k: state_dict[saved] for saved, k in keys.items()}, strict=False)


# ----------------------------------------------------------------------------- the wrapper

class PeftModelForCausalLM(nn.Module):
    """A CausalLM with one adapter: LoRA layers inside `base_model.model`, or prompt embeddings before the input.
    Walkthrough 2.6 | Mirrors: peft PeftModelForCausalLM (PeftModel)"""
    accepts_loss_kwargs = True

    def __init__(self, model, peft_config, adapter_name="default"):
        super().__init__()
        self.active_adapter, self.peft_type = adapter_name, peft_config.peft_type
        self.peft_config = {adapter_name: peft_config}
        if peft_config.peft_type == "LORA":
            self.base_model = LoraModel(model, self.peft_config, adapter_name)
        else:
            self.base_model = model.requires_grad_(False)
            self._setup_prompt_encoder(adapter_name)
        if getattr(model, "is_gradient_checkpointing", False) and not is_quantized(model):
            model.enable_input_require_grads()  # peft _prepare_model_for_gradient_checkpointing

    def _setup_prompt_encoder(self, adapter_name):
        config, model = self.peft_config[adapter_name], self.base_model
        config.num_layers = config.num_layers or model.config.num_hidden_layers  # filled from the base config
        config.token_dim = config.token_dim or model.config.hidden_size
        config.num_attention_heads = config.num_attention_heads or model.config.num_attention_heads
        self.word_embeddings = model.get_input_embeddings()
        encoder = PromptEmbedding(config, self.word_embeddings).to(self.word_embeddings.weight.device)
        self.prompt_encoder = nn.ModuleDict({adapter_name: encoder.requires_grad_(not config.inference_mode)})
        self.prompt_tokens = {adapter_name: torch.arange(config.num_virtual_tokens * config.num_transformer_submodules)}

    @property
    def active_peft_config(self):
        """The config of the active adapter. Mirrors: peft PeftModel.active_peft_config"""
        return self.peft_config[self.active_adapter]

    @property
    def config(self):
        """The base model's ModelConfig (peft forwards unknown attributes to the base model).
        Mirrors: peft PeftModel.__getattr__ (forwarding to the base model)"""
        return self.get_base_model().config

    def get_base_model(self):
        """The CausalLM itself (LoRA layers stay inside it).
        Walkthrough 2.5 | Mirrors: peft PeftModel.get_base_model"""
        return self.base_model.model if self.peft_type == "LORA" else self.base_model

    def get_prompt(self, batch_size, task_ids=None):
        """The virtual prompt embeddings repeated over the batch, (B, n_virtual, C).
        Walkthrough 2.6 | Mirrors: peft PeftModel.get_prompt"""
        encoder = self.prompt_encoder[self.active_adapter]
        if self.active_peft_config.inference_mode:
            prompts = encoder.embedding.weight
        else:  # one row of token ids through the encoder, then repeat the output (peft issue 2043)
            prompt_tokens = self.prompt_tokens[self.active_adapter].unsqueeze(0).to(encoder.embedding.weight.device)
            prompts = encoder(prompt_tokens)
        return prompts.repeat(batch_size, 1, 1)

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, labels=None, position_ids=None,
                num_items_in_batch=None, **kwargs):
        """LoRA: straight into the base model. Prompt tuning: prepend virtual tokens, mask ones, labels -100.
        Walkthrough 2.6 | Mirrors: peft PeftModelForCausalLM.forward"""
        peft_config = self.active_peft_config
        if peft_config.peft_type == "LORA":  # the LoRA layers already sit inside the base model
            return self.base_model(input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds,
                                   labels=labels, position_ids=position_ids, num_items_in_batch=num_items_in_batch,
                                   **kwargs)
        n = peft_config.num_virtual_tokens
        batch_size = input_ids.shape[0] if input_ids is not None else inputs_embeds.shape[0]
        if attention_mask is not None:
            # "concat prompt attention mask": ones for the n virtual tokens, (B, n + T)
            prefix_attention_mask = torch.ones(batch_size, n).to(attention_mask.device)
            attention_mask = torch.cat((prefix_attention_mask, attention_mask), dim=1)
        if position_ids is not None:
            warnings.warn("Position ids are not supported for parameter efficient tuning. Ignoring position ids.")
        kwargs.update(attention_mask=attention_mask, labels=labels, num_items_in_batch=num_items_in_batch)
        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)  # (B, T, C)
        if labels is not None:
            # "concat prompt labels": the virtual positions are never targets, (B, n + T)
            prefix_labels = torch.full((batch_size, n), -100).to(labels.device)
            kwargs["labels"] = torch.cat((prefix_labels, labels), dim=1)
        prompts = self.get_prompt(batch_size=batch_size)
        prompts = prompts.to(inputs_embeds.dtype)  # fp32 table -> the model's compute dtype
        inputs_embeds = torch.cat((prompts, inputs_embeds), dim=1)  # (B, n + T, C)
        return self.base_model(inputs_embeds=inputs_embeds, **kwargs)

    def get_nb_trainable_parameters(self):
        """(trainable, all) parameter counts; a packed 4-bit uint8 weight counts 2 parameters per byte.
        Walkthrough 2.1 | Mirrors: peft PeftModel.get_nb_trainable_parameters"""
        trainable = total = 0
        for p in self.parameters():
            n = p.numel() * 2 * p.element_size() if p.dtype == torch.uint8 else p.numel()
            total += n
            trainable += n if p.requires_grad else 0
        return trainable, total

    def print_trainable_parameters(self):
        """Print `trainable params: X || all params: Y || trainable%: Z` exactly as peft does.
        Walkthrough 2.1 | Mirrors: peft PeftModel.print_trainable_parameters"""
        t, a = self.get_nb_trainable_parameters()
        print(f"trainable params: {t:,d} || all params: {a:,d} || trainable%: {100 * t / a:.4f}")

    def save_pretrained(self, save_directory):
        """Write adapter_model.safetensors and adapter_config.json (each atomically) in peft's format.
        Walkthrough 2.6 | Mirrors: peft PeftModel.save_pretrained
        Differs: no README.md model card."""
        os.makedirs(save_directory, exist_ok=True)
        state = get_peft_model_state_dict(self, adapter_name=self.active_adapter)
        tensors = {k: v.contiguous() for k, v in state.items()}
        hub.atomic_write(os.path.join(save_directory, "adapter_model.safetensors"),
                         lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
        config = {**self.active_peft_config.to_dict(), "inference_mode": True}
        hub.write_json(config, os.path.join(save_directory, "adapter_config.json"), sort_keys=True)

    @classmethod
    def from_pretrained(cls, model, model_id, adapter_name="default", is_trainable=False):
        """Wrap `model` and load an adapter folder written by peft or nanosft; frozen and eval() unless trainable.
        Walkthrough 2.6 | Mirrors: peft PeftModel.from_pretrained, load_adapter"""
        paths = [os.path.join(model_id, f) for f in ("adapter_config.json", "adapter_model.safetensors")]
        for path in paths:
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{path} not found; an adapter folder holds adapter_config.json and "
                                        f"adapter_model.safetensors, as written by save_pretrained")
        config = peft_config_from_dict(hub.read_json(paths[0]), source=paths[0])  # errors name the file
        if config.peft_type == "PROMPT_TUNING" and is_trainable:
            raise ValueError("Cannot set a prompt learning adapter to trainable when loading pretrained adapter.")
        config.inference_mode = not is_trainable
        peft_model = cls(model, config, adapter_name)
        set_peft_model_state_dict(peft_model, load_file(paths[1]), adapter_name, source=paths[1])
        return peft_model if is_trainable else peft_model.eval()

    @contextlib.contextmanager
    def disable_adapter(self):
        """Run the base model alone inside the `with` block (LoRA only).
        Mirrors: peft PeftModel.disable_adapter"""
        if self.peft_type != "LORA":
            raise ValueError("disable_adapter() is implemented for LoRA; for prompt tuning call get_base_model()")
        layers = self.base_model.lora_layers()
        for layer in layers:
            layer.enable_adapters(False)
        try:
            yield
        finally:
            for layer in layers:
                layer.enable_adapters(True)

    def merge_and_unload(self):
        """Fold every LoRA delta into its base weight and return the plain CausalLM.
        Walkthrough 2.7 merge | Mirrors: peft LoraModel.merge_and_unload
        A Linear4bit base is dequantized, merged and re-quantized in place by LoraLinear.merge, as peft does."""
        if self.peft_type != "LORA":
            raise ValueError("merge_and_unload() applies to LoRA; a prompt-tuned model's base is get_base_model()")
        model = self.base_model.model
        for name, module in list(model.named_modules()):
            if isinstance(module, LoraLinear):
                module.merge()
                _replace_module(model, name, module.base_layer)
            elif isinstance(module, ModulesToSaveWrapper):
                _replace_module(model, name, module.modules_to_save[module.active_adapter])
        return model

    # delegates the Trainer and the CLI use
    def generate(self, *args, **kwargs):
        """Generate with the adapted model (LoRA). Mirrors: peft PeftModelForCausalLM.generate
        Differs: prompt tuning generation is not implemented."""
        if self.peft_type != "LORA":
            raise NotImplementedError("generate() with prompt tuning is not implemented in nanosft")
        return self.get_base_model().generate(*args, **kwargs)

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
        """Turn on gradient checkpointing in the base model. Mirrors: transformers gradient_checkpointing_enable"""
        self.get_base_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs=gradient_checkpointing_kwargs)

    def enable_input_require_grads(self):
        """Make the input embeddings' output require grad. Mirrors: transformers enable_input_require_grads"""
        self.get_base_model().enable_input_require_grads()

    def get_input_embeddings(self):
        """The base model's token embedding. Mirrors: transformers get_input_embeddings"""
        return self.get_base_model().get_input_embeddings()


def get_peft_model(model, peft_config, adapter_name="default"):
    """Wrap `model` with a fresh adapter (LoRA or prompt tuning); the base is frozen, only the adapter trains.
    Walkthrough 2.1 (peft_config) / 2.6 | Mirrors: peft get_peft_model
    Differs: the config is copied, so the caller's object is not mutated."""
    peft_config = dataclasses.replace(peft_config)
    peft_config.base_model_name_or_path = getattr(model, "name_or_path", None) or peft_config.base_model_name_or_path
    return PeftModelForCausalLM(model, peft_config, adapter_name)


def prepare_model_for_kbit_training(model, use_gradient_checkpointing=True, gradient_checkpointing_kwargs=None):
    """Freeze everything, upcast fp16/bf16 (non-4-bit) params to fp32, and on a 4-bit model turn on checkpointing.
    Walkthrough 2.1 | Mirrors: peft prepare_model_for_kbit_training (TRL does not call it; an opt-in step)"""
    gradient_checkpointing_kwargs = gradient_checkpointing_kwargs or {}
    for p in model.parameters():
        p.requires_grad = False
    for p in model.parameters():  # norms, embeddings, lm_head; the uint8 NF4 codes stay as they are
        if p.dtype in (torch.float16, torch.bfloat16):
            p.data = p.data.float()
    if is_quantized(model) and use_gradient_checkpointing:
        # with reentrant checkpointing the frozen embeddings' output must require grad, or no grad flows back
        if gradient_checkpointing_kwargs.get("use_reentrant", True):
            model.enable_input_require_grads()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gradient_checkpointing_kwargs)
    return model

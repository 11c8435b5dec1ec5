"""Adapter configs and files: what an adapter is before its forward runs, in peft's format.

`LoraConfig` and the prompt-learning configs (`PromptTuningConfig`, `PromptEncoderConfig` for
P-tuning, `PrefixTuningConfig`) carry peft's field names and defaults, and turn into (and back
from) the adapter_config.json dict peft 0.21.2 writes; `find_target_modules` says which
modules of a model a LoraConfig names (and `resolve_target_modules` what its target_modules is
saved as), `prompt_init_token_ids` which tokens a TEXT prompt starts from.
`get_peft_model_state_dict` / `set_peft_model_state_dict` map a wrapped model's tensors to peft's
saved keys and back; `save_adapter_files` / `load_adapter_files` write (atomically) and read the
two files. Nothing here builds or runs a layer, so this module sits below peft.py.
"""

import dataclasses
import enum
import importlib.metadata
import json
import math
import os
import re
import warnings

from safetensors.torch import load_file, save_file
from torch import nn

from nanosft.nf4 import Linear4bit

PEFT_FORMAT_VERSION = "0.21.2"  # the peft release whose adapter files we read and write
__version__ = PEFT_FORMAT_VERSION  # what a new config records as peft_version (peft: its own)
CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
BIN_WEIGHTS_NAME = "adapter_model.bin"  # safe_serialization=False
INIT_LORA_WEIGHTS = (True, False, "gaussian", "orthogonal")  # the LoRA inits nanosft draws
PROMPT_LEARNING_TYPES = ("PROMPT_TUNING", "P_TUNING", "PREFIX_TUNING")  # peft is_prompt_learning

# adapter_config.json keys of peft features nanosft does not implement, with peft's defaults
# (written as they are, so peft reads our files; refused when a file switches one on)
_LORA_UNUSED = {
    "arrow_config": None,
    "auto_mapping": None, "corda_config": None, "eva_config": None,
    "kasa_config": None,
    "loftq_config": {}, "lora_ga_config": None,
    "megatron_core": "megatron.core", "monteclora_config": None, "qalora_group_size": 16,
    "revision": None,
    "use_bdlora": None, "use_qalora": False,
    "velora_config": None}
# keys that change nothing nanosft computes, whatever their value
_HARMLESS = {"auto_mapping", "revision", "megatron_core", "qalora_group_size", "loftq_config"}


class PeftWarning(UserWarning):
    """The category of the warnings peft gives about an adapter's set-up (e.g. lora_bias on a
    layer without bias). Mirrors: peft PeftWarning"""


class TaskType(str, enum.Enum):
    """The task an adapter config is for; a str, so TaskType.CAUSAL_LM == "CAUSAL_LM" and it is
    saved as that string. nanosft trains CAUSAL_LM adapters. Mirrors: peft TaskType"""
    SEQ_CLS = "SEQ_CLS"
    SEQ_2_SEQ_LM = "SEQ_2_SEQ_LM"
    CAUSAL_LM = "CAUSAL_LM"
    TOKEN_CLS = "TOKEN_CLS"
    QUESTION_ANS = "QUESTION_ANS"
    FEATURE_EXTRACTION = "FEATURE_EXTRACTION"


class PeftType(str, enum.Enum):
    """The adapter method a config describes; a str, so PeftType.LORA == "LORA" and it is saved as
    that string. Mirrors: peft PeftType (the four methods nanosft implements)"""
    LORA = "LORA"
    PROMPT_TUNING = "PROMPT_TUNING"
    P_TUNING = "P_TUNING"
    PREFIX_TUNING = "PREFIX_TUNING"


# the prefix of each method's parameter names (peft's state-dict keys: "lora_A", ...)
PEFT_TYPE_TO_PREFIX_MAPPING = {PeftType.LORA: "lora_", PeftType.PROMPT_TUNING: "prompt_tuning_",
                               PeftType.P_TUNING: "p_tuning_",
                               PeftType.PREFIX_TUNING: "prefix_tuning_"}


def warn_if_name_in_prefix(adapter_name, peft_type):
    """An adapter named like part of its method's prefix ("lora" in "lora_") confuses peft's key
    mapping when its file is read back: warned, as peft warns. Mirrors: peft get_peft_model's
    and PeftModel.add_adapter's check"""
    prefix = PEFT_TYPE_TO_PREFIX_MAPPING.get(peft_type)
    if prefix and adapter_name in prefix:
        warnings.warn(f"Adapter name '{adapter_name}' should not be contained in the prefix "
                      f"'{prefix}'. This may lead to reinitialization of the adapter weights "
                      "during loading. Pick another adapter name.")


class PromptTuningInit(str, enum.Enum):
    """How prompt tuning's virtual tokens start: the embeddings of a text, of random vocabulary
    tokens, or nn.Embedding's N(0, 1). Mirrors: peft PromptTuningInit"""
    TEXT = "TEXT"
    SAMPLE_VOCAB = "SAMPLE_VOCAB"
    RANDOM = "RANDOM"


def _check_task_type(task_type):
    # peft's words for a task_type it does not know
    if task_type is not None and task_type not in [t.value for t in TaskType]:
        raise ValueError(f"Invalid task type: '{task_type}'. Must be one of the following task "
                         f"types: {', '.join(TaskType)}.")


def _warn_unexpected(cls, d, known):
    # a newer writer's keys are ignored, said once (peft's forward compatibility)
    unexpected = sorted(k for k in d if k not in known)
    if unexpected:
        warnings.warn(f"Unexpected keyword arguments {unexpected} for class {cls.__name__}, these "
                      "are ignored. This probably means that you're loading a configuration file "
                      "that was saved using a higher version of the library.")


def _check_unused(d, defaults, source):
    # a peft-only feature switched on would load silently wrong: refuse it, naming file and key
    for key, value in d.items():
        if key in defaults and key not in _HARMLESS and value and value != defaults[key]:
            raise ValueError(f"{source} sets {key}={value!r}, a peft feature nanosft does not "
                             f"implement; remove it or use peft itself")


def read_config_json(path_json_file):
    """An adapter_config.json as a dict. Mirrors: peft PeftConfig.from_json_file"""
    import json

    with open(path_json_file, encoding="utf-8") as f:
        return _drop_runtime_config(json.load(f))


def _drop_runtime_config(d):
    # runtime settings are never read from a file (peft warns and drops the key)
    if "runtime_config" in d:
        warnings.warn("The configuration file contains a `runtime_config` key. This is ignored. "
                      "Runtime configurations are only valid at runtime.")
        del d["runtime_config"]
    return d


def _get_commit_hash(pkg_name):
    """The commit a package was pip-installed from (its direct_url.json's vcs_info), else None.
    Mirrors: peft.config._get_commit_hash"""
    try:
        dist = importlib.metadata.distribution(pkg_name)
    except importlib.metadata.PackageNotFoundError:
        return None
    for path in dist.files or []:
        if path.name == "direct_url.json":
            vcs_info = json.loads(dist.locate_file(path).read_text()).get("vcs_info") or {}
            if "commit_id" in vcs_info:
                return vcs_info["commit_id"]
    return None


def _peft_version():
    """What a new config records as peft_version: `__version__`, with "@<commit>" (or "@UNKNOWN")
    after a dev version, whose number alone does not say which code wrote the file.
    Mirrors: peft PeftConfigMixin._get_peft_version"""
    if ".dev" not in __version__:
        return __version__
    try:
        commit = _get_commit_hash("peft") or "UNKNOWN"
    except Exception:  # never fail a config over its version string
        warnings.warn("A dev version of PEFT is used but there was an error while trying to "
                      "determine the commit hash. The version is recorded with @UNKNOWN.")
        commit = "UNKNOWN"
    return f"{__version__}@{commit}"


@dataclasses.dataclass
class LoraConfig:
    """LoRA hyper-parameters, peft's field names and defaults (target_modules None: q_proj, v_proj).
    SFTTrainer's `peft_config`. Mirrors: peft LoraConfig
    Differs: task_type defaults to "CAUSAL_LM"; init_lora_weights only True, False, "gaussian" or
    "orthogonal"; megatron_config refused."""
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
    # LoRA on parameters, e.g. an MoE's 3-D experts (nanosft.expert_lora)
    target_parameters: list | None = None
    # {regex: r or alpha} for the modules / parameters whose name ends in a match
    rank_pattern: dict = dataclasses.field(default_factory=dict)
    alpha_pattern: dict = dataclasses.field(default_factory=dict)
    # which layers: only those whose index (after `layers_pattern`, e.g. "layers") is listed
    layers_to_transform: list | int | None = None
    layers_pattern: list | str | None = None
    exclude_modules: list | str | None = None
    fan_in_fan_out: bool = False  # weight stored (in, out): transformers' Conv1D (GPT-2)
    lora_bias: bool = False  # lora_B gets a bias (merged into the base layer's bias)
    peft_version: str | None = None  # the writer's version: kept from a file, else ours
    # a few embedding rows trained in place of the whole matrix: [indices] for the input
    # embedding, or {module name: [indices]} (nanosft.trainable_tokens)
    trainable_token_indices: list | dict | None = None
    # keep modules tied to the input embedding (an LM head) tied through the adapter
    ensure_weight_tying: bool = False
    # aLoRA: the adapter acts only from the last occurrence of these token ids on
    alora_invocation_tokens: list | None = None
    # peft's Megatron-LM parallel layers: not implemented, refused when set
    megatron_config: dict | None = None
    # [[start, end), ...]: the decoder rebuilt from these ranges of its layers, weights shared,
    # each copy with its own adapter (nanosft.layer_replication)
    layer_replication: list | None = None
    # {module type: LoRA layer class} registered by _register_custom_module; never saved
    _custom_modules: dict | None = dataclasses.field(default=None, repr=False, compare=False)

    def __post_init__(self):
        self.peft_type = PeftType.LORA  # whatever was passed, as peft's __post_init__ sets it
        self.peft_version = self.peft_version or _peft_version()
        _check_task_type(self.task_type)
        if isinstance(self.task_type, enum.Enum):
            self.task_type = TaskType(self.task_type.value)
        if isinstance(self.target_modules, str) and self.layers_to_transform is not None:
            raise ValueError("`layers_to_transform` cannot be used when `target_modules` is a str.")
        if isinstance(self.target_modules, str) and self.layers_pattern is not None:
            raise ValueError("`layers_pattern` cannot be used when `target_modules` is a str.")
        if self.layers_pattern and self.layers_to_transform is None:
            raise ValueError("When `layers_pattern` is specified, `layers_to_transform` must "
                             "also be specified. ")
        if isinstance(self.target_parameters, str):
            raise TypeError("`target_parameters` must be a list of strings or None.")
        if self.use_dora and self.megatron_config:
            raise ValueError("DoRA does not support megatron_core, please set `use_dora=False`.")
        if self.megatron_config:
            raise ValueError("LoraConfig.megatron_config is set, but nanosft has no Megatron-LM "
                             "parallel layers; remove it (or use peft itself)")
        if self.lora_bias and self.init_lora_weights not in (True, False):
            raise ValueError("The argument lora_bias=True is only supported with "
                             "init_lora_weights=True or False, got "
                             f"init_lora_weights={self.init_lora_weights} instead.")
        if self.lora_bias and self.use_dora:
            raise ValueError("The argument lora_bias=True is not supported for DoRA, please pass "
                             "use_dora=False")
        if not isinstance(self.r, int) or self.r <= 0:
            raise ValueError("LoraConfig.r must be a positive integer (the adapter rank), "
                             f"got r={self.r!r}")
        for f in dataclasses.fields(self):  # lora_alpha, lora_dropout: peft takes inf/nan
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"LoraConfig.{f.name}={value!r} is invalid: give a finite number "
                                 f"(peft's default is {f.default!r}); with nan/inf the adapter's "
                                 "output is nan/inf")
        # an unknown `bias` is refused when the model is wrapped, as peft does
        # (nanosft.tuners.check_bias): a config alone may still be written and read
        if self.init_lora_weights not in INIT_LORA_WEIGHTS:
            raise ValueError(f"LoraConfig.init_lora_weights={self.init_lora_weights!r} is not "
                             "implemented; use True (peft's default), False, 'gaussian' or "
                             "'orthogonal'")
        if isinstance(self.target_modules, (set, tuple)):
            self.target_modules = sorted(self.target_modules)
        if isinstance(self.exclude_modules, (set, tuple)):
            self.exclude_modules = sorted(self.exclude_modules)
        if isinstance(self.target_parameters, (set, tuple)):
            self.target_parameters = sorted(self.target_parameters)

    @property
    def is_prompt_learning(self):
        """False: LoRA lives in the model's layers. Mirrors: peft PeftConfig.is_prompt_learning"""
        return False

    def to_dict(self):
        """The adapter_config.json dict, key for key as peft writes it.
        Mirrors: peft PeftConfig.to_dict"""
        fields = dataclasses.asdict(self)
        del fields["_custom_modules"]  # classes, not settings: peft does not save them either
        fields["peft_type"] = self.peft_type.value  # json-ready strings, as peft writes them
        if isinstance(fields["task_type"], enum.Enum):
            fields["task_type"] = fields["task_type"].value
        return {**_LORA_UNUSED, **fields}

    @classmethod
    def from_dict(cls, d, source="adapter config"):
        """Build from an adapter_config.json dict; peft keys we do not model must hold defaults.
        Mirrors: peft PeftConfig.from_peft_type"""
        _check_unused(d, _LORA_UNUSED, source)
        names = [f.name for f in dataclasses.fields(cls)]
        _warn_unexpected(cls, d, {*names, *_LORA_UNUSED})
        return cls(**{name: d[name] for name in names if name in d})

    from_json_file = staticmethod(read_config_json)

    def _register_custom_module(self, mapping):
        """Wrap modules of the types in `mapping` ({module type: LoRA layer class}) with that
        class, called as LoraLinear is (base layer, adapter name, r, lora_alpha, ...). Not saved:
        register again after loading the config. Mirrors: peft LoraConfig._register_custom_module
        Differs: the class gets LoraLinear's keyword arguments, not peft's `config=` and kwargs."""
        self._custom_modules = {**(self._custom_modules or {}), **mapping}

    def save_pretrained(self, save_directory, **kwargs):
        """Write adapter_config.json into `save_directory`.
        Mirrors: peft PeftConfig.save_pretrained"""
        save_config_file(self, save_directory)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, subfolder=None, **kwargs):
        """Read adapter_config.json from a folder. Mirrors: peft PeftConfig.from_pretrained"""
        return load_config_file(cls, pretrained_model_name_or_path, subfolder, kwargs)


def custom_layer_class(config, module):
    """The LoRA layer class registered for `module`'s type (_register_custom_module), or None."""
    for key, cls in (getattr(config, "_custom_modules", None) or {}).items():
        if isinstance(module, key):
            return cls
    return None


@dataclasses.dataclass
class PromptLearningConfig:
    """The fields every prompt-learning adapter shares: `num_virtual_tokens` and the base model's
    shape (token_dim, num_layers, num_attention_heads; None: read off the model when wrapped).
    Mirrors: peft PromptLearningConfig"""
    num_virtual_tokens: int | None = None
    token_dim: int | None = None
    num_transformer_submodules: int | None = 1
    num_attention_heads: int | None = None
    num_layers: int | None = None
    task_type: str | None = "CAUSAL_LM"
    base_model_name_or_path: str | None = None
    inference_mode: bool = False
    peft_type: str | None = None
    peft_version: str | None = None  # the writer's version: kept from a file, else ours

    # adapter_config.json keys of peft features nanosft does not implement (written as peft does)
    _unused = {"auto_mapping": None, "modules_to_save": None, "revision": None}
    _not_saved = ()  # fields that are objects, not settings

    def __post_init__(self):
        name = type(self).__name__
        n = self.num_virtual_tokens  # None until set (peft's default): checked when wrapping
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n <= 0):
            raise ValueError(f"{name}.num_virtual_tokens must be a positive int, got {n!r}")
        if isinstance(self.task_type, enum.Enum):  # peft's TaskType: saved as its string
            self.task_type = self.task_type.value
        _check_task_type(self.task_type)
        own = self.__dataclass_fields__["peft_type"].default  # a subclass's kind, as peft sets
        if own is not None or self.peft_type is not None:
            self.peft_type = PeftType(own if own is not None else self.peft_type)
        self.peft_version = self.peft_version or _peft_version()
        _check_task_type(self.task_type)

    @property
    def is_prompt_learning(self):
        """True: the adapter is virtual tokens, not layers. Mirrors: peft is_prompt_learning"""
        return True

    def to_dict(self):
        """The adapter_config.json dict, key for key as peft writes it.
        Mirrors: peft PeftConfig.to_dict"""
        names = [f.name for f in dataclasses.fields(self) if f.name not in self._not_saved]
        fields = {name: getattr(self, name) for name in names}
        fields = {k: v.value if isinstance(v, enum.Enum) else v for k, v in fields.items()}
        return {**self._unused, **fields}

    from_json_file = staticmethod(read_config_json)

    def save_pretrained(self, save_directory, **kwargs):
        """Write adapter_config.json into `save_directory`.
        Mirrors: peft PeftConfig.save_pretrained"""
        save_config_file(self, save_directory)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, subfolder=None, **kwargs):
        """Read adapter_config.json from a folder. Mirrors: peft PeftConfig.from_pretrained"""
        return load_config_file(cls, pretrained_model_name_or_path, subfolder, kwargs)

    @classmethod
    def from_dict(cls, d, source="adapter config"):
        """Build from an adapter_config.json dict.
        Mirrors: peft PeftConfig.from_peft_type"""
        _check_unused(d, cls._unused, source)
        names = [f.name for f in dataclasses.fields(cls) if f.name not in cls._not_saved]
        _warn_unexpected(cls, d, {*names, *cls._unused})
        return cls(**{name: d[name] for name in names if name in d})


@dataclasses.dataclass
class PromptTuningConfig(PromptLearningConfig):
    """Prompt tuning: `num_virtual_tokens` trainable embeddings before the input (RANDOM or TEXT).
    2.6 reads its `num_virtual_tokens`. Mirrors: peft PromptTuningConfig
    Differs: TEXT init takes a `tokenizer` object (anything with `encode`) or a tokenizer folder."""
    prompt_tuning_init: str = "RANDOM"
    prompt_tuning_init_text: str | None = None
    tokenizer_name_or_path: str | None = None
    tokenizer: object = dataclasses.field(default=None, repr=False, compare=False)
    peft_type: str = "PROMPT_TUNING"

    _unused = {**PromptLearningConfig._unused, "tokenizer_kwargs": None}
    _not_saved = ("tokenizer",)

    def __post_init__(self):
        super().__post_init__()
        if self.prompt_tuning_init not in ("RANDOM", "TEXT", "SAMPLE_VOCAB"):
            raise ValueError("prompt_tuning_init must be 'RANDOM', 'TEXT' or 'SAMPLE_VOCAB', "
                             f"got {self.prompt_tuning_init!r}")
        self.prompt_tuning_init = PromptTuningInit(self.prompt_tuning_init)
        has_tokenizer = self.tokenizer or self.tokenizer_name_or_path
        text_ok = self.prompt_tuning_init_text and has_tokenizer
        # loading a saved adapter (inference_mode) needs no text: the embeddings come from the file
        if self.prompt_tuning_init == "TEXT" and not self.inference_mode and not text_ok:
            missing = ("tokenizer_name_or_path" if not has_tokenizer else
                       "prompt_tuning_init_text")  # peft's wording, the tokenizer asked first
            raise ValueError(f"When prompt_tuning_init='TEXT', {missing} can't be None: "
                             "prompt_tuning_init='TEXT' needs prompt_tuning_init_text and a "
                             "tokenizer (tokenizer=... or tokenizer_name_or_path=...)")


@dataclasses.dataclass
class PromptEncoderConfig(PromptLearningConfig):
    """P-tuning: the virtual tokens' embeddings pass through an MLP, or a bidirectional LSTM then
    an MLP, before they are prepended (nanosft.prompt_learning.PromptEncoder).
    Mirrors: peft PromptEncoderConfig
    Args: encoder_reparameterization_type ("MLP" or "LSTM"); encoder_hidden_size (None: token_dim);
    encoder_num_layers (the LSTM's layers; MLP always has 3 linears); encoder_dropout (LSTM)."""
    encoder_reparameterization_type: str = "MLP"
    encoder_hidden_size: int | None = None
    encoder_num_layers: int = 2
    encoder_dropout: float = 0.0
    peft_type: str = "P_TUNING"

    def __post_init__(self):
        super().__post_init__()
        kind = self.encoder_reparameterization_type
        kind = kind.value if isinstance(kind, enum.Enum) else kind  # peft's enum, or its string
        if kind not in ("MLP", "LSTM"):
            raise ValueError("PromptEncoderConfig.encoder_reparameterization_type must be 'MLP' "
                             f"(recommended) or 'LSTM', got {kind!r}")
        self.encoder_reparameterization_type = kind


@dataclasses.dataclass
class PrefixTuningConfig(PromptLearningConfig):
    """Prefix tuning: `num_virtual_tokens` trained keys and values in every attention layer, handed
    to the model as its cache (nanosft.prompt_learning.PrefixEncoder).
    Mirrors: peft PrefixTuningConfig
    Args: prefix_projection (the prefix comes from an embedding through a 2-layer tanh MLP of width
    encoder_hidden_size, None: token_dim); init_weights (None: random; "zero": a zero prefix)."""
    init_weights: str | None = None
    encoder_hidden_size: int | None = None
    prefix_projection: bool = False
    peft_type: str = "PREFIX_TUNING"

    def __post_init__(self):
        super().__post_init__()
        if self.init_weights not in (None, "zero"):
            raise ValueError("PrefixTuningConfig.init_weights must be None (random) or 'zero', "
                             f"got {self.init_weights!r}")


def prompt_init_token_ids(config, total):
    """The `total` token ids a TEXT init copies: prompt_tuning_init_text encoded, cut or repeated.
    Mirrors: peft PromptEmbedding.__init__"""
    tokenizer = config.tokenizer
    if tokenizer is None:
        from nanosft.tokenizer import Tokenizer
        tokenizer = Tokenizer.from_pretrained(config.tokenizer_name_or_path)
    ids = list(tokenizer.encode(config.prompt_tuning_init_text))
    if not ids:
        raise ValueError(f"prompt_tuning_init_text={config.prompt_tuning_init_text!r} "
                         "encodes to no tokens")
    return (ids * -(-total // len(ids)))[:total]  # truncate, or repeat up to the virtual length


class PeftConfig:
    """Reads any adapter config file into the class its peft_type names.
    Mirrors: peft PeftConfig.from_pretrained, from_json_file
    Differs: a reader only; the config classes do not inherit from it."""

    @staticmethod
    def from_pretrained(pretrained_model_name_or_path, subfolder=None, **kwargs):
        """The config of an adapter folder. Mirrors: peft PeftConfig.from_pretrained"""
        return load_config_file(None, pretrained_model_name_or_path, subfolder, kwargs)

    from_json_file = staticmethod(read_config_json)


def peft_config_from_dict(d, source="adapter config"):
    """The config class `peft_type` names (LoRA or a prompt-learning one), from an
    adapter_config.json dict. Mirrors: peft PeftConfig.from_pretrained"""
    kinds = {"LORA": LoraConfig, "PROMPT_TUNING": PromptTuningConfig,
             "P_TUNING": PromptEncoderConfig, "PREFIX_TUNING": PrefixTuningConfig}
    if d.get("peft_type") not in kinds:
        raise ValueError(f"{source} has peft_type={d.get('peft_type')!r}; "
                         f"nanosft reads {sorted(kinds)}")
    return kinds[d["peft_type"]].from_dict(d, source)


def save_config_file(config, save_directory):
    """Write a config's adapter_config.json (sorted keys, as peft).
    Mirrors: peft PeftConfig.save_pretrained"""
    from nanosft.io import hub  # the files layer below: imported on use

    os.makedirs(save_directory, exist_ok=True)
    hub.write_json(config.to_dict(), os.path.join(save_directory, CONFIG_NAME), sort_keys=True)


def load_config_file(cls, folder, subfolder=None, overrides=None):
    """A config of class `cls` (or the class peft_type names) from a folder's adapter_config.json,
    with `overrides` set on top. Mirrors: peft PeftConfig.from_pretrained"""
    from nanosft.io import hub  # the files layer below: imported on use

    path = os.path.join(folder, subfolder or "", CONFIG_NAME)
    d = {**_drop_runtime_config(hub.read_json(path)), **(overrides or {})}
    if "peft_type" not in d:  # not an adapter config at all (peft: a TypeError)
        name = cls.__name__ if cls is not None else "PeftConfig"
        raise TypeError(f"The {name} config that is trying to be loaded is missing required keys: "
                        f"{{'peft_type'}}. ({path} is no adapter config: peft writes peft_type "
                        "into every one)")
    config = peft_config_from_dict(d, source=path)
    if cls is not None and not isinstance(config, cls):
        raise TypeError(f"{path} holds a {type(config).__name__}, not a {cls.__name__}")
    return config


# ----------------------------------------------------------------------------- target modules

# peft's default target_modules per model_type (the facts of peft's
# TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING); peft has none for phi3 and smollm3, so
# those need target_modules, as in peft
DEFAULT_TARGET_MODULES = {
    "t5": ["q", "v"], "mt5": ["q", "v"], "bart": ["q_proj", "v_proj"], "gpt2": ["c_attn"],
    "bloom": ["query_key_value"], "blip-2": ["q", "v", "q_proj", "v_proj"],
    "opt": ["q_proj", "v_proj"], "gptj": ["q_proj", "v_proj"], "gpt_neox": ["query_key_value"],
    "gpt_neo": ["q_proj", "v_proj"], "bert": ["query", "value"], "roberta": ["query", "value"],
    "xlm-roberta": ["query", "value"], "electra": ["query", "value"],
    "deberta-v2": ["query_proj", "value_proj"], "deberta": ["in_proj"],
    "layoutlm": ["query", "value"], "llama": ["q_proj", "v_proj"], "llama4": ["q_proj", "v_proj"],
    "chatglm": ["query_key_value"], "gpt_bigcode": ["c_attn"], "mpt": ["Wqkv"],
    "RefinedWebModel": ["query_key_value"], "RefinedWeb": ["query_key_value"],
    "falcon": ["query_key_value"], "btlm": ["c_proj", "c_attn"], "codegen": ["qkv_proj"],
    "mistral": ["q_proj", "v_proj"], "mixtral": ["q_proj", "v_proj"],
    "stablelm": ["q_proj", "v_proj"], "phi": ["q_proj", "v_proj", "fc1", "fc2"],
    "gemma": ["q_proj", "v_proj"], "gemma2": ["q_proj", "v_proj"],
    "gemma3_text": ["q_proj", "v_proj"], "gemma4": r".*language_model\..*\.(q_proj|v_proj)",
    "qwen2": ["q_proj", "v_proj"], "qwen3": ["q_proj", "v_proj"],
    "nemotron_h": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "rwkv": ["key", "value", "receptance", "output"],
    "rwkv7": ["r_proj", "k_proj", "v_proj", "o_proj", "key", "value"]}

_LINEAR = (nn.Linear, Linear4bit)  # the layers a LoraLinear wraps (and transformers' Conv1D)


def is_conv1d(module):
    """transformers' Conv1D (GPT-2): a linear whose weight is stored (in, out), found by name so
    nothing here imports transformers. Mirrors: peft's isinstance(target, Conv1D)"""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def is_lora_target(module):
    """Whether LoRA can wrap `module`: a linear, 4-bit linear, Conv1D, embedding, convolution,
    multi-head attention, or a LoRA layer already there (a second adapter).
    Mirrors: peft LoraModel._create_new_module's dispatch"""
    return (isinstance(module, (*_LINEAR, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d,
                                nn.MultiheadAttention))
            or is_conv1d(module) or hasattr(module, "lora_A")
            or hasattr(module, "lora_embedding_A"))


def linear_layer_names(model):
    """Full names of the linears a LoRA may wrap: not the output head, not a LoRA's own A/B.
    Mirrors: peft _maybe_include_all_linear_layers (its search)"""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return [n for n, m in model.named_modules()
            if (isinstance(m, _LINEAR) or is_conv1d(m)) and m is not head and ".lora_" not in n
            and not n.endswith(".base_layer")]


def pattern_value(patterns, key, default):
    """patterns[p] for the first regex p that matches the end of `key` after a dot, else default
    (rank_pattern, alpha_pattern). Mirrors: peft get_pattern_key"""
    for p in patterns:
        if re.match(rf"(.*\.)?({p})$", key):
            return patterns[p]
    return default


def target_module_matches(target, name):
    """Whether module `name` is targeted: a str is a regex fullmatch, a list entry matches `name`
    or `*.name`. Mirrors: peft check_target_module_exists"""
    if isinstance(target, str):
        return re.fullmatch(target, name) is not None
    return any(name == t or name.endswith("." + t) for t in target)


def layer_index_allowed(config, name):
    """With `layers_to_transform`: whether `name` sits in a listed layer (the first number after
    `layers_pattern`, or after any module name). Mirrors: peft check_target_module_exists"""
    indexes = config.layers_to_transform
    if indexes is None or (isinstance(indexes, list) and not indexes):
        return True
    patterns = config.layers_pattern
    if not patterns:
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", name)
    else:
        match = None
        for p in [patterns] if isinstance(patterns, str) else patterns:
            match = re.match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", name)
            if match is not None:
                break
    if match is None:
        return False
    idx = int(match.group("idx"))
    return idx == indexes if isinstance(indexes, int) else idx in indexes


def _excluded(config, name):
    # peft's _ExcludedModule: exclude_modules, and anything inside modules_to_save
    excluded = getattr(config, "exclude_modules", None)
    if excluded and target_module_matches(excluded, name):
        return True
    to_save = config.modules_to_save or []
    return any(re.match(rf"(^|.*\.){m}($|\..*)", name) for m in to_save)


def resolve_target_modules(model, config):
    """`target_modules` as saved: None -> the architecture default (none, with target_parameters:
    None), "all-linear" -> every linear. Mirrors: peft _maybe_include_all_linear_layers,
    LoraModel._prepare_adapter_config,
    TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING"""
    target = config.target_modules
    if target is None:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        if model_type in DEFAULT_TARGET_MODULES:
            return list(DEFAULT_TARGET_MODULES[model_type])
        if config.target_parameters:  # no default: the parameters alone, None kept (as peft)
            return None
        raise ValueError("Please specify `target_modules` in `peft_config`: there is no "
                         f"default target_modules for model_type={model_type!r}; set "
                         "LoraConfig.target_modules or target_parameters")
    if isinstance(target, str) and target.lower() == "all-linear":
        return linear_layer_names(model)  # lm_head excluded
    return target


def find_target_modules(model, config):
    """Names of the modules LoRA wraps, in `model.named_modules()` order (peft's init order); the
    modules inside a LoRA layer are skipped (a second adapter goes onto the LoRA layer itself).
    Mirrors: peft BaseTuner.inject_adapter, check_target_module_exists
    Differs: a list entry that matches nothing is an error (peft errors only if nothing matches)."""
    target = resolve_target_modules(model, config)
    if target is None:  # target_parameters alone
        return []
    inside = [n for n, m in model.named_modules() if hasattr(m, "base_layer")]
    candidates = [n for n, _ in model.named_modules()
                  if not any(n.startswith(p + ".") for p in inside)]
    names = [n for n in candidates if target_module_matches(target, n)
             and not _excluded(config, n) and layer_index_allowed(config, n)]
    linear = sorted({n.rsplit(".", 1)[-1] for n in linear_layer_names(model)})
    # peft errors only when nothing matches; a plain list without layer filters is checked per entry
    per_entry = config.layers_to_transform is None and not config.exclude_modules
    entries = [target] if isinstance(target, str) or not per_entry else target
    for t in entries:
        entry = t if isinstance(target, str) else [t]
        if not names or (per_entry and not any(target_module_matches(entry, n) for n in names)):
            raise ValueError(f"LoraConfig.target_modules entry {t!r} matches no module of "
                             f"{type(model).__name__} (Target modules {t!r} not found in the base "
                             f"model; searched all {len(list(model.named_modules()))} module "
                             f"names); its linear layers are named {linear}")
    for n in names:
        module = model.get_submodule(n)
        if not is_lora_target(module) and custom_layer_class(config, module) is None:
            raise ValueError(f"Target module {n!r} is a {type(module).__name__}, not a linear "
                             "layer: LoRA wraps torch.nn.Linear, Linear4bit, transformers' "
                             "Conv1D, nn.Conv1d/2d/3d, torch.nn.Embedding and "
                             f"nn.MultiheadAttention, e.g. {linear}")
    return names


# ----------------------------------------------------------------------------- saved keys

def _saved_key(key, adapter_name):
    # peft _remove_adapter_name_from_state_dict_key: lora_A.default.weight -> lora_A.weight, ...
    a = re.escape(adapter_name)
    key = re.sub(rf"\.lora_magnitude_vector\.{a}\.weight$", ".lora_magnitude_vector", key)
    key = re.sub(rf"\.modules_to_save\.{a}\.", ".", key)
    key = re.sub(rf"\.trainable_tokens_delta\.{a}$", ".trainable_tokens_delta", key)
    key = re.sub(rf"\.(lora_embedding_A|lora_embedding_B)\.{a}$", r".\1", key)
    return re.sub(rf"\.(lora_A|lora_B)\.{a}\.", r".\1.", key)


def _adapter_keys(model, adapter_name):
    # {saved key: model state-dict key} for every tensor the adapter file holds
    config = model.peft_config[adapter_name]
    keys = {}
    # a wrapper tied to the embedding's rows saves nothing of its own
    tied = tuple(f"{n}." for n, m in model.named_modules()
                 if getattr(getattr(m, "token_adapter", None), "tied_adapter", None) is not None)
    for k in model.state_dict():
        if k.endswith(f".trainable_tokens_delta.{adapter_name}"):
            if not k.startswith(tied):
                keys[_saved_key(k, adapter_name)] = k
            continue
        is_lora = "lora_" in k and (f".{adapter_name}." in k or k.endswith(f".{adapter_name}"))
        bias_trains = config.bias == "all" or (config.bias == "lora_only" and ".base_layer." in k)
        is_bias = k.endswith(".bias") and ".original_module." not in k and bias_trains
        if is_lora or is_bias or f".modules_to_save.{adapter_name}." in k:
            keys[_saved_key(k, adapter_name)] = k
    return keys


def get_peft_model_state_dict(model, state_dict=None, adapter_name="default",
                              unwrap_compiled=False, save_embedding_layers="auto"):
    """The adapter's tensors under peft's saved keys (no adapter name). Prompt learning saves one
    `prompt_embeddings`: the encoder's output (P-tuning: after its MLP / LSTM; prefix tuning: the
    flat per-layer keys and values), so a loaded adapter needs no encoder.
    Mirrors: peft get_peft_model_state_dict, BasePromptEncoder._get_adapter_state_dict"""
    config = model.peft_config[adapter_name]
    if config.peft_type in PROMPT_LEARNING_TYPES:
        if config.inference_mode:
            prompt_embeddings = model.prompt_encoder[adapter_name].embedding.weight.detach()
        else:
            prompt_embeddings = model.get_prompt_embedding_to_save(adapter_name)
        return {"prompt_embeddings": prompt_embeddings}
    state_dict = model.state_dict() if state_dict is None else state_dict
    keys = _adapter_keys(model, adapter_name)
    if save_embedding_layers == "auto":
        save_embedding_layers = (_embedding_targeted(model, config)
                                 and config.trainable_token_indices is None)
        if save_embedding_layers:
            warnings.warn("Setting `save_embedding_layers` to `True` as embedding layers found in "
                          "`target_modules`.")
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if save_embedding_layers and not hasattr(base, "get_input_embeddings"):
        warnings.warn("Could not identify embedding layer(s) because the model is not a 🤗 "
                      "transformers model.")
    elif save_embedding_layers:
        targeted = _embedding_targeted(model, config)
        keys.update({k: k for k in _embedding_base_keys(model, state_dict, targeted)})
    return {saved: state_dict[k].detach() for saved, k in keys.items()}


def _embedding_targeted(model, config):
    # peft: an entry named exactly embed_tokens / lm_head, or a regex matching such a module
    target = config.target_modules
    if isinstance(target, str) and target != "all-linear":
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        return any(re.fullmatch(target, n) for n, _ in base.named_modules()
                   if re.match(r"(.*\.)?(embed_tokens|lm_head)$", n))
    return isinstance(target, list) and any(k in target for k in ("embed_tokens", "lm_head"))


def _embedding_base_keys(model, state_dict, targeted=True):
    # the weights of the input / output embeddings, saved whole as peft's save_embedding_layers
    # saves them (a resized vocabulary travels with the adapter): a targeted one's base layer, an
    # untargeted one itself
    out = []
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for get in ("get_input_embeddings", "get_output_embeddings"):
        layer = getattr(base, get, lambda: None)()
        module = getattr(layer, "base_layer", None) if targeted else layer
        if module is None or (targeted and not isinstance(module, (nn.Linear, nn.Embedding))):
            continue
        name = next((n for n, m in model.named_modules() if m is module), None)
        if name is not None:
            out += [k for k in state_dict if k.startswith(name + ".")]
    return out


def set_peft_model_state_dict(model, state_dict, adapter_name="default", source="state_dict"):
    """Copy adapter tensors saved under peft's keys into `model`; a key or shape that does not fit
    is an error. Mirrors: peft set_peft_model_state_dict
    Differs: peft warns about unexpected/missing adapter keys; we raise, naming them."""
    if model.peft_config[adapter_name].peft_type in PROMPT_LEARNING_TYPES:
        keys = {"prompt_embeddings": f"prompt_encoder.{adapter_name}.embedding.weight"}
    else:
        keys = _adapter_keys(model, adapter_name)
    own = model.state_dict()
    # a bias a bias="all" / "lora_only" adapter saved loads into any model that has it (peft)
    keys.update({k: k for k in state_dict if k not in keys and k.endswith(".bias") and k in own})
    # save_embedding_layers: an embedding's base weight, loaded over the model's (peft)
    embedding = set(_embedding_base_keys(model, own)) | set(_embedding_base_keys(model, own, False))
    keys.update({k: k for k in state_dict if k not in keys and k in embedding})
    unexpected = sorted(set(state_dict) - set(keys))
    missing = sorted(set(keys) - set(state_dict))
    if unexpected:
        raise ValueError(f"{source}: tensor {unexpected[0]!r} (and {len(unexpected) - 1} more) "
                         "fits no module of this model; was the adapter trained on another base "
                         "model or with other target_modules?")
    if missing:
        raise ValueError(f"{source}: adapter tensor {missing[0]!r} "
                         f"(and {len(missing) - 1} more) is missing")
    for saved, k in keys.items():
        if state_dict[saved].shape != own[k].shape:
            raise ValueError(f"{source}: tensor {saved!r} has shape "
                             f"{tuple(state_dict[saved].shape)} but this model expects "
                             f"{tuple(own[k].shape)}; the adapter was made for another base "
                             "model or rank")
    model.load_state_dict({k: state_dict[saved] for saved, k in keys.items()}, strict=False)
    return LoadResult(missing_keys=[], unexpected_keys=[])


@dataclasses.dataclass
class LoadResult:
    """What loading an adapter's tensors left out: nothing, or set_peft_model_state_dict raises.
    Mirrors: torch's _IncompatibleKeys (as peft returns it)"""
    missing_keys: list
    unexpected_keys: list


# ----------------------------------------------------------------------------- the two files

def save_adapter_files(save_directory, config, state_dict, safe_serialization=True):
    """Write adapter_model.safetensors (or .bin) and adapter_config.json (each atomically), as
    peft does (the model card: write_model_card). Mirrors: peft PeftModel.save_pretrained (its
    file writing); the config is saved with inference_mode=True, as peft's."""
    import torch

    from nanosft.io import hub  # the files layer below: imported on use

    os.makedirs(save_directory, exist_ok=True)
    tensors, seen = {}, set()
    for k, v in state_dict.items():  # a tied weight saved twice: the second is a copy (peft)
        v = v.contiguous()
        tensors[k] = v.clone() if v.data_ptr() in seen else v
        seen.add(v.data_ptr())
    if safe_serialization:
        hub.atomic_write(os.path.join(save_directory, WEIGHTS_NAME),
                         lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    else:
        hub.atomic_write(os.path.join(save_directory, BIN_WEIGHTS_NAME),
                         lambda tmp: torch.save(tensors, tmp))
    config_dict = {**config.to_dict(), "inference_mode": True}
    hub.write_json(config_dict, os.path.join(save_directory, CONFIG_NAME), sort_keys=True)


def write_model_card(save_directory, peft_type, base_model=None, is_transformers=True,
                     model_tags=(), causal_lm=False):
    """README.md with the Hub's front matter (library_name: peft, base_model, tags, pipeline_tag)
    and a "- PEFT <version>" line under "### Framework versions"; an existing card keeps its text
    and metadata and gets these added. `base_model`: the base's name_or_path, if it has one.
    Mirrors: peft PeftModel.create_or_update_model_card, _get_peft_specific_model_tags
    Differs: without huggingface_hub (the `hub` extra) a new card is the front matter alone and an
    existing one is left as it is."""
    path = os.path.join(save_directory, "README.md")
    try:
        from huggingface_hub import ModelCard, ModelCardData
    except ImportError:
        if not os.path.exists(path):
            _write_bare_model_card(path, peft_type, base_model, is_transformers)
        return
    exists = os.path.exists(path)
    card = ModelCard.load(path) if exists else ModelCard.from_template(ModelCardData())
    card.data["library_name"] = "peft"
    tags = set(model_tags or []) | set(_peft_tags(peft_type, base_model, is_transformers))
    if tags:
        card.data["tags"] = sorted(tags)
    if causal_lm and not card.data.pipeline_tag:
        card.data.pipeline_tag = "text-generation"
    if is_transformers and base_model:
        card.data["base_model"] = base_model
    lines = card.text.splitlines()
    heading, version_line = "### Framework versions", f"- PEFT {__version__}"
    if version_line not in lines:
        if heading in lines:
            lines.insert(lines.index(heading) + 2, version_line)
        else:
            lines.append(f"{heading}\n\n{version_line}")
    card.text = "\n".join(lines)
    card.save(path)


def _peft_tags(peft_type, base_model, is_transformers):
    # peft's own tags: the base's library, the method, the base model the adapter belongs to
    tags = ["transformers"] if is_transformers else []
    tags += ["lora"] if peft_type == "LORA" else []
    return tags + ([f"base_model:adapter:{base_model}"] if base_model else [])


def _write_bare_model_card(path, peft_type, base_model, is_transformers):
    lines = ["---", "library_name: peft"]
    if is_transformers and base_model:
        lines.append(f"base_model: {base_model}")
    tags = _peft_tags(peft_type, base_model, is_transformers)
    if tags:
        lines += ["tags:"] + [f"- {t}" for t in tags]
    lines += ["---", "", "# Model Card", "", "An adapter written by nanosft in peft's format.", ""]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))


def load_adapter_files(model_id):
    """(config, state_dict, weights path) of an adapter folder written by peft or nanosft.
    Mirrors: peft PeftConfig.from_pretrained, load_peft_weights"""
    from nanosft.io import hub  # the files layer below: imported on use

    config_path = os.path.join(model_id, CONFIG_NAME)
    weights_path = os.path.join(model_id, WEIGHTS_NAME)
    bin_path = os.path.join(model_id, BIN_WEIGHTS_NAME)
    if not os.path.isfile(weights_path) and os.path.isfile(bin_path):
        import torch

        config = peft_config_from_dict(hub.read_json(config_path), source=config_path)
        return config, torch.load(bin_path, weights_only=True), bin_path
    for path in (config_path, weights_path):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} not found; an adapter folder holds {CONFIG_NAME} "
                                    f"and {WEIGHTS_NAME}, as written by save_pretrained")
    # read_json's errors name the file, line and column
    config = peft_config_from_dict(hub.read_json(config_path), source=config_path)
    return config, load_file(weights_path), weights_path

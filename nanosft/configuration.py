"""The model's hyper-parameters: config.json read and written under transformers' names.

`ModelConfig` holds what `CausalLM` (model.py) is built from, with the field names and defaults of
transformers' LlamaConfig; `from_dict` / `to_dict` translate config.json in transformers-5 spelling
(rope_parameters, dtype) and the older one (rope_theta, rope_scaling, torch_dtype), and refuse
what the hand-written model does not implement (partial RoPE, activations). Family configs
(Qwen2, Qwen3, SmolLM3, Mistral's window) subclass ModelConfig in nanosft.families.
"""

import os
import sys
from dataclasses import dataclass, fields

from nanosft.rope import check_rope, standardize_rope

# Llama and Mistral without a window: the same decoder (the other families: nanosft.families)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}


# the sizes that build tensors: each must be a positive int
SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
         "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings")


def _require(ok, message):
    if not ok:
        raise ValueError(message)


def _is_number(value) -> bool:
    return type(value) in (int, float) and value == value and abs(value) != float("inf")


def _rope_dicts(config):
    """(where, dict) of each RoPE parameter set: rope_scaling, and a family's per-layer-type
    rope_parameters ({"sliding_attention": {...}, "full_attention": {...}})."""
    found = [("rope_parameters", {"rope_theta": config.rope_theta, **(config.rope_scaling or {})})]
    per_type = getattr(config, "rope_parameters", None)
    if isinstance(per_type, dict):
        found += [(f"rope_parameters[{k!r}]", p) for k, p in per_type.items()
                  if isinstance(p, dict)]
    return found


def check_fields(config) -> None:
    """Refuse values of config.json that build a model but one that cannot work (a window of no
    key, RoPE at theta <= 0, a layer list shorter than the layers): the error names the field,
    its value and what it must be. Runs on every family's config after its own defaults."""
    n = config.num_hidden_layers
    _require(_is_number(config.rms_norm_eps) and config.rms_norm_eps > 0,
             f"config: rms_norm_eps={config.rms_norm_eps!r} must be a positive number such as "
             "1e-06; fix config.json")
    for where, rope in _rope_dicts(config):
        theta = rope.get("rope_theta", 1.0)
        _require(_is_number(theta) and theta > 0, f"config: {where} rope_theta={theta!r} must be "
                 "a positive number (RoPE's base, e.g. 10000.0); fix config.json")
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind in ("linear", "dynamic", "yarn", "llama3"):  # the ones that scale by factor
            factor = rope.get("factor")
            _require(_is_number(factor) and factor > 0, f"config: {where} rope_type={kind!r} "
                     f"needs a positive 'factor' (got {factor!r}); add it to config.json, or set "
                     "rope_type to 'default'")
        partial = rope.get("partial_rotary_factor", 1.0)
        _require(_is_number(partial) and 0 < partial <= 1, f"config: {where} "
                 f"partial_rotary_factor={partial!r} must be in (0, 1] (the share of each head "
                 "that RoPE rotates); fix config.json")
    partial = getattr(config, "partial_rotary_factor", 1.0)
    _require(_is_number(partial) and 0 < partial <= 1, f"config: partial_rotary_factor="
             f"{partial!r} must be in (0, 1]; fix config.json")
    window = getattr(config, "sliding_window", None)
    _require(window is None or type(window) is int and window > 0, f"config: sliding_window="
             f"{window!r} must be a positive integer (the keys a sliding layer sees) or null; fix "
             "config.json")
    types = getattr(config, "layer_types", None)
    if isinstance(types, list):
        _require(len(types) == n, f"config: layer_types has {len(types)} entries but "
                 f"num_hidden_layers={n}; give one per layer in config.json")
        # the class's LAYER_TYPES, and its family module's where that names them
        module = sys.modules.get(type(config).__module__)
        kinds = list(dict.fromkeys([*config.LAYER_TYPES, *getattr(module, "LAYER_TYPES", ())]))
        unknown = sorted({str(t) for t in types} - set(kinds))
        _require(not unknown, f"config: layer_types holds {unknown}, which "
                 f"{type(config).__name__} does not build; use {kinds}")
    no_rope = getattr(config, "no_rope_layers", None)
    if isinstance(no_rope, list):
        _require(len(no_rope) == n, f"config: no_rope_layers has {len(no_rope)} entries but "
                 f"num_hidden_layers={n}; give one 0 or 1 per layer in config.json")
        _require(all(v in (0, 1) and type(v) in (int, bool) for v in no_rope),
                 f"config: no_rope_layers={no_rope} must hold only 0 (no RoPE) or 1 (RoPE)")


@dataclass
class ModelConfig:
    """Model hyper-parameters under transformers' LlamaConfig names and defaults.
    Mirrors: transformers LlamaConfig, MistralConfig
    Differs: rope_theta / rope_scaling stay flat fields; `to_dict` folds them into
    rope_parameters."""

    ARCHITECTURES = ARCHITECTURES  # model_type -> transformers class; a family config's own
    LAYER_TYPES = ("full_attention", "sliding_attention")  # the layer_types entries it builds
    # ModelConfig fields a family's transformers config neither has nor reads: config.json keys of
    # those names are dropped on load, as transformers ignores them (a family lists its own)
    UNREAD_FIELDS = ()

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "linear" | "yarn" | ..., "factor": ..., ...}
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 1
    eos_token_id: int | list | None = 2
    pad_token_id: int | None = None
    model_type: str = "llama"
    dtype: str | None = None  # the checkpoint dtype as config.json names it, e.g. "bfloat16"

    def __post_init__(self):
        for name in SIZES:  # a negative or fractional size would fail deep inside torch
            value = getattr(self, name)
            _require(value is None and name in ("num_key_value_heads", "head_dim")
                     or type(value) is int and value > 0,
                     f"config: {name}={value!r} must be a positive integer; fix config.json")
        _require(self.pad_token_id is None or type(self.pad_token_id) is int
                 and 0 <= self.pad_token_id < self.vocab_size,
                 f"config: pad_token_id={self.pad_token_id!r} is not a token id of the vocabulary "
                 f"(0 to {self.vocab_size - 1}); fix config.json (or set it to null)")
        _require(self.model_type in self.ARCHITECTURES, f"config: model_type={self.model_type!r} "
                 f"is not supported by {type(self).__name__}; use one of "
                 f"{list(self.ARCHITECTURES)} (AutoConfig / AutoModelForCausalLM load the other "
                 "families' model types)")
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        _require(self.num_attention_heads % self.num_key_value_heads == 0,
                 f"config: num_attention_heads={self.num_attention_heads} is not a multiple of "
                 f"num_key_value_heads={self.num_key_value_heads}")
        _require(self.hidden_act in ("silu", "swish"), f"config: hidden_act={self.hidden_act!r} "
                 "is not supported; Llama-family models use 'silu'")
        scaling = standardize_rope(self.rope_scaling, self.max_position_embeddings)
        partial = scaling.get("partial_rotary_factor", 1.0)
        _require(partial == 1.0, f"config: rope {self.rope_scaling} partial_rotary_factor="
                 f"{partial} is not supported for {self.model_type} (RoPE over whole heads)")
        check_rope("rope_parameters", scaling, self.head_dim)  # default .. llama3 (nanosft.rope)
        self.rope_scaling = None if scaling["rope_type"] == "default" else scaling

    @classmethod
    def from_dict(cls, d):
        """Build a config from a config.json dict in transformers-5 or older spelling.
        Mirrors: RotaryEmbeddingConfigMixin.standardize_rope_params"""
        _require(isinstance(d, dict), "config.json must hold a JSON object of fields such as "
                 f'{{"model_type": "llama", "hidden_size": 4096}}, not a {type(d).__name__}')
        model_type = d.get("model_type", "llama")
        _require(model_type != "mistral" or d.get("sliding_window") is None
                 or hasattr(cls, "sliding_window"),  # nanosft.families.mistral has the window
                 f"config.json: sliding_window={d.get('sliding_window')} is not supported by "
                 f"{cls.__name__}; load it with AutoModelForCausalLM.from_pretrained")
        kwargs = {f.name: d[f.name] for f in fields(cls)
                  if f.name in d and f.name not in cls.UNREAD_FIELDS}
        rope = dict(d.get("rope_parameters") or {})  # v5: {"rope_theta", "rope_type", factor, ...}
        kwargs["rope_theta"] = rope.pop("rope_theta", d.get("rope_theta", 10000.0))
        kwargs["rope_scaling"] = rope or d.get("rope_scaling")
        kwargs["dtype"] = d.get("dtype", d.get("torch_dtype"))
        config = cls(**kwargs)
        check_fields(config)
        return config

    def to_dict(self):
        """The transformers-5 config.json dict: rope_parameters, dtype, architectures.
        Mirrors: transformers PreTrainedConfig.to_dict"""
        d = {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("rope_")}
        rope = self.rope_scaling or {"rope_type": "default"}
        d.update(rope_parameters={"rope_theta": self.rope_theta, **rope},
                 dtype=self.dtype or "float32", architectures=[self.ARCHITECTURES[self.model_type]],
                 attention_dropout=0.0, use_cache=True)
        if self.model_type == "mistral" and not hasattr(self, "sliding_window"):
            d.update(sliding_window=None)  # transformers' MistralConfig default is 4096
        return dict(sorted(d.items()))

    @classmethod
    def from_pretrained(cls, model_dir):
        """Read model_dir/config.json as this class (AutoConfig picks the class by model_type).
        Mirrors: transformers PreTrainedConfig.from_pretrained"""
        from nanosft.io import hub  # the files layer below: imported on use

        path = os.path.join(model_dir, "config.json")
        try:
            return cls.from_dict(hub.read_json(path))
        except ValueError as error:  # the message names the field; this adds the file
            raise ValueError(f"{path}: {error}") from None

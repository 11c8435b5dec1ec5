"""The model's hyper-parameters: config.json read and written under transformers' names.

`ModelConfig` holds what `CausalLM` (model.py) is built from, with the field names and defaults of
transformers' LlamaConfig; `from_dict` / `to_dict` translate config.json in transformers-5 spelling
(rope_parameters, dtype) and the older one (rope_theta, rope_scaling, torch_dtype), and refuse
what the hand-written model does not implement (sliding windows, other rope types, activations).
"""

import os
from dataclasses import dataclass, fields

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM"}


def _require(ok, message):
    if not ok:
        raise ValueError(message)


@dataclass
class ModelConfig:
    """Model hyper-parameters under transformers' LlamaConfig names and defaults.
    Walkthrough 2.6 | Mirrors: transformers LlamaConfig, Qwen2Config, MistralConfig
    Differs: rope_theta / rope_scaling stay flat fields; `to_dict` folds them into
    rope_parameters."""

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
    rope_scaling: dict | None = None  # {"rope_type": "linear" | "llama3", "factor": ..., ...}
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 1
    eos_token_id: int | list | None = 2
    pad_token_id: int | None = None
    model_type: str = "llama"
    dtype: str | None = None  # the checkpoint dtype as config.json names it, e.g. "bfloat16"

    def __post_init__(self):
        _require(self.model_type in ARCHITECTURES, f"config: model_type={self.model_type!r} is "
                 f"not supported; use one of {list(ARCHITECTURES)}")
        # Qwen2 has q/k/v biases
        self.attention_bias = self.attention_bias or self.model_type == "qwen2"
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        _require(self.num_attention_heads % self.num_key_value_heads == 0,
                 f"config: num_attention_heads={self.num_attention_heads} is not a multiple of "
                 f"num_key_value_heads={self.num_key_value_heads}")
        _require(self.hidden_act in ("silu", "swish"), f"config: hidden_act={self.hidden_act!r} "
                 "is not supported; Llama-family models use 'silu'")
        scaling = dict(self.rope_scaling or {})
        # "type" is the legacy spelling of "rope_type"
        rope_type = scaling.pop("type", None) or scaling.get("rope_type", "default")
        partial = scaling.get("partial_rotary_factor", 1.0)
        _require(rope_type in ("default", "linear", "llama3") and partial == 1.0,
                 f"config: rope {self.rope_scaling} is not supported; use rope_type default, "
                 "linear or llama3")
        if rope_type == "llama3":
            scaling.setdefault("original_max_position_embeddings", self.max_position_embeddings)
        self.rope_scaling = None if rope_type == "default" else {**scaling, "rope_type": rope_type}

    @classmethod
    def from_dict(cls, d):
        """Build a config from a config.json dict in transformers-5 or older spelling.
        Walkthrough 2.1 | Mirrors: RotaryEmbeddingConfigMixin.standardize_rope_params"""
        model_type = d.get("model_type", "llama")
        _require(model_type != "mistral" or d.get("sliding_window") is None,
                 f"config.json: sliding_window={d.get('sliding_window')} is not supported; set it "
                 "to null if your texts fit in the window")
        _require(model_type != "qwen2" or not d.get("use_sliding_window"),
                 "config.json: use_sliding_window=true is not supported; set it to false")
        kwargs = {f.name: d[f.name] for f in fields(cls) if f.name in d}
        rope = dict(d.get("rope_parameters") or {})  # v5: {"rope_theta", "rope_type", factor, ...}
        kwargs["rope_theta"] = rope.pop("rope_theta", d.get("rope_theta", 10000.0))
        kwargs["rope_scaling"] = rope or d.get("rope_scaling")
        kwargs["dtype"] = d.get("dtype", d.get("torch_dtype"))
        return cls(**kwargs)

    def to_dict(self):
        """The transformers-5 config.json dict: rope_parameters, dtype, architectures.
        Walkthrough 2.1 | Mirrors: transformers PreTrainedConfig.to_dict"""
        d = {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("rope_")}
        rope = self.rope_scaling or {"rope_type": "default"}
        d.update(rope_parameters={"rope_theta": self.rope_theta, **rope},
                 dtype=self.dtype or "float32", architectures=[ARCHITECTURES[self.model_type]],
                 attention_dropout=0.0, use_cache=True)
        if self.model_type != "llama":  # Mistral's default window is 4096
            d.update(sliding_window=None, use_sliding_window=False)
        return dict(sorted(d.items()))

    @classmethod
    def from_pretrained(cls, model_dir):
        """Read model_dir/config.json.
        Walkthrough 2.1 | Mirrors: transformers PreTrainedConfig.from_pretrained"""
        from nanosft.io import hub  # product layer: imported on use

        return cls.from_dict(hub.read_json(os.path.join(model_dir, "config.json")))

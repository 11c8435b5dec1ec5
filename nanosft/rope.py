"""RoPE's inverse frequencies for every `rope_type` transformers 5 defines, and their cos/sin scale.

A rope dict is one entry of config.json's `rope_parameters` (`rope_type`, `rope_theta`, `factor`,
...). `rope_frequencies` turns it into (inverse frequencies, attention scaling): default RoPE
(RoFormer 2104.09864), position interpolation ("linear", 2306.15595), dynamic NTK ("dynamic"),
YaRN ("yarn", 2309.00071), LongRoPE ("longrope", 2402.13753) and Llama 3.1's ("llama3"). The
model (model.py, the families) multiplies position by frequency and scales cos and sin.
"""

import math

import torch

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
# the types whose parameters name the context length the model was pretrained at
WITH_ORIGINAL_LENGTH = ("llama3", "yarn", "longrope")
# the fields each type cannot do without (yarn / longrope infer `factor` from the lengths)
REQUIRED = {"linear": ("factor",), "dynamic": ("factor",), "yarn": (),
            "longrope": ("short_factor", "long_factor"),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor")}


def standardize_rope(rope, max_position_embeddings):
    """The rope dict under transformers-5 spelling: `type` read as `rope_type`, and the
    pretraining length of llama3 / yarn / longrope defaulting to max_position_embeddings.
    Mirrors: transformers RotaryEmbeddingConfigMixin.standardize_rope_params"""
    rope = dict(rope or {})
    legacy = rope.pop("type", None)
    rope["rope_type"] = rope.get("rope_type", legacy or "default")
    if rope["rope_type"] in WITH_ORIGINAL_LENGTH:
        rope.setdefault("original_max_position_embeddings", max_position_embeddings)
    return rope


def check_rope(where, rope, dim):
    """Refuse a rope dict nanosft cannot compute: an unknown type, a missing field, LongRoPE
    factors of the wrong length (`dim`: the rotated width of a head)."""
    kind = rope.get("rope_type", "default")
    if kind not in ROPE_TYPES:
        raise ValueError(f"config: {where} rope_type={kind!r} is not supported; use one of "
                         f"{list(ROPE_TYPES)}")
    missing = [f for f in REQUIRED.get(kind, ()) if rope.get(f) is None]
    if missing:
        raise ValueError(f"config: {where} rope_type={kind!r} needs {missing} in config.json")
    if kind == "longrope" and not all(len(rope[f]) == dim // 2
                                      for f in ("short_factor", "long_factor")):
        raise ValueError(f"config: {where} longrope needs {dim // 2} short_factor and "
                         "long_factor values (one per rotated frequency)")


def _get_mscale(scale, mscale=1):
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rope, dim, theta, max_position_embeddings):
    # Frequencies that turn fewer than beta_slow times over the original context are
    # interpolated (divided by factor), more than beta_fast times kept, a linear ramp between.
    old_len = rope["original_max_position_embeddings"]
    factor = rope.get("factor") or max_position_embeddings / old_len
    scale = rope.get("attention_factor")
    if scale is None:  # the paper's 0.1 ln(factor) + 1, or DeepSeek's ratio of two such
        mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        scale = (_get_mscale(factor, mscale) / _get_mscale(factor, mscale_all_dim)
                 if mscale and mscale_all_dim else _get_mscale(factor))
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def correction_dim(rotations):  # the dim whose frequency turns `rotations` times in old_len
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    keep = 1 - ramp  # 1: the original frequency (extrapolation), 0: divided by factor
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return inv_freq, float(scale)


def _llama3(rope, inv_freq):
    # Wavelengths above old_len / low are slowed by `factor`, below old_len / high kept, and in
    # between blended.
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_len, wavelen = rope["original_max_position_embeddings"], 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)


def rope_frequencies(rope, dim, max_position_embeddings, seq_len=None):
    """(inverse frequencies (dim / 2,) fp32, attention scaling) of one rope dict over the `dim`
    rotated dims of a head; `seq_len` (the batch's largest position + 1) picks dynamic NTK's base
    and LongRoPE's long or short factors. Mirrors: transformers ROPE_INIT_FUNCTIONS,
    dynamic_rope_update
    Differs: stateless: dynamic NTK at seq_len every call (transformers keeps the largest seen
    until a call falls back under max_position_embeddings)."""
    kind, theta = rope.get("rope_type", "default"), rope["rope_theta"]
    if kind == "yarn":
        return _yarn(rope, dim, theta, max_position_embeddings)
    if kind == "dynamic" and seq_len is not None and seq_len > max_position_embeddings:
        factor = rope["factor"]
        theta = theta * ((factor * seq_len / max_position_embeddings) - (factor - 1)) ** (
            dim / (dim - 2))
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    if kind == "longrope":
        old_len = rope["original_max_position_embeddings"]
        factor = rope.get("factor") or max_position_embeddings / old_len
        scale = rope.get("attention_factor")
        if scale is None:  # the paper's: sqrt(1 + ln(factor) / ln(old_len)), 1 when not extended
            scale = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))
        long = seq_len is not None and seq_len > old_len
        ext = torch.tensor(rope["long_factor" if long else "short_factor"], dtype=torch.float32)
        return 1.0 / (ext * theta**exponent), float(scale)
    inv_freq = 1.0 / (theta**exponent)
    if kind == "linear":
        return inv_freq / rope["factor"], 1.0
    if kind == "llama3":
        return _llama3(rope, inv_freq), 1.0
    return inv_freq, 1.0


def needs_seq_len(rope):
    """Whether the frequencies depend on the batch's length (dynamic NTK, LongRoPE)."""
    return rope.get("rope_type") in ("dynamic", "longrope")


def rope_cos_sin(rope, dim, max_position_embeddings, position_ids, dtype, interleave=False):
    """cos, sin (B|1, 1, T, dim) of one rope dict at position_ids, times its attention scaling,
    computed in fp32 then cast. interleave: each frequency repeated for a pair of neighbouring
    dims (Cohere) instead of the two halves (Llama's rotate_half).
    Mirrors: transformers LlamaRotaryEmbedding.forward"""
    seq_len = int(position_ids.max()) + 1 if needs_seq_len(rope) else None
    inv_freq, scale = rope_frequencies(rope, dim, max_position_embeddings, seq_len)
    freqs = position_ids[..., None].float() * inv_freq.to(position_ids.device)  # (B|1, T, dim/2)
    if interleave:
        emb = torch.repeat_interleave(freqs, 2, dim=-1)[:, None]
    else:
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]
    if scale == 1.0:
        return emb.cos().to(dtype), emb.sin().to(dtype)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)

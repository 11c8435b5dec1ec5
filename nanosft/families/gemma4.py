"""Gemma 4 text (`gemma4_text`): Gemma 3's layer with per-layer inputs, shared keys and values.

What changes from Gemma 3 (families/gemma3.py): RMSNorms multiply by weight (not 1 + weight), a
scale-free v_norm joins q_norm / k_norm, and the attention scale is 1; full-attention layers may
have their own head_dim and kv heads (`per_layer_config`), share k_proj for values
(`attention_k_eq_v`) and turn only part of each head (RoPE "proportional"). Per-layer inputs: a
second embedding table, num_hidden_layers slices of hidden_size_per_layer_input per token, mixed
with a projection of the embeddings and fed to each layer through a gated residual. The last
num_kv_shared_layers layers reuse the keys and values of the last earlier layer of their type
(no k_proj, v_proj of their own). Each layer's output is multiplied by its `layer_scalar`.
With `enable_moe_block` each layer adds routed experts beside its MLP (families/gemma4_moe.py).
Refused: bidirectional attention over text ("all").
"""

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from nanosft.configuration import ModelConfig
from nanosft.families.gemma3 import Gemma3MLP, Gemma3ScaledEmbedding
from nanosft.families.gemma4_moe import add_moe_block, moe_block
from nanosft.families.moe import init_moe_weights
from nanosft.families.sliding_window import SlidingWindowAttention
from nanosft.masking import build_attention_mask
from nanosft.loss import causal_lm_loss
from nanosft.model import CausalLM, CausalLMOutput, DecoderModel, rotate_half
from nanosft.reference import fast_path
from nanosft.rope import check_rope, rope_cos_sin, standardize_rope

LAYER_TYPES = ("sliding_attention", "full_attention")
DEFAULT_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                   "rope_theta": 1_000_000.0}}


@dataclass
class Gemma4Config(ModelConfig):
    """ModelConfig plus Gemma 4's text fields, with Gemma4TextConfig's defaults.
    Mirrors: transformers Gemma4TextConfig
    Differs: use_bidirectional_attention="all" is refused."""

    ARCHITECTURES = {"gemma4_text": "Gemma4ForCausalLM"}
    UNREAD_FIELDS = ("hidden_act", "mlp_bias")  # transformers never reads these
    model_type: str = "gemma4_text"
    vocab_size: int = 262_144
    hidden_size: int = 2304
    intermediate_size: int = 9216
    num_hidden_layers: int = 30
    num_attention_heads: int = 8
    num_key_value_heads: int | None = 4
    head_dim: int | None = 256
    hidden_activation: str = "gelu_pytorch_tanh"
    max_position_embeddings: int = 131_072
    tie_word_embeddings: bool = True
    pad_token_id: int | None = 0
    eos_token_id: int | list | None = 1
    bos_token_id: int | None = 2
    sliding_window: int = 512
    layer_types: list | None = None
    rope_parameters: dict | None = None  # per layer type
    final_logit_softcapping: float | None = None
    use_bidirectional_attention: str | None = None
    vocab_size_per_layer_input: int = 262_144
    hidden_size_per_layer_input: int = 256
    attention_k_eq_v: bool = False
    num_kv_shared_layers: int = 0
    enable_moe_block: bool = False
    use_double_wide_mlp: bool = False
    num_experts: int | None = None
    top_k_experts: int | None = None
    moe_intermediate_size: int | None = None
    # {layer index: {"head_dim", "num_key_value_heads"}}; None: from the two fields below
    per_layer_config: dict | None = None
    global_head_dim: int = 512
    num_global_key_value_heads: int | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.enable_moe_block:
            self.check_moe_fields()
        if self.use_bidirectional_attention not in (None, "vision"):  # "vision": text is causal
            raise ValueError(f"config: use_bidirectional_attention="
                             f"{self.use_bidirectional_attention!r} is not supported: nanosft's "
                             "text model is causal (null or 'vision', which is causal on text)")
        if self.hidden_activation != "gelu_pytorch_tanh":
            raise ValueError(f"config: hidden_activation={self.hidden_activation!r} is not "
                             "supported; Gemma 4 uses 'gelu_pytorch_tanh'")
        if self.layer_types is None:
            self.layer_types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                for i in range(self.num_hidden_layers)]
        self.layer_types = list(self.layer_types)
        self.layer_types[-1] = "full_attention"  # as transformers: the last layer is global
        rope = self.rope_parameters or {}
        # a layer type's dict as given (transformers reads it so), Gemma 4's default when absent
        self.rope_parameters = {t: {"rope_theta": DEFAULT_ROPE[t]["rope_theta"], **rope[t]}
                                if rope.get(t) else dict(DEFAULT_ROPE[t]) for t in LAYER_TYPES}
        for t, p in self.rope_parameters.items():
            p = self.rope_parameters[t] = standardize_rope(p, self.max_position_embeddings)
            if p["rope_type"] in ("default", "proportional"):
                continue
            if p.get("partial_rotary_factor", 1.0) != 1.0:  # transformers' shapes break too
                raise ValueError(f"config: rope_parameters[{t!r}]={p}: partial_rotary_factor "
                                 "goes with rope_type proportional only (the others turn every "
                                 "dim of a Gemma 4 head)")
            D = self.global_head_dim if t == "full_attention" else self.head_dim
            check_rope(f"rope_parameters[{t!r}]", p, D)
        if self.per_layer_config is None:
            full = {"head_dim": self.global_head_dim}
            if self.attention_k_eq_v and self.num_global_key_value_heads is not None:
                full["num_key_value_heads"] = self.num_global_key_value_heads
            self.per_layer_config = {i: dict(full) for i, t in enumerate(self.layer_types)
                                     if t == "full_attention"}
        self.per_layer_config = {int(i): c for i, c in self.per_layer_config.items()}

    def check_moe_fields(self):
        """Refuse an MoE config without its experts' sizes, or top_k_experts out of range."""
        for name in ("num_experts", "top_k_experts", "moe_intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"config: enable_moe_block=true needs {name} (a whole number "
                                 f">= 1), got {value!r}; set it in config.json")
        if self.top_k_experts > self.num_experts:
            raise ValueError(f"config: top_k_experts={self.top_k_experts} must be at most "
                             f"num_experts={self.num_experts}; fix config.json")

    def layer_config(self, i):
        """(head_dim, num_key_value_heads) of layer i."""
        c = self.per_layer_config.get(i, {})
        return c.get("head_dim", self.head_dim), c.get("num_key_value_heads",
                                                       self.num_key_value_heads)

    @property
    def kv_sharing_modes(self):
        """Per layer: None, "store" (the last earlier layer of a type the shared ones read) or
        "reuse". Mirrors: transformers Gemma4TextConfig.kv_sharing_modes"""
        L, n = self.num_hidden_layers, self.num_kv_shared_layers
        modes = [None if i < L - n else "reuse" for i in range(L)]
        if n:
            for t in set(self.layer_types):
                if t not in self.layer_types[:L - n]:
                    raise ValueError(f"config: num_kv_shared_layers={n} leaves no earlier "
                                     f"{t} layer to share keys and values from")
                modes[max(i for i in range(L - n) if self.layer_types[i] == t)] = "store"
        return modes

    def to_dict(self):
        """The transformers-5 config.json dict: rope_parameters per layer type, per_layer_config
        keyed by layer index."""
        d = super().to_dict()
        d.pop("hidden_act"), d.pop("global_head_dim"), d.pop("num_global_key_value_heads")
        d.update(rope_parameters=self.rope_parameters,
                 per_layer_config={str(i): c for i, c in self.per_layer_config.items()})
        return d


class Gemma4RMSNorm(nn.Module):
    """x * (mean(x^2) + eps) ** -0.5 in fp32, times weight (none for v_norm), then cast.
    Mirrors: transformers Gemma4RMSNorm"""

    def __init__(self, dim, eps=1e-6, with_scale=True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None

    def forward(self, x):
        """(..., D) -> (..., D)."""
        x32 = x.float()
        x32 = x32 * torch.pow(x32.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)  # pow: as HF
        if self.weight is not None:
            x32 = x32 * self.weight.float()
        return x32.type_as(x)


def gemma4_inv_freq(p, head_dim):
    """Inverse frequencies (head_dim / 2,) of one layer type's RoPE; "proportional" turns the first
    partial_rotary_factor of the angles (exponents over the whole head_dim) and zeroes the rest.
    Mirrors: transformers _compute_proportional_rope_parameters, compute_default_rope_parameters"""
    theta = p["rope_theta"]
    if p["rope_type"] == "default":
        return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    angles = int(p.get("partial_rotary_factor", 1.0) * head_dim // 2)
    turned = 1.0 / (theta ** (torch.arange(0, 2 * angles, 2).float() / head_dim))
    inv_freq = torch.cat((turned, torch.zeros(head_dim // 2 - angles)))
    return inv_freq / p.get("factor", 1.0)


class Gemma4Attention(SlidingWindowAttention):
    """Attention at scale 1 with q_norm, k_norm and a scale-free v_norm; this layer's head_dim and
    kv heads; values from k_proj in a full layer under attention_k_eq_v; in a KV-shared layer
    only q_proj and o_proj (keys and values come in). Mirrors: transformers Gemma4TextAttention"""

    def __init__(self, config, layer_idx=0):
        super().__init__(config, layer_idx)
        self.layer_type = config.layer_types[layer_idx]
        D, KV = config.layer_config(layer_idx)
        C, H, bias = config.hidden_size, config.num_attention_heads, config.attention_bias
        self.head_dim, self.num_kv_heads, self.scaling = D, KV, 1.0
        self.is_kv_shared_layer = config.kv_sharing_modes[layer_idx] == "reuse"
        self.q_proj = nn.Linear(C, H * D, bias=bias)
        self.q_norm = Gemma4RMSNorm(D, config.rms_norm_eps)
        del self.k_proj, self.v_proj, self.o_proj  # rebuilt at this layer's sizes, or not at all
        if not self.is_kv_shared_layer:
            self.k_norm = Gemma4RMSNorm(D, config.rms_norm_eps)
            self.v_norm = Gemma4RMSNorm(D, config.rms_norm_eps, with_scale=False)
            self.k_proj = nn.Linear(C, KV * D, bias=bias)
            if not (config.attention_k_eq_v and self.layer_type == "full_attention"):
                self.v_proj = nn.Linear(C, KV * D, bias=bias)
        self.o_proj = nn.Linear(H * D, C, bias=bias)

    def forward(self, x, cos, sin, mask, past=None, shared=None):
        """(B, T, C) -> (B, T, C) and this layer's (k, v) (for a shared layer: `shared`)."""
        B, T, _ = x.shape
        cos, sin = cos[self.layer_type], sin[self.layer_type]
        q = self.q_norm(self.q_proj(x).view(B, T, -1, self.head_dim)).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        if self.is_kv_shared_layer:  # the producer's keys and values, its cache included
            return self.attend(q, *shared, mask)[0], shared
        k = self.k_proj(x).view(B, T, -1, self.head_dim)
        v = self.v_proj(x).view(B, T, -1, self.head_dim) if hasattr(self, "v_proj") else k
        k = self.k_norm(k).transpose(1, 2)  # (B, KV, T, D)
        k = k * cos + rotate_half(k) * sin
        v = self.v_norm(v).transpose(1, 2)
        return self.attend(q, k, v, mask, past)

    def attend(self, q, k, v, mask, past=None):
        """SlidingWindowAttention.attend; a shared layer's k, v (B, KV, S, D) hold the producer's
        cache, split back into past and this step so the causal and window masks line up."""
        T = q.shape[2]
        if past is None and k.shape[2] > T:
            past, k, v = (k[:, :, :-T], v[:, :, :-T]), k[:, :, -T:], v[:, :, -T:]
        return super().attend(q, k, v, mask, past)


class Gemma4DecoderLayer(nn.Module):
    """Gemma 3's four-norm layer (experts beside the MLP under enable_moe_block), then the
    per-layer input's gated residual, all times layer_scalar.
    Mirrors: transformers Gemma4TextDecoderLayer"""

    def __init__(self, config, layer_idx=0):
        super().__init__()
        C, eps, P = config.hidden_size, config.rms_norm_eps, config.hidden_size_per_layer_input
        self.self_attn = Gemma4Attention(config, layer_idx)
        if config.use_double_wide_mlp and self.self_attn.is_kv_shared_layer:  # twice as wide
            config = replace(config, intermediate_size=2 * config.intermediate_size)
        self.mlp = Gemma3MLP(config)
        self.input_layernorm = Gemma4RMSNorm(C, eps)
        self.post_attention_layernorm = Gemma4RMSNorm(C, eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(C, eps)
        self.post_feedforward_layernorm = Gemma4RMSNorm(C, eps)
        self.register_buffer("layer_scalar", torch.ones(1))
        if P:
            self.per_layer_input_gate = nn.Linear(C, P, bias=False)
            self.per_layer_projection = nn.Linear(P, C, bias=False)
            self.post_per_layer_input_norm = Gemma4RMSNorm(C, eps)
        self.enable_moe_block = config.enable_moe_block
        if self.enable_moe_block:  # router, experts and three more norms
            add_moe_block(self, config, Gemma4RMSNorm)

    def forward(self, h, per_layer_input, cos, sin, mask, past=None, shared=None):
        """(B, T, C) residual stream in and out, plus this layer's (k, v)."""
        a, kv = self.self_attn(self.input_layernorm(h), cos, sin, mask, past, shared)
        h = h + self.post_attention_layernorm(a)
        m = self.mlp(self.pre_feedforward_layernorm(h))
        if self.enable_moe_block:  # the experts read h, the residual before the MLP
            m = moe_block(self, h, m)
        h = h + self.post_feedforward_layernorm(m)
        if per_layer_input is not None:  # gelu(gate(h)) * this layer's input, projected back
            g = F.gelu(self.per_layer_input_gate(h), approximate="tanh") * per_layer_input
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(g))
        return h * self.layer_scalar, kv


class Gemma4Model(DecoderModel):
    """Scaled embeddings, the per-layer inputs, one RoPE per layer type and KV sharing.
    Mirrors: transformers Gemma4TextModel"""

    layer_class = Gemma4DecoderLayer

    def __init__(self, config):
        super().__init__(config)
        C, L, P = config.hidden_size, config.num_hidden_layers, config.hidden_size_per_layer_input
        self.embed_tokens = Gemma3ScaledEmbedding(config.vocab_size, C, config.pad_token_id)
        self.norm = Gemma4RMSNorm(C, config.rms_norm_eps)
        if P:
            self.embed_tokens_per_layer = Gemma3ScaledEmbedding(
                config.vocab_size_per_layer_input, L * P, config.pad_token_id)
            self.embed_tokens_per_layer.embed_scale = P**0.5  # not sqrt(L * P)
            self.per_layer_model_projection = nn.Linear(C, L * P, bias=False)
            self.per_layer_projection_norm = Gemma4RMSNorm(P, config.rms_norm_eps)

    def per_layer_inputs(self, input_ids, h):
        """(B, T, L, P): each layer's slice of the second embedding, mixed with a projection of
        the embeddings h. Mirrors: transformers Gemma4TextModel.get_per_layer_inputs,
        project_per_layer_inputs"""
        c = self.config
        shape = (*h.shape[:-1], c.num_hidden_layers, c.hidden_size_per_layer_input)
        projected = self.per_layer_model_projection(h) * c.hidden_size**-0.5
        projected = self.per_layer_projection_norm(projected.reshape(shape))
        return (projected + self.embed_tokens_per_layer(input_ids).reshape(shape)) * 2**-0.5

    def rotary(self, position_ids, dtype):
        """{layer type: cos}, {layer type: sin}, each (B|1, 1, T, that type's head_dim).
        Mirrors: transformers Gemma4TextRotaryEmbedding.forward"""
        cos, sin = {}, {}
        for t in set(self.config.layer_types):
            D = self.config.layer_config(self.config.layer_types.index(t))[0]
            p = self.config.rope_parameters[t]
            if p["rope_type"] not in ("default", "proportional"):  # linear .. llama3: nanosft.rope
                # (YaRN's `truncate` is read from the outer dict by transformers: unread here)
                p = {k: v for k, v in p.items() if k != "truncate"}
                cos[t], sin[t] = rope_cos_sin(p, D, self.config.max_position_embeddings,
                                              position_ids, dtype)
                continue
            inv_freq = gemma4_inv_freq(p, D).to(position_ids.device)
            freqs = position_ids[..., None].float() * inv_freq  # (B|1, T, D/2)
            emb = torch.cat((freqs, freqs), dim=-1)[:, None]
            cos[t], sin[t] = emb.cos().to(dtype), emb.sin().to(dtype)
        return cos, sin

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None,
                past_key_values=None, use_cache=False):
        """Final-norm hidden states (B, T, C), plus the per-layer (k, v) cache when use_cache
        (None for the KV-shared layers)."""
        if input_ids is None:
            raise ValueError("Gemma 4 needs input_ids: its per-layer inputs are looked up by "
                             "token id (inputs_embeds alone is not supported)")
        c = self.config
        if past_key_values and torch.is_tensor(past_key_values[0]) and (
                c.num_kv_shared_layers or len({c.layer_config(i) for i in range(len(self.layers))})
                > 1):  # peft's prefixes: one (2, B, KV, n, D) tensor per layer, all alike
            raise ValueError("prefix tuning is not supported for this gemma4_text model: its "
                             "layers share keys and values or differ in head_dim / kv heads; use "
                             "LoRA")
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds  # (B, T, C)
        B, T, C = h.shape
        past_len = past_key_values[0][0].shape[2] if past_key_values else 0
        if position_ids is None:
            position_ids = torch.arange(past_len, past_len + T, device=h.device)[None]
        P = self.config.hidden_size_per_layer_input
        if P:  # ride along with h through the unpadded speed path
            h = torch.cat((h, self.per_layer_inputs(input_ids, h).flatten(2)), dim=-1)
        unpad = None if use_cache else fast_path("unpad")
        layout = None if unpad is None else unpad.layout(self, attention_mask, position_ids, B, T,
                                                        past_len)
        if layout is None:
            mask = build_attention_mask(attention_mask, position_ids, T, past_len)
        else:
            h, position_ids, mask = unpad.pack(h, position_ids, layout)
        h, per_layer = h[..., :C], h[..., C:].unflatten(-1, (-1, P)) if P else None
        cos, sin = self.rotary(position_ids, h.dtype)
        use_checkpoint = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        modes, types = self.config.kv_sharing_modes, self.config.layer_types
        cache, shared = [], {}
        for i, layer in enumerate(self.layers):
            args = (h, None if per_layer is None else per_layer[:, :, i], cos, sin, mask,
                    past_key_values[i] if past_key_values else None, shared.get(types[i]))
            if use_checkpoint:
                h, kv = checkpoint(layer, *args, **self.checkpoint_kwargs)
            else:
                h, kv = layer(*args)
            if modes[i] == "store":
                shared[types[i]] = kv
            cache.append(None if modes[i] == "reuse" else kv)
        h = self.norm(h)
        if layout is not None:
            h = unpad.unpack(h, layout, B, T)
        return h, (cache if use_cache else None)


class SoftcappedHead(nn.Module):
    """lm_head then cap * tanh(logits / cap). Mirrors: Gemma4ForCausalLM final_logit_softcapping"""

    def __init__(self, lm_head, cap):
        super().__init__()
        self.lm_head, self.cap = lm_head, cap

    def forward(self, h):
        """(..., C) -> (..., V)."""
        return torch.tanh(self.lm_head(h) / self.cap) * self.cap


class Gemma4ForCausalLM(CausalLM):
    """Mirrors: transformers Gemma4ForCausalLM"""

    config_class = Gemma4Config
    model_class = Gemma4Model

    def _init_weights(self, module):
        super()._init_weights(module)
        init_moe_weights(module, self.config.initializer_range)  # the 3-D experts: Normal(0, std)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None,
                labels=None, num_items_in_batch=None, past_key_values=None, use_cache=False,
                fused_lm_head=False, **kwargs):
        """CausalLM.forward, the logits soft-capped when final_logit_softcapping is set."""
        cap = self.config.final_logit_softcapping
        if cap is None:
            return super().forward(input_ids, attention_mask, position_ids, inputs_embeds, labels,
                                   num_items_in_batch, past_key_values, use_cache, fused_lm_head)
        h, cache = self.model(input_ids, attention_mask, position_ids, inputs_embeds,
                              past_key_values, use_cache)
        head = SoftcappedHead(self.lm_head, cap)
        if fused_lm_head and labels is not None:
            from nanosft.fast.lm_head import fused_lm_head_outputs  # a speed path

            log_probs, entropy, is_top1, mask = fused_lm_head_outputs(h, head, labels)
            count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
            loss = -log_probs.sum() / torch.as_tensor(count, device=h.device)
            return CausalLMOutput(loss, None, cache, log_probs, entropy, is_top1, mask)
        logits = head(h)
        loss = None if labels is None else causal_lm_loss(logits, labels, num_items_in_batch)
        return CausalLMOutput(loss=loss, logits=logits, past_key_values=cache)

    def _load_tensor(self, key, tensor, quantization_config):
        # layer_scalar is a buffer (not trained), as in transformers
        module_name, _, leaf = key.rpartition(".")
        if leaf == "layer_scalar":
            self.get_submodule(module_name).layer_scalar = tensor
            return
        super()._load_tensor(key, tensor, quantization_config)

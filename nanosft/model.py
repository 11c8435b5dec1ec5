"""A hand-written Llama causal LM (llama, mistral without a window) that loads and saves HF folders.

The network walkthrough 2.6 `PeftModelForCausalLM.forward` wraps; its loss is the
`outputs["loss"]` of walkthrough 2.5 `compute_loss`. RMSNorm, RoPE (its scaled kinds: rope.py),
grouped-query SDPA attention, SwiGLU, then `CausalLM`. Beside it: configuration.py (ModelConfig),
loss.py (the causal-LM loss, whole or in lm_head tiles), masking.py (attention masks, packed
rows), generation.py (decoding with the (k, v) cache), hub.py (safetensors files;
`from_pretrained` streams them and can quantize to NF4 while loading, nf4.py).
Other families (qwen2, qwen3, smollm3, mistral with a window, gemma3_text, phi3, qwen3_5_text,
qwen3_5_moe_text, lfm2, gemma4_text, olmo3, cohere2, gpt_neox, qwen3_moe, glm4_moe, gpt_oss)
subclass these pieces in nanosft.families.
State-dict keys equal transformers'. Papers: LLaMA 2302.13971, RoFormer 2104.09864, GQA 2305.13245.
"""

import os
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from nanosft import generation, nf4
from nanosft.configuration import ModelConfig
from nanosft.generation import sample_next_token as sample_next_token  # model API too
from nanosft.loss import causal_lm_loss
from nanosft.masking import build_attention_mask
from nanosft.reference import fast_path
from nanosft.rope import rope_cos_sin


@dataclass
class CausalLMOutput:
    """What CausalLM.forward returns, readable as `out.loss` or `out["loss"]`.
    Mirrors: transformers CausalLMOutputWithPast"""

    loss: torch.Tensor | None
    logits: torch.Tensor | None  # None under fused_lm_head: the per-token fields below instead
    past_key_values: list | None = None
    # fused_lm_head=True (trl FusedCausalLMOutput): (B, T-1) each, zero where the label is -100
    log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    is_top1: torch.Tensor | None = None
    label_mask: torch.Tensor | None = None

    def __getitem__(self, key):
        return getattr(self, key)


def rope_dict(config):
    """The config's RoPE as one rope dict ({"rope_type", "rope_theta", factor, ...}) for
    nanosft.rope. Mirrors: transformers PreTrainedConfig.rope_parameters"""
    return {"rope_theta": config.rope_theta, **(config.rope_scaling or {"rope_type": "default"})}


def rotate_half(x):
    """(x1, x2) -> (-x2, x1) over the halves of the head dim (HF half-split, not interleaved).
    Mirrors: transformers rotate_half"""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RMSNorm(nn.Module):
    """Root-mean-square norm in fp32, cast back to the input dtype before the weight multiply.
    Mirrors: transformers LlamaRMSNorm"""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(hidden_size)), eps

    def forward(self, x):
        """x / rms(x) * weight over the last dim, (..., C) -> (..., C)."""
        if (recomputed := fast_path("recomputed")) is not None:  # speed path: backward keeps x
            return recomputed(self._normalize, x)
        return self._normalize(x)

    def _normalize(self, x):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE over SDPA, appending to an optional (k, v) cache.
    LoRA wraps its q/k/v/o_proj (lora.LoraLinear). Mirrors: transformers LlamaAttention,
    sdpa_attention_forward"""

    def __init__(self, config, layer_idx=0):
        super().__init__()
        C, H, D = config.hidden_size, config.num_attention_heads, config.head_dim
        KV = config.num_key_value_heads
        self.num_heads, self.num_kv_heads, self.head_dim, bias = H, KV, D, config.attention_bias
        self.layer_idx = layer_idx  # transformers' name; a family's layer types read it
        self.scaling = D**-0.5  # Gemma 3: query_pre_attn_scalar**-0.5 (families/gemma3.py)
        self.q_proj = nn.Linear(C, H * D, bias=bias)
        self.k_proj, self.v_proj = nn.Linear(C, KV * D, bias=bias), nn.Linear(C, KV * D, bias=bias)
        self.o_proj = nn.Linear(H * D, C, bias=bias)

    def forward(self, x, cos, sin, mask, past=None):
        """(B, T, C) -> (B, T, C) and the layer's (k, v) cache, each (B, KV, past + T, D).
        mask: a boolean (B|1, 1, T, S) tensor, None (plain causal), a list of document lengths
        (one packed row) or a context-parallel layout (it attends itself)."""
        B, T, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds H / tp query and KV / tp kv heads
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, KV, T, D)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        # cos, sin: (B|1, 1, T, D)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        return self.attend(q, k, v, mask, past)

    def attend(self, q, k, v, mask, past=None):
        """SDPA of q (B, H, T, D) over the cache plus this step's k, v (B, KV, T, D), then o_proj.
        Mirrors: transformers sdpa_attention_forward (and LlamaAttention.forward's last lines)"""
        B, _, T, _ = q.shape
        if past is not None:
            k, v = torch.cat((past[0], k), dim=2), torch.cat((past[1], v), dim=2)
        if hasattr(mask, "attend"):  # context parallel: this rank's queries over every rank's k, v
            y = mask.attend(q, k, v, self.scaling)  # (nanosft.parallel.context_parallel)
        elif isinstance(mask, list):  # document lengths of one packed row: causal inside each
            docs = zip(*(t.split(mask, dim=2) for t in (q, k, v)))
            y = torch.cat([self.sdpa(*qkv, is_causal=True) for qkv in docs], 2)
        else:
            y = self.sdpa(q, k, v, mask, is_causal=mask is None and past is None and T > 1)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1)), (k, v)

    def sdpa(self, q, k, v, mask=None, is_causal=False):
        """Scaled dot-product attention at this layer's scale: (B, H, T, D) out."""
        # speed path: short bf16 / fp16 rows on CPU through the fp32 kernel (nanosft.fast.attention)
        attention = fast_path("scaled_dot_product_attention") or F.scaled_dot_product_attention
        # enable_gqa: query head j reads kv head j // (H // KV), as transformers' repeat_kv.
        return attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=self.scaling,
                         enable_gqa=self.num_kv_heads != self.num_heads)


class MLP(nn.Module):
    """SwiGLU feed-forward: down_proj(silu(gate_proj(x)) * up_proj(x)).
    Mirrors: transformers LlamaMLP"""

    def __init__(self, config):
        super().__init__()
        C, I, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj, self.up_proj = nn.Linear(C, I, bias=bias), nn.Linear(C, I, bias=bias)
        self.down_proj = nn.Linear(I, C, bias=bias)

    def forward(self, x):
        """(B, T, C) -> (B, T, I) -> (B, T, C)."""
        if (recomputed := fast_path("recomputed")) is not None:  # speed path: silu redone backward
            return self.down_proj(recomputed(self._glu, self.gate_proj(x), self.up_proj(x)))
        return self.down_proj(self._glu(self.gate_proj(x), self.up_proj(x)))

    def _glu(self, gate, up):
        return F.silu(gate) * up  # the families with another activation override this


class DecoderLayer(nn.Module):
    """Pre-norm block: h + attn(norm(h)), then h + mlp(norm(h)).
    Mirrors: transformers LlamaDecoderLayer"""

    # the pieces a model family swaps (nanosft.families subclasses set these)
    attention_class = Attention
    mlp_class = MLP

    def __init__(self, config, layer_idx=0):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = self.attention_class(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = self.mlp_class(config)

    def forward(self, h, cos, sin, mask, past=None):
        """(B, T, C) residual stream in and out, plus this layer's (k, v)."""
        a, kv = self.self_attn(self.input_layernorm(h), cos, sin, mask, past)
        h = h + a
        return h + self.mlp(self.post_attention_layernorm(h)), kv


class DecoderModel(nn.Module):
    """Embeddings, decoder layers and the final norm: the `.model` inside CausalLM.
    Mirrors: transformers LlamaModel.forward"""

    layer_class = DecoderLayer  # a model family's own (nanosft.families)

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         padding_idx=config.pad_token_id)
        self.layers = nn.ModuleList(self.layer_class(config, i)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.gradient_checkpointing, self.checkpoint_kwargs = False, {}

    def rotary(self, position_ids, dtype):
        """cos, sin (B|1, 1, T, D) computed in fp32, then cast to the hidden-state dtype.
        Mirrors: transformers LlamaRotaryEmbedding.forward"""
        # Recomputed (a few flops) rather than a buffer that `.to(bfloat16)` would round; HF keeps
        # it fp32 too. Scaled RoPE (linear, dynamic, yarn, longrope, llama3): nanosft.rope.
        c = self.config
        return rope_cos_sin(rope_dict(c), c.head_dim, c.max_position_embeddings, position_ids,
                            dtype)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None,
                past_key_values=None, use_cache=False):
        """Final-norm hidden states (B, T, C), plus the per-layer (k, v) cache when use_cache."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds  # (B, T, C)
        T, past_len = h.shape[1], past_key_values[0][0].shape[2] if past_key_values else 0
        if position_ids is None:  # as transformers: arange, blind to padding (RoPE: differences)
            position_ids = torch.arange(past_len, past_len + T, device=h.device)[None]
        B = h.shape[0]
        # speed path (nanosft.fast.unpad, off in reference mode): packed or right-padded rows run
        # as one row of real tokens, one causal SDPA per document, instead of a dense mask
        unpad = None if use_cache else fast_path("unpad")
        # context parallel hands over its own mask: this rank's part of each row attends over every
        # rank's keys (nanosft.parallel.context_parallel); nothing to build or unpad
        context_parallel = hasattr(attention_mask, "attend")
        layout = None if unpad is None or context_parallel else unpad.layout(
            self, attention_mask, position_ids, B, T, past_len)
        if context_parallel:
            mask = attention_mask
        elif layout is None:
            mask = build_attention_mask(attention_mask, position_ids, T, past_len)
        else:
            h, position_ids, mask = unpad.pack(h, position_ids, layout)
        cos, sin = self.rotary(position_ids, h.dtype)
        use_checkpoint = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        cache = []
        for i, layer in enumerate(self.layers):
            args = (h, cos, sin, mask, past_key_values[i] if past_key_values else None)
            # Checkpointing keeps only the layer input and recomputes the rest during backward.
            if use_checkpoint:
                h, kv = checkpoint(layer, *args, **self.checkpoint_kwargs)
            else:
                h, kv = layer(*args)
            cache.append(kv)
        h = self.norm(h)
        if layout is not None:
            h = unpad.unpack(h, layout, B, T)
        return h, (cache if use_cache else None)


# checkpoint keys no model reads, which transformers drops on load: the per-layer rotary inv_freq
# buffers older checkpoints saved (GLM-4.5's MTP layers: glm4_moe.py)
ALWAYS_IGNORED_KEYS = (r"rotary_emb\.inv_freq$",)


def text_model_index(config, index, ignored=()):
    """The checkpoint index under the text model's keys (model.language_model.X -> model.X, the
    other towers dropped) when config came from a multimodal folder (its `checkpoint_prefix`),
    less the keys matching an `ignored` pattern.
    Mirrors: transformers conversion_mapping PrefixChange (qwen3_5_text),
    _keys_to_ignore_on_load_unexpected, _adjust_missing_and_unexpected_keys (inv_freq)"""
    ignored = (*ignored, *ALWAYS_IGNORED_KEYS)
    index = {k: info for k, info in index.items() if not any(re.search(p, k) for p in ignored)}
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


class CausalLM(nn.Module):
    """The decoder plus lm_head: logits, the causal-LM loss, generation, HF checkpoint load, save.
    What 2.6's `self.base_model(...)` ends in. Mirrors: transformers LlamaForCausalLM"""

    # forward takes num_items_in_batch: the Trainer must not divide the loss by GA
    accepts_loss_kwargs = True
    model_class = DecoderModel  # a model family's own (nanosft.families)
    config_class = ModelConfig  # what from_pretrained reads config.json as (a family's own)
    # patterns of checkpoint keys the model never reads (Qwen3.5's multi-token-prediction head)
    _keys_to_ignore_on_load_unexpected = ()
    # a family whose files spell some weights otherwise (an MoE's per-expert keys, stacked here
    # into 3-D parameters): model_index(index), merge(tensors, index), split(state_dict)
    checkpoint_conversion = None

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = self.model_class(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        # after init, so lm_head's own draw is dropped and the zero padding row survives
        self.tie_weights()
        self._input_grad_hook = None

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):  # norms are built as ones
            nn.init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, nn.Embedding) and module.padding_idx is not None:
            module.weight.data[module.padding_idx] = 0

    def tie_weights(self):
        """Share the embedding matrix with lm_head when tie_word_embeddings is set.
        Mirrors: transformers PreTrainedModel.tie_weights"""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def get_input_embeddings(self):
        """The token embedding (peft's prompt tuning reads it).
        Mirrors: transformers get_input_embeddings"""
        return self.model.embed_tokens

    def get_output_embeddings(self):
        """The lm_head. Mirrors: transformers get_output_embeddings"""
        return self.lm_head

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None,
                labels=None, num_items_in_batch=None, past_key_values=None, use_cache=False,
                fused_lm_head=False, **kwargs):
        """Logits (B, T, V) and, given labels, causal_lm_loss(logits, labels, num_items_in_batch).
        What 2.5's `model(**inputs)` reaches. Mirrors: LlamaForCausalLM.forward
        fused_lm_head=True (trl add_fused_lm_head's kwarg): per-token log_probs, entropy, is_top1
        and label_mask from fused_lm_head_outputs, logits=None."""
        h, cache = self.model(input_ids, attention_mask, position_ids, inputs_embeds,
                              past_key_values, use_cache)
        if fused_lm_head and labels is not None:  # the (B, T, V) logits never exist
            fused_lm_head_outputs = fast_path("fused_lm_head_outputs", asked=True)  # nanosft.fast
            log_probs, entropy, is_top1, mask = fused_lm_head_outputs(h, self.lm_head, labels)
            count = mask.sum() if num_items_in_batch is None else num_items_in_batch
            loss = -log_probs.sum() / torch.as_tensor(count, device=h.device).clamp(min=1)
            return CausalLMOutput(loss, None, cache, log_probs, entropy, is_top1, mask)
        logits = self.lm_head(h)
        loss = None if labels is None else causal_lm_loss(logits, labels, num_items_in_batch)
        return CausalLMOutput(loss=loss, logits=logits, past_key_values=cache)

    def generate(self, input_ids, attention_mask=None, max_new_tokens=None, temperature=None,
                 top_k=None, top_p=None, eos_token_id=None, pad_token_id=None, streamer=None,
                 **kwargs):
        """Prompt + new ids (B, T + n), decoded with a (k, v) cache (nanosft.generation);
        kwargs: do_sample, num_beams=1, max_length as transformers takes them.
        Mirrors: transformers GenerationMixin.generate"""
        max_new_tokens, temperature, top_k, top_p = generation.resolve_decoding(
            input_ids.shape[1], max_new_tokens, temperature=temperature, top_k=top_k,
            top_p=top_p, **kwargs)
        return generation.generate(self, input_ids, attention_mask, max_new_tokens, temperature,
                                   top_k, top_p, eos_token_id, pad_token_id, streamer)

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
        """Recompute each decoder layer in backward (torch.utils.checkpoint, use_reentrant=False
        by default). Guide: performance | Mirrors: PreTrainedModel.gradient_checkpointing_enable"""
        kwargs = gradient_checkpointing_kwargs or {}
        self.model.checkpoint_kwargs = {"use_reentrant": False, **kwargs}
        self.model.gradient_checkpointing = True

    def gradient_checkpointing_disable(self):
        """Store activations again. Mirrors: PreTrainedModel.gradient_checkpointing_disable"""
        self.model.gradient_checkpointing = False

    @property
    def is_gradient_checkpointing(self):
        """Whether decoder layers are checkpointed.
        Mirrors: transformers PreTrainedModel.is_gradient_checkpointing"""
        return self.model.gradient_checkpointing

    def enable_input_require_grads(self):
        """Make the embedding output require grad, so checkpointed layers over a frozen base
        backprop to LoRA.
        Mirrors: transformers PreTrainedModel.enable_input_require_grads"""
        if self._input_grad_hook is None:
            hook = lambda module, args, output: output.requires_grad_(True)
            self._input_grad_hook = self.model.embed_tokens.register_forward_hook(hook)

    def num_parameters(self, only_trainable=False):
        """Parameter count, tied weights once; a packed NF4 weight (uint8, two 4-bit values a byte)
        counts its values, as transformers counts Params4bit twice.
        Mirrors: ModuleUtilsMixin.num_parameters"""
        return sum(p.numel() * (2 if p.dtype == torch.uint8 else 1) for p in self.parameters()
                   if p.requires_grad or not only_trainable)

    @classmethod
    def from_pretrained(cls, model_dir, dtype=None, quantization_config=None, device_map=None,
                        config=None):
        """Build on the meta device, then read the safetensors tensor by tensor, each cast to dtype
        (None: float32, "auto": config.json's) and, given a BitsAndBytesConfig, each linear weight
        quantized as soon as it is read: no full-precision copy of the model ever exists.
        `config`: this class's config, else read from model_dir/config.json as `config_class`
        (AutoModelForCausalLM picks a family's class and config by model_type).
        Mirrors: transformers PreTrainedModel.from_pretrained, Bnb4BitHfQuantizer
        Differs: keys and shapes must match exactly, all checked from the file headers before any
        weight is read; device_map is one device."""
        from nanosft.io import hub  # the files layer below: imported on use

        config = config if config is not None else cls.config_class.from_pretrained(model_dir)
        dtype = hub.torch_dtype((config.dtype or "float32") if dtype == "auto" else
                                (dtype or torch.float32))
        if quantization_config is not None:
            quantization_config = nf4.BitsAndBytesConfig.from_any(quantization_config)
        index = hub.safetensors_index(model_dir)  # headers only: names, dtypes, shapes, offsets
        index = text_model_index(config, index, cls._keys_to_ignore_on_load_unexpected)
        with torch.device("meta"):  # no random init of weights about to be replaced
            model = cls(config)
        expected = model.state_dict()
        if config.tie_word_embeddings:  # some tied checkpoints store lm_head.weight anyway
            expected.pop("lm_head.weight"), index.pop("lm_head.weight", None)
        conversion = model.checkpoint_conversion  # None: file keys are the model's keys
        hub.check_state_dict(index if conversion is None else conversion.model_index(index),
                             expected, model_dir)
        tensors = hub.iter_tensors(index, dtype, device=device_map or "cpu",
                                   keep_fp32=keep_in_fp32(model, dtype))
        if conversion is not None:
            tensors = conversion.merge(tensors, index)
        for key, tensor in tensors:
            model._load_tensor(key, tensor, quantization_config)
            del tensor  # the next read must not overlap this one
        model.config.dtype = str(dtype).removeprefix("torch.")
        model.name_or_path = os.fspath(model_dir)  # peft's base_model_name_or_path reads it
        model.tie_weights()
        return model

    def _load_tensor(self, key, tensor, quantization_config):
        # one checkpoint tensor into its module: a linear weight becomes a Linear4bit right here
        module_name, _, leaf = key.rpartition(".")
        module = self.get_submodule(module_name)
        qc, tied = quantization_config, self.config.tie_word_embeddings
        if leaf in module._buffers:  # a buffer stays one, in the dtype it was built in
            module._buffers[leaf] = tensor.to(module._buffers[leaf].dtype)
        elif (qc is not None and leaf == "weight" and type(module) is nn.Linear
                and qc.quantizes(module_name, tensor, tied_lm_head=tied)):
            parent, _, child = module_name.rpartition(".")
            setattr(self.get_submodule(parent), child, qc.quantize(tensor, module.bias))
        else:
            setattr(module, leaf, nn.Parameter(tensor, requires_grad=tensor.is_floating_point()))

    def save_pretrained(self, save_directory, max_shard_size="5GB", state_dict=None):
        """Write config.json (transformers-5 spelling), generation_config.json and the weights.
        Mirrors: transformers PreTrainedModel.save_pretrained
        `state_dict`: tensors to write instead of the model's (whole ones gathered under FSDP)."""
        from nanosft.io import hub

        state_dict = self.state_dict() if state_dict is None else dict(state_dict)
        if self.config.tie_word_embeddings:
            state_dict.pop("lm_head.weight")  # loaders re-tie it to model.embed_tokens.weight
        if self.checkpoint_conversion is not None:
            state_dict = self.checkpoint_conversion.split(state_dict)
        hub.save_state_dict_to_hf(state_dict, save_directory, max_shard_size)
        self.config.dtype = str(self.model.embed_tokens.weight.dtype).removeprefix("torch.")
        hub.write_json(self.config.to_dict(), os.path.join(save_directory, "config.json"))
        ids = {k: getattr(self.config, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        ids = {k: v for k, v in ids.items() if v is not None}
        hub.write_json({"_from_model_config": True, **ids},
                       os.path.join(save_directory, "generation_config.json"))

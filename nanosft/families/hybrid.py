"""Hybrid decoders: attention layers beside recurrent ones (Gated DeltaNet, short convolutions).

Qwen3.5 and LFM2 interleave full-attention layers with layers that carry a state instead of a
(k, v) cache. `HybridModel.forward` is DecoderModel.forward with one mask per layer type (as
transformers' causal_mask_mapping): the attention layers get the usual SDPA mask, the recurrent
ones `recurrent_mask`'s (keep, docs): zeros at padding, and the document lengths of packed rows
(each document then runs from a fresh state). The cache holds each layer's own kind of entry.
"""

import torch
from torch.utils.checkpoint import checkpoint

from nanosft.masking import build_attention_mask, packed_segment_ids
from nanosft.model import DecoderModel
from nanosft.reference import fast_path

RECURRENT = ("linear_attention", "conv")  # the layer types whose cache is a state


def recurrent_mask(attention_mask, position_ids, T, past_len):
    """(keep, docs) for the recurrent layers, or None where each row is one plain sequence.
    keep (B, T): 0 at padding (several new tokens only; a generated token is never padding).
    docs: per row, its document lengths where position_ids restart (packed rows, no
    attention_mask and no cache, as build_attention_mask reads them).
    Mirrors: transformers create_recurrent_attention_mask
    Differs: transformers' torch fallback ignores packed documents; the state leaks across them."""
    keep = None
    if attention_mask is not None and T > 1 and not bool(attention_mask.all()):
        keep = attention_mask[:, -T:]
    docs = None
    if attention_mask is None and past_len == 0 and T > 1:
        seg = packed_segment_ids(position_ids.expand(-1, T))
        if bool(seg[:, -1].any()):
            docs = [[n for n in torch.bincount(row).tolist() if n] for row in seg]
    return None if keep is None and docs is None else (keep, docs)


def run_documents(fn, docs, *tensors):
    """fn over each document of each row alone (fresh state, fresh conv window): tensors are
    (B, T, ...) with time at dim 1, `docs` the per-row document lengths; outputs joined back."""
    rows = []
    for b, lengths in enumerate(docs):
        parts = zip(*(t[b:b + 1].split(lengths, dim=1) for t in tensors))
        rows.append(torch.cat([fn(*p) for p in parts], dim=1))
    return torch.cat(rows, dim=0)


class HybridModel(DecoderModel):
    """DecoderModel whose layers are of the types in config.layer_types; the recurrent ones get
    recurrent_mask's (keep, docs) and cache a state. Mirrors: transformers Qwen3_5TextModel,
    Lfm2Model (forward)"""

    norm_name = "norm"  # the final norm's attribute (LFM2: embedding_norm)

    def attention_index(self):
        """The index of the first attention layer."""
        return next(i for i, t in enumerate(self.config.layer_types) if t not in RECURRENT)

    def past_length(self, past_key_values):
        """Tokens already in the cache: the key length of the first attention layer."""
        if not past_key_values:
            return 0
        return past_key_values[self.attention_index()][0].shape[2]

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None,
                past_key_values=None, use_cache=False):
        """Final-norm hidden states (B, T, C), plus the per-layer cache when use_cache."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds  # (B, T, C)
        B, T = h.shape[:2]
        # peft's prefixes: a (2, B, KV, n, D) tensor per layer (a cache holds (k, v) tuples)
        if past_key_values and torch.is_tensor(past_key_values[self.attention_index()]):
            raise ValueError(f"prefix tuning is not supported for {self.config.model_type}: its "
                             f"{'/'.join(sorted(set(self.config.layer_types) & set(RECURRENT)))} "
                             "layers keep a state, not keys and values a prefix could extend; "
                             "use LoRA, prompt tuning or P-tuning")
        past_len = self.past_length(past_key_values)
        if position_ids is None:
            position_ids = torch.arange(past_len, past_len + T, device=h.device)[None]
        # speed path (nanosft.fast.unpad): one row of real tokens; recurrent layers split it by
        # the same document lengths
        unpad = None if use_cache else fast_path("unpad")
        layout = None if unpad is None else unpad.layout(self, attention_mask, position_ids, B, T,
                                                        past_len)
        if layout is None:
            masks = {"attention": build_attention_mask(attention_mask, position_ids, T, past_len),
                     "recurrent": recurrent_mask(attention_mask, position_ids, T, past_len)}
        else:
            h, position_ids, lengths = unpad.pack(h, position_ids, layout)
            masks = {"attention": lengths, "recurrent": (None, [lengths])}
        cos, sin = self.rotary(position_ids, h.dtype)
        use_checkpoint = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        cache = []
        for i, layer in enumerate(self.layers):
            kind = "recurrent" if self.config.layer_types[i] in RECURRENT else "attention"
            args = (h, cos, sin, masks[kind], past_key_values[i] if past_key_values else None)
            if use_checkpoint:
                h, entry = checkpoint(layer, *args, **self.checkpoint_kwargs)
            else:
                h, entry = layer(*args)
            cache.append(entry)
        h = getattr(self, self.norm_name)(h)
        if layout is not None:
            h = unpad.unpack(h, layout, B, T)
        return h, (cache if use_cache else None)

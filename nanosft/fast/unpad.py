"""Unpadded attention: packed or right-padded rows run as one row of real tokens, one causal SDPA
per document, instead of a dense (T, T) mask (1.3-1.4x faster fp32 training steps).

`layout` says whether a batch can run so exactly; `pack` and `unpack` move the hidden states into
that row and back. Equal to the dense mask of nanosft.masking (tested); off in reference mode.
"""

import torch

from nanosft.masking import packed_segment_ids


def varlen_layout(attention_mask, position_ids, B, T, past_len, unpad):
    """(index of the kept tokens in the flattened (B*T) batch or None for all, document lengths),
    or None. One packed row then runs one causal SDPA per document, not a dense (T, T) mask.
    Mirrors: transformers flash-attention varlen path (_upad_input, cu_seq_lens)
    Differs: transformers' SDPA path keeps the dense mask; `unpad` (training only) also unpads
    right-padded rows."""
    if past_len or T == 1:
        return None
    if attention_mask is not None and (not unpad or bool(attention_mask.all())):
        return None
    seg = packed_segment_ids(position_ids.expand(B, T))  # (B, T) document index per token
    if attention_mask is None:
        if not bool(seg[:, -1].any()):
            return None  # one document per row: plain is_causal is already exact and fastest
        return None, [n for row in seg for n in torch.bincount(row).tolist() if n]
    m = attention_mask.bool()
    # Exact only for right padding: each row's real tokens one run from column 0 holding one
    # document. A left pad would be the position that predicts the first real token, and its
    # logits do enter the loss.
    runs = (m[:, 1:] & ~m[:, :-1]).sum(1) + m[:, 0]
    docs = seg.masked_fill(~m, -1).amax(1) - seg.masked_fill(~m, T).amin(1)
    if not bool(((runs <= 1) & (m[:, 0] | ~m.any(1)) & (docs <= 0)).all()):
        return None
    return m.flatten().nonzero().squeeze(1), [n for n in m.sum(1).tolist() if n]


def layout(model, attention_mask, position_ids, B, T, past_len):
    """varlen_layout for this forward: right-padded rows are unpadded in a training step, fp32 or
    under CPU bf16 autocast (a bf16 QLoRA step at SmolLM2-135M's widths: 1.6x in CPU time, the pad
    tokens' GEMMs gone; torch's bf16 SDPA per document is within 1 bf16 ulp of the masked one).
    Under CUDA autocast the padded batch stays: one SDPA launch per document cost more there."""
    device = position_ids.device.type
    cuda_autocast = device != "cpu" and torch.is_autocast_enabled(device)
    unpad = (model.training and torch.is_grad_enabled() and not cuda_autocast
             and not draws_dropout(model))
    return varlen_layout(attention_mask, position_ids, B, T, past_len, unpad=unpad)


def draws_dropout(model):
    """Whether a dropout with p > 0 runs in `model` (LoRA's lora_dropout): its masks must be drawn
    over the padded (B, T, C) batch, pad tokens included, for the RNG stream to give peft's."""
    return any(isinstance(m, torch.nn.Dropout) and m.p > 0 and m.training
               for m in model.modules())


def pack(h, position_ids, layout):
    """(B, T, C) -> one row (1, N, C) of the kept tokens (pad rows skip the layers), its position
    ids, and the document lengths the attention layers split it by."""
    index, doc_lengths = layout
    B, T, C = h.shape
    h, position_ids = h.reshape(1, B * T, C), position_ids.expand(B, T).reshape(1, B * T)
    if index is not None:
        h, position_ids = h[:, index], position_ids[:, index]
    return h, position_ids, doc_lengths


def unpack(h, layout, B, T):
    """Back to (B, T, C); unpadded positions get zeros (their labels are -100)."""
    index = layout[0]
    C = h.shape[-1]
    h = h[0] if index is None else h.new_zeros(B * T, C).index_copy(0, index, h[0])
    return h.view(B, T, C)

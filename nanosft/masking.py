"""Which token may attend to which: the causal SDPA mask of padded and packed rows.

What `DecoderModel.forward` hands to each attention layer: `None` where SDPA's own is_causal is
exact, else a boolean (B|1, 1, T, S) mask. Mirrors transformers' masking_utils. (The unpadded
layout, one causal SDPA per document, is a speed path: nanosft.fast.unpad.)
"""

import torch


def packed_segment_ids(position_ids):
    """Document index per token (B, T): a new document wherever position_ids does not step by +1.
    Mirrors: transformers masking_utils.find_packed_sequence_indices"""
    step = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1)
    return (step != 1).cumsum(-1)


def build_attention_mask(attention_mask, position_ids, q_len, past_len):
    """Boolean SDPA mask (B|1, 1, T, past+T), True = attend; None where plain causal is exact.
    Mirrors: transformers masking_utils.create_causal_mask (sdpa, packed)"""
    padded = attention_mask is not None and not bool(attention_mask.all())
    seg = packed_segment_ids(position_ids) if attention_mask is None and past_len == 0 else None
    packed = seg is not None and bool(seg[:, -1].any())  # some row holds several documents
    if not padded and not packed and (past_len == 0 or q_len == 1):
        return None  # fast path: SDPA's is_causal (a single new token may see the whole cache)
    k_idx = torch.arange(past_len + q_len, device=position_ids.device)
    mask = (k_idx[None, :] <= k_idx[past_len:, None])[None, None]  # (1, 1, T, S) causal
    if padded:
        mask = mask & attention_mask[:, None, None, : past_len + q_len].bool()
    if packed:  # block-diagonal per document
        mask = mask & (seg[:, None, :, None] == seg[:, None, None, :])
    # A left-padding query sees no key at all and softmax over nothing is NaN: let it see every
    # key (its output is never read, it is masked as a key and has label -100).
    return mask | ~mask.any(dim=-1, keepdim=True)

"""Which token may attend to which: the causal SDPA mask, and the unpadded / packed (varlen) layout.

What `DecoderModel.forward` (walkthrough 2.6) hands to each attention layer: `None` where SDPA's own
is_causal is exact, a boolean (B|1, 1, T, S) mask for padding and packed rows, or document lengths
when a packed or right-padded batch runs as one row of real tokens, one causal SDPA per document.
Mirrors transformers' masking_utils and its flash-attention varlen convention.
"""

import torch


def packed_segment_ids(position_ids):
    """Document index per token (B, T): a new document wherever position_ids does not step by +1.
    Walkthrough 2.6 | Mirrors: transformers masking_utils.find_packed_sequence_indices"""
    step = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1)
    return (step != 1).cumsum(-1)


def build_attention_mask(attention_mask, position_ids, q_len, past_len):
    """Boolean SDPA mask (B|1, 1, T, past+T), True = attend; None where plain causal is exact.
    Walkthrough 2.6 | Mirrors: transformers masking_utils.create_causal_mask (sdpa, packed)"""
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


def varlen_layout(attention_mask, position_ids, B, T, past_len, unpad):
    """(index of the kept tokens in the flattened (B*T) batch or None for all, document lengths),
    or None. One packed row then runs one causal SDPA per document, not a dense (T, T) mask.
    Walkthrough 2.6 | Mirrors: transformers flash-attention varlen path (_upad_input, cu_seq_lens)
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

"""Context parallel: every row's sequence split over the mesh's "cp" ranks, attention over them all.

Each of the cp ranks of one data shard reads the same rows and keeps part of each: the row is
padded to a multiple of 2 * cp and cut into 2 * cp chunks; rank r keeps chunks r and 2cp-1-r, so
under the causal mask every rank has the same number of (query, key) pairs to score. Its tokens
keep their global positions (RoPE) and their documents (packed rows). Attention all-gathers K and V
over the cp ranks (the backward sums each block's gradient back onto its owner) and merges the
blocks with an online softmax written out: running max, running sum, rescaled partial outputs
(the FlashAttention / Ring Attention recurrence, 2205.14135, 2310.01889).
`ContextParallel` wraps the model the Trainer calls; the attention layers receive a
`ContextParallelLayout` as their mask and hand it their q, k, v (model.Attention.attend).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nanosft.masking import packed_segment_ids

IGNORE_INDEX = -100


# ----- the load-balanced split
def padded_length(length: int, cp_size: int) -> int:
    """The row length rounded up to a multiple of 2 * cp_size (the pad is never trained on)."""
    return -(-length // (2 * cp_size)) * 2 * cp_size


def load_balanced_index(length: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Global positions rank `cp_rank` keeps of a row of `length` (a multiple of 2 * cp_size):
    chunk cp_rank and chunk 2cp-1-cp_rank. Early chunks see few keys under the causal mask, late
    ones many; one of each gives every rank the same work. Mirrors: torch context_parallel's
    _HeadTailLoadBalancer"""
    chunk = length // (2 * cp_size)
    head = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    tail_start = (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat((head, torch.arange(tail_start, tail_start + chunk)))


# ----- K / V of every cp rank, with the backward that returns each block's gradient to its owner
class _GatherBlocks(torch.autograd.Function):
    """x (this rank's block) -> the blocks of every rank of `group`, in rank order. Backward: every
    rank holds a gradient for every block; the owner's gradient is their sum (a reduce-scatter,
    written as an all-reduce and the owner's slice: gloo has no reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group):
        import torch.distributed as dist

        ctx.group = group
        blocks = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(blocks, x.contiguous(), group=group)
        return tuple(blocks)

    @staticmethod
    def backward(ctx, *grads):
        import torch.distributed as dist

        grad = torch.stack(grads)  # (cp, B, KV, T_local, D)
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


def gather_blocks(x: torch.Tensor, group) -> tuple:
    """Every cp rank's block of x, in rank order (just x without a group)."""
    return (x,) if group is None else _GatherBlocks.apply(x, group)


# ----- the online softmax over blocks of keys
def online_softmax_attention(q, key_blocks, value_blocks, mask_blocks, scale) -> torch.Tensor:
    """softmax(q k^T * scale, masked) v over keys that come in blocks, one block at a time:
    q (B, H, T, D); each key / value block (B, KV, S_j, D); each mask (B|1, 1, T, S_j), True =
    attend. Equal to one softmax over all the keys at once. A query that sees no key gets zeros.
    Mirrors: FlashAttention's online softmax (2205.14135, Algorithm 1), Ring Attention's merge"""
    B, H, T, D = q.shape
    m = q.new_full((B, H, T, 1), float("-inf"))  # running max of the scores seen so far
    l = q.new_zeros((B, H, T, 1))  # running sum of exp(score - m)
    o = q.new_zeros((B, H, T, D))  # running sum of exp(score - m) * v
    for k, v, mask in zip(key_blocks, value_blocks, mask_blocks):
        groups = H // k.shape[1]  # GQA: kv head j serves query heads j*groups .. (j+1)*groups-1
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        s = (q @ k.transpose(-1, -2)) * scale  # (B, H, T, S_j)
        s = s.masked_fill(~mask, float("-inf"))
        # the max only keeps exp() in range; the result does not depend on it: no gradient
        m_new = torch.maximum(m, s.detach().amax(dim=-1, keepdim=True))
        m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)  # no key yet: exp(-inf) = 0
        p = torch.exp(s - m_safe)  # (B, H, T, S_j), 0 where masked
        rescale = torch.exp(m - m_safe)  # what the old partial sums were measured against
        l = l * rescale + p.sum(dim=-1, keepdim=True)
        o = o * rescale + p @ v
        m = m_new
    return o / l.clamp(min=torch.finfo(l.dtype).tiny)  # l = 0 only for a query that sees nothing


# ----- which of every rank's keys each of this rank's queries may see
@dataclass
class ContextParallelLayout:
    """What the attention layers get as their mask under context parallel: this rank's tokens,
    every rank's keys, and which pairs may attend (causal by global position, the same document
    of a packed row, no padding key). `attend` all-gathers k, v over `group` and merges.

    Args:
        query_index: (T,) global positions of this rank's tokens in the padded row.
        key_index: per cp rank, (T,) global positions of its tokens.
        query_segment / key_segment: (B, T) document index of each token (zeros: one document).
        key_valid: per cp rank, (B, T) False for a padding key (the collator's or the split's).
        blind: (B, T) queries that see no key at all (a left pad): they see every real key, as
            nanosft.masking.build_attention_mask lets them.
        real_length: the row length before the split's padding.
        group: the cp ranks' process group (None: one rank, no gather)."""

    query_index: torch.Tensor
    key_index: list
    query_segment: torch.Tensor
    key_segment: list
    key_valid: list
    blind: torch.Tensor
    real_length: int
    group: object = None

    def block_mask(self, j: int) -> torch.Tensor:
        """(B, 1, T, T_j) True where this rank's query may attend to rank j's key."""
        causal = self.key_index[j][None, :] <= self.query_index[:, None]  # (T, T_j)
        same_document = self.query_segment[:, :, None] == self.key_segment[j][:, None, :]
        mask = causal & same_document & self.key_valid[j][:, None, :]  # (B, T, T_j)
        real_key = self.key_index[j] < self.real_length
        mask = mask | (self.blind[:, :, None] & real_key[None, None, :])
        return mask[:, None]

    def attend(self, q, k, v, scale) -> torch.Tensor:
        """This rank's queries q (B, H, T, D) over every cp rank's k, v (B, KV, T, D each):
        (B, H, T, D). The blocks are merged in a ring's order (own first, then rank - 1, ...)."""
        keys, values = gather_blocks(k, self.group), gather_blocks(v, self.group)
        me = self._group_rank()
        order = [(me - step) % len(keys) for step in range(len(keys))]
        return online_softmax_attention(q, [keys[j] for j in order], [values[j] for j in order],
                                        [self.block_mask(j) for j in order], scale)

    def _group_rank(self) -> int:
        if self.group is None:
            return 0
        import torch.distributed as dist

        return dist.get_rank(self.group)


def _pad_right(x, length, value):
    return F.pad(x, (0, length - x.shape[-1]), value=value)


def build_layout(attention_mask, position_ids, length, cp_size, cp_rank, group=None,
                 device=None) -> ContextParallelLayout:
    """The layout of rank `cp_rank`'s part of rows of `length` tokens. Documents come from
    position_ids restarting, as nanosft.masking reads them (only when there is no attention_mask);
    padding keys from attention_mask and from the split's own pad."""
    padded = padded_length(length, cp_size)
    B = (attention_mask if attention_mask is not None else position_ids).shape[0]
    valid = (torch.ones(B, length, dtype=torch.bool, device=device) if attention_mask is None
             else attention_mask.bool())
    if attention_mask is None and position_ids is not None:
        segment = packed_segment_ids(position_ids.expand(B, length))
    else:
        segment = torch.zeros(B, length, dtype=torch.long, device=device)
    # blind: no valid key at or before the query in its document (counts of valid keys, restarted
    # at each document's first token)
    seen = valid.long().cumsum(-1)
    starts = torch.diff(segment, prepend=segment[:, :1] - 1, dim=-1) != 0
    before_document = torch.where(starts, seen - valid.long(), 0).cummax(-1).values
    blind = seen - before_document == 0
    valid = _pad_right(valid, padded, False)
    segment = torch.cat((segment, segment[:, -1:].expand(B, padded - length)), dim=-1)
    blind = _pad_right(blind, padded, False)
    index = [load_balanced_index(padded, cp_size, j).to(valid.device) for j in range(cp_size)]
    mine = index[cp_rank]
    return ContextParallelLayout(
        query_index=mine, key_index=index, query_segment=segment[:, mine],
        key_segment=[segment[:, i] for i in index], key_valid=[valid[:, i] for i in index],
        blind=blind[:, mine], real_length=length, group=group)


@dataclass
class RowPart:
    """This rank's part of a batch of rows: ids, global positions, the next-token labels already
    shifted on the whole row (a part's last token predicts a token another rank holds), the
    whole rows' supervised token count, and the layout its attention layers get."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    shift_labels: torch.Tensor | None
    num_items: torch.Tensor | None
    layout: ContextParallelLayout


def shard_rows(input_ids, attention_mask, position_ids, labels, cp_size, cp_rank,
               group=None) -> RowPart:
    """Pad (B, T) rows to a multiple of 2 * cp_size (pad ids 0, labels -100, masked keys) and take
    rank `cp_rank`'s load-balanced part of each."""
    B, T = input_ids.shape
    padded = padded_length(T, cp_size)
    device = input_ids.device
    if position_ids is None:  # as the model's default: 0 .. T-1, blind to padding
        position_ids = torch.arange(T, device=device)[None]
    layout = build_layout(attention_mask, position_ids, T, cp_size, cp_rank, group, device)
    mine = layout.query_index
    # the pad tokens' positions continue the row (RoPE of tokens nothing reads)
    positions = torch.cat((position_ids.expand(B, T),
                           torch.arange(T, padded, device=device).expand(B, padded - T)), -1)
    shift_labels = num_items = None
    if labels is not None:
        # position t predicts labels[t + 1]: shifted on the whole row, before the split
        shift_labels = _pad_right(labels[:, 1:], padded, IGNORE_INDEX)
        num_items = shift_labels.ne(IGNORE_INDEX).sum()
        shift_labels = shift_labels[:, mine]
    return RowPart(input_ids=_pad_right(input_ids, padded, 0)[:, mine],
                   position_ids=positions[:, mine], shift_labels=shift_labels,
                   num_items=num_items, layout=layout)


class ContextParallel(nn.Module):
    """The model as the Trainer calls it under cp_size > 1: each rank runs its part of every row
    (shard_rows) and returns cp_size x its share of the loss (its tokens' summed cross entropy over
    the whole window's num_items_in_batch), so that the mean over the cp ranks, which FSDP's
    gradient average over dp_shard x cp and the logged mean over ranks take, is the rows' loss.
    Mirrors: accelerate maybe_context_parallel + transformers' shift_labels under cp
    Differs: K/V are all-gathered and merged by hand (torch's ring SDPA is not used).

    Args:
        module: the model (FSDP-sharded over dp_shard x cp) with the Llama attention of model.py.
        cp_mesh: the 1-D "cp" dim of the parallelism config's mesh."""

    def __init__(self, module, cp_mesh):
        super().__init__()
        self.module = module
        self.cp_size, self.cp_rank = cp_mesh.size(), cp_mesh.get_local_rank()
        self.group = cp_mesh.get_group()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None,
                num_items_in_batch=None, **kwargs):
        """CausalLM.forward's outputs on this rank's tokens: logits (B, T_local, V), the loss
        above."""
        if input_ids is None or kwargs.get("inputs_embeds") is not None:
            raise ValueError("context parallel splits input_ids; pass input_ids, not inputs_embeds")
        fused = kwargs.pop("fused_lm_head", False) and labels is not None
        part = shard_rows(input_ids, attention_mask, position_ids, labels, self.cp_size,
                          self.cp_rank, self.group)
        outputs = self.module(input_ids=part.input_ids, attention_mask=part.layout,
                              position_ids=part.position_ids, **kwargs)
        if labels is None:
            return outputs
        logits = outputs["logits"].float()
        loss = F.cross_entropy(logits.flatten(0, -2), part.shift_labels.flatten(),
                               ignore_index=IGNORE_INDEX, reduction="sum")
        count = part.num_items if num_items_in_batch is None else num_items_in_batch
        outputs.loss = self.cp_size * loss / torch.as_tensor(count, device=loss.device)
        if fused:
            self._token_outputs(outputs, logits.detach(), part, input_ids.shape[1])
        return outputs

    def _token_outputs(self, outputs, logits, part, length) -> None:
        """The fused LM head's per-token fields (SFTTrainer's token metrics), (B, length - 1) over
        the whole rows as one process computes them: this rank's from its logits, all-gathered
        over cp and put back at their positions. No gradient: the loss above carries it.
        Differs: from this rank's (B, T / cp, V) logits, not tiles of the LM head."""
        target = part.shift_labels
        mask = target != IGNORE_INDEX
        log_p = logits.log_softmax(-1)
        picked = log_p.gather(-1, target.clamp(min=0)[..., None]).squeeze(-1)
        fields = torch.stack([picked * mask, -(log_p.exp() * log_p).sum(-1) * mask,
                              ((logits.argmax(-1) == target) & mask).float(), mask.float()])
        import torch.distributed as dist

        pieces = [torch.empty_like(fields) for _ in range(self.cp_size)]
        dist.all_gather(pieces, fields.contiguous(), group=self.group)
        whole = fields.new_zeros(*fields.shape[:2], padded_length(length, self.cp_size))
        for index, piece in zip(part.layout.key_index, pieces):
            whole[:, :, index] = piece
        log_probs, entropy, is_top1, label_mask = whole[:, :, :length - 1]
        outputs.logits, outputs.log_probs, outputs.entropy = None, log_probs, entropy
        outputs.is_top1, outputs.label_mask = is_top1.bool(), label_mask.bool()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """FSDP2's switch (the Trainer's no_sync on accumulation micro-batches), passed through."""
        self.module.set_requires_gradient_sync(requires_gradient_sync)


def check_context_parallel(model, args) -> None:
    """Refuse, before any step, what context parallel does not split correctly: a decoder or an
    attention other than model.py's (sliding windows, linear attention, ...), RoPE whose
    frequencies depend on the batch's length, prompt learning, label smoothing."""
    from nanosft.model import Attention, DecoderModel, rope_dict
    from nanosft.rope import needs_seq_len

    if getattr(model, "peft_type", "LORA") != "LORA":
        raise ValueError(f"context parallel with {model.peft_type} (virtual tokens prepended to "
                         "each row) is not implemented yet; use LoRA or cp_size=1")
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = getattr(base, "model", None)
    attentions = [m for m in base.modules() if isinstance(m, Attention)]
    same = (type(decoder).forward is DecoderModel.forward and attentions
            and all(type(m).attend is Attention.attend for m in attentions))
    if not same:
        kind = getattr(getattr(base, "config", None), "model_type", type(base).__name__)
        raise ValueError(f"context parallel supports the Llama decoder's attention (model.py); "
                         f"{kind} changes it, which is not implemented yet; use cp_size=1")
    if needs_seq_len(rope_dict(base.config)):
        raise ValueError(f"context parallel with rope_type="
                         f"{base.config.rope_scaling['rope_type']!r} (frequencies from the "
                         "batch's length, which each rank sees only part of) is not implemented "
                         "yet; use cp_size=1")
    if getattr(args, "loss_type", "nll") == "dft":
        raise ValueError("context parallel with loss_type='dft' (its per-token weights need the "
                         "fused head's log-probabilities with their gradient) is not implemented "
                         "yet; use loss_type='nll' or cp_size=1")
    if args.label_smoothing_factor != 0:
        raise ValueError("context parallel with label_smoothing_factor > 0 (the Trainer's loss on "
                         "the whole rows' logits) is not implemented yet; use "
                         "label_smoothing_factor=0 or cp_size=1")

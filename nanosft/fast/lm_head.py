"""The fused LM head: per-token log p, entropy and top-1 hit without the (B, T, V) logits.

What TRL's SFTTrainer asks the model for (`model(**inputs, fused_lm_head=True)`, trl
add_fused_lm_head): supervised tokens go through lm_head a tile at a time and each tile's gradient
is written by hand (TileLogProbs), as trl's ChunkedLogProbFunction. Tested equal to
`causal_lm_loss` over the full logits; reference mode uses that instead.
"""

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from nanosft.fast.nf4 import workspace


# supervised tokens per lm_head tile: (256, V) fp32 logits at a time, 48 MiB at V = 49,152
# (a LoRA step on that vocabulary peaked at 449 MiB RSS with 256, 1,020 with 1,024, same speed)
LOSS_CHUNK_SIZE = 256


def _compute_dtype(h, weight):
    # what lm_head(h) would multiply in: autocast's dtype when it is on, else the weight's
    device = h.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype


def _tile_logits(h, weight, dtype, out=None, low=None):
    """(n, C) @ (V, C)^T -> (n, V) fp32 logits, multiplied in `dtype` as lm_head(h) would be;
    `low`: an (n, V) buffer in `dtype` for the product (else a fresh one)."""
    if dtype == torch.float32:
        return torch.mm(h.float(), weight.float().t(), out=out)
    logits = torch.mm(h.to(dtype), weight.to(dtype).t(), out=low)
    return logits.float() if out is None else out.copy_(logits)


def _tile_buffer(name, shape, dtype, device):
    """An empty tensor of `shape` for the tiles. On CPU the same pages on every call (one buffer
    per name, thread and dtype): a fresh 48 MiB buffer is mapped anew by glibc and faults in
    every page on first touch (22 ms against 5 ms for the same subtraction into warm pages).
    Elsewhere a fresh tensor (the CUDA caching allocator already reuses freed blocks)."""
    device = torch.device(device)
    if device.type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    return workspace(shape.numel(), dtype, device, name="lm_head." + name).view(shape)


def _is_top1(logits, targets, target_logit, peak):
    """logits.argmax(1) == targets (argmax: the first maximum, as trl's test). On CPU argmax (10 ms
    of a (256, 49152) tile, one thread) runs only over rows whose target logit is the row's
    peak, or NaN (argmax takes NaN for the maximum): no other row can be a hit. Under
    torch.compile the whole-tile argmax: the row selection's data-dependent shape recompiles."""
    if logits.device.type != "cpu" or torch.compiler.is_compiling():
        return logits.argmax(1) == targets
    is_top1 = (target_logit == peak) | target_logit.isnan()
    rows = is_top1.nonzero().squeeze(1)
    if len(rows):  # a tie at the peak before the target makes argmax pick the earlier index
        is_top1[rows] = logits[rows].argmax(1) == targets[rows]
    return is_top1


def _row_dots(a, b):
    """(n, V), (n, V) -> (n,) row-wise dot products. On CPU one BLAS dot per row: 2.7x faster
    than torch.bmm's (n, 1, V) @ (n, V, 1) at V = 49,152, and closer to the float64 sum. Under
    torch.compile the bmm: a loop over rows would be traced into one graph node per row."""
    if a.device.type != "cpu" or torch.compiler.is_compiling():
        return torch.bmm(a[:, None, :], b[:, :, None]).view(a.shape[0])
    return torch.stack([torch.dot(x, y) for x, y in zip(a, b)]) if len(a) else a.new_zeros(0)


class TileLogProbs(torch.autograd.Function):
    """One tile of supervised tokens through a bias-free lm_head: log p(target) (differentiable),
    entropy and top-1 hit (metrics); the (n, V) logits live in `workspace` only during the call.
    Mirrors: trl ChunkedLogProbFunction
    Differs: tiles tokens only; over a frozen head nothing is recomputed in backward: forward keeps
    d log p / dh = w[target] - E_p[w], (n, C); a trainable head recomputes its tile (as trl)."""

    @staticmethod
    def forward(ctx, h, weight, targets, workspace, low=None):
        # low: None, or an (n, V) buffer in the multiply's dtype when that is not fp32 (bf16
        # autocast), reused by every tile for the product and for p's cast
        ctx.set_materialize_grads(False)
        n, dtype = h.shape[0], _compute_dtype(h, weight)
        low = None if low is None else low[:n]
        with torch.autocast(h.device.type, enabled=False):
            logits = _tile_logits(h, weight, dtype, out=workspace[0][:n], low=low)  # (n, V)
            target_logit = logits.gather(1, targets[:, None]).squeeze(1)
            peak = logits.amax(1, keepdim=True)
            is_top1 = _is_top1(logits, targets, target_logit, peak.squeeze(1))
            p = torch.sub(logits, peak, out=workspace[1][:n]).exp_()  # unnormalised softmax
            z = p.sum(1)
            log_z = peak.squeeze(1) + z.log()
            # H = log Z - E_p[logit]; the dot product per row without an (n, V) temporary
            entropy = log_z - _row_dots(p, logits) / z
            needs_h, needs_weight = ctx.needs_input_grad[:2]
            if needs_weight:  # the head trains: backward recomputes the tile (its p is needed)
                ctx.save_for_backward(h, weight, targets, log_z)
                ctx.workspace = workspace  # the tiles' backward runs one after another too
            elif needs_h:  # frozen head: the whole gradient is a per-token scale of this (n, C)
                p_low = p.to(dtype) if low is None or dtype == p.dtype else low.copy_(p)
                expected_w = torch.mm(p_low, weight.to(dtype)).float() / z[:, None]
                ctx.save_for_backward(weight[targets].float() - expected_w)
        ctx.dtype, ctx.h_dtype, ctx.needs_weight = dtype, h.dtype, needs_weight
        ctx.mark_non_differentiable(entropy, is_top1)
        return target_logit - log_z, entropy, is_top1

    @staticmethod
    def backward(ctx, grad_log_probs, *_):
        if grad_log_probs is None:
            return None, None, None, None, None
        if not ctx.needs_weight:
            (direction,) = ctx.saved_tensors
            grad_h = grad_log_probs[:, None] * direction  # d/dh of g * log p
            return grad_h.to(ctx.h_dtype), None, None, None, None
        h, weight, targets, log_z = ctx.saved_tensors
        dtype, n = ctx.dtype, h.shape[0]
        with torch.autocast(h.device.type, enabled=False):
            logits = _tile_logits(h, weight, dtype, out=ctx.workspace[0][:n])
            p = logits.sub_(log_z[:, None]).exp_()  # softmax, (n, V)
            # d(g log p_y)/d logits = g (onehot(y) - p), written over p
            grad_logits = p.mul_(-grad_log_probs[:, None])
            grad_logits[torch.arange(n, device=h.device), targets] += grad_log_probs
            grad_logits = grad_logits.to(dtype)
            grad_h = torch.mm(grad_logits, weight.to(dtype)).to(h.dtype)
            grad_weight = torch.mm(grad_logits.t(), h.to(dtype)).to(weight.dtype)
        return grad_h, grad_weight, None, None, None


def _tile_token_stats(lm_head, h, targets):
    # any other head (LoRA on lm_head, modules_to_save, a bias): (n, C) -> (n, V) fp32 logits,
    # dropped after this call and recomputed in backward by torch.utils.checkpoint
    logits = lm_head(h).float()
    log_z = logits.logsumexp(-1)  # (n,)
    log_probs = logits.gather(-1, targets[:, None]).squeeze(-1) - log_z
    with torch.no_grad():  # the metrics: H = log Z - E_p[z]; top-1 is argmax's first index
        entropy = log_z - (logits.softmax(-1) * logits).sum(-1)
        is_top1 = logits.argmax(-1) == targets
    return log_probs, entropy, is_top1


def fused_lm_head_outputs(hidden, lm_head, labels, chunk_size=LOSS_CHUNK_SIZE):
    """Per-token log p(next token), entropy and top-1 hit, each (B, T-1) and zero where the shifted
    label is -100, plus that label mask; the (B, T, V) logits never exist: only supervised
    positions go through lm_head, `chunk_size` at a time.
    Mirrors: trl add_fused_lm_head (its compact, supervised-only scoring)
    Differs: tiles tokens, not the vocabulary; a head other than a bias-free nn.Linear goes
    through torch.utils.checkpoint, which recomputes each tile in backward."""
    targets = labels[:, 1:].to(hidden.device)  # position t predicts token t+1
    mask = targets != -100
    h, y = hidden[:, :-1][mask], targets[mask]  # (N, C), (N,)
    pairs = list(zip(h.split(chunk_size), y.split(chunk_size)))
    if type(lm_head) is nn.Linear and lm_head.bias is None:
        # two (chunk, V) fp32 buffers shared by the tiles: fresh ones would fault in their pages
        # on every tile (48 MiB each at V = 49,152); under bf16 autocast a third in bf16, and a
        # frozen head's weight cast once for all tiles (not twice a tile: 54 MiB a cast). On CPU
        # the same buffers serve every call (_tile_buffer): no page faults per micro-batch
        rows = min(chunk_size, max(len(y), 1))
        weight, V = lm_head.weight, lm_head.out_features
        tiles_buffer = _tile_buffer("logits", torch.Size((2, rows, V)), torch.float32, h.device)
        dtype, low = _compute_dtype(h, weight), None
        if dtype != torch.float32:
            low = _tile_buffer("low", torch.Size((rows, V)), dtype, h.device)
            if not weight.requires_grad and weight.dtype != dtype:  # a cast rounds as .to(dtype)
                weight = _tile_buffer("weight", weight.shape, dtype, h.device).copy_(weight)
        tiles = [TileLogProbs.apply(hc, weight, yc, tiles_buffer, low) for hc, yc in pairs]
    else:
        tiles = [checkpoint(_tile_token_stats, lm_head, hc, yc, use_reentrant=False)
                 for hc, yc in pairs]
    # no supervised token still gives one empty tile, so the loss stays in the graph (0, not 0/0)
    per_token = []
    for parts in zip(*tiles):
        flat = torch.cat(parts)
        per_token.append(flat.new_zeros(mask.shape).masked_scatter(mask, flat))
    log_probs, entropy, is_top1 = per_token
    return log_probs, entropy, is_top1, mask


def chunked_causal_lm_loss(hidden, lm_head, labels, num_items_in_batch=None,
                           chunk_size=LOSS_CHUNK_SIZE):
    """causal_lm_loss(lm_head(hidden), labels, ...) without the (B, T, V) logits, through
    fused_lm_head_outputs: -Σ log p over supervised tokens / num_items_in_batch (else their count).
    Mirrors: trl add_fused_lm_head's loss"""
    log_probs, _, _, mask = fused_lm_head_outputs(hidden, lm_head, labels, chunk_size)
    count = mask.sum() if num_items_in_batch is None else num_items_in_batch
    return -log_probs.sum() / torch.as_tensor(count, device=log_probs.device)

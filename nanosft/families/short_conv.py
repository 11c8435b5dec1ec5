"""Short convolutions: a causal depthwise conv1d over the last K tokens, its window cached.

`causal_conv1d` is the conv both recurrent families use: Gated DeltaNet runs q, k, v through it
(then SiLU) before the delta rule; LFM2's `ShortConv` layer is a gated one, C * conv(B * x), in
place of attention. At a sequence start the window holds zeros; in generation the cache holds the
last K - 1 inputs. Paper: Hyena 2302.10866 (short convolutions as token mixers).
"""

import torch
import torch.nn.functional as F
from torch import nn

from nanosft.families.hybrid import run_documents


def causal_conv1d(x, weight, bias=None, state=None, activation=None):
    """Depthwise causal conv over time: x (B, D, T), weight (D, 1, K); `state` (B, D, K - 1) holds
    the inputs before x (None: a sequence start, zeros). -> (B, D, T) after `activation`, and the
    new state. Mirrors: transformers causal_conv1d_fn, causal_conv1d_update"""
    K = weight.shape[-1]
    if state is None:  # zero padding on the left (conv1d's own: same rounding as transformers)
        y = F.conv1d(x.to(weight.dtype), weight, bias, padding=K - 1, groups=x.shape[1])
        y, full = y[..., :x.shape[-1]], F.pad(x, (K - 1, 0))
    else:
        full = torch.cat((state.to(x.dtype), x), dim=-1)  # (B, D, K - 1 + T)
        y = F.conv1d(full.to(weight.dtype), weight, bias, groups=x.shape[1])
    if activation is not None:
        y = activation(y)
    return y.to(x.dtype), full[..., full.shape[-1] - (K - 1):]


class ShortConv(nn.Module):
    """LFM2's conv layer: in_proj to (B, C, x), then C * conv(B * x) through out_proj; its cache is
    the conv window. Mirrors: transformers Lfm2ShortConv

    Args:
        config: hidden_size, conv_L_cache (the kernel size K), conv_bias.
    """

    def __init__(self, config, layer_idx=0):
        super().__init__()
        C, K, bias = config.hidden_size, config.conv_L_cache, config.conv_bias
        self.layer_idx = layer_idx
        self.conv = nn.Conv1d(C, C, K, groups=C, bias=bias, padding=K - 1)
        self.in_proj = nn.Linear(C, 3 * C, bias=bias)
        self.out_proj = nn.Linear(C, C, bias=bias)

    def mix(self, Bx, past=None):
        """The conv over one stretch of tokens: (B, C, T) -> (B, C, T) and the window after it."""
        return causal_conv1d(Bx, self.conv.weight, self.conv.bias, past)

    def forward(self, x, mask=None, past=None):
        """(B, T, C) -> (B, T, C) and the conv window (B, C, K - 1).
        mask: None or (keep (B, T) with 0 at padding, or None; per-row document lengths or None)."""
        keep, docs = (None, None) if mask is None else mask
        if keep is not None:  # padding enters as zeros
            x = (x * keep[:, :, None]).to(x.dtype)
        b, c, h = self.in_proj(x).transpose(-1, -2).chunk(3, dim=-2)  # (B, C, T) each
        Bx = b * h
        if docs is None:
            y, window = self.mix(Bx, past)
        else:  # packed documents: each from an empty window
            y = run_documents(lambda t: self.mix(t.transpose(1, 2))[0].transpose(1, 2), docs,
                              Bx.transpose(1, 2)).transpose(1, 2)
            window = None
        return self.out_proj((c * y).transpose(-1, -2).contiguous()), window

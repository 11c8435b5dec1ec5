"""Gemma 4's mixture-of-experts block (`gemma4_text` with `enable_moe_block`, e.g. 26B-A4B).

Every layer keeps its dense GeGLU MLP and adds experts beside it: the router reads the residual
stream before the MLP (normed without a weight, times its own `scale` and hidden_size ** -0.5),
softmax in fp32 over `num_experts`, the top `top_k_experts` renormalised to sum 1, then each
weight times its expert's `per_expert_scale`. The experts (families.moe's 3-D layout, GeGLU in
place of SwiGLU) read pre_feedforward_layernorm_2 of the same residual; the two branches are normed
apart (post_feedforward_layernorm_1 / _2) and summed before post_feedforward_layernorm. Checkpoints
hold the 3-D `gate_up_proj` / `down_proj` as they are (no per-expert spelling). transformers adds
no load-balancing loss for Gemma 4, so neither does nanosft (TRL's aux_loss_enabled stays False).
"""

import torch
import torch.nn.functional as F
from torch import nn

from nanosft.families.moe import Experts


class Gemma4Router(nn.Module):
    """Each token's top-k experts and their weights, from the pre-MLP residual (N, C).
    Mirrors: transformers Gemma4TextRouter"""

    def __init__(self, config, norm_class):
        super().__init__()
        C, E = config.hidden_size, config.num_experts
        self.top_k, self.scalar_root_size = config.top_k_experts, C**-0.5
        self.norm = norm_class(C, config.rms_norm_eps, with_scale=False)
        self.proj = nn.Linear(C, E, bias=False)
        self.scale = nn.Parameter(torch.ones(C))
        self.per_expert_scale = nn.Parameter(torch.ones(E))

    def forward(self, x):
        """(N, C) -> router probabilities (N, E) fp32, top-k weights (N, k) fp32, ids (N, k)."""
        x = self.norm(x) * self.scale * self.scalar_root_size
        probs = F.softmax(self.proj(x), dim=-1, dtype=torch.float32)
        top_k_weights, top_k_index = torch.topk(probs, self.top_k, dim=-1)
        top_k_weights = top_k_weights / top_k_weights.sum(dim=-1, keepdim=True)
        return probs, top_k_weights * self.per_expert_scale[top_k_index], top_k_index


class Gemma4Experts(Experts):
    """E GeGLU experts in transformers' 3-D layout: gate_up_proj (E, 2 I, C), down_proj (E, C, I).
    Mirrors: transformers Gemma4TextExperts"""

    def expert(self, x, e):
        """Expert e on its tokens: (n, C) -> (n, C); Qwen3-MoE's experts: silu."""
        gate, up = self.linear(x, "gate_up_proj", e).chunk(2, dim=-1)
        return self.linear(F.gelu(gate, approximate="tanh") * up, "down_proj", e)


def add_moe_block(layer, config, norm_class):
    """Give a Gemma4DecoderLayer its router, experts and three extra norms (after its own
    modules, transformers' order). `norm_class`: Gemma 4's RMSNorm, passed in by gemma4.py (which
    imports this module, so this one cannot import it back)."""
    C, eps = config.hidden_size, config.rms_norm_eps
    layer.router = Gemma4Router(config, norm_class)
    layer.experts = Gemma4Experts(config, config.moe_intermediate_size)
    layer.post_feedforward_layernorm_1 = norm_class(C, eps)
    layer.post_feedforward_layernorm_2 = norm_class(C, eps)
    layer.pre_feedforward_layernorm_2 = norm_class(C, eps)


def moe_block(layer, h, m):
    """The dense MLP's output m (B, T, C) normed, plus the experts' output on the pre-MLP
    residual h (B, T, C), normed: what post_feedforward_layernorm then norms.
    Mirrors: transformers Gemma4TextDecoderLayer.forward (enable_moe_block)"""
    x = h.reshape(-1, h.shape[-1])  # (N, C): the router reads the residual, not the MLP's input
    _, top_k_weights, top_k_index = layer.router(x)
    y = layer.experts(layer.pre_feedforward_layernorm_2(x), top_k_index, top_k_weights)
    y = layer.post_feedforward_layernorm_2(y.reshape(h.shape))
    return layer.post_feedforward_layernorm_1(m) + y

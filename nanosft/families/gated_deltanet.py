"""Gated DeltaNet by hand: the linear-attention layer of Qwen3.5 (`linear_attn`).

A state S (Dk, Dv) per head replaces the (k, v) cache. Each token decays it by a_t = exp(g_t),
reads what S predicts for its key, and writes back beta_t times the error (the delta rule):
    S = a_t S;   u_t = beta_t (v_t - S^T k_t);   S = S + k_t u_t^T;   o_t = S^T q_t
`recurrent_gated_delta_rule` runs that one token at a time (generation); `chunk_gated_delta_rule`
runs it a chunk of tokens at a time with matrices (training), equal up to rounding. Before the
rule a causal depthwise conv1d (a short window of the last K tokens, its state cached too) mixes
q, k, v; after it a gated RMSNorm. Packed rows reset the state and the conv window at each
document start (hybrid.run_documents). Papers: DeltaNet 2406.06484, Gated DeltaNet 2412.06464.
"""

import torch
import torch.nn.functional as F
from torch import nn

from nanosft.families.hybrid import run_documents
from nanosft.families.short_conv import causal_conv1d

# transformers' (and fla's) chunk: the two chunked forms then round alike (bitwise equal here);
# benchmarks/bench_linear_attention.py's sweep (T 1,024, 1 CPU thread, forward + backward): 16
# and 32 0.74 s, 64 0.62 s, 128 0.59 s
CHUNK_SIZE = 64


def l2norm(x, eps=1e-6):
    """x / ||x|| over the last dim (eps inside the root). Mirrors: transformers qwen3_5 l2norm"""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta):
    """(B, T, H, D) inputs -> fp32 (B, Hv, T, D), k heads repeated to the value heads, q and k
    l2-normed, q scaled by Dk ** -0.5; g and beta (B, T, Hv) -> (B, Hv, T)."""
    rep = v.shape[2] // k.shape[2]  # each q/k head serves `rep` consecutive value heads
    q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    q, k, v, g, beta = (t.transpose(1, 2).float().contiguous() for t in (q, k, v, g, beta))
    q, k = l2norm(q), l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=None):
    """The gated delta rule one token at a time: q, k (B, T, Hk, Dk), v (B, T, Hv, Dv), g (log
    decay, <= 0) and beta (B, T, Hv) -> o (B, T, Hv, Dv) in q's dtype, final state (B, Hv, Dk, Dv).
    Mirrors: transformers torch_recurrent_gated_delta_rule"""
    dtype = q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    B, H, T, Dk = k.shape
    S = q.new_zeros(B, H, Dk, v.shape[-1]) if initial_state is None else initial_state.float()
    out = []
    for t in range(T):
        S = S * g[:, :, t, None, None].exp()  # forget: S = a_t S
        predicted = (S * k[:, :, t, :, None]).sum(-2)  # S^T k_t: (B, H, Dv)
        u = (v[:, :, t] - predicted) * beta[:, :, t, None]  # the delta rule's correction
        S = S + k[:, :, t, :, None] * u[:, :, None, :]  # write: S + k_t u_t^T
        out.append((S * q[:, :, t, :, None]).sum(-2))  # read: S^T q_t
    return torch.stack(out, 1).to(dtype), S


def chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=CHUNK_SIZE, initial_state=None):
    """The gated delta rule a chunk of C tokens at a time (same arguments and results as the
    recurrent form). Within a chunk, with G_t the cumulative log decay from the chunk start and
    S0 the state entering it, the corrections U solve one unit lower-triangular system:
        (I + A) U = beta V - (beta e^G K) S0,   A[t, s] = beta_t e^(G_t - G_s) k_t.k_s  (s < t)
    then O = (e^G Q) S0 + tril(Q K^T e^(G_t - G_s)) U and S = e^G_C S0 + (e^(G_C - G) K)^T U.
    Mirrors: transformers torch_chunk_gated_delta_rule"""
    dtype = q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    B, H, T, Dk = k.shape
    C = chunk_size
    pad = (C - T % C) % C  # zero tokens at the end: g = 0, beta = 0 leave the state alone
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = (T + pad) // C
    q, k, v = (t.reshape(B, H, n, C, -1) for t in (q, k, v))  # (B, H, n, C, D)
    G = g.reshape(B, H, n, C).cumsum(-1)  # log decay from the chunk start, inclusive
    b = beta.reshape(B, H, n, C, 1)
    later = torch.ones(C, C, dtype=torch.bool, device=q.device).triu(1)  # s > t: not yet
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(later, float("-inf")).exp()
    A = (b * k @ k.transpose(-1, -2)) * decay  # its diagonal is ignored: unitriangular
    W = torch.linalg.solve_triangular(A, b * v, upper=False, unitriangular=True)
    Kc = torch.linalg.solve_triangular(A, b * k * G[..., None].exp(), upper=False,
                                       unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay  # causal within the chunk, diagonal included
    q_read = q * G[..., None].exp()  # what the state entering the chunk gives each query
    k_write = k * (G[..., -1:] - G)[..., None].exp()  # each key decayed to the chunk end
    S = q.new_zeros(B, H, Dk, v.shape[-1]) if initial_state is None else initial_state.float()
    out = []
    for i in range(n):  # the only sequential part: one step per chunk
        U = W[:, :, i] - Kc[:, :, i] @ S  # (B, H, C, Dv)
        out.append(q_read[:, :, i] @ S + scores[:, :, i] @ U)
        S = S * G[:, :, i, -1, None, None].exp() + k_write[:, :, i].transpose(-1, -2) @ U
    o = torch.stack(out, 2).reshape(B, H, n * C, -1)[:, :, :T]
    return o.transpose(1, 2).contiguous().to(dtype), S


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output (in fp32, weight times the cast), then times silu(gate).
    Mirrors: transformers Qwen3_5RMSNormGated"""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(hidden_size)), eps

    def forward(self, x, gate):
        """x, gate (..., D) -> (..., D)."""
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32.to(x.dtype) * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """Qwen3.5's linear-attention layer: in_proj_qkv -> causal conv -> gated delta rule (heads
    Hk for q, k and Hv for v) -> gated RMSNorm by in_proj_z -> out_proj; beta from in_proj_b,
    the decay from in_proj_a, A_log and dt_bias. Its cache: (conv state, recurrent state).
    Mirrors: transformers Qwen3_5GatedDeltaNet

    Args:
        config: linear_num_key_heads, linear_num_value_heads, linear_key_head_dim,
            linear_value_head_dim, linear_conv_kernel_dim, rms_norm_eps.
    """

    def __init__(self, config, layer_idx=0):
        super().__init__()
        C = config.hidden_size
        self.num_k_heads = config.linear_num_key_heads
        self.num_v_heads = config.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.layer_idx, self.chunk_size = layer_idx, CHUNK_SIZE
        conv_dim, K = 2 * self.key_dim + self.value_dim, config.linear_conv_kernel_dim
        # transformers' registration order: peft's "all-linear" order follows it
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, K, groups=conv_dim, bias=False, padding=K - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads).uniform_(0.01, 16).log())
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, C, bias=False)
        self.in_proj_qkv = nn.Linear(C, conv_dim, bias=False)
        self.in_proj_z = nn.Linear(C, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(C, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(C, self.num_v_heads, bias=False)

    def mix(self, qkv, g, beta, past=None):
        """Conv then the rule over one stretch of tokens: qkv (B, T, 2 Kd + Vd), g, beta (B, T,
        Hv) -> (B, T, Hv, Dv) and the (conv state, recurrent state) after it."""
        B, T, _ = qkv.shape
        conv_state, state = (None, None) if past is None else past
        x, conv_state = causal_conv1d(qkv.transpose(1, 2), self.conv1d.weight, None, conv_state,
                                      activation=F.silu)
        q, k, v = x.transpose(1, 2).split((self.key_dim, self.key_dim, self.value_dim), dim=-1)
        q, k = q.reshape(B, T, -1, self.head_k_dim), k.reshape(B, T, -1, self.head_k_dim)
        v = v.reshape(B, T, -1, self.head_v_dim)
        if state is not None and T == 1:  # a generation step: the recurrent form
            o, state = recurrent_gated_delta_rule(q, k, v, g, beta, state)
        else:
            o, state = chunk_gated_delta_rule(q, k, v, g, beta, self.chunk_size, state)
        return o, (conv_state, state)

    def forward(self, x, mask=None, past=None):
        """(B, T, C) -> (B, T, C) and the (conv state, recurrent state) cache.
        mask: None or (keep (B, T) with 0 at padding, or None; per-row document lengths or None)."""
        keep, docs = (None, None) if mask is None else mask
        if keep is not None:  # padding enters as zeros: it leaves the state alone
            x = (x * keep[:, :, None]).to(x.dtype)
        B, T, _ = x.shape
        qkv = self.in_proj_qkv(x)
        z = self.in_proj_z(x)
        beta = self.in_proj_b(x).sigmoid()
        # per-head decay g = -exp(A_log) * softplus(a + dt_bias) < 0, in fp32
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        if docs is None:
            o, cache = self.mix(qkv, g, beta, past)
        else:  # packed documents: each alone, as if in its own row
            o, cache = run_documents(lambda *t: self.mix(*t)[0], docs, qkv, g, beta), None
        o = self.norm(o.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(o.reshape(B, T, -1)), cache

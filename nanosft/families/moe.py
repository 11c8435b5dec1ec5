"""The sparse mixture-of-experts block: a router sends each token to k of E expert MLPs.

The router scores every token against every expert (a linear layer, no bias for Qwen3-MoE), keeps
the top k and weights their outputs; each expert is a SwiGLU MLP whose weights are one slice of two
3-D parameters, `gate_up_proj` (E, 2 I, C) and `down_proj` (E, C, I), transformers 5's layout, so
checkpoints move both ways unrenamed. Tokens are dispatched by gathering the rows each expert got
and combined with `index_add_` back into their places. `load_balancing_loss` is Switch
Transformer's auxiliary loss over the routers' logits of every layer; `MoeCausalLM` adds it,
times `router_aux_loss_coef`, to the loss when `output_router_logits` asks for it.
Papers: Switch Transformer 2101.03961 (the aux loss), Mixtral 2401.04088 (top-k SwiGLU experts).
"""

import re
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from nanosft.adapter_files import linear_layer_names
from nanosft.expert_lora import moe_target_conversion
from nanosft.model import CausalLM, CausalLMOutput


@dataclass
class MoeCausalLMOutput(CausalLMOutput):
    """CausalLMOutput plus the router outputs. Mirrors: transformers MoeCausalLMOutputWithPast"""

    aux_loss: torch.Tensor | None = None
    router_logits: tuple | None = None  # one (N, E) tensor per MoE layer


class TopKRouter(nn.Module):
    """Each token's k experts and their weights: softmax over all E router logits, the k largest,
    renormalised to sum 1 when `norm_topk_prob`. Mirrors: transformers Qwen3MoeTopKRouter"""

    def __init__(self, config):
        super().__init__()
        self.top_k, self.num_experts = config.num_experts_per_tok, config.num_experts
        self.norm_topk_prob = config.norm_topk_prob
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))

    def forward(self, x):
        """(N, C) -> router_logits (N, E), top-k weights (N, k), top-k expert ids (N, k)."""
        router_logits = F.linear(x, self.weight)
        probs = F.softmax(router_logits, dim=-1, dtype=torch.float)  # fp32 even in bf16
        top_value, top_index = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:  # Qwen3-MoE checkpoints: the k weights sum to 1
            top_value = top_value / top_value.sum(dim=-1, keepdim=True)
        return router_logits, top_value.to(router_logits.dtype), top_index


class Experts(nn.Module):
    """E SwiGLU MLPs held as two 3-D parameters: expert e is gate_up_proj[e] (2 I, C), chunked
    [gate | up], and down_proj[e] (C, I). Mirrors: transformers Qwen3MoeExperts"""

    def __init__(self, config, intermediate_size):
        super().__init__()
        E, C, I = config.num_experts, config.hidden_size, intermediate_size
        self.num_experts = E
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, C))
        self.down_proj = nn.Parameter(torch.empty(E, C, I))

    def linear(self, x, name, e):
        """x through expert e's slice of the 3-D parameter `name`: (n, in) -> (n, out).
        (nf4_experts.NF4Experts reads that slice from 4-bit codes instead.)"""
        return F.linear(x, getattr(self, name)[e])

    def expert(self, x, e):
        """Expert e on its tokens: (n, C) -> (n, C)."""
        gate, up = self.linear(x, "gate_up_proj", e).chunk(2, dim=-1)
        return self.linear(F.silu(gate) * up, "down_proj", e)

    def forward(self, x, top_k_index, top_k_weights):
        """(N, C) tokens, their (N, k) expert ids and weights -> (N, C): sum over each token's k
        experts of weight * expert(token)."""
        out = torch.zeros_like(x)
        for e in top_k_index.unique().tolist():  # ascending; an expert no token chose is skipped
            token_idx, k_pos = torch.where(top_k_index == e)  # dispatch: the rows expert e got
            y = self.expert(x[token_idx], e) * top_k_weights[token_idx, k_pos, None]
            out.index_add_(0, token_idx, y.to(out.dtype))  # combine: back into their rows
        return out


class SparseMoeBlock(nn.Module):
    """The MLP of an MoE layer: route, dispatch to the chosen experts, combine. Keeps this
    forward's router logits for the auxiliary loss. Mirrors: transformers Qwen3MoeSparseMoeBlock"""

    def __init__(self, config):
        super().__init__()
        self.experts = Experts(config, config.moe_intermediate_size)
        self.gate = TopKRouter(config)
        self.router_logits = None  # a list while MoeCausalLM.forward collects, else None

    def forward(self, h):
        """(B, T, C) -> (B, T, C); every token independently."""
        B, T, C = h.shape
        x = h.reshape(-1, C)
        router_logits, top_k_weights, top_k_index = self.gate(x)
        self.keep(router_logits)
        return self.experts(x, top_k_index, top_k_weights).reshape(B, T, C)

    def keep(self, router_logits):
        """Hand (B * T, E) router logits to MoeCausalLM.forward, which set a list to collect them
        (not a checkpointed layer's recompute in backward: the list is gone by then)."""
        if self.router_logits is not None:
            self.router_logits.append(router_logits)


def load_balancing_loss(router_logits, num_experts, top_k, attention_mask=None):
    """Switch Transformer's auxiliary loss: E * sum_e f_e * P_e, where f_e is how many of each
    token's k picks went to expert e and P_e its mean router probability, both averaged over the
    real tokens of every layer (attention_mask (B, T) or None: all).
    Mirrors: transformers load_balancing_loss_func (Mixtral's, which TRL's fused head calls)"""
    if not router_logits:
        return 0
    device = router_logits[0].device
    picks = torch.zeros(num_experts, device=device)  # sum over tokens of picks per expert
    probs = torch.zeros(num_experts, device=device)  # sum over tokens of router probabilities
    rows = 0.0
    for logits in router_logits:  # (N, E) per layer
        p = F.softmax(logits.to(device), dim=-1)
        w = torch.ones(len(p), device=device) if attention_mask is None else attention_mask
        w = w.reshape(-1).to(device=device, dtype=torch.float32)  # (N,) 1 for a real token
        top_index = torch.topk(p, top_k, dim=-1).indices  # (N, k)
        picks = picks.scatter_add(0, top_index.reshape(-1), w.repeat_interleave(top_k))
        probs = probs + (p.float() * w[:, None]).sum(0)
        rows = rows + w.sum()
    return torch.sum((picks / rows) * (probs / rows)) * num_experts


# a checkpoint's per-expert key: (layer prefix ending in .experts, expert id, projection)
EXPERT_KEY = re.compile(r"(.+\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def _expert_groups(index):
    """{3-D parameter key: {(projection, expert id): file key}} of the per-expert file keys."""
    groups = {}
    for key in index:
        m = EXPERT_KEY.fullmatch(key)
        if m:
            target = m[1] + (".down_proj" if m[3] == "down_proj" else ".gate_up_proj")
            groups.setdefault(target, {})[(m[3], int(m[2]))] = key
    return groups


class PerExpertFiles:
    """The Hub's and transformers' save_pretrained spelling of expert weights, one 2-D linear per
    expert (`experts.{e}.gate_proj.weight` (I, C), up_proj, down_proj (C, I)), read into and written
    from the 3-D parameters: gate_up_proj = [stack(gate) | stack(up)] along dim 1.
    Mirrors: transformers conversion_mapping "qwen2_moe" (MergeModulelist, Concatenate)"""

    @staticmethod
    def model_index(index):
        """The file index as the model's keys: each group of per-expert entries as one entry
        with the stacked shape (for hub.check_state_dict)."""
        out = {k: v for k, v in index.items() if not EXPERT_KEY.fullmatch(k)}
        for target, parts in _expert_groups(index).items():
            E = 1 + max(e for _, e in parts)
            info = index[next(iter(parts.values()))]
            rows, cols = info.shape
            shape = (E, 2 * rows, cols) if target.endswith("gate_up_proj") else (E, rows, cols)
            if len(parts) != E * (2 if target.endswith("gate_up_proj") else 1):
                shape = (len(parts), *shape)  # an expert or a projection missing: a shape error
            out[target] = SimpleNamespace(shape=torch.Size(shape), dtype=info.dtype)
        return out

    @staticmethod
    def merge(tensors, index):
        """(key, tensor) pairs with each layer's per-expert tensors stacked into its 3-D
        parameters as soon as the last of them is read."""
        groups = _expert_groups(index)
        target_of = {key: t for t, parts in groups.items() for key in parts.values()}
        read = {}
        for key, tensor in tensors:
            if key not in target_of:
                yield key, tensor
                continue
            target = target_of[key]
            m = EXPERT_KEY.fullmatch(key)
            read.setdefault(target, {})[(m[3], int(m[2]))] = tensor
            if len(read[target]) < len(groups[target]):
                continue
            parts = read.pop(target)
            E = len(parts) // (2 if target.endswith("gate_up_proj") else 1)
            if target.endswith("gate_up_proj"):
                gate = torch.stack([parts[("gate_proj", e)] for e in range(E)])  # (E, I, C)
                up = torch.stack([parts[("up_proj", e)] for e in range(E)])
                yield target, torch.cat((gate, up), dim=1)  # (E, 2 I, C)
            else:
                yield target, torch.stack([parts[("down_proj", e)] for e in range(E)])

    @staticmethod
    def split(state_dict):
        """The state dict with every 3-D expert parameter written as per-expert 2-D weights."""
        out = {}
        for key, t in state_dict.items():
            if key.endswith(".experts.gate_up_proj"):
                gate, up = t.chunk(2, dim=1)
                for e in range(len(t)):
                    out[f"{key[:-len('gate_up_proj')]}{e}.gate_proj.weight"] = gate[e]
                    out[f"{key[:-len('gate_up_proj')]}{e}.up_proj.weight"] = up[e]
            elif key.endswith(".experts.down_proj"):
                for e in range(len(t)):
                    out[f"{key[:-len('down_proj')]}{e}.down_proj.weight"] = t[e]
            else:
                out[key] = t
        return out


def init_moe_weights(module, std):
    """Normal(0, std) router and expert weights (their zeros / empty tensors at construction).
    Mirrors: transformers Qwen3MoePreTrainedModel._init_weights"""
    for name, p in module.named_parameters(recurse=False):
        if isinstance(module, Experts) or isinstance(module, TopKRouter) and name == "weight":
            nn.init.normal_(p, mean=0.0, std=std)


class MoeCausalLM(CausalLM):
    """CausalLM whose output carries the routers' logits and the auxiliary loss, added to the
    loss times router_aux_loss_coef when output_router_logits (argument, else the config's).
    Mirrors: transformers Qwen3MoeForCausalLM.forward"""

    checkpoint_conversion = PerExpertFiles

    def convert_peft_config(self, config):
        """A LoraConfig naming transformers-4's expert linears (or "all-linear") rewritten in place
        to target the 3-D experts and the router, as peft does for this model type.
        Mirrors: peft convert_peft_config_for_transformers"""
        leaves = {name.rsplit(".", 1)[-1] for name in linear_layer_names(self)}
        moe_target_conversion(config, self.config.model_type, leaves)

    def _init_weights(self, module):
        super()._init_weights(module)
        init_moe_weights(module, self.config.initializer_range)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None,
                labels=None, num_items_in_batch=None, past_key_values=None, use_cache=False,
                fused_lm_head=False, output_router_logits=None, **kwargs):
        """CausalLM.forward, then the routers' logits of this forward and, when asked, the aux
        loss (over attention_mask's real tokens)."""
        blocks = [m for m in self.modules() if isinstance(m, SparseMoeBlock)]
        for m in blocks:
            m.router_logits = []
        try:
            out = super().forward(input_ids, attention_mask, position_ids, inputs_embeds, labels,
                                  num_items_in_batch, past_key_values, use_cache, fused_lm_head)
            router_logits = tuple(logits for m in blocks for logits in m.router_logits)
        finally:
            for m in blocks:
                m.router_logits = None  # no graph kept alive past this forward
        out = MoeCausalLMOutput(**vars(out))
        if output_router_logits is None:
            output_router_logits = self.config.output_router_logits
        if not output_router_logits:
            return out
        out.router_logits = router_logits
        if not hasattr(self.config, "router_aux_loss_coef"):
            return out  # GLM-4-MoE: transformers computes no auxiliary loss for it
        mask = attention_mask
        if mask is not None and len(router_logits[0]) != mask.numel():
            mask = None  # nanosft.fast.unpad ran the layers on the real tokens only
        out.aux_loss = load_balancing_loss(router_logits, self.config.num_experts,
                                           self.config.num_experts_per_tok, mask)
        if out.loss is not None:
            out.loss = out.loss + self.config.router_aux_loss_coef * out.aux_loss
        return out

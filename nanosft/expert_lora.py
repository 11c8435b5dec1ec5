"""LoRA on parameters (peft's `target_parameters`): the 3-D expert weights and the router's.

peft 0.21's ParamWrapper wraps the module that holds a targeted parameter (one wrapper per
parameter, nested when a module has two: `experts` -> down_proj's wrapper -> gate_up_proj's ->
the Experts module), and for the length of a forward swaps the parameter for W + scaling * delta
(torch's parametrize). A 3-D parameter (E, out, in) gets one rank-r pair per expert, stored in two
plain linears whose weights hold all experts: A (r E, in), rows e r ... (e + 1) r for expert e;
B (out, r E), columns r_i E + e. `moe_target_conversion` is peft's rewrite of a Qwen3-MoE /
GLM-4-MoE config whose target_modules name the transformers-4 expert linears (or "all-linear").
Paper: LoRA 2106.09685.
"""

import math
import re

import torch
from torch import nn
from torch.nn.utils import parametrize

from nanosft.adapter_files import pattern_value
from nanosft.lora import adapters_to_merge, peft_repr

# model types whose experts transformers 5 fused (conversion pattern "qwen2_moe"): leaf name in a
# target_modules list -> the parameter peft targets instead
MOE_TARGETS = {"gate": "gate.weight", "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj",
               "down_proj": "down_proj"}
MOE_CONVERTED_TYPES = ("qwen3_moe", "glm4_moe")


def moe_target_conversion(config, model_type, linear_leaves):
    """Rewrite `config` in place as peft does for these model types: "all-linear" is every linear
    leaf name plus the v4 expert and router names; those names move to target_parameters, and
    gate_proj + up_proj (fused) get rank and alpha doubled by pattern.
    Mirrors: peft _convert_peft_config_moe, _resolve_string_target_modules ("all-linear")"""
    if model_type not in MOE_CONVERTED_TYPES:
        return
    target = config.target_modules
    if isinstance(target, str):
        if target.lower() != "all-linear":
            return  # a regex: left as it is (peft probes it against the v4 names)
        target = set(linear_leaves) | set(MOE_TARGETS)
    parameters, modules, fused = set(config.target_parameters or []), set(), set()
    for t in target or []:
        old = next((o for o in MOE_TARGETS if t == o or t.endswith("." + o)), None)
        if old is None:
            modules.add(t)
            continue
        parameters.add(MOE_TARGETS[old])
        fused |= {old} & {"gate_proj", "up_proj"}
    if len(fused) == 1:
        raise ValueError(f"LoraConfig.target_modules names {fused.pop()} without its partner: "
                         "gate_proj and up_proj are fused into gate_up_proj; name both")
    if fused:
        config.rank_pattern = {**config.rank_pattern, r".*\.gate_up_proj": 2 * config.r}
        config.alpha_pattern = {**config.alpha_pattern, r".*\.gate_up_proj": 2 * config.lora_alpha}
    config.target_parameters = sorted(parameters)
    config.target_modules = sorted(modules)


class FactorsProxy(nn.Module):
    """W (E, out, in) -> W + scaling * lhs @ rhs, one baddbmm, in W's dtype.
    Mirrors: peft _LoraFactorsProxy"""

    def __init__(self, lhs, rhs, scaling):
        super().__init__()
        self.lhs, self.rhs, self.scaling = lhs, rhs, scaling

    def forward(self, W):
        with torch.autocast(device_type=W.device.type, enabled=False):
            return torch.baddbmm(W, self.lhs, self.rhs, alpha=self.scaling)


class DeltaProxy(nn.Module):
    """W -> W + delta. Mirrors: peft _LoraParameterProxy (fp32 / bf16 weights)"""

    def __init__(self, delta):
        super().__init__()
        self.delta = delta

    def forward(self, W):
        return W + self.delta


class ParamWrapper(nn.Module):
    """LoRA on one parameter of the wrapped module: during forward it reads W + the active
    adapters' scaling * B A (per expert for a 3-D W). Mirrors: peft lora.ParamWrapper
    Differs: no dropout, DoRA or bias, which peft refuses here too.

    Args:
        base_layer: the module holding the parameter, or another ParamWrapper around it.
        parameter_name: the parameter's name on that module ("gate_up_proj", "weight").
        r, lora_alpha: the rank per expert and the scale numerator (scaling = lora_alpha / r).
    """

    adapter_layer_names = ("lora_A", "lora_B")
    other_param_names = ("r", "lora_alpha", "scaling")

    def __init__(self, base_layer, parameter_name, adapter_name="default", r=8, lora_alpha=8,
                 use_rslora=False, init_lora_weights=True):
        super().__init__()
        self.base_layer, self.parameter_name = base_layer, parameter_name
        shape = self.get_param().shape
        # (E, out, in) as F.linear reads each expert's slice; (E, in, out) where x @ W[e] does
        self.is_transposed = getattr(self.get_base_layer(), "is_transposed", False)
        if len(shape) == 3 and self.is_transposed:  # gpt-oss
            self.num_experts, self.in_features, self.out_features = shape
        elif len(shape) == 3:
            self.num_experts, self.out_features, self.in_features = shape
        else:
            self.num_experts, (self.out_features, self.in_features) = 1, shape
        self.lora_A, self.lora_B = nn.ModuleDict(), nn.ModuleDict()
        self.r, self.lora_alpha, self.scaling = {}, {}, {}
        self.active_adapters, self.merged_adapters = [adapter_name], []
        self.disable_adapters = False
        self.add_adapter(adapter_name, r, lora_alpha, use_rslora, init_lora_weights)

    def add_adapter(self, adapter_name, r=8, lora_alpha=8, use_rslora=False,
                    init_lora_weights=True):
        """One more adapter on the same parameter (it stays inactive until set_adapter).
        Mirrors: peft ParamWrapper.update_layer"""
        E = self.num_experts
        # RNG order as peft: A's and B's constructor draws, then A drawn again
        self.lora_A[adapter_name] = nn.Linear(self.in_features, r * E, bias=False)
        self.lora_B[adapter_name] = nn.Linear(r * E, self.out_features, bias=False)
        self.r[adapter_name], self.lora_alpha[adapter_name] = r, lora_alpha
        self.scaling[adapter_name] = lora_alpha / math.sqrt(r) if use_rslora else lora_alpha / r
        if init_lora_weights is True:
            nn.init.kaiming_uniform_(self.lora_A[adapter_name].weight, a=math.sqrt(5))
        elif init_lora_weights == "gaussian":
            nn.init.normal_(self.lora_A[adapter_name].weight, std=1 / r)
        if init_lora_weights is not False:
            nn.init.zeros_(self.lora_B[adapter_name].weight)
        param = self.get_param()
        for linear in (self.lora_A[adapter_name], self.lora_B[adapter_name]):
            linear.to(param.device, param.dtype if param.is_floating_point() else None)
        self.set_adapter(self.active_adapters)

    def set_adapter(self, adapter_names):
        """Make `adapter_names` active; only their A and B require grad.
        Mirrors: peft BaseTunerLayer.set_adapter"""
        names = [adapter_names] if isinstance(adapter_names, str) else list(adapter_names)
        for layer in (self.lora_A, self.lora_B):
            for key, module in layer.items():
                module.requires_grad_(key in names)
        self.active_adapters = names

    def delete_adapter(self, adapter_name):
        """Drop one adapter's A and B. Mirrors: peft BaseTunerLayer.delete_adapter"""
        for d in (self.lora_A, self.lora_B, self.r, self.lora_alpha, self.scaling):
            if adapter_name in d:
                del d[adapter_name]
        self.active_adapters = [a for a in self.active_adapters if a != adapter_name]

    def __repr__(self):  # the parameter named first, as peft prints it
        return peft_repr(self, "ParamWrapper", f"\n  parameter_name='{self.parameter_name}',")

    def get_base_layer(self):
        """The module that holds the parameter (under any nested wrappers)."""
        module = self.base_layer
        while isinstance(module, ParamWrapper):
            module = module.base_layer
        return module

    def get_param(self):
        return getattr(self.get_base_layer(), self.parameter_name)

    @property
    def merged(self):
        return bool(self.merged_adapters)

    def enable_adapters(self, enabled):
        """Switch the delta on or off (peft's disable_adapter context)."""
        self.disable_adapters = not enabled

    def get_delta_factors(self, adapter):
        """(lhs, rhs, scaling): expert e's delta is scaling lhs[e] @ rhs[e], W[e]'s shape.
        Mirrors: peft ParamWrapper.get_delta_factors"""
        A, B, E = self.lora_A[adapter].weight, self.lora_B[adapter].weight, self.num_experts
        rhs = A.reshape(E, -1, A.shape[-1])  # rows e r ... (e + 1) r
        lhs = B.reshape(B.shape[0], -1, E).permute(2, 0, 1)  # columns r_i E + e
        if self.is_transposed:  # W[e] is (in, out): delta[e] = A_e^T B_e^T
            lhs, rhs = rhs.transpose(-2, -1), lhs.transpose(-2, -1)
        dtype = self.get_param().dtype
        return lhs.to(dtype), rhs.to(dtype), self.scaling[adapter]

    def get_delta_weight(self, adapter):
        """The delta as the parameter's shape. Mirrors: peft ParamWrapper.get_delta_weight"""
        if self.num_experts == 1:
            A, B = self.lora_A[adapter].weight, self.lora_B[adapter].weight
            delta = (B @ A) * self.scaling[adapter]
        else:
            lhs, rhs, scaling = self.get_delta_factors(adapter)
            delta = (lhs @ rhs) * scaling
        return delta.to(self.get_param().dtype)

    def forward(self, *args, **kwargs):
        """The wrapped module's forward, reading W + the active adapters' deltas for this
        parameter. Mirrors: peft ParamWrapper._activate_lora"""
        adapters = [a for a in self.active_adapters if a in self.lora_A]
        if self.disable_adapters and self.merged:  # disabled: the base parameter (peft's forward)
            self.unmerge()
        if self.disable_adapters or self.merged or not adapters:
            return self.base_layer(*args, **kwargs)
        if len(adapters) == 1 and self.num_experts > 1:  # the factors: no E x out x in delta
            proxy = FactorsProxy(*self.get_delta_factors(adapters[0]))
        else:
            proxy = DeltaProxy(sum(self.get_delta_weight(a) for a in adapters))
        module, name = self.get_base_layer(), self.parameter_name
        requires_grad = getattr(module, name).requires_grad
        parametrize.register_parametrization(module, name, proxy)
        module.parametrizations[name].original.requires_grad_(requires_grad)
        try:
            with parametrize.cached():  # one W + delta per forward, however often it is read
                return self.base_layer(*args, **kwargs)
        finally:
            parametrize.remove_parametrizations(module, name, leave_parametrized=False)

    def merge(self, safe_merge=False, adapter_names=None):
        """Fold the delta into the parameter (the active adapters, or `adapter_names`; one
        already merged is skipped with peft's warning). Mirrors: peft ParamWrapper.merge"""
        for adapter in adapters_to_merge(self, adapter_names):
            if adapter not in self.lora_A:
                continue
            param, delta = self.get_param(), self.get_delta_weight(adapter)
            if 0 in param.stride():  # an NF4 expert placeholder (nf4_experts): the delta its own
                param.data = param.data + delta
            else:
                param.data += delta
            self.merged_adapters.append(adapter)

    def unmerge(self):
        """Take it out again. Mirrors: peft ParamWrapper.unmerge"""
        while self.merged_adapters:
            self.get_param().data -= self.get_delta_weight(self.merged_adapters.pop())


def _unwrapped_name(module_name):
    # a module inside adapter layers is named with ".base_layer" (one per wrapper): without them
    # it has the name a target_parameters entry is written against
    while ".base_layer" in module_name:
        head, _, tail = module_name.rpartition(".base_layer")
        module_name = head + tail
    return module_name


def find_target_parameters(model, target_parameters):
    """(module name, parameter name) of each targeted parameter in named_modules order, a module
    named without the adapter layers around it. Mirrors: peft BaseTuner._inject_parameters (its
    matching, strip_base_layer_from_name)"""
    targets = sorted(set(target_parameters))
    found = []
    for module_name, module in model.named_modules():
        if isinstance(module, ParamWrapper):
            continue
        module_name = _unwrapped_name(module_name)
        for param_name, _ in module.named_parameters(recurse=False):
            key = f"{module_name}.{param_name}"
            if key in targets or any(key.endswith("." + t) for t in targets):
                found.append((module_name, param_name))
    return found


def no_parameter_message(entry, owner, parameter_names):
    """The error for a target_parameters entry that names none of `parameter_names` (of `owner`),
    listing them with layer numbers as N."""
    names = dict.fromkeys(re.sub(r"\.\d+\.", ".N.", n.replace(".base_layer", ""))
                          for n in parameter_names if ".lora_" not in n)
    return (f"LoraConfig.target_parameters entry {entry!r} matches no parameter of {owner}: an "
            "entry is a parameter's full name or its ending after a dot (e.g. "
            f"'mlp.experts.gate_up_proj'), and this model's parameters are {', '.join(names)}; fix "
            "the entry (--target_parameters / --lora_target_parameters on the command line)")


def check_each_target_parameter(model, target_parameters, found, nothing_else=False):
    """Refuse an entry of target_parameters that names no parameter. Mirrors: peft's
    "target_parameters=... were set but no parameter was matched" (NoMatchingPeftModuleError when
    nothing else matched either)
    Differs: per entry and always an error, as nanosft's target_modules check."""
    keys = [f"{module_name}.{param_name}" for module_name, param_name in found]
    for t in target_parameters:
        if not any(k == t or k.endswith("." + t) for k in keys):
            names = (n for n, _ in model.named_parameters())
            lead = ("No `target_modules` passed but also no `target_parameters` found. Please "
                    "check the values for these arguments. ") if nothing_else and not found else ""
            raise ValueError(lead + no_parameter_message(t, type(model).__name__, names))


def inject_parameter_adapters(model, config, adapter_name, replace_module):
    """Wrap every targeted parameter's module in a ParamWrapper (the second parameter of a module
    wraps the first's wrapper). Mirrors: peft BaseTuner._inject_parameters"""
    found = find_target_parameters(model, config.target_parameters)
    check_each_target_parameter(model, config.target_parameters, found,
                                nothing_else=not config.target_modules)
    for module_name, param_name in found:
        target = model.get_submodule(module_name)
        if hasattr(target, "base_layer") and not isinstance(target, ParamWrapper):
            base = target.get_base_layer()
            raise ValueError(f"Trying to wrap an `nn.Parameter` of layer '{module_name}' of type "
                             f"{type(base).__name__}, which is not a valid target. Make sure that "
                             "this layer is not also targeted with `target_modules`. For some "
                             "models, PEFT will do this automatically, try setting "
                             "`target_modules=[]` to prevent it.")
        key = f"{module_name}.{param_name}"
        settings = dict(r=pattern_value(config.rank_pattern, key, config.r),
                        lora_alpha=pattern_value(config.alpha_pattern, key, config.lora_alpha),
                        use_rslora=config.use_rslora, init_lora_weights=config.init_lora_weights)
        existing = target
        while isinstance(existing, ParamWrapper) and existing.parameter_name != param_name:
            existing = existing.base_layer
        if isinstance(existing, ParamWrapper):  # a further adapter on an already wrapped parameter
            existing.add_adapter(adapter_name, **settings)
            continue
        # the outermost wrapper so far is wrapped again (one wrapper per parameter)
        layer = ParamWrapper(target, param_name, adapter_name, **settings)
        replace_module(model, module_name, layer)


def check_same_target_parameters(configs, config):
    """Refuse a further adapter whose target_parameters differ from another adapter's: which
    parameter an A and B belong to is only their wrapper's nesting depth.
    Mirrors: peft LoraModel._check_new_adapter_config (target_parameters)"""
    if not config.target_parameters:
        return
    mine = set(config.target_parameters)
    for name, other in configs.items():
        theirs = getattr(other, "target_parameters", None)
        if other is not config and theirs and set(theirs) != mine:
            raise ValueError("When using multiple adapters with `target_parameters`, all adapters "
                             f"must target the same set of parameters, but got {sorted(mine)} for "
                             f"the new adapter and {sorted(theirs)} for adapter '{name}'.")

"""The memory ledger: where a fine-tuning run's bytes go, predicted from the config, and measured.

QLoRA's arithmetic, with and without gradient checkpointing. `estimate_memory(config, plan)` counts,
without building a model, the base weights (fp32 / bf16 / NF4 with absmax and double-quantization
tables), trainable parameters, gradients, optimizer states, the tensors each decoder layer saves for
backward (with and without checkpointing) and the logits / loss buffers (B x T x V), per FSDP rank.
The plan and shapes live in nanosft.memory.plan, the per-layer saves in nanosft.memory.activations
(Llama's layer and its close variants) and nanosft.memory.families (OLMo 3, Cohere 2, GPT-NeoX,
the mixture-of-experts layers and NF4 experts, LFM2, Gemma 4, Qwen3.5), the measuring tools
(`MemoryTracker`, `PeakMemory`, ...) in nanosft.memory.measure; their names import from here too.
Papers: QLoRA 2305.14314 (2-3), ZeRO / FSDP 1910.02054.
"""

import dataclasses
import math

from nanosft.fast.lm_head import LOSS_CHUNK_SIZE
from nanosft.memory import families
from nanosft.memory.activations import head_saved_bytes, layer_saved_bytes
from nanosft.memory.measure import (  # noqa: F401 (measuring tools, re-exported)
    MemoryTracker, PeakMemory, count_saved_tensors, cpu_memory, cpu_peak_reset, unique_bytes)
from nanosft.memory.plan import (  # noqa: F401 (the plan and shapes, re-exported)
    DTYPE_BYTES, LAYER_LINEARS, OPTIMIZERS, MemoryPlan, _fail, layer_linears, lora_targets,
    nf4_quantizable, parameter_shapes, parameter_targets)

MiB = 2**20
BNB_MIN_8BIT_SIZE = 4096  # bitsandbytes keeps smaller tensors' optimizer states in fp32
BNB_OPTIM_BLOCKSIZE = 256  # one fp32 absmax per 256 values of an 8-bit optimizer state
NESTED_BLOCKSIZE = 256  # double quantization: one fp32 absmax per 256 first-level absmax values
# families whose layers the ledger does not model: refused by name rather than predicted as Llama's
# (none today: a family added to nanosft.families without its walk here belongs in this list)
NOT_MODELLED = ()
# the families whose (E, out, in) experts families.nf4_experts.quantize_experts stores as NF4
NF4_EXPERT_TYPES = ("qwen3_moe", "glm4_moe", "gpt_oss", "qwen3_5_moe_text", "gemma4_text")


# ----------------------------------------------------------------------------- weights
def nf4_bytes(numel, blocksize=64, double_quant=True):
    """Bytes of one NF4 weight: packed 4-bit codes, absmax per block, the 16-value code table,
    and with double quantization uint8 absmax + fp32 absmax per 256 blocks + offset + the
    256-value fp32 map of the second level. QLoRA 3 | Mirrors: bitsandbytes quantize_4bit"""
    blocks = math.ceil(numel / blocksize)
    codes = (numel + 1) // 2 + 16 * 4  # two codes a byte; fp32 quant_map of the 16 NF4 levels
    if not double_quant:
        return codes + 4 * blocks  # one fp32 absmax per block
    # uint8 absmax per block, fp32 absmax per 256 blocks, fp32 offset, (256,) fp32 nested map
    return codes + blocks + 4 * math.ceil(blocks / NESTED_BLOCKSIZE) + 4 + 256 * 4


def _shard(nbytes, shape, world):
    # FSDP2 pads dim 0 to a multiple of the world size and keeps one slice per rank
    if world == 1 or not shape:
        return nbytes
    return nbytes * math.ceil(shape[0] / world) // shape[0]


# ----------------------------------------------------------------------------- optimizer
def optimizer_state_bytes(numel, dtype_bytes, optim, optim_args=None, embedding=False):
    """Bytes of one parameter tensor's optimizer state (the shared 8-bit maps are added once).
    Mirrors: torch AdamW (exp_avg, exp_avg_sq, fp32 step), bitsandbytes
    Optimizer2State.init_state (uint8 states, fp32 absmax per 256), torch SGD momentum_buffer
    `embedding`: 32-bit states, as transformers registers nn.Embedding with bitsandbytes."""
    if optim in ("adamw_torch", "adamw_torch_fused"):
        return 2 * numel * dtype_bytes + 4  # step is a 0-d fp32 tensor
    if optim in ("adamw_bnb_8bit", "paged_adamw_8bit"):
        if numel < BNB_MIN_8BIT_SIZE or embedding:
            return 2 * numel * 4
        return 2 * numel + 2 * 4 * math.ceil(numel / BNB_OPTIM_BLOCKSIZE)
    items = (optim_args or "").replace(" ", "").split(",")
    momentum = float(dict(kv.split("=") for kv in items if kv).get("momentum", 0.0))
    return numel * dtype_bytes if momentum else 0


# ----------------------------------------------------------------------------- the ledger
@dataclasses.dataclass
class MemoryLedger:
    """Predicted bytes per part of one training step on one rank; `format()` prints the table.
    Mirrors: accelerate estimate-memory (which covers weights and Adam only)"""

    rows: dict
    notes: dict
    per_layer: list  # {tensor: bytes} each decoder layer saves for backward, no checkpointing
    plan: MemoryPlan

    @property
    def total(self):
        """Sum of the rows: an upper bound of the peak (grads and activations overlap)."""
        return sum(self.rows.values())

    def format(self, measured=None):
        """The ledger as text, a row a part, MiB, a note; `measured` {row: bytes} adds a column."""
        lines = [f"{'part':<34}{'predicted':>14}" + (f"{'measured':>14}" if measured else "")]
        for name, value in self.rows.items():
            extra = ""
            if measured is not None:
                m = measured.get(name)
                extra = f"{m / MiB:>10.3f} MiB" if m is not None else f"{'-':>14}"
            lines.append(f"{name:<34}{value / MiB:>10.3f} MiB{extra}  {self.notes.get(name, '')}")
        lines.append(f"{'total (upper bound of the peak)':<34}{self.total / MiB:>10.3f} MiB")
        return "\n".join(lines)


def estimate_memory(config, plan, device_type="cpu"):
    """Predict the memory of one training step of `config` under `plan`, per part, per rank.
    Mirrors: the tensors transformers Trainer + peft + bitsandbytes keep alive
    Differs: predicted from shapes alone, so a 70B config costs nothing to ask about."""
    if config.model_type in NOT_MODELLED:
        raise ValueError(f"the memory ledger does not model model_type={config.model_type!r} "
                         "yet; measure a step instead (nanosft.memory.PeakMemory)")
    if plan.nf4_experts and config.model_type not in NF4_EXPERT_TYPES:
        _fail("nf4_experts", True, f"quantize_experts stores the experts of "
              f"{', '.join(NF4_EXPERT_TYPES)} only; model_type={config.model_type!r} keeps "
              "its experts in float: drop nf4_experts")
    from nanosft.families.nf4_experts import nf4_nbytes

    wd, world = DTYPE_BYTES[plan.dtype], plan.fsdp
    targets, param_targets = lora_targets(config, plan), parameter_targets(config, plan)
    if not plan.full and not targets and not param_targets:
        _fail("target_modules", plan.target_modules,
              f"it matches none of {', '.join(layer_linears(config))}")
    ab = DTYPE_BYTES[plan.adapter_dtype]
    base = trainable = grads = optim = 0
    any_8bit = False
    n_quant = held = 0
    # nf4_held: each 4-bit weight dequantized once per step and kept, in the weights' dtype and,
    # under bf16 autocast over a wider base, in bf16 too (forward in bf16, backward in the stored
    # dtype): nanosft.fast.nf4.hold_dequantized
    held_bytes = wd + (2 if plan.bf16 and wd != 2 else 0)
    for name, shape in parameter_shapes(config):
        numel = math.prod(shape)
        lin = name.split(".")[-2]
        quant = (plan.load_in_4bit and lin in layer_linears(config) and name.endswith("weight")
                 and nf4_quantizable(shape, device_type))
        n_quant += quant
        held += quant * numel * held_bytes
        nf4_expert = plan.nf4_experts and lin == "experts" and len(shape) == 3
        if nf4_expert:  # NF4 codes + statistics per expert, the zero placeholder's one value
            nbytes = _shard(nf4_nbytes(shape, plan.bnb_4bit_use_double_quant) + wd, shape, world)
        elif quant:  # FSDP shards the packed (numel / 2, 1) codes
            nbytes = nf4_bytes(numel, double_quant=plan.bnb_4bit_use_double_quant)
            nbytes = _shard(nbytes, ((numel + 1) // 2, 1), world)
        else:
            nbytes = _shard(numel * wd, shape, world)
        if plan.full and not nf4_expert:
            trainable += nbytes
            grads += nbytes
            embedding = name.endswith(("embed_tokens.weight", "embed_in.weight"))
            state = optimizer_state_bytes(numel, wd, plan.optim, plan.optim_args, embedding)
            optim += _shard(state, shape, world)
            any_8bit |= numel >= BNB_MIN_8BIT_SIZE and not embedding
        else:
            base += nbytes
        adapter = []
        leaf = ".".join(name.split(".")[-2:]) if lin != "experts" else name.split(".")[-1]
        if not plan.full and lin in ("experts", "gate", "router") and leaf in param_targets:
            # peft ParamWrapper: A (r E, in), B (out, r E) hold every expert's pair (E = 1: router)
            r = param_targets[leaf]
            E, (out_f, in_f) = (1, shape) if len(shape) == 2 else (shape[0], shape[1:])
            adapter = [((r * E, in_f), ab), ((out_f, r * E), ab)]
        elif not plan.full and lin in targets and name.endswith("weight"):
            out_f, in_f = shape
            adapter = [((plan.r, in_f), ab), ((out_f, plan.r), ab)]
            if plan.use_dora:
                adapter.append(((out_f,), 4))  # the magnitude stays fp32
        if adapter:
            for a_shape, a_bytes in adapter:
                a_numel = math.prod(a_shape)
                trainable += _shard(a_numel * a_bytes, a_shape, world)
                grads += _shard(a_numel * a_bytes, a_shape, world)
                state = optimizer_state_bytes(a_numel, a_bytes, plan.optim, plan.optim_args)
                optim += _shard(state, a_shape, world)
                any_8bit |= a_numel >= BNB_MIN_8BIT_SIZE
    if any_8bit and plan.optim in ("adamw_bnb_8bit", "paged_adamw_8bit"):
        optim += 2 * 256 * 4  # the signed and unsigned dynamic maps, shared by every 8-bit state
    L = config.num_hidden_layers
    layer_fn = (families.layer_saved_bytes if config.model_type in families.MODELLED
                else layer_saved_bytes)
    per_layer = [layer_fn(config, plan, first=i == 0, device_type=device_type, layer_idx=i)
                 for i in range(L)]
    head_fn = (families.head_saved_bytes if config.model_type in families.HEAD_TYPES
               else head_saved_bytes)
    head, logprob_bytes = head_fn(config, plan)
    if plan.fused_lm_head:  # the tiles hold what lm_head and the loss would save: fused_head_bytes
        head = {k: v for k, v in head.items() if not k.startswith(HEAD_SAVES)}
    N = plan.per_device_train_batch_size * plan.max_length
    layer_input = N * config.hidden_size * wd
    if plan.gradient_checkpointing and config.model_type == "gemma4_text":
        # the per-layer inputs ride in the first input; RoPE tables and shared (k, v) per type
        activations = (sum(families.gemma4_checkpointed_saved(config, plan, device_type).values())
                       + sum(head.values()))
    elif plan.gradient_checkpointing:  # each layer keeps only its input (and the RoPE tables)
        T, D = plan.max_length, families.rotary_dim(config)
        activations = L * layer_input + 2 * T * D * wd + sum(head.values())
    else:
        activations = sum(sum(d.values()) for d in per_layer) + sum(head.values())
    logits_dtype = 2 if plan.bf16 else wd
    V = config.vocab_size
    # logits (N, V) + their fp32 copy + fp32 log-probs saved + their gradient in backward
    logits = N * V * (logits_dtype + (4 if logits_dtype != 4 else 0)) + logprob_bytes + N * V * 4
    if plan.fused_lm_head:
        logits = fused_head_bytes(config, plan, N)
    rows = {"base weights (frozen)": base, "trainable parameters": trainable, "gradients": grads,
            "optimizer states": optim, "activations (saved for backward)": activations}
    quant_note = (f"NF4: {n_quant} linears at {nf4_bytes(4096 * 4096) / 4096**2:.4f} B/weight"
                  if n_quant else f"{plan.dtype}")
    if plan.nf4_experts:
        quant_note += "; experts NF4 (quantize_experts)"
    notes = {"base weights (frozen)": quant_note,
             "trainable parameters": "all weights" if plan.full else
             f"{'DoRA' if plan.use_dora else 'LoRA'} r={plan.r} on "
             f"{','.join(sorted(targets) + sorted(param_targets))} "
             f"({plan.adapter_dtype})",
             "gradients": "one per trainable weight, same dtype",
             "optimizer states": plan.optim,
             "activations (saved for backward)":
             (f"{L} layer inputs (checkpointing)" if plan.gradient_checkpointing else
              f"{L} layers x ~{sum(per_layer[-1].values()) / MiB:.3f} MiB")
             + f", B={plan.per_device_train_batch_size} T={plan.max_length}"}
    if plan.gradient_checkpointing:
        rows["recompute of one layer (backward)"] = max(sum(d.values()) for d in per_layer)
        notes["recompute of one layer (backward)"] = "transient, one layer at a time"
    if plan.fused_lm_head:
        rows["LM head tiles (fused)"] = logits
        notes["LM head tiles (fused)"] = (f"V={V}: {min(LOSS_CHUNK_SIZE, N)} tokens' logits at a "
                                          "time, per-token gradients; no B x T x V logits")
    else:
        rows["logits and loss (B x T x V)"] = logits
        notes["logits and loss (B x T x V)"] = f"V={V}: logits, fp32 log-probs and their gradient"
    if plan.nf4_held and n_quant:
        rows["4-bit weights dequantized (held)"] = held
        notes["4-bit weights dequantized (held)"] = ("nf4_dequantize=\"per_step\": every NF4 "
                                                     "linear in its compute dtype for the step")
    if world > 1:  # FSDP gathers one layer's full weights, and prefetches the next
        # the largest layer (an MoE layer's experts beside GLM's dense first layers); 4-bit
        # linears travel at half a byte, the experts and router in their float dtype
        layer_bytes = {}
        for n, s in parameter_shapes(config):
            if ".layers." in n:
                i = int(n.split(".layers.")[1].split(".")[0])
                half = plan.load_in_4bit and n.split(".")[-2] in layer_linears(config)
                layer_bytes[i] = layer_bytes.get(i, 0) + math.prod(s) * (0.5 if half else wd)
        gather = 2 * int(max(layer_bytes.values()))
        rows[f"FSDP all-gather ({world} ranks)"] = gather
        notes[f"FSDP all-gather ({world} ranks)"] = "two decoder layers unsharded at a time"
    return MemoryLedger(rows=rows, notes=notes, per_layer=per_layer, plan=plan)


# what lm_head, its softcap and the loss save on transformers' path, held by the tiles instead
HEAD_SAVES = ("lm_head.", "softcap.", "loss.")


def fused_head_bytes(config, plan, N):
    """What the fused LM head holds over a step of N tokens (all taken as supervised): its two
    (256, V) fp32 tile buffers (plus, under bf16 autocast, one in bf16 and a frozen head's bf16
    weight), what the tiles save for backward and the per-token outputs. Saved: a frozen Linear
    head d log p / dh, (n, C) fp32; a trained one its input and log Z; any other head (Gemma 4's
    softcap) its input, each tile recomputed in backward.
    Mirrors: nanosft.fast.lm_head.fused_lm_head_outputs (TileLogProbs)"""
    C, V, wd = config.hidden_size, config.vocab_size, DTYPE_BYTES[plan.dtype]
    rows = min(LOSS_CHUNK_SIZE, N)
    held = 2 * rows * V * 4
    linear = config.model_type != "gemma4_text"  # SoftcappedHead goes through checkpoint
    if plan.bf16 and linear:
        held += rows * V * 2 + (V * C * 2 if not plan.full and wd != 2 else 0)
    if not linear:
        saved = N * C * wd
    elif plan.full:
        saved = N * C * wd + N * 4
    else:
        saved = N * C * 4
    outputs = N * (4 + 4 + 1 + 1)  # log p, entropy, top-1 hit, label mask
    return held + saved + outputs


# ----------------------------------------------------------------------------- the Trainer's lines
def _parameter_ranks(peft_config):
    """{target parameter: rank} of a LoraConfig, its rank_pattern read on the full key (the
    doubled rank peft gives a fused gate_up_proj)."""
    from nanosft.adapter_files import pattern_value

    ranks = {}
    for name in peft_config.target_parameters or []:
        key = "model.layers.0.mlp." + (name if "." in name else "experts." + name)
        ranks[name] = pattern_value(peft_config.rank_pattern, key, peft_config.r)
    return ranks


def uses_fused_lm_head(args):
    """Whether an SFT run under `args` takes the fused LM head: SFTTrainer.compute_loss's speed
    path, outside reference mode and label smoothing (a compute_loss_func also turns it off,
    which the arguments do not show)."""
    from nanosft.args import SFTConfig
    from nanosft.reference import reference_mode_enabled

    return (isinstance(args, SFTConfig) and not args.label_smoothing_factor
            and not reference_mode_enabled())


def holds_dequantized(args):
    """Whether a run under `args` keeps each 4-bit weight dequantized for the whole step
    (nf4_dequantize="per_step", a speed path: off in reference mode)."""
    from nanosft.reference import reference_mode_enabled

    per_step = getattr(args, "nf4_dequantize", "per_call") == "per_step"
    return per_step and not reference_mode_enabled()


def plan_from_model(model, args, max_length, device_type="cpu"):
    """A MemoryPlan read off a live (peft-wrapped or not, 4-bit or not) model and its arguments.
    Mirrors: what SFTTrainer.__init__ set up (peft_config, 4-bit base)"""
    from nanosft import nf4

    peft_config = getattr(model, "active_peft_config", None)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    weights = [p for p in base.parameters() if p.dtype.is_floating_point]
    dtype = str(weights[0].dtype).removeprefix("torch.") if weights else "float32"
    lora = peft_config is not None and hasattr(peft_config, "r")
    nf4_experts = [m for m in base.modules() if type(m).__name__ == "NF4Experts"]
    nested = all(w.nested for m in nf4_experts for w in m.nf4.values())
    return MemoryPlan(full=peft_config is None, load_in_4bit=nf4.is_quantized(base),
                      use_dora=lora and peft_config.use_dora, r=peft_config.r if lora else 8,
                      target_modules=peft_config.target_modules if lora else None,
                      target_parameters=_parameter_ranks(peft_config) if lora else None,
                      dtype=dtype if dtype in DTYPE_BYTES else "float32",
                      per_device_train_batch_size=args.per_device_train_batch_size,
                      max_length=max_length, optim=args.optim,
                      gradient_checkpointing=bool(args.gradient_checkpointing),
                      optim_args=args.optim_args, bf16=bool(args.bf16),
                      nf4_experts=bool(nf4_experts), bnb_4bit_use_double_quant=nested,
                      fused_lm_head=uses_fused_lm_head(args),
                      nf4_held=holds_dequantized(args))


def predict_for_trainer(model, args):
    """The ledger of the run a Trainer is about to start, or None for a model it cannot read
    (not a nanosft CausalLM, prompt tuning, a family not modelled). T is
    SFTConfig.max_length, else the context size.
    Mirrors: nothing in transformers, which predicts no memory"""
    from nanosft.model import ModelConfig

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    peft_config = getattr(model, "active_peft_config", None)
    config = getattr(base, "config", None)
    if (not isinstance(config, ModelConfig) or config.model_type in NOT_MODELLED
            or peft_config is not None and not hasattr(peft_config, "r")):
        return None
    if args.optim not in OPTIMIZERS:  # Lion, RMSprop, AdEMAMix, 32-bit bitsandbytes: not modelled
        return None
    max_length = getattr(args, "max_length", None) or config.max_position_embeddings
    plan = plan_from_model(model, args, max_length)
    if getattr(args, "fsdp", None):
        plan.fsdp = args.world_size
    return estimate_memory(config, plan, args.device.type)


def summary_line(ledger):
    """One banner line: the predicted total and its largest parts, in MiB. It says what it counts:
    the tensors of one step at batches of B rows padded to T = max_length (shorter data needs
    less; the process adds its allocator's and libraries' memory)."""
    parts = ", ".join(f"{name.split(' (')[0]} {value / MiB:.1f}"
                      for name, value in ledger.rows.items() if value)
    plan = ledger.plan
    shape = f"{plan.per_device_train_batch_size} x {plan.max_length}"
    return (f"  Memory predicted (MiB, tensors of a step at {shape} tokens) = "
            f"{ledger.total / MiB:.1f} ({parts})")


def peak_line(peak, ledger):
    """One closing line: the measured peak growth beside the prediction."""
    measured = ", ".join(f"{k.replace('_', ' ')} {v / MiB:.1f} MiB" for k, v in peak.items())
    predicted = ""
    if ledger is not None:
        plan = ledger.plan
        predicted = (f" (predicted {ledger.total / MiB:.1f} MiB at "
                     f"{plan.per_device_train_batch_size} x {plan.max_length} tokens")
        # the ledger counts tensors; the process also grows by what torch's allocator, threads and
        # libraries take once (MiBs): a bound for the GPU's allocated bytes, not for CPU RSS
        predicted += ")" if "gpu_peak_growth" in peak else (
            " of tensors; CPU RSS also counts the allocator's and libraries' own memory)")
    return f"  Memory measured: {measured}{predicted}"

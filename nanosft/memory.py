"""The memory ledger: where a fine-tuning run's bytes go, predicted from the config, and measured.

Guide: memory (QLoRA's arithmetic, gradient checkpointing). `estimate_memory(config, plan)` counts,
without building a model, the base weights (fp32 / bf16 / NF4 with absmax and double-quantization
tables), trainable parameters, gradients, optimizer states, the tensors each decoder layer saves for
backward (with and without checkpointing) and the logits / loss buffers (B x T x V), per FSDP rank.
`MemoryTracker` measures peaks the way transformers' TrainerMemoryTracker reports them.
Papers: QLoRA 2305.14314 (2-3), activation recomputation 1604.06174, ZeRO / FSDP 1910.02054.
"""

import dataclasses
import gc
import math
import re

import torch

MiB = 2**20
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
OPTIMIZERS = ("adamw_torch_fused", "adamw_torch", "adamw_bnb_8bit", "paged_adamw_8bit", "sgd")
LAYER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BNB_MIN_8BIT_SIZE = 4096  # bitsandbytes keeps smaller tensors' optimizer states in fp32
BNB_OPTIM_BLOCKSIZE = 256  # one fp32 absmax per 256 values of an 8-bit optimizer state
NESTED_BLOCKSIZE = 256  # double quantization: one fp32 absmax per 256 first-level absmax values


def _fail(field, value, fix):
    raise ValueError(f"{field}={value!r} is invalid: {fix}")


@dataclasses.dataclass
class MemoryPlan:
    """What a run keeps in memory: method, batch shape, precision (SFTConfig / LoraConfig names).
    Guide: memory | Mirrors: trl SFTConfig, peft LoraConfig, transformers BitsAndBytesConfig
    Differs: `fsdp` is the number of ranks sharding the model (transformers takes a strategy)."""

    full: bool = False  # full fine-tuning; otherwise LoRA / DoRA adapters on a frozen base
    load_in_4bit: bool = False  # NF4 base linears (QLoRA)
    bnb_4bit_use_double_quant: bool = True
    use_dora: bool = False
    r: int = 8
    target_modules: list | str | None = None  # None -> peft's default for the model type
    dtype: str = "float32"  # base weights as loaded (from_pretrained dtype)
    per_device_train_batch_size: int = 8
    max_length: int = 1024
    gradient_checkpointing: bool = False
    optim: str = "adamw_torch_fused"
    optim_args: str | None = None
    bf16: bool = False  # bf16 autocast (mixed precision): weights stay in `dtype`
    fsdp: int = 1

    def __post_init__(self):
        for name in ("per_device_train_batch_size", "max_length", "r", "fsdp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                _fail(name, value, "it must be a whole number >= 1")
        if self.dtype not in DTYPE_BYTES:
            _fail("dtype", self.dtype, f"choose one of {', '.join(DTYPE_BYTES)}")
        if self.optim not in OPTIMIZERS:
            _fail("optim", self.optim, f"choose one of {', '.join(OPTIMIZERS)}")
        if self.full and (self.load_in_4bit or self.use_dora):
            _fail("full", True, "full fine-tuning trains every weight, so it takes no 4-bit base "
                  "and no DoRA; drop --qlora / --dora or --full")

    @property
    def adapter_dtype(self):
        """bf16 adapters on a 4-bit base (SFTTrainer casts them), else the base dtype."""
        return "bfloat16" if self.load_in_4bit else self.dtype


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


def parameter_shapes(config):
    """(name, shape) of every parameter under transformers' Llama names; a tied lm_head once.
    Guide: memory | Mirrors: transformers LlamaForCausalLM.state_dict keys"""
    C, V, I = config.hidden_size, config.vocab_size, config.intermediate_size
    H, KV, D = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    out = {"q_proj": H * D, "k_proj": KV * D, "v_proj": KV * D, "o_proj": C, "gate_proj": I,
           "up_proj": I, "down_proj": C}
    inp = {"q_proj": C, "k_proj": C, "v_proj": C, "o_proj": H * D, "gate_proj": C, "up_proj": C,
           "down_proj": I}
    shapes = [("model.embed_tokens.weight", (V, C))]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.append((p + "input_layernorm.weight", (C,)))
        for lin in LAYER_LINEARS:
            block = "self_attn." if lin in LAYER_LINEARS[:4] else "mlp."
            shapes.append((p + block + lin + ".weight", (out[lin], inp[lin])))
            bias = config.mlp_bias if block == "mlp." else config.attention_bias
            if bias and not (lin == "o_proj" and config.model_type == "qwen2"):
                shapes.append((p + block + lin + ".bias", (out[lin],)))
        shapes.append((p + "post_attention_layernorm.weight", (C,)))
    shapes.append(("model.norm.weight", (C,)))
    if not config.tie_word_embeddings:
        shapes.append(("lm_head.weight", (V, C)))
    return shapes


def lora_targets(config, plan):
    """Short names of the layer linears LoRA wraps: target_modules, "all-linear", or peft's default.
    Guide: memory | Mirrors: peft check_target_module_exists (list: suffix match, str: regex)"""
    from nanosft.peft import DEFAULT_TARGET_MODULES

    if plan.full:
        return set()
    target = plan.target_modules
    if target is None:
        target = DEFAULT_TARGET_MODULES[config.model_type]
    if isinstance(target, str) and target.lower() == "all-linear":
        return set(LAYER_LINEARS)
    if isinstance(target, str):
        return {lin for lin in LAYER_LINEARS if re.fullmatch(target, f"model.layers.0.x.{lin}")}
    return {lin for lin in LAYER_LINEARS if any(t == lin or t.endswith("." + lin) for t in target)}


def _quantizable(shape, device_type):
    # nf4.quantize_model keeps a CPU linear in float where bitsandbytes' CPU kernel decodes wrongly
    return device_type != "cpu" or shape[1] % 64 == 0 or shape[1] % 2 == 1


def _shard(nbytes, shape, world):
    # FSDP2 pads dim 0 to a multiple of the world size and keeps one slice per rank
    if world == 1 or not shape:
        return nbytes
    return nbytes * math.ceil(shape[0] / world) // shape[0]


# ----------------------------------------------------------------------------- optimizer
def optimizer_state_bytes(numel, dtype_bytes, optim, optim_args=None, embedding=False):
    """Bytes of one parameter tensor's optimizer state (the shared 8-bit maps are added once).
    Guide: 优化器配置与管理 | Mirrors: torch AdamW (exp_avg, exp_avg_sq, fp32 step), bitsandbytes
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


# ----------------------------------------------------------------------------- activations
class _Saved:
    """Tensors saved for backward, by name, so a tensor saved by several ops is counted once."""

    def __init__(self):
        self.bytes = {}

    def add(self, name, numel, nbytes):
        self.bytes[name] = numel * nbytes


def _norm(saved, tag, N, C, rg, trainable, wd):
    # RMSNorm: pow and x32 * rsqrt save the fp32 input and rsqrt (N, 1); weight * xn saves xn
    if rg:
        saved.add(f"{tag}.input_fp32", N * C, 4)
        saved.add(f"{tag}.rsqrt", N, 4)
    if trainable:
        saved.add(f"{tag}.normed", N * C, wd)
    return rg or trainable


def _linear(saved, ctx, lin, x_name, x_bytes, in_f, out_f, rg_in):
    """Saves of one (LoRA) linear on input `x_name`; returns whether its output needs grad."""
    N, plan, ad, wd = ctx["N"], ctx["plan"], ctx["ad"], ctx["wd"]
    trains_base, has_lora = plan.full, lin in ctx["targets"]
    float_base = plan.full or not ctx["nf4"].get(lin, False)
    cb = ad or wd  # a float base computes in the autocast dtype, else in its own
    if trains_base:  # weight grad needs the input: the same tensor, or its autocast copy
        if cb == x_bytes:
            saved.add(x_name, N * in_f, x_bytes)
        else:
            saved.add(f"{lin}.input_cast", N * in_f, cb)
    if float_base and ad and ad != wd and (rg_in or trains_base):
        saved.add(f"{lin}.weight_cast", out_f * in_f, ad)  # autocast's copy of the weight
    if has_lora:
        ca = ad or DTYPE_BYTES[plan.adapter_dtype]
        r = plan.r
        if ca == x_bytes:
            saved.add(x_name, N * in_f, x_bytes)  # lora_A reads the same input
        else:
            saved.add(f"{lin}.lora_input_cast", N * in_f, ca)  # one cast copy per adapter
        saved.add(f"{lin}.lora_A_out", N * r, ca)
        if ad and ad != DTYPE_BYTES[plan.adapter_dtype]:
            saved.add(f"{lin}.lora_weight_cast", r * (in_f + out_f), ad)
        if plan.use_dora:  # B A through an identity (in, in), and the two outputs m scales
            saved.add(f"{lin}.dora_eye", in_f * in_f, ca)
            saved.add(f"{lin}.dora_eye_A", in_f * r, ca)
            saved.add(f"{lin}.dora_base_result", N * out_f, cb if float_base else x_bytes)
            saved.add(f"{lin}.dora_lora_result", N * out_f, ca)
    return rg_in or trains_base or has_lora


def layer_saved_bytes(config, plan, first=False, device_type="cpu"):
    """Bytes one decoder layer saves for backward, by tensor (shared ones once), no checkpointing.
    Guide: memory (activations) | Mirrors: autograd's saves in transformers LlamaDecoderLayer
    Assumes flash / memory-efficient SDPA (no (T, T) matrix), as nanosft's causal batches use."""
    C, I, T = config.hidden_size, config.intermediate_size, plan.max_length
    H, KV, D = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    B = plan.per_device_train_batch_size
    N, wd = B * T, DTYPE_BYTES[plan.dtype]
    ad = 2 if plan.bf16 else None
    in_features = {"o_proj": H * D, "down_proj": I}
    nf4 = {lin: plan.load_in_4bit and _quantizable((0, in_features.get(lin, C)), device_type)
           for lin in LAYER_LINEARS}
    ctx = {"N": N, "plan": plan, "ad": ad, "wd": wd, "nf4": nf4,
           "targets": lora_targets(config, plan)}
    saved = _Saved()
    # the first layer's input needs no grad unless the embedding trains
    rg = plan.full or not first
    n_rg = _norm(saved, "input_layernorm", N, C, rg, plan.full, wd)
    q_rg, k_rg, v_rg = (_linear(saved, ctx, lin, "normed_1", wd, C, o, n_rg)
                        for lin, o in (("q_proj", H * D), ("k_proj", KV * D), ("v_proj", KV * D)))
    attn_rg = q_rg or k_rg or v_rg
    s = ad or wd  # SDPA works in the autocast dtype, else in the stream's
    if attn_rg:
        if first:
            saved.add("rope_cos_sin", 2 * T * D, wd)  # shared by every layer, counted in the first
        saved.add("sdpa.q", N * H * D, s)
        saved.add("sdpa.k", N * KV * D, s)
        saved.add("sdpa.v", N * KV * D, s)
        saved.add("sdpa.out", N * H * D, s)
        saved.add("sdpa.logsumexp", B * H * T, 4)
    o_rg = _linear(saved, ctx, "o_proj", "sdpa.out", s, H * D, C, attn_rg)
    h_rg = rg or o_rg
    n2_rg = _norm(saved, "post_attention_layernorm", N, C, h_rg, plan.full, wd)
    g_rg = _linear(saved, ctx, "gate_proj", "normed_2", wd, C, I, n2_rg)
    u_rg = _linear(saved, ctx, "up_proj", "normed_2", wd, C, I, n2_rg)
    g = (ad or wd) if (plan.full or not nf4["gate_proj"]) else wd  # 4-bit: returns its input dtype
    if g_rg:
        saved.add("mlp.gate_out", N * I, g)  # silu's input
        saved.add("mlp.up_out", N * I, g)  # mul's other factor
    if u_rg:
        saved.add("mlp.silu_out", N * I, g)
    _linear(saved, ctx, "down_proj", "mlp.act_product", g, I, C, g_rg or u_rg)
    return saved.bytes


def head_saved_bytes(config, plan):
    """Bytes saved for backward outside the decoder layers (ids, final norm, lm_head input),
    and the loss's fp32 log-probabilities (N, V), which the logits row reports.
    Guide: memory | Mirrors: transformers ForCausalLMLoss (logits.float(), cross_entropy)"""
    C, V = config.hidden_size, config.vocab_size
    N, wd = plan.per_device_train_batch_size * plan.max_length, DTYPE_BYTES[plan.dtype]
    ad = 2 if plan.bf16 else None
    saved = _Saved()
    if plan.full:
        saved.add("embed_tokens.input_ids", N, 8)
    _norm(saved, "norm", N, C, True, plan.full, wd)
    if plan.full:
        saved.add("lm_head.input", N * C, ad or wd)
    if ad and ad != wd:
        saved.add("lm_head.weight_cast", V * C, ad)
    saved.add("loss.labels", N, 8)
    saved.add("loss.total_weight", 1, 4)
    return saved.bytes, N * V * 4


# ----------------------------------------------------------------------------- the ledger
@dataclasses.dataclass
class MemoryLedger:
    """Predicted bytes per part of one training step on one rank; `format()` prints the table.
    Guide: memory | Mirrors: accelerate estimate-memory (which covers weights and Adam only)"""

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
    Guide: memory | Mirrors: the tensors transformers Trainer + peft + bitsandbytes keep alive
    Differs: predicted from shapes alone, so a 70B config costs nothing to ask about."""
    wd, world = DTYPE_BYTES[plan.dtype], plan.fsdp
    targets = lora_targets(config, plan)
    if not plan.full and not targets:
        _fail("target_modules", plan.target_modules,
              f"it matches none of {', '.join(LAYER_LINEARS)}")
    ab = DTYPE_BYTES[plan.adapter_dtype]
    base = trainable = grads = optim = 0
    any_8bit = False
    n_quant = 0
    for name, shape in parameter_shapes(config):
        numel = math.prod(shape)
        lin = name.split(".")[-2]
        quant = (plan.load_in_4bit and lin in LAYER_LINEARS and name.endswith("weight")
                 and _quantizable(shape, device_type))
        n_quant += quant
        if quant:  # FSDP shards the packed (numel / 2, 1) codes
            nbytes = nf4_bytes(numel, double_quant=plan.bnb_4bit_use_double_quant)
            nbytes = _shard(nbytes, ((numel + 1) // 2, 1), world)
        else:
            nbytes = _shard(numel * wd, shape, world)
        if plan.full:
            trainable += nbytes
            grads += nbytes
            embedding = name == "model.embed_tokens.weight"
            state = optimizer_state_bytes(numel, wd, plan.optim, plan.optim_args, embedding)
            optim += _shard(state, shape, world)
            any_8bit |= numel >= BNB_MIN_8BIT_SIZE and not embedding
        else:
            base += nbytes
        if not plan.full and lin in targets and name.endswith("weight"):
            out_f, in_f = shape
            adapter = [((plan.r, in_f), ab), ((out_f, plan.r), ab)]
            if plan.use_dora:
                adapter.append(((out_f,), 4))  # the magnitude stays fp32
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
    per_layer = [layer_saved_bytes(config, plan, first=i == 0, device_type=device_type)
                 for i in range(L)]
    head, logprob_bytes = head_saved_bytes(config, plan)
    N = plan.per_device_train_batch_size * plan.max_length
    layer_input = N * config.hidden_size * wd
    if plan.gradient_checkpointing:  # each layer keeps only its input (and the shared RoPE tables)
        T, D = plan.max_length, config.head_dim
        activations = L * layer_input + 2 * T * D * wd + sum(head.values())
    else:
        activations = sum(sum(d.values()) for d in per_layer) + sum(head.values())
    logits_dtype = 2 if plan.bf16 else wd
    V = config.vocab_size
    # logits (N, V) + their fp32 copy + fp32 log-probs saved + their gradient in backward
    logits = N * V * (logits_dtype + (4 if logits_dtype != 4 else 0)) + logprob_bytes + N * V * 4
    rows = {"base weights (frozen)": base, "trainable parameters": trainable, "gradients": grads,
            "optimizer states": optim, "activations (saved for backward)": activations}
    quant_note = (f"NF4: {n_quant} linears at {nf4_bytes(4096 * 4096) / 4096**2:.4f} B/weight"
                  if n_quant else f"{plan.dtype}")
    notes = {"base weights (frozen)": quant_note,
             "trainable parameters": "all weights" if plan.full else
             f"{'DoRA' if plan.use_dora else 'LoRA'} r={plan.r} on {','.join(sorted(targets))} "
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
    rows["logits and loss (B x T x V)"] = logits
    notes["logits and loss (B x T x V)"] = f"V={V}: logits, fp32 log-probs and their gradient"
    if world > 1:  # FSDP gathers one layer's full weights, and prefetches the next
        layer_params = [math.prod(s) for n, s in parameter_shapes(config)
                        if n.startswith("model.layers.0.")]
        frozen_bytes = 0.5 if plan.load_in_4bit else wd
        gather = 2 * int(sum(layer_params) * (wd if plan.full else frozen_bytes))
        rows[f"FSDP all-gather ({world} ranks)"] = gather
        notes[f"FSDP all-gather ({world} ranks)"] = "two decoder layers unsharded at a time"
    return MemoryLedger(rows=rows, notes=notes, per_layer=per_layer, plan=plan)


# ----------------------------------------------------------------------------- measuring
def unique_bytes(tensors):
    """Bytes of the distinct storages behind `tensors` (views and shared tables counted once).
    Guide: memory | Mirrors: torch UntypedStorage.nbytes"""
    seen = {}
    for t in tensors:
        if torch.is_tensor(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def cpu_peak_reset():
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS; False where /proc refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def cpu_memory():
    """(RSS, peak RSS since the last reset) of this process in bytes, from /proc/self/status.
    Mirrors: psutil Process.memory_info().rss (transformers' cpu_mem_used)"""
    values = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    values[line.split(":")[0]] = int(line.split()[1]) * 1024
    except OSError:
        import psutil

        rss = psutil.Process().memory_info().rss
        return rss, rss
    return values["VmRSS"], values["VmHWM"]


class MemoryTracker:
    """Memory deltas per stage (init, train, eval) under transformers' metric names.
    Guide: memory | Mirrors: transformers TrainerMemoryTracker (start, stop, update_metrics)
    Differs: the CPU peak is the kernel's VmHWM (reset per stage), not RSS polled by a thread."""

    def __init__(self, skip_memory_metrics=False):
        self.skip_memory_metrics = skip_memory_metrics
        self.cur_stage, self.cpu, self.gpu, self.init_reported = None, {}, {}, False
        self.cuda = torch.cuda.is_available()

    def start(self, stage):
        """Begin measuring `stage`; a stage inside another (eval inside train) is ignored."""
        if self.skip_memory_metrics or (self.cur_stage is not None and self.cur_stage != stage):
            return
        self.cur_stage = stage
        gc.collect()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.empty_cache()
            self.gpu_begin = torch.cuda.memory_allocated()
        cpu_peak_reset()
        self.cpu_begin = cpu_memory()[0]

    def stop(self, stage):
        """End `stage`: alloc = end - begin, peaked = max(0, peak - end), as in transformers."""
        if self.skip_memory_metrics or self.cur_stage != stage:
            return
        _, peak = cpu_memory()  # read before gc.collect can lower anything
        gc.collect()
        now = cpu_memory()[0]
        self.cpu[stage] = {"begin": self.cpu_begin, "end": now, "alloc": now - self.cpu_begin,
                           "peaked": max(0, peak - now)}
        if self.cuda:
            torch.cuda.empty_cache()
            now, peak = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
            self.gpu[stage] = {"begin": self.gpu_begin, "end": now, "alloc": now - self.gpu_begin,
                               "peaked": max(0, peak - now)}
        self.cur_stage = None

    def update_metrics(self, stage, metrics):
        """Add `{stage}_mem_cpu_alloc_delta`, `..._peaked_delta` (+ `_gpu_`); init's go first."""
        if self.skip_memory_metrics:
            return
        stages = [stage]
        if not self.init_reported and "init" in self.cpu:
            stages.insert(0, "init")
            self.init_reported = True
            metrics["before_init_mem_cpu"] = self.cpu["init"]["begin"]
            if self.cuda:
                metrics["before_init_mem_gpu"] = self.gpu["init"]["begin"]
        for s in stages:
            for kind in ("alloc", "peaked"):
                if s in self.cpu:
                    metrics[f"{s}_mem_cpu_{kind}_delta"] = self.cpu[s][kind]
                if self.cuda and s in self.gpu:
                    metrics[f"{s}_mem_gpu_{kind}_delta"] = self.gpu[s][kind]

    def stop_and_update_metrics(self, stage, metrics=None):
        """stop(stage), then update_metrics(stage, metrics) when a dict is given."""
        self.stop(stage)
        if metrics is not None:
            self.update_metrics(stage, metrics)


class PeakMemory:
    """The peak a run reaches above its start: CPU RSS (VmHWM) and, on CUDA, allocated bytes.
    Guide: memory | Mirrors: torch.cuda.max_memory_allocated, the kernel's VmHWM"""

    def __init__(self, device_type="cpu"):
        self.cuda = device_type == "cuda" and torch.cuda.is_available()

    def start(self):
        """Reset the peaks and remember where this run starts."""
        self.exact = cpu_peak_reset()
        self.cpu_start = cpu_memory()[0]
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            self.gpu_start = torch.cuda.memory_allocated()
        return self

    def stop(self):
        """{"cpu_peak_growth": bytes, "gpu_peak_growth": bytes on CUDA} since start()."""
        out = {"cpu_peak_growth": cpu_memory()[1] - self.cpu_start}
        if self.cuda:
            out["gpu_peak_growth"] = torch.cuda.max_memory_allocated() - self.gpu_start
        return out


def count_saved_tensors(model):
    """A context manager counting the bytes autograd saves for backward, per decoder layer, less
    the model's own weights and quantization state; `.per_layer`, `.outside`, `.total` after it.
    Guide: memory | Mirrors: torch.autograd.graph.saved_tensors_hooks"""
    return _SavedTensorCounter(model)


class _SavedTensorCounter:
    def __init__(self, model):
        self.model = model
        inner = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.layers = list(inner.model.layers)
        state = [p for p in model.parameters()] + [b for b in model.buffers()]
        for m in model.modules():
            qs = getattr(m, "quant_state", None)
            if qs is not None:
                state += [qs.absmax, qs.code] + ([qs.state2.absmax, qs.state2.code, qs.offset]
                                                 if qs.nested else [])
        self.state_ptrs = {t.untyped_storage().data_ptr() for t in state if torch.is_tensor(t)}

    def _pack(self, t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.state_ptrs and ptr not in self.seen:
            self.seen[ptr] = (self.where, t.untyped_storage().nbytes())
        return t

    def __enter__(self):
        self.seen, self.where = {}, "outside"
        self.handles = []
        for i, layer in enumerate(self.layers):  # attribute each save to the layer running
            enter = layer.register_forward_pre_hook(lambda m, a, i=i: setattr(self, "where", i))
            leave = layer.register_forward_hook(lambda m, a, o: setattr(self, "where", "outside"))
            self.handles += [enter, leave]
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)
        for h in self.handles:
            h.remove()
        self.per_layer = [sum(b for w, b in self.seen.values() if w == i)
                          for i in range(len(self.layers))]
        self.outside = sum(b for w, b in self.seen.values() if w == "outside")
        self.total = sum(b for _, b in self.seen.values())
        return False


def plan_from_model(model, args, max_length, device_type="cpu"):
    """A MemoryPlan read off a live (peft-wrapped or not, 4-bit or not) model and its arguments.
    Guide: memory | Mirrors: what SFTTrainer.__init__ set up (peft_config, 4-bit base)"""
    from nanosft import nf4

    peft_config = getattr(model, "active_peft_config", None)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    weights = [p for p in base.parameters() if p.dtype.is_floating_point]
    dtype = str(weights[0].dtype).removeprefix("torch.") if weights else "float32"
    lora = peft_config is not None and hasattr(peft_config, "r")
    return MemoryPlan(full=peft_config is None, load_in_4bit=nf4.is_quantized(base),
                      use_dora=lora and peft_config.use_dora, r=peft_config.r if lora else 8,
                      target_modules=peft_config.target_modules if lora else None,
                      dtype=dtype if dtype in DTYPE_BYTES else "float32",
                      per_device_train_batch_size=args.per_device_train_batch_size,
                      max_length=max_length, optim=args.optim,
                      gradient_checkpointing=bool(args.gradient_checkpointing),
                      optim_args=args.optim_args, bf16=bool(args.bf16))


def predict_for_trainer(model, args):
    """The ledger of the run a Trainer is about to start, or None for a model it cannot read
    (not a nanosft CausalLM, or prompt tuning). T is SFTConfig.max_length, else the context size.
    Guide: memory | Mirrors: nothing in transformers, which predicts no memory"""
    from nanosft.model import ModelConfig

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    peft_config = getattr(model, "active_peft_config", None)
    config = getattr(base, "config", None)
    if not isinstance(config, ModelConfig) or (peft_config is not None and
                                               not hasattr(peft_config, "r")):
        return None
    max_length = getattr(args, "max_length", None) or config.max_position_embeddings
    plan = plan_from_model(model, args, max_length)
    if getattr(args, "fsdp", None):
        plan.fsdp = args.world_size
    return estimate_memory(config, plan, args.device.type)


def summary_line(ledger):
    """One banner line: the predicted total and its largest parts, in MiB."""
    parts = ", ".join(f"{name.split(' (')[0]} {value / MiB:.1f}"
                      for name, value in ledger.rows.items() if value)
    return f"  Memory predicted (MiB, upper bound) = {ledger.total / MiB:.1f} ({parts})"


def peak_line(peak, ledger):
    """One closing line: the measured peak growth beside the prediction."""
    measured = ", ".join(f"{k.replace('_', ' ')} {v / MiB:.1f} MiB" for k, v in peak.items())
    predicted = f" (predicted <= {ledger.total / MiB:.1f} MiB)" if ledger is not None else ""
    return f"  Memory measured: {measured}{predicted}"

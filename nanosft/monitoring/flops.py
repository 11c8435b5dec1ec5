"""Throughput and FLOPs: the logging window's tokens, samples and sequence lengths, the model FLOPs
of a step (nanoGPT's MFU numerator, causal attention counted exactly), transformers' total_flos
parameter count, and a matmul calibration for the MFU denominator.

The numbers behind samples/s, tokens/s, step time and MFU. Read by
nanosft.monitoring.callbacks.ThroughputCallback.
"""

import time
from dataclasses import dataclass, field

import torch

from nanosft.masking import packed_segment_ids
from nanosft.nf4 import Linear4bit


@dataclass
class LogWindow:
    """Tokens, samples, sequence lengths and wall time since the last log: the throughput and
    model FLOP/s of the window.
    Mirrors: transformers speed_metrics (its names), Trainer.num_input_tokens_seen, current_flos"""

    start: float = field(default_factory=time.time)
    tokens: int = 0
    samples: int = 0
    input_ids: int = 0  # every input_ids element, padding too: what transformers' total_flos counts
    seq_lengths: list = field(default_factory=list)  # tokens of each sequence: the attention FLOPs

    def add(self, inputs: dict) -> None:
        """Count one (host-side) micro-batch: its attention_mask ones, or all ids (padding-free)."""
        mask = inputs.get("attention_mask")
        self.tokens += int(mask.sum()) if mask is not None else inputs["input_ids"].numel()
        self.samples += len(inputs["input_ids"])
        self.input_ids += inputs["input_ids"].numel()
        self.seq_lengths += sequence_lengths(inputs["input_ids"], mask, inputs.get("position_ids"))

    def speed(self, data_parallel_size: int, steps: int, model_flos=None, peak_flops=None,
              world_size=None) -> dict:
        """Tokens/s and samples/s of the data-parallel ranks (each reads about as many rows as this
        one; the tensor-parallel ranks of one shard read the same rows), steps/s and seconds per
        optimizer step, over the window of `steps` optimizer steps; given the window's model FLOPs
        of all ranks, their rate, and its share of world_size (default: data_parallel_size) x
        peak_flops (mfu)."""
        seconds = max(time.time() - self.start, 1e-9)
        world_size = data_parallel_size if world_size is None else world_size
        speed = {"train_tokens_per_second": round(self.tokens * data_parallel_size / seconds, 1),
                 "train_samples_per_second": round(self.samples * data_parallel_size / seconds, 3),
                 "train_steps_per_second": round(steps / seconds, 3),
                 "train_step_time": round(seconds / max(steps, 1), 4)}
        if model_flos is not None:
            speed["train_model_flops_per_second"] = round(model_flos / seconds, 1)
        if model_flos is not None and peak_flops:
            speed["mfu"] = model_flos / seconds / (peak_flops * world_size)
        return speed


def sequence_lengths(input_ids, attention_mask=None, position_ids=None) -> list:
    """Tokens of each sequence in a batch: the attention_mask row sums; without a mask, each row's
    documents, split where position_ids do not step by +1 (padding-free), else whole rows.
    Mirrors: the documents nanosft.fast.unpad.varlen_layout attends within"""
    if attention_mask is not None:
        return attention_mask.sum(-1).tolist()
    if position_ids is None:
        return [input_ids.shape[-1]] * len(input_ids)
    segments = packed_segment_ids(position_ids.reshape(-1, position_ids.shape[-1]))
    return [n for row in segments for n in torch.bincount(row).tolist() if n]


def model_flops(matmul_params, trainable_matmul_params, attention_width, num_layers,
                seq_lengths) -> int:
    """FLOPs of one forward + backward over sequences of `seq_lengths` tokens: per token 4 a matmul
    weight (forward, input gradient) and 2 more a trainable one (weight gradient), so 6N for full
    fine-tuning and 4N + 6 an adapter weight on a frozen base; plus causal attention, 6 x width x
    layers x T(T+1) a sequence of T. Mirrors: nanoGPT estimate_mfu"""
    # Differs: nanoGPT (PaLM's appendix B) counts the whole T x T square, 12 x layers x width x T
    # a token; the causal products need the lower triangle only: T(T+1)/2 of its entries, which
    # fused kernels skip (QK^T and AV: 2 x 2 x width a pair forward, twice that backward)
    tokens = sum(seq_lengths)
    pairs = sum(t * (t + 1) for t in seq_lengths)
    return ((4 * matmul_params + 2 * trainable_matmul_params) * tokens
            + 6 * attention_width * num_layers * pairs)


def matmul_parameters(model) -> tuple:
    """(weights, trainable weights) that multiply activations, the N of 6N: every nn.Linear (the
    base layers, lm_head once even when tied, LoRA's A and B) and 4-bit linear at in x out.
    Differs: DoRA's weight norm and prompt tuning's encoder are left out."""
    total = trainable = 0
    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, Linear4bit)):
            total += module.in_features * module.out_features
            trainable += module.in_features * module.out_features * module.weight.requires_grad
    return total, trainable


def non_embedding_parameters(model) -> int:
    """Parameters of the base model (LoRA included, a PEFT wrapper's prompt encoder not) less its
    nn.Embedding weights, a packed 4-bit byte as 2: the N of transformers' total_flos.
    Mirrors: transformers ModuleUtilsMixin.num_parameters(exclude_embeddings=True)"""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    embeddings = {id(m.weight) for m in base.modules() if isinstance(m, torch.nn.Embedding)}
    return sum(p.numel() * (2 * p.element_size() if p.dtype == torch.uint8 else 1)
               for p in base.parameters() if id(p) not in embeddings)


def attention_shape(model) -> tuple:
    """(heads x head_dim, layers) of the model's config; (0, 0) for a model without one."""
    config = getattr(model, "config", None)
    if config is None:
        return 0, 0
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_attention_heads * head_dim, config.num_hidden_layers


def not_a_causal_lm(model, batch=None) -> str | None:
    """Why tokens/s, model FLOPs and MFU cannot be read off `model` (and a `batch` of it), or None
    when they can: they need a config with the decoder's shape and batches of input_ids."""
    config = getattr(model, "config", None)
    shape = ("hidden_size", "num_attention_heads", "num_hidden_layers")
    if not all(isinstance(getattr(config, name, None), int) for name in shape):
        return (f"{type(model).__name__} is not a causal LM (no config with "
                f"{', '.join(shape)})")
    if batch is not None and "input_ids" not in batch:
        return f"its batches have no input_ids (keys: {', '.join(sorted(batch))})"
    return None


def compute_dtype(model, args) -> torch.dtype:
    """The dtype the matmuls run in: autocast's (bf16 / fp16), else the first float parameter's."""
    if args.bf16 or args.fp16:
        return torch.bfloat16 if args.bf16 else torch.float16
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def model_width(model) -> int:
    """config.hidden_size, else the in_features of the model's first linear layer."""
    width = getattr(getattr(model, "config", None), "hidden_size", None)
    if width is None:
        width = next(m.in_features for m in model.modules() if isinstance(m, torch.nn.Linear))
    return width


def calibrate_matmul_flops(width, dtype=torch.float32, device="cpu", budget_s=0.2) -> float:
    """Best FLOP/s of torch.mm at (M, width) x (width, width): M doubles from a ~16 MFLOP product
    while a product takes under budget_s / 4, up to ~2 GFLOP (at most 4096 rows), then repeats,
    stopping after about budget_s, or after 3 products at the largest M once a quarter of budget_s
    is spent (small widths start at the largest M: 3 products there would be cold kernels).
    Mirrors: nothing in transformers (it reports no MFU)"""
    device = torch.device(device)
    max_rows = max(1, min(4096, 2**30 // width**2))
    rows = max(1, min(max_rows, 2**23 // width**2))
    generator = torch.Generator(device).manual_seed(0)  # the global RNG is the run's: untouched
    a = torch.randn(max_rows, width, generator=generator, device=device, dtype=dtype)
    b = torch.randn(width, width, generator=generator, device=device, dtype=dtype)
    best, spent, at_max = 0.0, 0.0, 0
    # a slow kernel (bf16 on a CPU without bf16 units) stops the growth early: it costs < 1 s
    while spent < budget_s and (at_max < 3 or spent < budget_s / 4):
        start = time.perf_counter()
        torch.mm(a[:rows], b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        spent += seconds
        best = max(best, 2 * rows * width * width / max(seconds, 1e-9))
        at_max += rows == max_rows
        if seconds < budget_s / 4:
            rows = min(max_rows, 2 * rows)
    return best

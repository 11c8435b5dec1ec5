"""Side by side: nanosft beside transformers Trainer / TRL SFTTrainer + peft / bitsandbytes.

The same Llama (weights copied, so every stack starts identical), the same token sequences and the
same arguments go through full fine-tuning, LoRA, DoRA and QLoRA (walkthrough 2.3 - 2.7), with
reference and nanosft repetitions interleaved so machine noise hits both. Reported per pair: non-pad
tokens/s, achieved model GFLOP/s and its share of a matmul calibration taken in the same run at the
model's own GEMM shapes, seconds per optimizer step (median after warmup), peak memory during
train() and the largest per-step loss difference. A plain PyTorch loop gives the framework-free
floor.
Papers: LoRA 2106.09685, QLoRA 2305.14314, DoRA 2402.09353.
Run: python benchmarks/bench_sft.py --sizes small,medium --steps 12 --reps 2   (--quick: ~1 minute)
Real size (SmolLM2-135M's shapes, fp32 and bf16, LoRA / QLoRA / full, best of 3, plus NF4
dequantize per call against bitsandbytes direct):
     python benchmarks/bench_sft.py --real --steps 3 --warmup 1
"""

import argparse
import contextlib
import ctypes
import dataclasses
import gc
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.optim.optimizer import register_optimizer_step_post_hook  # noqa: E402

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
VOCAB_SIZE = 1000
# Llama shapes: intermediate ~ 8/3 hidden rounded to a multiple of 64 (the NF4 block)
SIZES = {
    "small": {
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
    },
    "medium": {
        "hidden_size": 256,
        "intermediate_size": 704,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
    },
    # SmolLM2-135M's config with random weights: big enough that the arithmetic sets the pace
    "smollm2-135m": {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
    },
}
# What a size changes beside its shapes: sequence lengths and the batch (chat-sized examples, 4 x 2)
SIZE_DATA = {"smollm2-135m": {"min_len": 50, "max_len": 500, "batch_size": 4, "grad_accum": 2}}
# --real-rows: the real-size case's row lengths; "short" is a chat turn of about 50 tokens, where
# the costs that do not grow with tokens (dequantize, per-module dispatch, the optimizer) decide
REAL_ROWS = {"chat": {"min_len": 50, "max_len": 500}, "short": {"min_len": 40, "max_len": 60}}
REAL_SIZE = "smollm2-135m"
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MODES = ("full", "lora", "dora", "qlora")  # the four training set-ups of the walkthrough path
# on LoRA, both stacks: checkpointing, compile, bf16 autocast, padding-free
EXTRAS = ("gc", "compile", "bf16", "padfree")


@dataclasses.dataclass
class Options:
    """What every stack receives: the same batch, accumulation, optimizer and schedule."""

    steps: int = 10
    warmup: int = 2
    batch_size: int = 8
    grad_accum: int = 2
    learning_rate: float = 2e-4
    max_grad_norm: float = 1.0
    seed: int = 42
    lora_r: int = 16
    lora_alpha: int = 32
    device: str = "cpu"


@dataclasses.dataclass
class Case:
    """One benchmark row: a training set-up and the switches layered on it."""

    mode: str  # full | lora | dora | qlora
    gradient_checkpointing: bool = False
    torch_compile: bool = False
    bf16: bool = False  # bf16=True in the arguments (autocast)
    padding_free: bool = False  # SFT only: one row per micro-batch, positions restart per example
    # the user's bf16 recipe: weights loaded in bf16 (QLoRA: bnb_4bit_compute_dtype bf16)
    # + bf16=True
    weights_bf16: bool = False

    @property
    def name(self):
        switches = (
            ("gc", self.gradient_checkpointing),
            ("compile", self.torch_compile),
            ("bf16w" if self.weights_bf16 else "bf16", self.bf16),
            ("padfree", self.padding_free),
        )
        return "+".join([self.mode, *[n for n, on in switches if on]])

    @property
    def dtype(self):
        return torch.bfloat16 if self.weights_bf16 else torch.float32


# ---------------------------------------------------------- data and the bare loop (pure torch)
def make_examples(num_examples, vocab_size=VOCAB_SIZE, min_len=75, max_len=250, seed=0):
    """Deterministic token sequences of min_len..max_len tokens ending in EOS; labels = input_ids.

    Each token has four likely successors (a fixed random grammar), so the loss can fall; ids 0-2
    are pad/bos/eos.
    Walkthrough 2.1 | Mirrors: a pre-tokenized TRL dataset
    (input_ids present: _prepare_dataset is skipped)
    """
    rng = random.Random(seed)
    successors = [[rng.randrange(3, vocab_size) for _ in range(4)] for _ in range(vocab_size)]
    rows = []
    for _ in range(num_examples):
        length = rng.randint(min_len, max_len)
        token = rng.randrange(3, vocab_size)
        ids = [token]
        for _ in range(length - 2):
            token = (
                rng.choice(successors[token])
                if rng.random() < 0.9
                else rng.randrange(3, vocab_size)
            )
            ids.append(token)
        ids.append(EOS_ID)
        rows.append({"input_ids": ids, "labels": list(ids)})
    return rows


def step_plan(num_examples, batch_size, grad_accum, steps, seed=42, epoch=0):
    """Example indices per optimizer step, each a list of micro-batches: randperm(N, seed + epoch)
    sliced in order.

    Walkthrough 2.3 | Mirrors: accelerate SeedableRandomSampler (the order both Trainers use)
    """
    order = torch.randperm(
        num_examples, generator=torch.Generator().manual_seed(seed + epoch)
    ).tolist()
    micro = [order[i : i + batch_size] for i in range(0, num_examples, batch_size)]
    plan = [micro[i : i + grad_accum] for i in range(0, len(micro), grad_accum)]
    if len(plan) < steps:
        raise ValueError(
            f"step_plan: {num_examples} examples give {len(plan)} steps of "
            f"{batch_size}x{grad_accum}, fewer than steps={steps}; pass more examples"
        )
    return plan[:steps]


def collate_padded(rows, pad_id=PAD_ID):
    """Right-padded input_ids, attention_mask and labels (-100 on padding).
    Guide: data collators | Mirrors: trl DataCollatorForLanguageModeling (padded mode)"""
    width = max(len(r["input_ids"]) for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        input_ids[i, :n] = torch.tensor(r["input_ids"])
        labels[i, :n] = torch.tensor(r["labels"])
        attention_mask[i, :n] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def tokens_per_step(rows, plan):
    """Non-pad tokens seen by each optimizer step of `plan`."""
    return [sum(len(rows[i]["input_ids"]) for mb in step for i in mb) for step in plan]


def next_token_loss(logits, labels, num_items_in_batch):
    """Σ -log p(label[t+1] | ..t) over supervised positions (fp32), / the window's token count.
    Walkthrough 2.5 | Mirrors: transformers ForCausalLMLoss with num_items_in_batch"""
    # shift the labels, not the logits: a (B, T, V) view instead of a sliced copy;
    # the last position gets -100
    targets = F.pad(labels, (0, 1), value=-100)[:, 1:].to(logits.device)
    loss = F.cross_entropy(
        logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum"
    )
    return loss / num_items_in_batch


def bare_loop(model, rows, plan, opts, bf16=False):
    """The framework-free floor: collate, forward, loss / window tokens, backward, clip, fused
    AdamW, linear decay.

    Returns the per-step losses (the sum of the micro-batch losses, as the trainers log them).
    Walkthrough 2.3 - 2.5 | Mirrors: custom-training-loop.md (the loop with no Trainer)
    """
    device = torch.device(opts.device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params, lr=opts.learning_rate, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, fused=True
    )
    steps = len(plan)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: max(0.0, (steps - s) / steps)
    )
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    )
    model.train()
    losses = []
    for step in plan:
        batches = [collate_padded([rows[i] for i in mb]) for mb in step]
        num_items = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
        total = torch.zeros((), device=device)
        for b in batches:
            with autocast:
                logits = model(
                    input_ids=b["input_ids"].to(device),
                    attention_mask=b["attention_mask"].to(device),
                ).logits
            loss = next_token_loss(logits, b["labels"], num_items)
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(params, opts.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total.item())
    return losses


# ----------------------------------------------------------------------------- measurement
class StepClock:
    """Timestamps every optimizer.step() of any optimizer (a global post-step hook), whatever
    stack drives it."""

    def __enter__(self):
        self.times, self.cpu_times = [], []
        self._handle = register_optimizer_step_post_hook(lambda *_: self._tick())
        return self

    def _tick(self):
        self.times.append(time.perf_counter())
        self.cpu_times.append(
            time.process_time()
        )  # CPU seconds of this process: less hurt by a busy machine

    def __exit__(self, *exc):
        self._handle.remove()


def _proc_status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return None


class PeakMemory:
    """Peak memory above the level at entry, in MiB: CUDA max_memory_allocated, else peak RSS
    (VmHWM reset).

    On Linux the RSS high-water mark is reset by writing 5 to /proc/self/clear_refs, so the peak is
    exact and free.
    """

    def __init__(self, device):
        self.device, self.peak_mib = torch.device(device), float("nan")

    def __enter__(self):
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated()
            return self
        with contextlib.suppress(OSError):
            ctypes.CDLL("libc.so.6").malloc_trim(
                0
            )  # give freed heap back, so the baseline is honest
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self._base = _proc_status_kib("VmRSS") * 1024
        except OSError:
            self._base = None
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.peak_mib = (torch.cuda.max_memory_allocated() - self._base) / 2**20
        elif self._base is not None:
            self.peak_mib = (_proc_status_kib("VmHWM") * 1024 - self._base) / 2**20


@dataclasses.dataclass
class Run:
    """One repetition of one stack on one case."""

    losses: list
    step_times: list  # seconds of each optimizer step after warmup
    tokens_per_s: float
    tokens_per_cpu_s: float  # per CPU second of this process (all its threads)
    peak_mib: float
    wall_s: float
    gflops: float  # achieved model GFLOP/s over the timed steps (Fixture.flops_per_step)


def measure(train, fx, case, warmup):
    """Run train() -> per-step losses under the step clock and the memory probe; derive the speed
    of the timed steps."""
    opts, tokens = fx.opts, fx.tokens
    start = time.perf_counter()
    with PeakMemory(opts.device) as mem, StepClock() as clock, open(os.devnull, "w") as quiet:
        # banners and log dicts: every stack prints, none to the terminal
        with contextlib.redirect_stdout(quiet):
            losses = train()
        if opts.device == "cuda":
            torch.cuda.synchronize()
    wall = time.perf_counter() - start
    t = clock.times
    if len(t) != len(tokens):
        raise RuntimeError(f"measure: {len(t)} optimizer steps were timed, {len(tokens)} planned")
    step_times = [t[i] - t[i - 1] for i in range(warmup, len(t))]
    tokens_per_s = sum(tokens[warmup:]) / (t[-1] - t[warmup - 1])
    tokens_per_cpu_s = sum(tokens[warmup:]) / (clock.cpu_times[-1] - clock.cpu_times[warmup - 1])
    gflops = sum(fx.flops_per_step(case.mode)[warmup:]) / (t[-1] - t[warmup - 1]) / 1e9
    return Run(losses, step_times, tokens_per_s, tokens_per_cpu_s, mem.peak_mib, wall, gflops)


# ----------------------------------------------------------------------------- the shared fixture
class Fixture:
    """One size: the base weights, the examples, a tokenizer folder, the per-step token counts."""

    def __init__(self, size, opts, workdir):
        from transformers import LlamaConfig, LlamaForCausalLM

        data = SIZE_DATA.get(size, {})
        opts = dataclasses.replace(
            opts, **{k: data[k] for k in ("batch_size", "grad_accum") if k in data}
        )
        self.size, self.opts, self.workdir = size, opts, workdir
        shape = {"vocab_size": VOCAB_SIZE, "tie_word_embeddings": False, **SIZES[size]}
        self.hf_config = LlamaConfig(
            max_position_embeddings=max(512, data.get("max_len", 0)),
            rms_norm_eps=1e-6,
            pad_token_id=PAD_ID,
            bos_token_id=BOS_ID,
            eos_token_id=EOS_ID,
            **shape,
        )
        torch.manual_seed(0)
        base = LlamaForCausalLM(self.hf_config)
        self.state_dict = {k: v.detach().clone() for k, v in base.state_dict().items()}
        self.model_dir = os.path.join(workdir, f"base-{size}")
        base.save_pretrained(self.model_dir)  # QLoRA reference loads it through BitsAndBytesConfig
        del base
        self.max_steps = opts.warmup + opts.steps
        num_examples = self.max_steps * opts.batch_size * opts.grad_accum
        lengths = {k: data[k] for k in ("min_len", "max_len") if k in data}
        self.rows = make_examples(num_examples, shape["vocab_size"], seed=1, **lengths)
        self.plan = step_plan(
            len(self.rows), opts.batch_size, opts.grad_accum, self.max_steps, opts.seed
        )
        self.tokens = tokens_per_step(self.rows, self.plan)
        self.tokenizer_dir = _tokenizer_folder(workdir)

    def hf_model(self, quantized=False, dtype=torch.float32, attn_implementation="sdpa"):
        """transformers LlamaForCausalLM with the shared weights in `dtype`; quantized: loaded
        through BitsAndBytesConfig NF4 with that compute dtype (the user's recipe)."""
        from transformers import BitsAndBytesConfig, LlamaForCausalLM

        if quantized:
            bnb = BitsAndBytesConfig(
                load_in_4bit=True,
                bnb_4bit_quant_type="nf4",
                bnb_4bit_use_double_quant=True,
                bnb_4bit_compute_dtype=dtype,
            )
            return LlamaForCausalLM.from_pretrained(
                self.model_dir,
                quantization_config=bnb,
                dtype=dtype,
                device_map=self.opts.device,
                attn_implementation=attn_implementation,
            )
        model = LlamaForCausalLM(self.hf_config)
        model.load_state_dict(self.state_dict)
        model.set_attn_implementation(attn_implementation)
        return model.to(self.opts.device, dtype)

    def nano_model(self, quantized=False, dtype=torch.float32):
        """nanosft CausalLM with the shared weights in `dtype`; quantized:
        nanosft.nf4.quantize_model with that compute dtype (lm_head kept)."""
        from nanosft import nf4
        from nanosft.model import CausalLM, ModelConfig

        c = self.hf_config
        config = ModelConfig(
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_hidden_layers=c.num_hidden_layers,
            num_attention_heads=c.num_attention_heads,
            num_key_value_heads=c.num_key_value_heads,
            max_position_embeddings=c.max_position_embeddings,
            tie_word_embeddings=c.tie_word_embeddings,
            rms_norm_eps=1e-6,
            pad_token_id=PAD_ID,
            bos_token_id=BOS_ID,
            eos_token_id=EOS_ID,
        )
        model = CausalLM(config)
        model.load_state_dict(self.state_dict)
        model = model.to(self.opts.device, dtype)
        if quantized:
            nf4.quantize_model(model, compute_dtype=dtype)
        return model

    def flops_per_step(self, mode):
        """Model FLOPs of each planned optimizer step: 6N per token for full fine-tuning, 4N for a
        frozen base (forward + input gradients; the adapters add 6 per LoRA weight), plus causal
        attention, 6 * hidden * layers * T * (T + 1) per sequence of T tokens (QK^T and AV, forward
        and both backward products, only the lower triangle): nanosft.monitoring.flops.model_flops,
        the count the Trainer logs."""
        from nanosft.monitoring.flops import model_flops

        c = self.hf_config
        d, layers = c.hidden_size, c.num_hidden_layers
        kv = d // c.num_attention_heads * c.num_key_value_heads
        per_layer = {"q_proj": (d, d), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (d, d),
                     "gate_proj": (d, c.intermediate_size), "up_proj": (d, c.intermediate_size),
                     "down_proj": (c.intermediate_size, d)}
        n_base = layers * sum(i * o for i, o in per_layer.values()) + d * c.vocab_size
        n_lora = layers * sum(self.opts.lora_r * (i + o) for i, o in per_layer.values())
        weights, trainable = (n_base, n_base) if mode == "full" else (n_base + n_lora, n_lora)
        return [model_flops(weights, trainable, d, layers,
                            [len(self.rows[i]["input_ids"]) for mb in step for i in mb])
                for step in self.plan]

    def gemm_shapes(self):
        """(M, K, N, count) of the model's matrix products for one micro-batch of mean length:
        the forward x @ W^T and the input gradient g @ W of every linear layer and lm_head."""
        c = self.hf_config
        d, kv = c.hidden_size, c.hidden_size // c.num_attention_heads * c.num_key_value_heads
        mean_len = statistics.mean(len(r["input_ids"]) for r in self.rows)
        m = int(self.opts.batch_size * mean_len)
        layers, inter = c.num_hidden_layers, c.intermediate_size
        shapes = [
            (d, d, 2), (d, kv, 2), (d, inter, 2), (inter, d, 1), (d, c.vocab_size, 1 / layers)
        ]
        out = []
        for k, n, count in shapes:
            out += [(m, k, n, count * layers), (m, n, k, count * layers)]
        return out


def calibrate_matmul(fx, dtype, device, repeats=3):
    """GFLOP/s of torch.mm at the model's own GEMM shapes (weighted by how often each occurs): the
    rate this machine multiplies such matrices at, to read a training run's GFLOP/s against."""
    total_flops, total_s = 0.0, 0.0
    for m, k, n, count in fx.gemm_shapes():
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        torch.mm(a, b)  # warm the kernel and the pages
        best = float("inf")
        for _ in range(repeats):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            torch.mm(a, b)
            if device == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        total_flops += 2 * m * k * n * count
        total_s += best * count
    return total_flops / total_s / 1e9


def _tokenizer_folder(workdir):
    """A tiny BPE (pad = <|endoftext|> = id 0) saved as an HF folder: both SFT trainers need
    a processing_class."""
    from nanosft.tokenizer import Tokenizer

    folder = os.path.join(workdir, "tokenizer")
    if not os.path.isdir(folder):
        texts = [f"example {i}: the quick brown fox {i * 7} jumps" for i in range(200)]
        tok = Tokenizer.train(texts, vocab_size=300)
        if tok.pad_token_id != PAD_ID:
            raise RuntimeError(f"tokenizer: pad id {tok.pad_token_id}, the data pads with {PAD_ID}")
        tok.save_pretrained(folder)
    return folder


def _trainer_kwargs(case, opts, steps, output_dir):
    """The arguments every trainer gets, under the names transformers, TRL and nanosft share."""
    return {
        "output_dir": output_dir,
        "per_device_train_batch_size": opts.batch_size,
        "gradient_accumulation_steps": opts.grad_accum,
        "max_steps": steps,
        "learning_rate": opts.learning_rate,
        "lr_scheduler_type": "linear",
        "warmup_steps": 0,
        "weight_decay": 0.0,
        "max_grad_norm": opts.max_grad_norm,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "seed": opts.seed,
        "bf16": case.bf16,
        "fp16": False,
        "gradient_checkpointing": case.gradient_checkpointing,
        "torch_compile": case.torch_compile,
        "use_cpu": opts.device == "cpu",
        "dataloader_num_workers": 0,
    }


def _logged_losses(log_history):
    return [h["loss"] for h in log_history if "loss" in h and "train_loss" not in h]


def _cast_adapters_bf16(model):
    """TRL's QLoRA step: trainable params except DoRA magnitudes become bf16, as trl
    SFTTrainer.__init__ casts them when the base is quantized."""
    for name, p in model.named_parameters():
        if p.requires_grad and "lora_magnitude_vector" not in name:
            p.data = p.data.to(torch.bfloat16)


# ----------------------------------------------------------------------------- the stacks
def run_reference(fx, case, workdir, attn_implementation="sdpa"):
    """transformers Trainer (full) or TRL SFTTrainer + peft LoRA / DoRA / QLoRA (BitsAndBytesConfig
    NF4). attn_implementation="eager": the reference against itself on another attention path."""
    import datasets
    from transformers import AutoTokenizer, Trainer, TrainingArguments
    from trl import SFTConfig, SFTTrainer
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    opts = fx.opts
    kwargs = _trainer_kwargs(case, opts, fx.max_steps, os.path.join(workdir, "ref-out"))
    dataset = datasets.Dataset.from_list(fx.rows)
    model = fx.hf_model(case.mode == "qlora", case.dtype, attn_implementation)
    if case.mode == "full":
        trainer = Trainer(
            model=model,
            args=TrainingArguments(**kwargs),
            train_dataset=dataset,
            data_collator=DataCollatorForLanguageModeling(pad_token_id=PAD_ID),
        )
    else:
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=opts.lora_r,
            lora_alpha=opts.lora_alpha,
            lora_dropout=0.0,
            target_modules=LORA_TARGETS,
            use_dora=case.mode == "dora",
            task_type="CAUSAL_LM",
        )
        tokenizer = AutoTokenizer.from_pretrained(fx.tokenizer_dir)
        sft_args = SFTConfig(**kwargs, max_length=None, padding_free=case.padding_free)
        trainer = SFTTrainer(
            model=model,
            args=sft_args,
            train_dataset=dataset,
            processing_class=tokenizer,
            peft_config=peft_config,
        )
    return measure(
        lambda: (trainer.train(), _logged_losses(trainer.state.log_history))[1],
        fx,
        case,
        _warmup(case, opts),
    )


def run_nanosft(fx, case, workdir, callbacks=()):
    """nanosft Trainer (full) or nanosft SFTTrainer + LoRA / DoRA / QLoRA
    (nanosft.nf4 over bitsandbytes); `callbacks`: extra nanosft TrainerCallbacks."""
    from nanosft.args import SFTConfig, TrainingArguments
    from nanosft.collator import DataCollatorForLanguageModeling
    from nanosft.peft import LoraConfig
    from nanosft.sft import SFTTrainer
    from nanosft.tokenizer import Tokenizer
    from nanosft.trainer import Trainer

    opts = fx.opts
    kwargs = _trainer_kwargs(case, opts, fx.max_steps, os.path.join(workdir, "nano-out"))
    model = fx.nano_model(case.mode == "qlora", case.dtype)
    rows = [dict(r) for r in fx.rows]
    if case.mode == "full":
        trainer = Trainer(
            model,
            TrainingArguments(**kwargs),
            train_dataset=rows,
            data_collator=DataCollatorForLanguageModeling(pad_token_id=PAD_ID),
            callbacks=list(callbacks),
        )
    else:
        peft_config = LoraConfig(
            r=opts.lora_r,
            lora_alpha=opts.lora_alpha,
            lora_dropout=0.0,
            target_modules=LORA_TARGETS,
            use_dora=case.mode == "dora",
        )
        sft_args = SFTConfig(**kwargs, max_length=None, padding_free=case.padding_free)
        trainer = SFTTrainer(
            model,
            sft_args,
            train_dataset=rows,
            processing_class=Tokenizer.from_pretrained(fx.tokenizer_dir),
            peft_config=peft_config,
            callbacks=list(callbacks),
        )
    return measure(
        lambda: (trainer.train(), _logged_losses(trainer.state.log_history))[1],
        fx,
        case,
        _warmup(case, opts),
    )


def run_bare(fx, case, workdir, which):
    """bare_loop over the reference model (+ peft adapters) or over nanosft's model (+ nanosft
    adapters)."""
    opts = fx.opts
    quantized = case.mode == "qlora"
    if which == "hf":
        model = fx.hf_model(quantized, case.dtype)
        # as both SFT trainers: seed right before get_peft_model draws LoRA A
        torch.manual_seed(opts.seed)
        if case.mode != "full":
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(
                model,
                LoraConfig(
                    r=opts.lora_r,
                    lora_alpha=opts.lora_alpha,
                    lora_dropout=0.0,
                    target_modules=LORA_TARGETS,
                    use_dora=case.mode == "dora",
                    task_type="CAUSAL_LM",
                ),
            )
    else:
        model = fx.nano_model(quantized, case.dtype)
        torch.manual_seed(opts.seed)
        if case.mode != "full":
            from nanosft.peft import LoraConfig, get_peft_model

            model = get_peft_model(
                model,
                LoraConfig(
                    r=opts.lora_r,
                    lora_alpha=opts.lora_alpha,
                    lora_dropout=0.0,
                    target_modules=LORA_TARGETS,
                    use_dora=case.mode == "dora",
                ),
            )
    if quantized:
        _cast_adapters_bf16(model)
    if case.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    if case.torch_compile:
        model = torch.compile(model)
    return measure(
        lambda: bare_loop(model, fx.rows, fx.plan, opts, bf16=case.bf16),
        fx,
        case,
        _warmup(case, opts),
    )


def _warmup(case, opts):
    # compile: the first shapes compile, the next ones recompile with dynamic shapes
    return max(opts.warmup, 3) if case.torch_compile else opts.warmup


STACKS = {
    "ref": run_reference,
    "nano": run_nanosft,
    "bare-hf": lambda fx, case, wd: run_bare(fx, case, wd, "hf"),
    "bare-nano": lambda fx, case, wd: run_bare(fx, case, wd, "nano"),
    "ref-eager": lambda fx, case, wd: run_reference(fx, case, wd, "eager"),
}


def stacks_for(case, bare):
    """Which stacks a case runs: the bare loops only for the four plain fp32 set-ups."""
    if not _is_plain(case):
        return ["ref", "nano"]
    return ["ref", "nano", *[f"bare-{b}" for b in bare]]


def build_cases(modes, extras):
    """The plain set-ups, then the switches, each on LoRA."""
    cases = [Case(m) for m in modes]
    if "gc" in extras:
        cases.append(Case("lora", gradient_checkpointing=True))
    if "compile" in extras:
        cases.append(Case("lora", torch_compile=True))
    if "bf16" in extras:
        cases.append(Case("lora", bf16=True))
    if "padfree" in extras:
        cases.append(Case("lora", padding_free=True))
    return cases


def run_all(
    sizes, cases, opts, reps, bare, workdir, only=None, extras_sizes=None, on_rep=None, log=print
):
    """Every (size, case, stack) `reps` times, interleaved: each repetition alternates which
    stack goes first.

    `only`: stack names to run (e.g. {"nano"} under a sampling profiler); `extras_sizes`: sizes that
    also run the switch cases (default: all); `on_rep(results)` is called after each size of each
    repetition (partial results on disk).
    """
    results, fixtures = {}, {}  # (size, case name, stack) -> [Run]; size -> Fixture
    for rep in range(
        reps
    ):  # repetitions outermost: partial results on disk always cover every size
        for size in sizes:
            fx = fixtures.get(size) or fixtures.setdefault(size, Fixture(size, opts, workdir))
            for case in cases:
                if not _is_plain(case) and extras_sizes is not None and size not in extras_sizes:
                    continue
                stacks = [st for st in stacks_for(case, bare) if only is None or st in only]
                if rep % 2 == 1:
                    stacks = stacks[::-1]
                for stack in stacks:
                    run = STACKS[stack](fx, case, workdir)
                    results.setdefault((size, case.name, stack), []).append(run)
                    log(
                        f"[{size} rep {rep} {case.name:14s} {stack:9s}] "
                        f"{run.tokens_per_s:8.0f} tok/s  "
                        f"{run.tokens_per_cpu_s:8.0f} tok/cpu-s  "
                        f"{statistics.median(run.step_times):.3f} s/step  "
                        f"peak {run.peak_mib:7.1f} MiB  wall {run.wall_s:5.1f} s  "
                        f"loss {run.losses[0]:.4f} -> {run.losses[-1]:.4f}"
                    )
                    gc.collect()
            if on_rep is not None:
                on_rep(results)
    return results


def _is_plain(case):
    return not (case.gradient_checkpointing or case.torch_compile or case.bf16 or case.padding_free)


# ----------------------------------------------------------------------------- report
def _median_run(runs):
    """Medians over repetitions of one (size, case, stack)."""
    return {
        "tok_s": statistics.median(r.tokens_per_s for r in runs),
        "tok_cpu_s": statistics.median(r.tokens_per_cpu_s for r in runs),
        "s_step": statistics.median(t for r in runs for t in r.step_times),
        "peak": statistics.median(r.peak_mib for r in runs),
        "losses": runs[0].losses,
    }


def _max_dloss(a, b):
    return max(abs(x - y) for x, y in zip(a, b))


def summarize(results, sizes, cases, bare):
    """One row per (size, case): medians over repetitions, ratios nanosft / reference and / bare
    loops, and for the switches (gc, compile, bf16, padfree) nanosft against its own plain fp32
    LoRA run."""
    rows = []
    for size in sizes:
        plain_lora = results.get((size, "lora", "nano"))
        plain_ref = results.get((size, "lora", "ref"))
        for case in cases:
            if not any(results.get((size, case.name, st)) for st in ("ref", "nano")):
                continue  # not run at this size (switches run at --extras-sizes only)
            row = {"size": size, "case": case.name}
            for stack in ("ref", "nano", *[f"bare-{b}" for b in bare]):
                if results.get((size, case.name, stack)):
                    row[stack] = _median_run(results[(size, case.name, stack)])
            nano, ref = row.get("nano"), row.get("ref")
            if nano and ref:
                row["vs_ref"], row["vs_ref_cpu"] = (
                    nano["tok_s"] / ref["tok_s"],
                    nano["tok_cpu_s"] / ref["tok_cpu_s"],
                )
                row["dloss"] = _max_dloss(nano["losses"], ref["losses"])
            for b in bare:
                floor = row.get(f"bare-{b}")
                if nano and floor:
                    row[f"vs_bare-{b}"] = nano["tok_s"] / floor["tok_s"]
                    row[f"vs_bare-{b}_cpu"] = nano["tok_cpu_s"] / floor["tok_cpu_s"]
            if ref and row.get("bare-hf"):
                row["bare_dloss"] = _max_dloss(row["bare-hf"]["losses"], ref["losses"])
            if nano and plain_lora and case.name != "lora" and case.mode == "lora":
                base = _median_run(plain_lora)
                row["vs_plain"] = nano["tok_s"] / base["tok_s"]
                row["vs_plain_cpu"] = nano["tok_cpu_s"] / base["tok_cpu_s"]
                row["peak_vs_plain"] = nano["peak"] - base["peak"]
                row["dloss_plain"] = _max_dloss(nano["losses"], base["losses"])
            if ref and plain_ref and case.name != "lora" and case.mode == "lora":
                base = _median_run(plain_ref)
                row["ref_vs_plain"] = (
                    f"{ref['tok_s'] / base['tok_s']:.2f} "
                    f"({ref['tok_cpu_s'] / base['tok_cpu_s']:.2f})"
                )
                row["ref_peak_vs_plain"] = f"{ref['peak'] - base['peak']:+.0f}"
            rows.append(row)
    return rows


def _fmt(value, spec):
    return "-" if value is None else format(value, spec)


def _get(row, stack, key):
    return (row.get(stack) or {}).get(key)


def _ratio_cell(row, key):
    """'wall (cpu)' ratio text, or '-' when the row has no such pair."""
    return "-" if row.get(key) is None else f"{row[key]:.2f} ({row[key + '_cpu']:.2f})"


def table(rows, bare):
    """Markdown table: speeds (wall clock), the ratios by wall clock and by CPU time, s/step,
    peak memory, dloss."""
    head = [
        "size",
        "case",
        "ref tok/s",
        "nanosft tok/s",
        *[f"bare-{b} tok/s" for b in bare],
        "nanosft/ref (cpu)",
        *[f"nanosft/bare-{b} (cpu)" for b in bare],
        "ref s/step",
        "nanosft s/step",
        "ref peak MiB",
        "nanosft peak MiB",
        "max abs dloss",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [
            r["size"],
            r["case"],
            _fmt(_get(r, "ref", "tok_s"), ".0f"),
            _fmt(_get(r, "nano", "tok_s"), ".0f"),
            *[_fmt(_get(r, f"bare-{b}", "tok_s"), ".0f") for b in bare],
            _ratio_cell(r, "vs_ref"),
            *[_ratio_cell(r, f"vs_bare-{b}") for b in bare],
            _fmt(_get(r, "ref", "s_step"), ".3f"),
            _fmt(_get(r, "nano", "s_step"), ".3f"),
            _fmt(_get(r, "ref", "peak"), ".0f"),
            _fmt(_get(r, "nano", "peak"), ".0f"),
            _fmt(r.get("dloss"), ".1e"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def switch_table(rows):
    """nanosft with a switch on against its plain fp32 LoRA run: speed, memory and loss change."""
    if not any("vs_plain" in r for r in rows):
        return "(no switch was run beside a plain LoRA run)"
    lines = [
        (
            "| size | switch | nanosft tok/s vs plain LoRA (cpu) | nanosft peak MiB change "
            "| max abs dloss vs plain | reference tok/s vs its plain LoRA (cpu) "
            "| reference peak MiB change |"
        ),
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "vs_plain" in r:
            lines.append(
                f"| {r['size']} | {r['case']} | {r['vs_plain']:.2f} ({r['vs_plain_cpu']:.2f}) | "
                f"{r['peak_vs_plain']:+.0f} | {r['dloss_plain']:.1e} | "
                f"{r.get('ref_vs_plain', '-')} | {r.get('ref_peak_vs_plain', '-')} |"
            )
    return "\n".join(lines)


def onednn_kernels():
    """What oneDNN says in a fresh process (ONEDNN_VERBOSE=1): the CPU ISA it dispatches for and
    the kernel of a bf16 GEMM at the model's shapes, e.g. "brg_matmul:avx512_core_amx" (AMX),
    "brg_matmul:avx512_core_bf16" (AVX512-BF16). None where torch runs no oneDNN kernel."""
    probe = ("import torch; a = torch.randn(64, 576, dtype=torch.bfloat16); "
             "torch.mm(a, torch.randn(576, 1536, dtype=torch.bfloat16))")
    out = subprocess.run([sys.executable, "-c", probe], check=False, capture_output=True,
                         text=True, env={**os.environ, "ONEDNN_VERBOSE": "1"}).stdout
    isa = next((ln.split("isa:", 1)[1] for ln in out.splitlines() if ",isa:" in ln), None)
    kernel = next((ln.split(",")[6] for ln in out.splitlines()
                   if ",primitive,exec,cpu,matmul," in ln), None)
    return {"isa": isa, "bf16_matmul": kernel}


def machine_info():
    """CPU model, cores, bf16 matrix units, load, library versions and the nanosft commit."""
    import importlib.metadata as md

    cpu, flags = platform.processor() or "unknown", set()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    versions = {}
    for name in ("torch", "transformers", "trl", "peft", "accelerate", "bitsandbytes", "datasets"):
        with contextlib.suppress(md.PackageNotFoundError):
            versions[name] = md.version(name)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        check=False,
        capture_output=True,
        text=True,
        cwd=os.path.dirname(os.path.abspath(__file__)),
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--short", "--", "nanosft"],
        check=False,
        capture_output=True,
        text=True,
        cwd=os.path.dirname(os.path.abspath(__file__)),
    ).stdout.split("\n")
    dirty = [line[3:] for line in dirty if line.strip()]
    if dirty:
        commit = f"{commit or 'unknown'} (uncommitted changes in {', '.join(dirty)})"
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "gpu": gpu,
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "amx_bf16": "amx_bf16" in flags,
        "avx512_bf16": "avx512_bf16" in flags,
        "onednn": onednn_kernels() if torch.backends.mkldnn.is_available() else {},
        "loadavg": os.getloadavg(),
        "python": platform.python_version(),
        "versions": versions,
        "nanosft_commit": commit or "unknown",
    }


def write_results(path, text):
    """Write atomically: a temp file in the same folder, then os.replace."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".results-", suffix=".md")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def keep_sections(path, text):
    """`text` plus the marked sections (<!-- section: NAME --> ... <!-- end: NAME -->) that `path`
    holds and `text` does not: the small/medium run and the real-size runs share one RESULTS.md."""
    try:
        with open(path, encoding="utf-8") as f:
            old = f.read()
    except OSError:
        return text
    for start in re.finditer(r"<!-- section: ([\w.-]+) -->", old):
        name = start.group(1)
        end = old.find(f"<!-- end: {name} -->", start.end())
        if end != -1 and f"<!-- section: {name} -->" not in text:
            text += "\n" + old[start.start() : end + len(f"<!-- end: {name} -->")] + "\n"
    return text


def replace_section(path, section):
    """The text of `path` with its marked section of the same name replaced by `section` (or
    `section` appended when there is none yet)."""
    name = re.match(r"<!-- section: ([\w.-]+) -->", section).group(1)
    try:
        with open(path, encoding="utf-8") as f:
            old = f.read()
    except OSError:
        return section
    start, end_mark = old.find(f"<!-- section: {name} -->"), f"<!-- end: {name} -->"
    if start == -1 or old.find(end_mark, start) == -1:
        return old.rstrip("\n") + "\n\n" + section
    end = old.find(end_mark, start) + len(end_mark)
    return old[:start] + section.rstrip("\n") + old[end:]


def render_real(results, calibration, fx, info, command, started, finished, notes="",
                dequantize=()):
    """The real-size section of RESULTS.md: machine, set-up, calibration and the table."""
    rows = next((k for k, v in REAL_ROWS.items() if SIZE_DATA[REAL_SIZE].items() >= v.items()),
                "chat")
    # one section per row set: the short-row case sits beside the long one in RESULTS.md
    name = f"real-size-{fx.opts.device}" + ("" if rows == "chat" else f"-{rows}-rows")
    c = fx.hf_config
    lengths = [len(r["input_ids"]) for r in fx.rows]
    lines = [
        f"<!-- section: {name} -->",
        f"## Real size ({REAL_SIZE} shapes, {fx.opts.device}"
        + ("" if rows == "chat" else f", {rows} rows") + ")", "",
        f"Command: `{command}`", "",
        f"Run {started} to {finished} UTC on {info['cpu']}, {info['cores']} cores, torch threads "
        f"{info['torch_threads']}{', ' + info['gpu'] if info.get('gpu') else ''}. Versions: "
        + ", ".join(f"{k} {v}" for k, v in info["versions"].items())
        + f", nanosft at commit {info['nanosft_commit']}.", "",
        f"Model: Llama, hidden {c.hidden_size}, {c.num_hidden_layers} layers, "
        f"{c.num_attention_heads} query / {c.num_key_value_heads} KV heads, intermediate "
        f"{c.intermediate_size}, vocabulary {c.vocab_size}, tied embeddings, random weights. Data: "
        f"{len(lengths)} sequences of {min(lengths)}-{max(lengths)} tokens (mean "
        f"{statistics.mean(lengths):.0f}), every token supervised, right-padded; batch "
        f"{fx.opts.batch_size} x accumulation {fx.opts.grad_accum}; {fx.opts.warmup} warmup + "
        f"{fx.opts.steps} timed optimizer steps; best of the repetitions. LoRA r={fx.opts.lora_r} "
        f"on all seven projections. bf16w: the user's bf16 recipe, weights loaded in bf16 (QLoRA: "
        "bnb_4bit_compute_dtype=bf16, the rest bf16) and bf16=True, on both stacks.", "",
        "Matmul calibration at the model's own GEMM shapes (torch.mm, best of 3): "
        + ", ".join(f"{k} {v:.1f} GFLOP/s" for k, v in calibration.items())
        + (f"; bf16 / fp32 {calibration['bf16'] / calibration['fp32']:.2f}x"
           if {"bf16", "fp32"} <= set(calibration) else "") + ". oneDNN: ISA "
        + f"{info.get('onednn', {}).get('isa')}, bf16 GEMM kernel "
        + f"{info.get('onednn', {}).get('bf16_matmul')}.", "",
        real_table(results, calibration, fx), "",
        *(["NF4 dequantize per call (the first MLP weight, double quant, blocksize 64; best of "
           "200 interleaved calls; page faults from getrusage; the speed path's time includes "
           "decoding the absmax, as a forward does):", *dequantize, ""] if dequantize else []),
        "GFLOP/s: model FLOPs, 6N per token for full fine-tuning and 4N for a frozen base (plus 6 "
        "per LoRA weight), plus causal attention, over the timed steps; % matmul: that rate over "
        "the calibration of the case's dtype. vs own fp32: nanosft bf16 over nanosft fp32 tok/s "
        "(in brackets per CPU second). nanosft/ref (CPU s): tokens per CPU second of the process, "
        "all threads, each stack's best repetition by that measure (a busy machine hurts it "
        "less than wall time); CPU s / step: nanosft's, the timed steps' mean. "
        "peak MiB: peak RSS (CPU) or max_memory_allocated (CUDA) above the level at train()'s "
        "start. max dloss ref-ref(eager): the reference against itself with eager instead of SDPA "
        "attention, the yardstick for nanosft's bf16 difference.",
    ]
    if notes:
        lines += ["", notes]
    return "\n".join(lines) + f"\n<!-- end: {name} -->\n"


def render_results(rows, bare, info_before, info_after, command, opts, started, finished, notes=""):
    """RESULTS.md: machine, versions, command, set-up, the tables and how to read them."""
    info = info_before
    lines = [
        "# nanosft benchmark results",
        "",
        f"Command: `{command}`",
        "",
        (
            f"Run {started} to {finished} UTC. Machine: {info['cpu']}, {info['cores']} cores "
            f"(torch threads {info['torch_threads']}), "
            f"AVX512-BF16 {'yes' if info['avx512_bf16'] else 'no'}, "
            f"AMX-BF16 {'yes' if info['amx_bf16'] else 'no'}. Load average at start "
            f"{', '.join(f'{x:.1f}' for x in info_before['loadavg'])}, at end "
            f"{', '.join(f'{x:.1f}' for x in info_after['loadavg'])}."
        ),
        "",
        "Versions: Python "
        + info["python"]
        + ", "
        + ", ".join(f"{k} {v}" for k, v in info["versions"].items())
        + f", nanosft at commit {info['nanosft_commit']}.",
        "",
        (
            f"Set-up: fp32 unless the case says bf16; batch {opts.batch_size} x accumulation "
            f"{opts.grad_accum}; {opts.warmup} warmup + {opts.steps} timed optimizer steps; lr "
            f"{opts.learning_rate}, linear decay, max_grad_norm {opts.max_grad_norm}; LoRA "
            f"r={opts.lora_r} alpha={opts.lora_alpha} on {', '.join(LORA_TARGETS)}; vocab "
            f"{VOCAB_SIZE}, sequences 75-250 tokens, right-padded per micro-batch on every stack "
            "except the padfree rows (padding_free=True on both SFT trainers); logging every "
            "step on every stack; trainer output sent to /dev/null."
        ),
        "",
        table(rows, bare),
        "",
        (
            "tok/s: non-pad tokens per second of wall clock over the timed steps (median over "
            "repetitions). Ratios are by wall clock, and in parentheses by tokens per CPU-second "
            "of the benchmark process, which other processes on a shared machine disturb less. "
            "s/step: median seconds per optimizer step after warmup. peak MiB: peak RSS above "
            "the level at the start of train() (CPU; in-process, so allocator reuse between runs "
            "blurs it by tens of MiB) or max_memory_allocated (CUDA). max abs dloss: largest "
            "per-step difference of the logged loss, nanosft against the reference. bare-hf: a "
            "plain PyTorch loop over the reference model (+ peft adapters); bare-nano: the same "
            "loop over nanosft's model (+ nanosft adapters)."
        ),
        "",
        "Switches, nanosft against its own plain fp32 LoRA run of the same size:",
        "",
        switch_table(rows),
        "",
        "Analysis, profiles and recommendations: benchmarks/README.md.",
    ]
    if notes:
        lines += ["", notes]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- dequantize per call
def _minor_faults():
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def dequantize_per_call(weight, dtype=torch.float32, calls=200):
    """One NF4 weight (double quant, blocksize 64) dequantized, interleaved, best of `calls`:
    bitsandbytes.functional.dequantize_4bit called directly (a new tensor each call) against
    nanosft's speed path as a forward runs it (the absmax decoded, bitsandbytes' CPU kernel into
    the reused workspace; nanosft.fast.nf4). Returns {path: (best ms, page faults per call)}, plus
    "equal": both give the same bits. CPU only."""
    import bitsandbytes.functional as bnbF

    from nanosft.fast import nf4 as fast_nf4
    from nanosft.nf4 import Linear4bit

    out_f, in_f = weight.shape
    layer = Linear4bit(in_f, out_f, bias=False, compute_dtype=dtype, weight=weight.to(dtype))
    qs, packed = layer.quant_state, layer.weight.data.view(-1, 1)

    def nanosft_call():
        return fast_nf4.dequantize_into_workspace(packed, qs, fast_nf4.decoded_absmax(qs), dtype)

    paths = {"bitsandbytes": lambda: bnbF.dequantize_4bit(layer.weight.data, qs),
             "nanosft": nanosft_call}
    equal = torch.equal(paths["bitsandbytes"](), paths["nanosft"]())
    best, faults = dict.fromkeys(paths, float("inf")), dict.fromkeys(paths, 0)
    for _ in range(calls):
        for name, call in paths.items():
            f0, t0 = _minor_faults(), time.perf_counter()
            out = call()
            best[name] = min(best[name], time.perf_counter() - t0)
            faults[name] += _minor_faults() - f0
            del out
    result = {name: (best[name] * 1e3, faults[name] / calls) for name in paths}
    result["equal"] = equal
    return result


def dequantize_lines(fx, dtypes, calls=200):
    """The RESULTS.md lines: per-call dequantize of the first MLP weight (intermediate x hidden),
    nanosft against bitsandbytes direct, in each compute dtype of the run."""
    weight = fx.state_dict["model.layers.0.mlp.gate_proj.weight"]
    lines = []
    for name in dtypes:
        r = dequantize_per_call(weight, REAL_DTYPES[name], calls)
        (b_ms, b_pf), (n_ms, n_pf) = r["bitsandbytes"], r["nanosft"]
        lines.append(f"- {name}, {tuple(weight.shape)}: nanosft {n_ms:.3f} ms ({n_pf:.0f} page "
                     f"faults a call), bitsandbytes.functional.dequantize_4bit direct {b_ms:.3f} "
                     f"ms ({b_pf:.0f}); nanosft / bitsandbytes {n_ms / b_ms:.2f}; same bits: "
                     f"{'yes' if r['equal'] else 'NO'}")
    return lines


# ----------------------------------------------------------------------------- the real-size case
REAL_MODES = ("lora", "qlora", "full")
REAL_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def real_cases(modes=REAL_MODES, dtypes=tuple(REAL_DTYPES)):
    """fp32, then the user's bf16 recipe (weights or NF4 compute dtype in bf16, bf16=True)."""
    plain = [Case(m) for m in modes] if "fp32" in dtypes else []
    return plain + [Case(m, bf16=True, weights_bf16=True) for m in modes if "bf16" in dtypes]


def run_real(opts, reps, workdir, modes=REAL_MODES, only=None, on_rep=None, log=print,
             dtypes=tuple(REAL_DTYPES)):
    """The real-size model through every case, reference and nanosft interleaved; in bf16 the
    reference runs a second time on eager attention, to show how far it moves from itself.
    `on_rep(results, calibration, fx)` runs after every case (partial results on disk).
    Returns (results, calibration GFLOP/s by dtype, the fixture)."""
    fx = Fixture(REAL_SIZE, opts, workdir)
    calibration = {}
    for name in dtypes:
        calibration[name] = calibrate_matmul(fx, REAL_DTYPES[name], opts.device)
        log(f"matmul calibration {name}: {calibration[name]:.1f} GFLOP/s "
            "at the model's GEMM shapes")
    results = {}
    for rep in range(reps):
        for case in real_cases(modes, dtypes):
            stacks = ["ref", "nano", *(["ref-eager"] if case.weights_bf16 else [])]
            stacks = [st for st in stacks if only is None or st in only]
            for stack in stacks if rep % 2 == 0 else stacks[::-1]:
                run = STACKS[stack](fx, case, workdir)
                results.setdefault((REAL_SIZE, case.name, stack), []).append(run)
                log(f"[{REAL_SIZE} rep {rep} {case.name:12s} {stack:9s}] "
                    f"{run.tokens_per_s:7.0f} tok/s "
                    f"{run.gflops:7.1f} GFLOP/s  {statistics.median(run.step_times):.2f} s/step  "
                    f"peak {run.peak_mib:7.1f} MiB  "
                    f"loss {run.losses[0]:.4f} -> {run.losses[-1]:.4f}")
                gc.collect()
            if on_rep is not None:
                on_rep(results, calibration, fx)
    return results, calibration, fx


def real_table(results, calibration, fx, modes=REAL_MODES):
    """One row per case: best-of-repetitions speed of each stack, GFLOP/s and its share of the
    calibrated matmul rate, peak memory, and the loss differences (nanosft vs reference; in bf16
    also the reference vs itself on eager attention)."""
    head = ["case", "nanosft tok/s", "ref tok/s", "nanosft/ref", "nanosft/ref (CPU s)",
            "nanosft CPU s / step", "nanosft GFLOP/s (% matmul)",
            "ref GFLOP/s (% matmul)", "vs own fp32", "nanosft peak MiB", "ref peak MiB",
            "peak nanosft/ref", "max dloss nanosft-ref", "max dloss ref-ref(eager)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    best = {k: max(v, key=lambda r: r.tokens_per_s) for k, v in results.items()}
    best_cpu = {k: max(v, key=lambda r: r.tokens_per_cpu_s) for k, v in results.items()}
    fx_tokens = fx.tokens[fx.opts.warmup:]
    for case in real_cases(modes, tuple(calibration)):
        nano = best.get((REAL_SIZE, case.name, "nano"))
        ref = best.get((REAL_SIZE, case.name, "ref"))
        if not (nano and ref):
            continue
        cal = calibration["bf16" if case.weights_bf16 else "fp32"]
        fp32 = best.get((REAL_SIZE, case.mode, "nano"))
        cpu_fp32 = best_cpu.get((REAL_SIZE, case.mode, "nano"))
        cpu_nano, cpu_ref = (best_cpu[(REAL_SIZE, case.name, st)] for st in ("nano", "ref"))
        eager = best.get((REAL_SIZE, case.name, "ref-eager"))
        cells = [case.name, f"{nano.tokens_per_s:.0f}", f"{ref.tokens_per_s:.0f}",
                 f"{nano.tokens_per_s / ref.tokens_per_s:.2f}",
                 f"{cpu_nano.tokens_per_cpu_s / cpu_ref.tokens_per_cpu_s:.2f}",
                 f"{statistics.mean(fx_tokens) / cpu_nano.tokens_per_cpu_s:.2f}",
                 f"{nano.gflops:.1f} ({100 * nano.gflops / cal:.0f}%)",
                 f"{ref.gflops:.1f} ({100 * ref.gflops / cal:.0f}%)",
                 (f"{nano.tokens_per_s / fp32.tokens_per_s:.2f} "
                  f"({cpu_nano.tokens_per_cpu_s / cpu_fp32.tokens_per_cpu_s:.2f})"
                  if fp32 and case.weights_bf16 else "-"),
                 f"{nano.peak_mib:.0f}", f"{ref.peak_mib:.0f}",
                 f"{nano.peak_mib / ref.peak_mib:.2f}",
                 f"{_max_dloss(nano.losses, ref.losses):.1e}",
                 f"{_max_dloss(eager.losses, ref.losses):.1e}" if eager else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- profiling
def profile(fx, case, stack, workdir, top=25):
    """One run under torch.profiler; prints the ops with the largest self CPU time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        run = STACKS[stack](fx, case, workdir)
    print(
        f"{stack} {case.name}: {run.tokens_per_s:.0f} tok/s, "
        f"{statistics.median(run.step_times):.3f} s/step"
    )
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))
    return run


def _op_key(func, args, shapes):
    """The op's name, and with `shapes` its tensor arguments' dtypes and shapes, which tell apart
    the same op at different places (a norm's mul from rotary's, a weight's cast from x's)."""
    name = str(func.overloadpacket)
    if not shapes:
        return name
    dtypes = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    tensors += [t for a in args if isinstance(a, (list, tuple)) for t in a[:2]
                if isinstance(t, torch.Tensor)]
    described = [f"{dtypes.get(t.dtype, str(t.dtype).removeprefix('torch.'))}"
                 f"{list(t.shape)}" for t in tensors[:3]]
    return f"{name} {' '.join(described)}"


def _op_cpu_timer(shapes=False):
    """A TorchDispatchMode adding up the calling thread's CPU time per aten op (backward included:
    on CPU autograd runs on the caller's thread). Thread CPU time does not count the time a
    process waits for a core, which wall-clock profiles of a shared machine are full of.
    shapes=True: one row per op and argument dtypes / shapes (_op_key)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpCpuTimes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = {}  # op -> [CPU ms, calls]

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            start = time.thread_time_ns()
            out = func(*args, **(kwargs or {}))
            entry = self.ops.setdefault(_op_key(func, args, shapes), [0.0, 0])
            entry[0] += (time.thread_time_ns() - start) / 1e6
            entry[1] += 1
            return out

    return OpCpuTimes()


def profile_ops(fx, case, workdir, step=None, top=25, log=print, shapes=False):
    """nanosft on `case`, one thread: the CPU time of each aten op over one optimizer step (the
    first timed one unless `step`), ranked. Returns (the step's CPU ms, {op: [CPU ms, calls]}).
    What --profile cannot give on a shared machine: there a 0.1 ms op read 10-17 ms, OpenMP
    threads waiting for a descheduled sibling. Time outside aten ops (Python, bitsandbytes' ctypes
    kernels) is the step's CPU time minus the ops' sum. shapes=True: one row per op and argument
    dtypes / shapes, which says where in the model an op runs."""
    from nanosft.trainer_callback import TrainerCallback

    step = fx.opts.warmup if step is None else step
    timer, seen = _op_cpu_timer(shapes), {}

    class OneStep(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == step:
                seen["start"] = time.thread_time_ns()
                timer.__enter__()

        def on_step_end(self, args, state, control, **kwargs):
            if "start" in seen and "ms" not in seen:
                timer.__exit__(None, None, None)
                seen["ms"] = (time.thread_time_ns() - seen["start"]) / 1e6

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_nanosft(fx, case, workdir, callbacks=[OneStep()])
    finally:
        torch.set_num_threads(threads)
    ops = timer.ops
    total = sum(ms for ms, _ in ops.values())
    log(f"nano {case.name}, optimizer step {step}, one thread: {seen['ms']:.0f} CPU ms, "
        f"aten ops {total:.0f} ms, outside them {seen['ms'] - total:.0f} ms")
    for name, (ms, calls) in sorted(ops.items(), key=lambda kv: -kv[1][0])[:top]:
        width = 100 if shapes else 58
        log(f"  {name:{width}s} {ms:9.1f} ms {100 * ms / seen['ms']:5.1f} % {calls:6d} calls")
    return seen["ms"], ops


def parse_args(argv=None):
    """The command line (see the module docstring for a run)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="small,medium", help=f"comma list of {list(SIZES)}")
    p.add_argument(
        "--steps", type=int, default=10, help="timed optimizer steps per run (after warmup)"
    )
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=None,
                   help="repetitions, best (real size) or median kept (default 2; --real: 3)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument(
        "--extras", default=",".join(EXTRAS), help="gc,compile,bf16,padfree on LoRA ('' for none)"
    )
    p.add_argument(
        "--extras-sizes",
        default=None,
        help="sizes that run the switches (default: the last of --sizes)",
    )
    p.add_argument(
        "--bare",
        default="hf,nano",
        help="bare loops over the reference model and/or nanosft's model",
    )
    p.add_argument(
        "--quick", action="store_true", help="~1 minute smoke run: small size, 3 steps, 1 rep"
    )
    p.add_argument(
        "--profile", default=None, help="STACK:CASE, e.g. nano:lora or ref:full; prints top ops"
    )
    p.add_argument(
        "--profile-ops", default=None,
        help="CASE, e.g. qlora+bf16w: nanosft's CPU time per aten op over one step, one thread "
             "(for a shared machine; with --real and --real-layers for the real widths)")
    p.add_argument("--profile-top", type=int, default=25, help="--profile-ops: rows printed")
    p.add_argument("--profile-shapes", action="store_true",
                   help="--profile-ops: one row per op and argument dtypes / shapes")
    p.add_argument(
        "--stacks", default=None, help="run only these stacks: ref,nano,bare-hf,bare-nano"
    )
    p.add_argument(
        "--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)"
    )
    p.add_argument(
        "--out", default=None, help="results file (default benchmarks/RESULTS.md; not with --quick)"
    )
    p.add_argument("--real", action="store_true",
                   help=f"the real-size case ({REAL_SIZE} shapes): "
                        "LoRA, QLoRA, full in fp32 and bf16")
    p.add_argument("--real-modes", default=",".join(REAL_MODES), help="modes of the real-size case")
    p.add_argument("--real-rows", default="chat", choices=list(REAL_ROWS),
                   help="row lengths of the real-size case: chat 50-500 tokens, short 40-60")
    p.add_argument("--real-layers", type=int, default=None,
                   help="decoder layers of the real-size model (default 30; fewer: a smoke run)")
    p.add_argument("--real-dtypes", default=",".join(REAL_DTYPES),
                   help="fp32,bf16 (drop bf16 on a CPU without bf16 units: it is emulated there)")
    return p.parse_args(argv)


def main(argv=None):
    """Run the interleaved benchmark (or one profile); write RESULTS.md after every repetition."""
    args = parse_args(argv)
    args.reps = args.reps or (3 if args.real else 2)
    if args.quick:
        args.sizes, args.steps, args.warmup, args.reps = "small", 3, 1, 1
        args.extras = "gc,bf16,padfree" if args.extras == ",".join(EXTRAS) else args.extras
    sizes = [s for s in args.sizes.split(",") if s]
    for s in sizes:
        if s not in SIZES:
            raise SystemExit(f"--sizes: unknown size {s!r}; choose from {list(SIZES)}")
    modes = [m for m in args.modes.split(",") if m]
    extras = [e for e in args.extras.split(",") if e]
    bare = [b for b in args.bare.split(",") if b]
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device; use --device cpu")
    opts = Options(steps=args.steps, warmup=args.warmup, device=args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault(
        "HF_HUB_OFFLINE", "1"
    )  # everything is built in-process; never reach for the network
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    started = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    info_before = machine_info()
    if args.real_layers:
        SIZES[REAL_SIZE] = {**SIZES[REAL_SIZE], "num_hidden_layers": args.real_layers}
    SIZE_DATA[REAL_SIZE] = {**SIZE_DATA[REAL_SIZE], **REAL_ROWS[args.real_rows]}
    with tempfile.TemporaryDirectory(prefix="bench-sft-") as workdir:
        if args.profile_ops:
            known = build_cases(MODES, EXTRAS) + real_cases()
            case = next(c for c in known if c.name == args.profile_ops)
            profile_ops(Fixture(REAL_SIZE if args.real else sizes[-1], opts, workdir), case,
                        workdir, top=args.profile_top, shapes=args.profile_shapes)
            return
        if args.profile:
            stack, case_name = args.profile.split(":")
            known = build_cases(MODES, EXTRAS) + real_cases()
            case = next(c for c in known if c.name == case_name)
            size = REAL_SIZE if args.real else sizes[-1]
            profile(Fixture(size, opts, workdir), case, stack, workdir)
            return
        default_out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")
        command = "python " + " ".join(
            [
                os.path.relpath(sys.argv[0]) if argv is None else "bench_sft.py",
                *(sys.argv[1:] if argv is None else argv),
            ]
        )
        if args.real:
            out = args.out or default_out
            modes = [m for m in args.real_modes.split(",") if m]
            only = set(args.stacks.split(",")) if args.stacks else None
            dtypes = tuple(d for d in args.real_dtypes.split(",") if d)
            dequantize = []

            def report_real(results, calibration, fx, final=False):
                if final and args.device == "cpu" and "qlora" in modes:
                    dequantize.extend(dequantize_lines(fx, dtypes))
                text = render_real(results, calibration, fx, info_before, command, started,
                                   time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
                                   "" if final else "PARTIAL: the run was still going.",
                                   dequantize)
                write_results(out, replace_section(out, text))

            results, calibration, fx = run_real(opts, args.reps, workdir, modes, only,
                                                report_real, dtypes=dtypes)
            report_real(results, calibration, fx, final=True)
            print(real_table(results, calibration, fx, modes))
            print("\n".join(dequantize))
            print(f"wrote {out}")
            return
        cases = build_cases(modes, extras)
        only = set(args.stacks.split(",")) if args.stacks else None
        extras_sizes = set(args.extras_sizes.split(",")) if args.extras_sizes else {sizes[-1]}
        out = args.out or (None if args.quick else default_out)

        def report(results, final=False):
            rows = summarize(results, sizes, cases, bare)
            if final:
                print(table(rows, bare))
                print(switch_table(rows))
            if out:
                note = "" if final else "PARTIAL: the run was still going when this was written."
                finished = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
                text = render_results(rows, bare, info_before, machine_info(), command, opts,
                                      started, finished, note)
                write_results(out, keep_sections(out, text))

        results = run_all(sizes, cases, opts, args.reps, bare, workdir, only, extras_sizes, report)
        report(results, final=True)
        if out:
            print(f"wrote {out}")


if __name__ == "__main__":
    main()

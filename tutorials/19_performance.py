"""Tutorial 19: performance, measured (guide: 性能考虑 / performance).

Each of the guide's levers, measured in this run on a tiny Llama-family model: torch.profiler over
one training step (the top ops, the matmul share); torch.compile (speed and equal loss); gradient
checkpointing (activation bytes counted with saved_tensors_hooks, and the recompute time);
dataloader workers and pin_memory; bf16 autocast; and the batch-size search of
auto_find_batch_size, which retries on out-of-memory with a smaller batch. Timings are printed,
not asserted (a shared CPU is noisy); what is deterministic (op counts, byte counts, equal losses,
the batch sizes tried) is asserted.
Run:      python tutorials/19_performance.py             (torch.compile with backend="aot_eager")
          python tutorials/19_performance.py --inductor  (the default backend, inductor: C++
                                                          codegen, ~50 s of CPU compiling first)
Runtime:  about 15 s of CPU time, half of it torch.compile tracing (longer on a busy machine).
You should see:
  - the profiler's top ops and "aten::mm: 45 calls = 3 x 15 linears" with its share of the time;
  - compiled vs eager: step times and |loss difference|; checkpointing: saved bytes per layer drop
    to exactly the layer's inputs; worker and bf16 timings; the batch sizes auto_find_batch_size
    tried, equal to accelerate's find_executable_batch_size; "OK: performance checked".
"""

# %%
import contextlib
import io
import logging
import sys
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

from nanosft.args import TrainingArguments
from nanosft.collator import DataCollatorForLanguageModeling
from nanosft.model import CausalLM, ModelConfig
from nanosft.trainer import Trainer

torch.set_num_threads(1)
# dynamo warns at each graph break (the model's data-dependent `bool(attention_mask.all())`)
logging.getLogger("torch._dynamo").setLevel(logging.ERROR)
SMALL = {"vocab_size": 64, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
COLLATOR = DataCollatorForLanguageModeling(pad_token_id=0)
B, T = 8, 32


def banner(title):
    print(f"\n{'=' * 20} {title} {'=' * 20}")


def small_model(**overrides):
    torch.manual_seed(0)
    return CausalLM(ModelConfig(**{**SMALL, **overrides}))


def make_rows(n, length=T, seed=0):
    """`n` rows of `length` random ids, all trained on (equal lengths: no padding, one graph)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, SMALL["vocab_size"], (n, length), generator=g).tolist()
    return [{"input_ids": row, "labels": row} for row in ids]


def tiny_args(**overrides):
    return TrainingArguments(output_dir=tempfile.mkdtemp(), use_cpu=True, report_to="none",
                             disable_tqdm=True, save_strategy="no", logging_steps=1,
                             learning_rate=1e-3, **overrides)


def train_step(model, optimizer, batch):
    """One plain step: forward, loss, backward, optimizer step; returns the loss."""
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def seconds_per_call(fn, repeat):
    """Mean wall-clock seconds of fn() over `repeat` calls."""
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


BATCH = COLLATOR(make_rows(B))

# %% [markdown]
# ## torch.profiler: where one training step spends its time
# Self time (time in the op itself, not its children) sums to the step. Every nn.Linear is one
# aten::mm forward and two backward (grad of the input, grad of the weight).

# %%
banner("性能分析 / profiling: torch.profiler over one training step")
model = small_model()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
train_step(model, optimizer, BATCH)  # warm-up: the first step allocates the Adam moments
with profile(activities=[ProfilerActivity.CPU]) as prof:
    train_step(model, optimizer, BATCH)
events = prof.key_averages()
total = sum(e.self_cpu_time_total for e in events)
print(f"{'op':58s} calls   self ms   share")
for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:6]:
    print(f"{e.key[:58]:58s} {e.count:5d} {e.self_cpu_time_total / 1e3:9.2f} "
          f"{e.self_cpu_time_total / total:7.1%}")
matmul = [e for e in events if e.key in ("aten::mm", "aten::addmm", "aten::bmm")]
share = sum(e.self_cpu_time_total for e in matmul) / total
linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
mm_calls = sum(e.count for e in matmul)
print(f"aten::mm: {mm_calls} calls = 3 x {linears} linears; matmul share of the step {share:.1%}")
assert mm_calls == 3 * linears and 0 < share < 1

# %% [markdown]
# ## torch.compile: TrainingArguments(torch_compile=True) calls torch.compile(model)
# Compiling traces the model into graphs once (seconds), then runs the graphs. aot_eager captures
# forward and backward but runs the same aten ops (same numbers); inductor fuses them into
# generated kernels (float sums reordered: ~1e-6 differences), which pays on real model sizes;
# on this toy model the compiled step is not faster, and the first step costs the compile.

# %%
backend = "inductor" if "--inductor" in sys.argv else "aot_eager"
banner(f"torch.compile(model, backend={backend!r}): compile time, step time, same loss")
losses, times = {}, {}
for name in ("eager", "compiled"):
    model = small_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    runner = torch.compile(model, backend=backend) if name == "compiled" else model
    start = time.perf_counter()
    losses[name] = [train_step(runner, optimizer, BATCH).item()]  # the compile happens here
    first = time.perf_counter() - start
    times[name] = seconds_per_call(lambda: losses[name].append(
        train_step(runner, optimizer, BATCH).item()), repeat=5)
    print(f"{name:8s}: first step {first:6.2f} s, then {times[name] * 1e3:6.1f} ms per step")
diff = max(abs(a - b) for a, b in zip(losses["eager"], losses["compiled"]))
print(f"speed-up after compiling: {times['eager'] / times['compiled']:.2f}x; "
      f"max |loss difference| over 6 steps {diff:.1e}")
assert diff < (1e-6 if backend == "aot_eager" else 1e-4)

# %% [markdown]
# ## Gradient checkpointing: activation memory for recompute time
# saved_tensors_hooks sees every tensor autograd keeps for backward. A checkpointed layer keeps only
# its inputs (h, cos, sin) and recomputes the rest during backward.

# %%
banner("梯度检查点 / gradient checkpointing: bytes saved for backward, and the time it costs")


def saved_bytes(model):
    """Bytes of the non-parameter tensors autograd saves during one forward, and the loss."""
    params = {p.data_ptr() for p in model.parameters()}
    count = [0]

    def pack(t):
        if t.data_ptr() not in params:
            count[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**BATCH).loss
    loss.backward()
    return count[0]


measured = {}
for layers in (1, 2):
    for checkpointing in (False, True):
        model = small_model(num_hidden_layers=layers)
        if checkpointing:
            model.gradient_checkpointing_enable()
        measured[layers, checkpointing] = saved_bytes(model)
per_layer = {c: measured[2, c] - measured[1, c] for c in (False, True)}
head_dim = SMALL["hidden_size"] // SMALL["num_attention_heads"]
inputs_bytes = (B * T * SMALL["hidden_size"] + 2 * T * head_dim) * 4  # h, cos, sin in fp32
print(f"saved for backward, 2 layers: {measured[2, False]:,} B plain, {measured[2, True]:,} B "
      f"checkpointed\nper layer: {per_layer[False]:,} B plain, {per_layer[True]:,} B checkpointed "
      f"= h ({B}x{T}x{SMALL['hidden_size']}) + cos, sin ({T}x{head_dim}) in fp32")
assert per_layer[True] == inputs_bytes and per_layer[False] > 10 * inputs_bytes
step = {}
for checkpointing in (False, True):
    model = small_model()
    if checkpointing:
        model.gradient_checkpointing_enable()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step[checkpointing] = seconds_per_call(lambda: train_step(model, optimizer, BATCH), 5)
print(f"step time {step[False] * 1e3:.1f} ms plain, {step[True] * 1e3:.1f} ms checkpointed "
      f"({step[True] / step[False]:.2f}x: one more forward per layer)")

# %% [markdown]
# ## Dataloader workers and pin_memory
# Workers run __getitem__ and the collator in other processes, so slow row preparation (reading,
# tokenising) overlaps training. pin_memory puts batches in page-locked memory so the copy to a
# GPU can be asynchronous; without an accelerator there is nothing to pin for.

# %%
banner("数据加载 / dataloader_num_workers and pin_memory")


class SlowRows(torch.utils.data.Dataset):
    """Rows that take 15 ms each to produce, like reading and tokenising a document."""

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        time.sleep(0.015)
        return self.rows[i]


seen = {}
for workers in (0, 2):
    trainer = Trainer(small_model(), tiny_args(per_device_train_batch_size=8,
                                               dataloader_num_workers=workers),
                      train_dataset=SlowRows(make_rows(64)), data_collator=COLLATOR)
    start = time.perf_counter()
    seen[workers] = []
    for batch in trainer.get_train_dataloader():
        if not seen[workers]:
            first = time.perf_counter() - start  # with workers: their start-up, then one batch
        seen[workers].append(batch["input_ids"])
    print(f"dataloader_num_workers={workers}: first batch after {first:.2f} s, "
          f"{len(seen[workers])} batches in {time.perf_counter() - start:.2f} s")
assert all(torch.equal(a, b) for a, b in zip(seen[0], seen[2])) and len(seen[0]) == len(seen[2])
if torch.cuda.is_available():
    for pin in (False, True):
        batch = next(iter(torch.utils.data.DataLoader(make_rows(64, length=512), batch_size=64,
                                                      collate_fn=COLLATOR, pin_memory=pin)))
        copy = seconds_per_call(lambda: (batch["input_ids"].to("cuda", non_blocking=True),
                                         torch.cuda.synchronize()), 20)  # wait: the whole copy
        print(f"pin_memory={pin}: pinned {batch['input_ids'].is_pinned()}, "
              f"host-to-GPU copy of {batch['input_ids'].nbytes:,} B in {copy * 1e6:.0f} us")
else:
    print("pin_memory: no CUDA here, so nothing to pin for (torch warns and ignores it)")

# %% [markdown]
# ## bf16 autocast
# Matmuls in bfloat16, weights and grads in float32. Fast only where the CPU has bf16 units
# (avx512_bf16 / amx_bf16 in /proc/cpuinfo) or on a GPU; elsewhere it emulates and is slower.

# %%
banner("混合精度 / bf16 autocast vs fp32: step time and loss")
flags = open("/proc/cpuinfo").read() if sys.platform == "linux" else ""
print(f"this CPU: avx512_bf16 {'avx512_bf16' in flags}, amx_bf16 {'amx_bf16' in flags}")
runs = {}
for bf16 in (False, True):
    trainer = Trainer(small_model(), tiny_args(per_device_train_batch_size=8, max_steps=4,
                                               bf16=bf16),
                      train_dataset=make_rows(32), data_collator=COLLATOR)
    with contextlib.redirect_stdout(io.StringIO()):  # the banner and log lines
        metrics = trainer.train().metrics
    runs[bf16] = [h["loss"] for h in trainer.state.log_history if "grad_norm" in h]
    print(f"bf16={bf16!s:5s}: {metrics['train_runtime'] / 4 * 1e3:6.1f} ms per step, "
          f"first loss {runs[bf16][0]:.5f}")
print(f"|bf16 loss - fp32 loss| at step 1: {abs(runs[True][0] - runs[False][0]):.1e}")
assert abs(runs[True][0] - runs[False][0]) < 2e-2  # bf16 keeps ~3 significant digits

# %% [markdown]
# ## auto_find_batch_size: shrink the batch on out-of-memory and retry
# Trainer.train wraps _inner_training_loop in find_executable_batch_size: on an out-of-memory error
# the batch becomes int(0.9 x batch) and the loop starts again (accelerate 1.x; older versions
# halved). We simulate a device that fits at most 5 rows: a forward pre-hook raises CUDA's message.

# %%
banner("auto_find_batch_size: out of memory -> a smaller batch -> train")
FITS = 5


def out_of_memory_above(limit, tried):
    """A forward pre-hook that records each batch's rows and fails like CUDA above `limit`."""
    def hook(module, args, kwargs):
        rows = len(kwargs["input_ids"])
        tried.append(rows)
        if rows > limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    return hook


tried = []
model = small_model()
model.register_forward_pre_hook(out_of_memory_above(FITS, tried), with_kwargs=True)
trainer = Trainer(model, tiny_args(per_device_train_batch_size=16, auto_find_batch_size=True,
                                   max_steps=2),
                  train_dataset=make_rows(32), data_collator=COLLATOR)
with contextlib.redirect_stdout(io.StringIO()):
    trainer.train()
firsts = [tried[0]] + [b for a, b in zip(tried, tried[1:]) if b != a]  # first forward per attempt
print(f"batch sizes tried: {firsts}; trained with {trainer.state.train_batch_size} rows per batch")
try:
    from accelerate.utils import find_executable_batch_size
except ImportError:
    print("accelerate is not installed: skipping the side-by-side check")
else:
    theirs = []

    def attempt(batch_size):
        theirs.append(batch_size)
        if batch_size > FITS:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    find_executable_batch_size(attempt, starting_batch_size=16)()
    print(f"accelerate find_executable_batch_size tries: {theirs}")
    assert firsts == theirs
assert firsts[-1] == trainer.state.train_batch_size <= FITS < firsts[-2]
assert trainer.state.global_step == 2

print("\nOK: performance checked")

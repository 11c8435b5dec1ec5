"""Tutorial 20: monitoring a run, the guide's table (guide: 性能监控指标 / monitoring).

One tiny SFT run (full fine-tuning, fp32, 24 optimizer steps, a log every 2) reports through the
callbacks of nanosft.monitoring, and each row of the guide's table is read back and recomputed:
训练效率 (samples/s, tokens/s, and MFU in place of GPU utilisation), 内存使用 (the memory peak
beside the ledger's prediction), 收敛性能 (the loss curve), and where the figures land:
state.log_history, output_dir/metrics.jsonl and TensorBoard event files. Timings are only
checked for consistency (a shared CPU is noisy); counts and FLOPs are asserted exactly.
Run:      python tutorials/20_monitoring.py
Runtime:  about 6 s on one CPU core with transformers installed (half of it its import, for
          the tag check), 3 s without.
You should see:
  - per logging window: rows, non-padding tokens, the window's seconds, and tokens/s, samples/s
    recomputed from them; "tokens/s / samples/s = tokens per row" for every window;
  - the model FLOPs formula, 6N per token + causal attention, equal to the callback's total, and
    MFU against the matmul calibration; the memory peak beside the ledger's prediction, and a
    second run's peak (the first run's RSS holds the process's one-time costs);
  - the loss curve as a text plot; TensorBoard and metrics.jsonl equal to log_history, and
    "OK: guide monitoring table checked".
"""

# %%
import contextlib
import io
import json
import os
import re
import tempfile
import time

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from nanosft.args import SFTConfig
from nanosft.memory import MiB, unique_bytes
from nanosft.model import CausalLM, ModelConfig
from nanosft.monitoring.callbacks import (MemoryCallback, ThroughputCallback, find_callback,
                                          speed_summary, tensorboard_tag)
from nanosft.monitoring.flops import (calibrate_matmul_flops, matmul_parameters, model_flops,
                                      non_embedding_parameters)
from nanosft.sft import SFTTrainer
from nanosft.tokenizer import Tokenizer
from nanosft.trainer_callback import TrainerCallback

torch.set_num_threads(1)


def banner(title):
    print(f"\n{'=' * 20} {title} {'=' * 20}")


class WindowRecorder(TrainerCallback):
    """Per logging window: the rows and non-padding tokens of its batches, counted here from
    input_ids, the ThroughputCallback's LogWindow, and two clock reads around the moment the
    throughput callback reads its own (it runs before us in on_log)."""

    def __init__(self, throughput, pad_token_id):
        self.throughput = throughput
        self.pad_token_id = pad_token_id
        self.windows = []
        self.lengths = []  # non-padding tokens of each row of the open window
        self.padded = 0  # input_ids elements of the whole run, padding too

    def on_step_begin(self, args, state, control, batch_samples=(), **kwargs):
        for inputs in batch_samples:
            ids = inputs["input_ids"]  # (B, T), padded with pad_token_id
            self.lengths += (ids != self.pad_token_id).sum(-1).tolist()
            self.padded += ids.numel()

    def on_step_end(self, args, state, control, **kwargs):
        self.log_window = self.throughput.window  # on_log swaps it for a fresh one
        self.before = time.time()  # a log, if any, comes after this

    def on_log(self, args, state, control, logs=None, **kwargs):
        if "loss" not in logs or "train_runtime" in logs:
            return
        after = time.time()
        start = self.log_window.start
        self.windows.append({"step": state.global_step, "lengths": self.lengths,
                             "log_window": self.log_window,
                             "seconds": (self.before - start, after - start)})
        self.lengths = []


def rate_agrees(logged, count, seconds, half_unit):
    """`logged` = round(count / s) for some s in the (lo, hi) bracket `seconds`, rounded to a
    unit of 2 x half_unit (1e-9 of slack for float division)."""
    lo, hi = seconds
    return count / hi - half_unit - 1e-9 <= logged <= count / lo + half_unit + 1e-9


# %% [markdown]
# ## The run: a tiny SFT model, a log every 2 steps, report_to="all"
# ("all": tokens/s and MFU, the memory ledger, metrics.jsonl and TensorBoard events; the default
# "none" keeps only the progress bar and the non-finite guard, as transformers honours report_to)
# 12 prompt/completion rows of different lengths, 2 rows a micro-batch x 2 micro-batches a step:
# a window of 2 steps holds 8 rows and crosses epochs, so its token count changes from window to
# window. The trainer's own prints (banner, log dicts) are captured, to read the memory lines.

# %%
banner("性能监控指标 / the run: SFTTrainer, logging_steps=2, report_to='all'")
qa = [("What is two plus two?", " Four."), ("What is the capital of France?", " Paris."),
      ("Name a colour of the sky.", " Blue."), ("What do cats say?", " Meow."),
      ("Which animal barks?", " A dog."), ("How many legs has a spider?", " Eight."),
      ("What is frozen water?", " Ice."), ("What colour is grass?", " Green."),
      ("What is the opposite of hot?", " Cold."), ("How many days are in a week?", " Seven."),
      ("What do bees make?", " Honey."), ("Which planet do we live on?", " Earth.")]
examples = [{"prompt": p, "completion": c} for p, c in qa]
tokenizer = Tokenizer.train([p + c for p, c in qa], vocab_size=300)
torch.manual_seed(0)
config = ModelConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=64, bos_token_id=None,
                     eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
model = CausalLM(config)
output_dir = tempfile.TemporaryDirectory()
args = SFTConfig(output_dir=output_dir.name, per_device_train_batch_size=2,
                 gradient_accumulation_steps=2, max_steps=24, logging_steps=2,
                 learning_rate=5e-3, max_length=64, save_strategy="no", use_cpu=True,
                 gradient_checkpointing=False, bf16=False, disable_tqdm=True,
                 report_to="all", seed=0)
trainer = SFTTrainer(model, args=args, train_dataset=examples, processing_class=tokenizer)
throughput = find_callback(trainer, ThroughputCallback)
recorder = WindowRecorder(throughput, tokenizer.pad_token_id)
trainer.add_callback(recorder)  # last: after the throughput callback in every event
row_lengths = [len(row["input_ids"]) for row in trainer.train_dataset]
print(f"row lengths (tokens): {row_lengths}")
printed = io.StringIO()
with contextlib.redirect_stdout(printed):
    metrics = trainer.train().metrics
history = trainer.state.log_history
windows = recorder.windows
logs = [h for h in history if "loss" in h]  # one per logging window; the last entry is train()'s
print(f"{trainer.state.global_step} steps, {len(logs)} logging windows, "
      f"train_runtime {metrics['train_runtime']:.2f} s; the first log the trainer printed:")
print(next(line for line in printed.getvalue().splitlines() if line.startswith("{'loss'")))
assert len(logs) == len(windows) == args.max_steps // args.logging_steps

# %% [markdown]
# ## 训练效率: samples/s and tokens/s, recomputed
# ThroughputCallback counts a window's rows and attention_mask ones as the batches arrive
# (on_step_begin) and divides by the window's wall time when it logs. We count the same batches
# from input_ids != pad, and bracket its clock read between two of ours: each logged rate must be
# count / seconds, rounded, for a time inside the bracket. Both rates share the window's seconds,
# so their ratio is the window's tokens per row, whatever the clock said.

# %%
banner("训练效率 / samples/s, tokens/s: counted and divided by hand")
print("step  rows  tokens  window s (bracket)   tokens/s  samples/s  tokens/s / samples/s")
steps = args.logging_steps  # optimizer steps a window
for log, w in zip(logs, windows):
    rows, tokens = len(w["lengths"]), sum(w["lengths"])
    lo, hi = w["seconds"]
    ratio = log["train_tokens_per_second"] / log["train_samples_per_second"]
    print(f"{log['step']:4d}  {rows:4d}  {tokens:6d}  [{lo:.4f}, {hi:.4f}]  "
          f"{log['train_tokens_per_second']:9.1f}  {log['train_samples_per_second']:9.3f}  "
          f"{ratio:8.3f} = {tokens} / {rows} = {tokens / rows:.3f}")
    assert w["step"] == log["step"] and 0 < lo <= hi
    assert (rows, tokens) == (w["log_window"].samples, w["log_window"].tokens)
    assert w["lengths"] == w["log_window"].seq_lengths  # the per-row counts, in batch order
    assert rate_agrees(log["train_tokens_per_second"], tokens, w["seconds"], 0.05)
    assert rate_agrees(log["train_samples_per_second"], rows, w["seconds"], 5e-4)
    assert rate_agrees(log["train_steps_per_second"], steps, w["seconds"], 5e-4)
    assert lo / steps - 5e-5 - 1e-9 <= log["train_step_time"] <= hi / steps + 5e-5 + 1e-9
    # the seconds each rounded rate allows must overlap: tokens/s / samples/s = tokens per row
    t_rate, s_rate = log["train_tokens_per_second"], log["train_samples_per_second"]
    assert tokens / (t_rate + 0.05) <= rows / (s_rate - 5e-4)
    assert rows / (s_rate + 5e-4) <= tokens / (t_rate - 0.05)
# SFTTrainer's running num_tokens (TRL's metric) grows by each window's tokens
counted = [sum(sum(w["lengths"]) for w in windows[:i + 1]) for i in range(len(windows))]
assert [log["num_tokens"] for log in logs] == counted
rows_per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps
epochs = args.max_steps * rows_per_step // len(examples)  # each row trained on `epochs` times
print(f"all windows: {sum(len(w['lengths']) for w in windows)} rows, {counted[-1]} tokens = "
      f"{epochs} epochs x {sum(row_lengths)} tokens of the dataset")
assert counted[-1] == epochs * sum(row_lengths)
# The first window's clock starts in on_train_begin, before the matmul calibration and the other
# callbacks' on_train_begin (the ledger, opening the TensorBoard writer): its time counts them.
later = sorted(log["train_step_time"] for log in logs[1:])
print(f"step time: first window {logs[0]['train_step_time']:.4f} s, later windows median "
      f"{later[len(later) // 2]:.4f} s (the first also holds on_train_begin's work)")

# %% [markdown]
# ## 训练效率: model FLOPs and MFU (the CPU's stand-in for GPU utilisation)
# A matmul weight of N_w entries costs 2 N_w FLOPs a token forward, 2 N_w for the input's
# gradient and, if trainable, 2 N_w for its own: 6N a token for full fine-tuning. Causal
# attention adds QK^T and AV over T(T+1)/2 (query, key) pairs a sequence: 2 x 2 x width forward,
# twice that backward, so 6 x width x layers x T(T+1). MFU = achieved FLOP/s / peak FLOP/s; the
# peak is calibrate_matmul_flops (torch.mm at the model's width) measured at train start.

# %%
banner("训练效率 / model FLOPs and MFU")
C, I, L = config.hidden_size, config.intermediate_size, config.num_hidden_layers
head_dim = C // config.num_attention_heads
width = config.num_attention_heads * head_dim  # attention's q . k length, summed over heads
per_layer = {"q_proj": C * width, "k_proj": C * config.num_key_value_heads * head_dim,
             "v_proj": C * config.num_key_value_heads * head_dim, "o_proj": width * C,
             "gate_proj": C * I, "up_proj": C * I, "down_proj": I * C}
N = L * sum(per_layer.values()) + C * config.vocab_size  # + lm_head
print(f"N = {L} layers x {sum(per_layer.values()):,} ({' + '.join(map(str, per_layer.values()))})"
      f" + lm_head {C} x {config.vocab_size} = {N:,} matmul weights (embeddings: a lookup, 0)")
print(f"FLOPs of a sequence of T tokens = 6 x {N:,} x T + 6 x {width} x {L} x T(T+1)")
assert matmul_parameters(trainer.model) == (N, N)  # (weights, trainable weights)


def flops_by_hand(lengths):
    return sum(6 * N * T + 6 * width * L * T * (T + 1) for T in lengths)


total_by_hand = sum(flops_by_hand(w["lengths"]) for w in windows)
print(f"model FLOPs of the run: by hand {total_by_hand:,}; ThroughputCallback "
      f"{throughput.model_flos:,.0f}")
assert total_by_hand == throughput.model_flos
assert all(model_flops(N, N, width, L, w["lengths"]) == flops_by_hand(w["lengths"])
           for w in windows)  # the draft equals nanosft's function, window by window
# transformers' total_flos: 6 x every input_ids element (padding too) x non-embedding parameters
non_embedding = N + (2 * L + 1) * C  # + the RMSNorm weights: 2 a layer and the final one
print(f"total_flos (transformers' estimate) = 6 x {recorder.padded:,} input_ids x "
      f"{non_embedding:,} parameters = {6 * recorder.padded * non_embedding:,}")
assert non_embedding_parameters(trainer.model) == non_embedding
assert metrics["total_flos"] == 6 * recorder.padded * non_embedding
peak = throughput.peak_flops
# at width 32 the calibration is 3 products of (4096, 32) x (32, 32), about a millisecond, and the
# first products of a process run cold: the peak it measures, and so the MFU, moves run to run
print(f"peak: calibrate_matmul_flops({C}) at train start = {peak / 1e9:.2f} GFLOP/s "
      f"(once more now: {calibrate_matmul_flops(C) / 1e9:.2f})")
for log, w in zip(logs, windows):
    flops = flops_by_hand(w["lengths"])
    assert rate_agrees(log["train_model_flops_per_second"], flops, w["seconds"], 0.05)
    assert flops / w["seconds"][1] <= log["mfu"] * peak * (1 + 1e-12)  # mfu is unrounded
    assert log["mfu"] * peak <= flops / w["seconds"][0] * (1 + 1e-12)
    assert 0 < log["mfu"] < 1
mfus = ", ".join(f"{log['mfu']:.2%}" for log in logs)
print(f"MFU per window: {mfus}")
achieved = throughput.model_flos / metrics["train_runtime"]
print(f"whole run: {throughput.model_flos:,.0f} FLOPs / {metrics['train_runtime']} s = "
      f"{achieved / 1e9:.3f} GFLOP/s; MFU {metrics['mfu']:.2%}")
print(speed_summary(trainer, metrics))
assert abs(metrics["mfu"] - achieved / peak) <= 1e-12 * metrics["mfu"]
assert 0 < metrics["mfu"] < 1

# %% [markdown]
# ## 内存使用: the memory peak beside the ledger
# MemoryCallback prints the ledger's prediction at train start (nanosft.memory, from the config
# alone) and the measured peak growth at the end: on CPU the peak RSS (VmHWM) above the RSS at
# train start, on CUDA also torch.cuda.max_memory_allocated. It prints them only (they are not in
# log_history), so we read its lines. The ledger's tensor rows equal the live tensors; RSS counts
# the whole process, and a process's first run also pays one-time costs the ledger does not hold
# (opening the TensorBoard writer, autograd's and the allocator's first use): a second run in the
# same process reuses that memory.

# %%
banner("内存使用 / memory: predicted and measured peak")


def memory_lines(text):
    """MemoryCallback's two printed lines, and the predicted and measured MiB they show."""
    lines = [line.strip() for line in text.splitlines() if line.strip().startswith("Memory")]
    predicted = float(re.search(r"predicted \(MiB, tensors of a step at \d+ x \d+ tokens\) = "
                                r"([0-9.]+)", lines[0])[1])
    measured = float(re.search(r"cpu peak growth ([0-9.]+) MiB", lines[1])[1])
    return lines, predicted, measured


lines, predicted, measured = memory_lines(printed.getvalue())
print("\n".join(lines))
ledger = find_callback(trainer, MemoryCallback).ledger
assert predicted == round(ledger.total / MiB, 1)
trainable = [p for p in trainer.model.parameters() if p.requires_grad]
states = [v for s in trainer.optimizer.state.values() for v in s.values()]
print(f"ledger rows vs the live run: trainable parameters {ledger.rows['trainable parameters']:,}"
      f" B = {unique_bytes(trainable):,} B, optimizer states "
      f"{ledger.rows['optimizer states']:,} B = {unique_bytes(states):,} B")
assert ledger.rows["trainable parameters"] == unique_bytes(trainable)
assert ledger.rows["optimizer states"] == unique_bytes(states)
assert measured > 0
torch.manual_seed(0)
with tempfile.TemporaryDirectory() as again_dir, contextlib.redirect_stdout(io.StringIO()) as again:
    again_args = SFTConfig(**{**args.to_dict(), "output_dir": again_dir, "max_steps": 4})
    SFTTrainer(CausalLM(config), args=again_args, train_dataset=examples,
               processing_class=tokenizer).train()
_, again_predicted, again_measured = memory_lines(again.getvalue())
print(f"cpu peak growth: first run {measured} MiB, a second run in this process "
      f"{again_measured} MiB; ledger {predicted} MiB")
assert again_predicted == predicted and again_measured < measured

# %% [markdown]
# ## 收敛性能: the loss curve
# Each logged loss is the mean of its window's step losses; train_loss is the mean over the run.

# %%
banner("收敛性能 / loss curve (logged loss per window)")
top = max(log["loss"] for log in logs)
for log in logs:
    print(f"step {log['step']:3d} | {'#' * round(50 * log['loss'] / top):50s} {log['loss']:.4f}")
print(f"train_loss (mean of the run) {metrics['train_loss']:.4f}")
losses = [log["loss"] for log in logs]
assert all(b < a for a, b in zip(losses, losses[1:])), losses
mean_of_windows = sum(losses) / len(losses)  # equal windows: the mean of means is the mean
assert abs(metrics["train_loss"] - mean_of_windows) <= 1e-12 * mean_of_windows

# %% [markdown]
# ## Where the figures land: TensorBoard events and metrics.jsonl
# TensorBoardCallback writes every number of every log as a scalar under "train/<key>" (eval
# logs: "eval/<key>") at state.global_step; the events store float32. MetricsFileCallback appends
# each log with its step as a JSON line. Both must hold what log_history holds.

# %%
banner("可视化分析 / TensorBoard events and metrics.jsonl vs log_history")
events = EventAccumulator(os.path.join(args.output_dir, "runs"), size_guidance={"scalars": 0})
events.Reload()
expected = {}
for entry in history:
    for key, value in entry.items():
        if key != "step":
            as_float32 = torch.tensor(value, dtype=torch.float32).item()
            expected.setdefault(tensorboard_tag(key), []).append((entry["step"], as_float32))
read_back = {tag: [(e.step, e.value) for e in events.Scalars(tag)]
             for tag in events.Tags()["scalars"]}
print(f"TensorBoard: {len(read_back)} tags, {sum(map(len, read_back.values()))} scalars; "
      f"train/loss at steps {[step for step, _ in read_back['train/loss']]}")
assert read_back == expected
print("TensorBoard scalars equal log_history (float32) at the same steps")
try:
    from transformers.integrations.integration_utils import rewrite_logs
except ImportError:
    print("reference check skipped: transformers is not installed")
else:  # transformers' TensorBoardCallback names its tags with rewrite_logs
    theirs = {tag for entry in history
              for tag in rewrite_logs({k: v for k, v in entry.items() if k != "step"})}
    assert theirs == set(read_back)
    print("reference check ran: transformers rewrite_logs")
with open(os.path.join(args.output_dir, "metrics.jsonl"), encoding="utf-8") as f:
    jsonl = [json.loads(line) for line in f]
print(f"metrics.jsonl: {len(jsonl)} lines, equal to log_history")
assert jsonl == history

# %% [markdown]
# ## 通信开销: one process here
# Sync time and bandwidth need more than one rank: tutorials/13_ddp.py runs the all-reduce.

# %%
output_dir.cleanup()
print("\nOK: guide monitoring table checked")

"""Tutorial 09: the optimizer and the learning-rate schedule of a training run.

Guide (custom training loop), 优化器配置与管理: AdamW优化器实现 (two parameter groups,
decoupled weight decay) and 学习率调度器类型 (linear, cosine, constant, warmup, plateau);
walkthrough 1 `self.lr_scheduler.step()`, which runs only after a successful optimizer step.
Run:      python tutorials/09_optimizers_schedulers.py
Runtime:  about 20 s on a 2-core CPU (transformers' import is most of it).
You should see:
  - the decay / no-decay split of a tiny Llama (norms get no decay), transformers' beside it;
  - one AdamW step rebuilt by hand, equal to torch's fused AdamW that nanosft builds;
  - every schedule as a sparkline over 12 steps (3 warmup) with the guide's "when to use" beside it,
    and transformers' curve compared (max |difference| 0);
  - ReduceLROnPlateau driven by the Trainer's eval loss: the lr halves after each plateau, as
    torch's rule replayed by hand on the logged eval losses predicts; "OK: ..." at the end.
"""

# %%
import contextlib
import io
import math
import os
import tempfile

import torch

from nanosft.args import SFTConfig, TrainingArguments
from nanosft.collator import DataCollatorForLanguageModeling
from nanosft.model import CausalLM, ModelConfig
from nanosft.optim import create_optimizer, get_decay_parameter_names, get_scheduler
from nanosft.trainer import Trainer

try:
    import transformers
except ImportError:
    transformers = None

BARS = "▁▂▃▄▅▆▇█"


def banner(title):
    print(f"\n{'=' * 20} {title} {'=' * 20}")


def sparkline(values, top):
    return "".join(BARS[min(len(BARS) - 1, int(v / top * (len(BARS) - 1) + 0.5))] for v in values)


torch.manual_seed(0)
config = ModelConfig(
    vocab_size=64,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    max_position_embeddings=32,
)
model = CausalLM(config)

# %% [markdown]
# ## 分组参数权重衰减: which weights decay
# AdamW shrinks weights towards 0 each step by lr * weight_decay. Biases and norm scales are left
# alone: shrinking a norm's gain (initialised at 1) towards 0 fights the very thing the norm is for.

# %%
banner("优化器配置与管理: 分组参数权重衰减 (decay groups)")
decay = get_decay_parameter_names(model)
no_decay = [n for n, _ in model.named_parameters() if n not in decay]
print(f"{len(decay)} tensors get weight decay, e.g. {decay[:3]}")
print(f"{len(no_decay)} tensors do not: {no_decay}")
assert all("norm" in n for n in no_decay)
if transformers is not None:
    hf_config = transformers.LlamaConfig(
        **{
            k: getattr(config, k)
            for k in (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "max_position_embeddings",
            )
        }
    )
    hf_decay = transformers.Trainer.get_decay_parameter_names(
        None, transformers.LlamaForCausalLM(hf_config)
    )
    print(
        f"transformers Trainer.get_decay_parameter_names: {len(hf_decay)} decayed, "
        f"same names: {hf_decay == decay}"
    )
    assert hf_decay == decay
    print("reference check ran: transformers Trainer.get_decay_parameter_names")
else:
    print("reference check skipped: transformers is not installed")

# %% [markdown]
# ## AdamW优化器实现: one step by hand
# Decoupled decay (Loshchilov & Hutter): p *= 1 - lr*wd; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
# p -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps). SFTConfig's default optimizer is fused AdamW.

# %%
banner("AdamW优化器实现: one step of torch AdamW(fused=True) rebuilt by hand")
args = SFTConfig(
    output_dir=os.path.join(tempfile.gettempdir(), "nanosft_tutorial_09"),
    learning_rate=1e-2,
    weight_decay=0.1,
    bf16=False,
)
print(
    f"optim={args.optim!r} lr={args.learning_rate} weight_decay={args.weight_decay} "
    f"betas=({args.adam_beta1}, {args.adam_beta2}) eps={args.adam_epsilon}"
)
optimizer = create_optimizer(model, args)
print("param groups:", [(len(g["params"]), g["weight_decay"]) for g in optimizer.param_groups])
ids = torch.randint(0, config.vocab_size, (2, 8))
model(input_ids=ids, labels=ids).loss.backward()
p = model.model.layers[0].self_attn.q_proj.weight
w0, g = p.detach().clone(), p.grad.clone()
optimizer.step()
lr, wd, b1, b2, eps = (
    args.learning_rate,
    args.weight_decay,
    args.adam_beta1,
    args.adam_beta2,
    args.adam_epsilon,
)
m, v = (1 - b1) * g, (1 - b2) * g * g
by_hand = w0 * (1 - lr * wd) - (lr / (1 - b1)) * m / (v.sqrt() / math.sqrt(1 - b2) + eps)
diff = (by_hand - p.detach()).abs().max().item()
print(f"q_proj.weight[0, :4] before {w0[0, :4].tolist()}")
print(f"q_proj.weight[0, :4] after  {p.detach()[0, :4].tolist()}")
# Whether the fused kernel rounds exactly as these separate steps depends on the CPU's vector unit
# (an FMA contracts a multiply and an add into one rounding): it may agree to the bit or by ~1 ulp.
isa = torch.backends.cpu.get_cpu_capability()
rounding = "the same bits" if diff == 0 else "~1 ulp apart: the fused kernel rounds differently"
print(f"max |by hand - fused AdamW| = {diff:.2e} (on this CPU's {isa} kernels: {rounding})")
assert diff < 1e-6

# %% [markdown]
# ## 学习率调度器类型: every schedule over 12 steps, 3 of them warmup
# A schedule multiplies the base lr by lambda(k), k = scheduler.step() calls so far. The trainer
# reads the lr before stepping the scheduler, so optimizer step s runs at lambda(s - 1): with warmup
# the first step is lr 0.

# %%
banner("学习率调度器类型: lr per optimizer step (T=12, warmup W=3)")
T, W, BASE = 12, 3, 1.0
SCHEDULES = [
    ("linear", None),
    ("cosine", None),
    ("cosine_with_restarts", {"num_cycles": 2}),
    ("polynomial", {"power": 2.0, "lr_end": 0.1}),
    ("constant", None),
    ("constant_with_warmup", None),
    ("inverse_sqrt", None),
    ("cosine_with_min_lr", {"min_lr_rate": 0.2}),
    ("cosine_warmup_with_min_lr", {"min_lr_rate": 0.1}),
    ("warmup_stable_decay", {"num_decay_steps": 4}),
]
# The guide's 使用场景 ("when to use") column; rows the guide's table lacks are marked (not in the
# guide).
WHEN_TO_USE = {
    "linear": "标准训练任务 standard training (the Trainer's default)",
    "cosine": "需要平滑学习率变化 a smooth lr decay",
    "cosine_with_restarts": "(not in the guide) several decays, each restarting high",
    "polynomial": "(not in the guide) a decay of chosen curvature to lr_end",
    "constant": "特殊需求或调试 special needs or debugging",
    "constant_with_warmup": "大多数训练场景 (warmup) most runs: warmup, then flat",
    "inverse_sqrt": "(not in the guide) long runs with no fixed end",
    "cosine_with_min_lr": "需要平滑学习率变化 smooth decay, floored above 0",
    "cosine_warmup_with_min_lr": "大多数训练场景 (warmup) warmup + smooth floored decay",
    "warmup_stable_decay": "(not in the guide) flat for most of the run, decay at the end",
    "reduce_lr_on_plateau": "验证集性能监控 driven by the eval metric (below)",
}
assert set(WHEN_TO_USE) == {name for name, _ in SCHEDULES} | {"reduce_lr_on_plateau"}


def curve(make, name, kwargs):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=BASE)
    sched = make(
        name, opt, num_warmup_steps=W, num_training_steps=T, scheduler_specific_kwargs=kwargs
    )
    lrs = []
    for _ in range(T):
        lrs.append(
            opt.param_groups[0]["lr"]
        )  # what this optimizer step uses (the logged learning_rate)
        opt.step()
        sched.step()
    return lrs


curves = {}
for name, kwargs in SCHEDULES:
    ours = curve(get_scheduler, name, kwargs)
    curves[name] = ours
    line = f"{name:<26} {sparkline(ours, BASE)}  " + " ".join(f"{x:.2f}" for x in ours)
    if transformers is not None:
        theirs = curve(transformers.get_scheduler, name, kwargs)
        gap = max(abs(a - b) for a, b in zip(ours, theirs))
        line += f"  | transformers max|diff| {gap:.0e}"
        assert gap <= 1e-12, name
    print(line)
    print(f"{'':<26} when to use: {WHEN_TO_USE[name]}")
if transformers is not None:
    print("reference check ran: transformers.get_scheduler, every schedule above")
assert curves["linear"][0] == 0.0 and curves["linear"][W] == BASE  # warmup ends at the base lr
assert curves["constant"] == [BASE] * T  # "constant" ignores warmup entirely

# %% [markdown]
# ## ReduceLROnPlateau: 基于指标调整, driven by the eval loss
# The one schedule that reads a metric: after each evaluation the Trainer calls
# lr_scheduler.step(eval_loss) (transformers Trainer._evaluate) and skips the per-step call. The
# held-out rows here are random tokens, so the model can only memorise its 4 training rows: eval
# loss stops improving almost at once, and with patience=1 the lr halves after every two evals
# without a new best. We replay torch's rule by hand on the logged eval losses and predict every
# logged lr.

# %%
banner("ReduceLROnPlateau: lr_scheduler.step(eval_loss) after each evaluation")
print(f"when to use: {WHEN_TO_USE['reduce_lr_on_plateau']}")
g = torch.Generator().manual_seed(1)
plateau_rows = []
for _ in range(8):
    ids = torch.randint(1, config.vocab_size, (12,), generator=g).tolist()
    plateau_rows.append({"input_ids": ids, "labels": ids})
PATIENCE, FACTOR, LR0 = 1, 0.5, 3e-2
torch.manual_seed(0)
plateau_args = TrainingArguments(
    output_dir=tempfile.mkdtemp(),
    per_device_train_batch_size=4,
    max_steps=12,
    learning_rate=LR0,
    optim="adamw_torch",
    lr_scheduler_type="reduce_lr_on_plateau",
    lr_scheduler_kwargs={"patience": PATIENCE, "factor": FACTOR},
    eval_strategy="steps",
    eval_steps=1,
    logging_steps=1,
    save_strategy="no",
    disable_tqdm=True,
    report_to="none",
    bf16=False,
)
plateau = Trainer(
    CausalLM(config),
    plateau_args,
    train_dataset=plateau_rows[:4],
    eval_dataset=plateau_rows[4:],
    data_collator=DataCollatorForLanguageModeling(0),
)
with contextlib.redirect_stdout(io.StringIO()):
    plateau.train()
logged_lr = [h["learning_rate"] for h in plateau.state.log_history if "loss" in h]
eval_losses = [h["eval_loss"] for h in plateau.state.log_history if "eval_loss" in h]
# torch's rule (mode="min", threshold=1e-4 relative): a new best resets the count of bad evals;
# more than `patience` bad evals in a row multiply the lr by `factor` and reset the count.
lr, best, bad, predicted = LR0, math.inf, 0, [LR0]
for loss in eval_losses[:-1]:
    best, bad = (loss, 0) if loss < best * (1 - 1e-4) else (best, bad + 1)
    if bad > PATIENCE:
        lr, bad = lr * FACTOR, 0
    predicted.append(lr)  # the lr of the next optimizer step
print("step | eval_loss | logged lr | replayed rule")
for step, (loss, got, want) in enumerate(zip(eval_losses, logged_lr, predicted), start=1):
    print(f"{step:4d} | {loss:9.4f} | {got:9.6f} | {want:9.6f}")
assert logged_lr == predicted
assert logged_lr[-1] < LR0 / 4  # several plateaus, several halvings

# %% [markdown]
# ## warmup_steps below 1 is a ratio
# transformers 5 dropped warmup_ratio: warmup_steps=0.1 means ceil(0.1 * total steps).

# %%
banner("warmup_steps: a count (>= 1) or a ratio (< 1)")
for w in (5, 0.1, 0.25):
    print(
        f"warmup_steps={w!r:<5} with 37 total steps -> "
        f"{SFTConfig(warmup_steps=w, bf16=False).get_warmup_steps(37)}"
    )
assert SFTConfig(warmup_steps=0.1, bf16=False).get_warmup_steps(37) == math.ceil(3.7)

# %%
try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, lrs in curves.items():
        ax.plot(range(1, T + 1), lrs, marker=".", label=name)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("lr / base lr")
    ax.legend(fontsize=7)
    path = os.path.join(tempfile.gettempdir(), "nanosft_schedules.png")
    fig.savefig(path, dpi=100)
    print(f"\nplot written to {path}")
except ImportError:
    print("\n(matplotlib not installed: ASCII only)")

print("\nOK: decay groups, one AdamW step and every schedule checked")

"""Tutorial 09: the optimizer and the learning-rate schedule of a training run.

Guide (custom training loop), 优化器配置与管理: AdamW优化器实现 (two parameter groups, decoupled weight decay)
and 学习率调度器类型 (linear, cosine, constant, warmup, plateau); walkthrough 1 `self.lr_scheduler.step()`,
which runs only after a successful optimizer step.
Run:      python tutorials/09_optimizers_schedulers.py
Runtime:  a few seconds on CPU (about 10 s more when transformers is installed).
You should see:
  - the decay / no-decay split of a tiny Llama (norm weights get no decay) and transformers' split beside it;
  - one AdamW step rebuilt by hand, equal to torch's fused AdamW that nanosft builds;
  - every schedule as a row of numbers and a sparkline over 12 steps with 3 warmup steps, the first at lr 0;
  - transformers' curve beside each, max |difference| 0, and "OK: ..." at the end.
"""

# %%
import math
import os
import tempfile

import torch

from nanosft.args import SFTConfig
from nanosft.model import CausalLM, ModelConfig
from nanosft.optim import create_optimizer, get_decay_parameter_names, get_scheduler

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
config = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                     num_attention_heads=2, max_position_embeddings=32)
model = CausalLM(config)

# %% [markdown]
# ## 分组参数权重衰减: which weights decay
# AdamW shrinks weights towards 0 each step by lr * weight_decay. Biases and norm scales are left alone:
# shrinking a norm's gain (initialised at 1) towards 0 fights the very thing the norm is for.

# %%
banner("优化器配置与管理: 分组参数权重衰减 (decay groups)")
decay = get_decay_parameter_names(model)
no_decay = [n for n, _ in model.named_parameters() if n not in decay]
print(f"{len(decay)} tensors get weight decay, e.g. {decay[:3]}")
print(f"{len(no_decay)} tensors do not: {no_decay}")
assert all("norm" in n for n in no_decay)
if transformers is not None:
    hf_config = transformers.LlamaConfig(**{k: getattr(config, k) for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "max_position_embeddings")})
    hf_decay = transformers.Trainer.get_decay_parameter_names(None, transformers.LlamaForCausalLM(hf_config))
    print(f"transformers Trainer.get_decay_parameter_names: {len(hf_decay)} decayed, same names: {hf_decay == decay}")
    assert hf_decay == decay
else:
    print("(transformers not installed: reference split skipped)")

# %% [markdown]
# ## AdamW优化器实现: one step by hand
# Decoupled decay (Loshchilov & Hutter): p *= 1 - lr*wd; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
# p -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps). SFTConfig's default optimizer is fused AdamW.

# %%
banner("AdamW优化器实现: one step of torch AdamW(fused=True) rebuilt by hand")
args = SFTConfig(output_dir=os.path.join(tempfile.gettempdir(), "nanosft_tutorial_09"), learning_rate=1e-2,
                 weight_decay=0.1, bf16=False)
print(f"optim={args.optim!r} lr={args.learning_rate} weight_decay={args.weight_decay} "
      f"betas=({args.adam_beta1}, {args.adam_beta2}) eps={args.adam_epsilon}")
optimizer = create_optimizer(model, args)
print("param groups:", [(len(g["params"]), g["weight_decay"]) for g in optimizer.param_groups])
ids = torch.randint(0, config.vocab_size, (2, 8))
model(input_ids=ids, labels=ids).loss.backward()
p = model.model.layers[0].self_attn.q_proj.weight
w0, g = p.detach().clone(), p.grad.clone()
optimizer.step()
lr, wd, b1, b2, eps = args.learning_rate, args.weight_decay, args.adam_beta1, args.adam_beta2, args.adam_epsilon
m, v = (1 - b1) * g, (1 - b2) * g * g
by_hand = w0 * (1 - lr * wd) - (lr / (1 - b1)) * m / (v.sqrt() / math.sqrt(1 - b2) + eps)
diff = (by_hand - p.detach()).abs().max().item()
print(f"q_proj.weight[0, :4] before {w0[0, :4].tolist()}")
print(f"q_proj.weight[0, :4] after  {p.detach()[0, :4].tolist()}")
print(f"max |by hand - fused AdamW| = {diff:.2e} (fused kernels round differently by ~1 ulp)")
assert diff < 1e-6

# %% [markdown]
# ## 学习率调度器类型: every schedule over 12 steps, 3 of them warmup
# A schedule multiplies the base lr by lambda(k), k = scheduler.step() calls so far. The trainer reads the lr
# before stepping the scheduler, so optimizer step s runs at lambda(s - 1): with warmup the first step is lr 0.

# %%
banner("学习率调度器类型: lr per optimizer step (T=12, warmup W=3)")
T, W, BASE = 12, 3, 1.0
SCHEDULES = [
    ("linear", None), ("cosine", None), ("cosine_with_restarts", {"num_cycles": 2}),
    ("polynomial", {"power": 2.0, "lr_end": 0.1}), ("constant", None), ("constant_with_warmup", None),
    ("inverse_sqrt", None), ("cosine_with_min_lr", {"min_lr_rate": 0.2}),
    ("cosine_warmup_with_min_lr", {"min_lr_rate": 0.1}), ("warmup_stable_decay", {"num_decay_steps": 4}),
]


def curve(make, name, kwargs):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=BASE)
    sched = make(name, opt, num_warmup_steps=W, num_training_steps=T, scheduler_specific_kwargs=kwargs)
    lrs = []
    for _ in range(T):
        lrs.append(opt.param_groups[0]["lr"])  # what this optimizer step uses (the logged learning_rate)
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
assert curves["linear"][0] == 0.0 and curves["linear"][W] == BASE  # warmup ends at the base lr
assert curves["constant"] == [BASE] * T  # "constant" ignores warmup entirely

# %% [markdown]
# ## warmup_steps below 1 is a ratio
# transformers 5 dropped warmup_ratio: warmup_steps=0.1 means ceil(0.1 * total steps).

# %%
banner("warmup_steps: a count (>= 1) or a ratio (< 1)")
for w in (5, 0.1, 0.25):
    print(f"warmup_steps={w!r:<5} with 37 total steps -> {SFTConfig(warmup_steps=w, bf16=False).get_warmup_steps(37)}")
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

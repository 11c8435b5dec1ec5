"""Tutorial 14: troubleshooting and monitoring (guide: 故障排除指南, gradients and distributed).

The guide's 梯度爆炸 entry: "症状: 损失值突然变为NaN或无穷大; 解决方案: 启用梯度裁剪,
检查学习率设置". Walkthrough 2.3's loop has two monitors for this: `args.logging_nan_inf_filter` (a
nan/inf micro-batch loss is replaced by the average accumulated so far, so the logged curve stays
finite) and grad_norm (the pre-clip norm logged at every step, the first number to watch). We make
each failure happen on purpose:
A) a micro-batch with no trained token under a per-batch mean loss gives loss nan (0/0);
B) 梯度爆炸: one bad batch whose loss is 10^4 times too large, clipped at a threshold above
   every ordinary grad_norm, so clipping binds at the bad step only;
C) 梯度消失: per-layer gradient norms of a badly initialised 20-layer stack, with and without
   residual connections;
D) 梯度累积错误: a missing zero_grad() doubles the next gradient;
E) 同步失败: a peer that never joins a collective, ended by the process-group timeout (ddp_timeout);
F) 内存同步问题: a parameter checksum all-gathered across two ranks catches a rank that skipped
   an update;
G) 负载不均衡: padded tokens per rank per step over two simulated ranks, with the default random
   order and with train_sampling_strategy="group_by_length".
Run:      python tutorials/14_troubleshooting.py
Runtime:  about 25 s on a 2-core CPU (3 s of it is E's timeout).
You should see:
  - A: tr_loss_step nan on the empty micro-batch; logged loss finite with the filter, nan without;
  - B: grad_norm ~1e4 at the bad step; without clipping the later losses stay in the thousands;
    with max_grad_norm 1.5 x the largest ordinary norm, "binds at steps [3] only", a recovered run;
  - C: first/last layer gradient ratio ~0 plain, ~0.8 residual; D: max |grad - 2 g| = 0;
  - E, F: "first step out of sync: 2", the all_reduce returning after ~3 s;
  - G: a mean max/min tokens ratio across ranks of ~1.6 in random order, ~1.1 grouped by length;
    "OK: ..." at the end.
"""

# %%
import contextlib
import copy
import io
import math
import tempfile

import torch

from nanosft.args import TrainingArguments
from nanosft.collator import DataCollatorForLanguageModeling
from nanosft.model import CausalLM, ModelConfig
from nanosft.trainer import Trainer

torch.set_num_threads(1)
TINY = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
COLLATOR = DataCollatorForLanguageModeling(pad_token_id=0)


def banner(title):
    print(f"\n{'=' * 20} {title} {'=' * 20}")


def tiny_model():
    torch.manual_seed(0)
    return CausalLM(ModelConfig(**TINY))


class RecordingTrainer(Trainer):
    """A Trainer that records, per micro-batch, (supervised tokens, tr_loss_step) in `steps`, and
    multiplies the loss of micro-batch `bad_micro_batch` by 10^4 (B: one bad batch). Overrides, so
    `s` at the loop's `self.training_step(...)` lands here, then in Trainer.training_step."""

    steps = None
    bad_micro_batch = None

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.steps.append((int((inputs["labels"][:, 1:] != -100).sum()), loss.item()))
        return loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        return loss * 1e4 if len(self.steps) == self.bad_micro_batch else loss  # B: one bad batch


def train(rows, **overrides):
    """A RecordingTrainer over a fresh tiny model (plain SGD, constant lr, a log each step); run()
    trains."""
    settings = {
        "per_device_train_batch_size": 1,
        "gradient_accumulation_steps": 2,
        "learning_rate": 1e-2,
        "logging_steps": 1,
        "save_strategy": "no",
        "use_cpu": True,
        "optim": "sgd",
        "report_to": "none",
        "lr_scheduler_type": "constant",
        "disable_tqdm": True,
        "seed": 0,
        **overrides,
    }
    trainer = RecordingTrainer(
        tiny_model(),
        TrainingArguments(output_dir=tempfile.mkdtemp(), **settings),
        train_dataset=rows,
        data_collator=COLLATOR,
    )
    return trainer


def run(trainer, per_batch_mean=False, bad_micro_batch=None):
    """trainer.train(), quietly; returns what it printed and, per micro-batch, (supervised tokens,
    tr_loss_step)."""
    if per_batch_mean:  # a model that ignores num_items_in_batch and returns its own per-batch mean
        trainer.model_accepts_loss_kwargs = False
    trainer.steps, trainer.bad_micro_batch = [], bad_micro_batch
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        trainer.train()
    return printed.getvalue(), trainer.steps


# %% [markdown]
# ## A) A NaN loss and logging_nan_inf_filter
# The third row's labels are all -100 (say a prompt truncated before its answer; nanosft.data and
# TRL drop such rows while preparing, but a hand-made dataset may not). A per-batch mean over zero
# targets is 0/0.

# %%
banner("故障排除 A: 损失值变为NaN / a NaN loss, caught by logging_nan_inf_filter")
ROWS_A = [
    {"input_ids": [5, 17, 42, 8, 9, 2], "labels": [-100, -100, 42, 8, 9, 2]},
    {"input_ids": [7, 33, 12, 2], "labels": [-100, 33, 12, 2]},
    {"input_ids": [3, 9, 14, 21], "labels": [-100, -100, -100, -100]},  # nothing to train on
    {"input_ids": [11, 6, 2], "labels": [-100, 6, 2]},
]
results = {}
for nan_filter in (True, False):
    trainer = train(ROWS_A, logging_nan_inf_filter=nan_filter, max_steps=2)
    _, steps = run(trainer, per_batch_mean=True)
    results[nan_filter] = trainer
    logged = [
        (h["step"], h["loss"], h["grad_norm"])
        for h in trainer.state.log_history
        if "grad_norm" in h
    ]
    print(f"logging_nan_inf_filter={nan_filter}:")
    print(
        "   micro-batch tokens / tr_loss_step: "
        + ", ".join(f"{n} -> {loss:.4f}" for n, loss in steps)
    )
    print(
        "   logged (step, loss, grad_norm):    "
        + ", ".join(f"({s}, {loss:.4f}, {g:.4f})" for s, loss, g in logged)
    )
    bad = next(i for i, (n, _) in enumerate(steps) if n == 0)
    assert math.isnan(steps[bad][1])
    assert all(
        math.isfinite(g) for _, _, g in logged
    )  # 0/0 has zero gradient: only the reported loss is nan
    bad_step = logged[bad // 2]
    if nan_filter:
        # "if loss is nan or inf simply add the average of previous logged losses": tr_loss +=
        # tr_loss / (1 + 0)
        partner = steps[bad - 1][1] if bad % 2 else 0.0  # what tr_loss held when the nan arrived
        assert math.isclose(bad_step[1], 2 * partner, rel_tol=1e-6)
        assert all(math.isfinite(loss) for _, loss, _ in logged)
    else:
        assert math.isnan(bad_step[1])
same = all(
    torch.equal(a, b)
    for a, b in zip(results[True].model.parameters(), results[False].model.parameters())
)
print(
    f"weights after training equal with and without the filter: {same}  "
    "(the filter only changes the log)"
)
assert same

trainer = train(ROWS_A, max_steps=2)
_, steps = run(
    trainer
)  # the default: the model divides by num_items_in_batch, the window's token count
print(
    "fix, num_items_in_batch: micro-batch tokens / tr_loss_step: "
    + ", ".join(f"{n} -> {loss:.4f}" for n, loss in steps)
)
assert all(math.isfinite(loss) for _, loss in steps) and 0.0 in [
    loss for n, loss in steps if n == 0
]

try:
    import datasets
    import transformers
except ImportError:
    print("reference check skipped: transformers / datasets not installed")
else:
    transformers.utils.logging.set_verbosity_error()
    hf_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    hf_model.load_state_dict(tiny_model().state_dict())
    hf = transformers.Trainer(
        model=hf_model,
        train_dataset=datasets.Dataset.from_list(ROWS_A),
        data_collator=COLLATOR,
        args=transformers.TrainingArguments(
            output_dir=tempfile.mkdtemp(),
            per_device_train_batch_size=1,
            gradient_accumulation_steps=2,
            learning_rate=1e-2,
            max_steps=2,
            logging_steps=1,
            save_strategy="no",
            use_cpu=True,
            optim="sgd",
            lr_scheduler_type="constant",
            report_to="none",
            disable_tqdm=True,
            seed=0,
        ),
    )
    hf.model_accepts_loss_kwargs = False  # the same per-batch-mean set-up
    with contextlib.redirect_stdout(io.StringIO()):
        hf.train()
    hf_losses = [h["loss"] for h in hf.state.log_history if "grad_norm" in h]
    our_losses = [h["loss"] for h in results[True].state.log_history if "grad_norm" in h]
    print(
        f"logged losses with the filter: nanosft {[round(x, 5) for x in our_losses]}   "
        f"transformers {[round(x, 5) for x in hf_losses]}"
    )
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(our_losses, hf_losses))
    print("reference check ran: transformers Trainer (zero-token micro-batch)")

# %% [markdown]
# ## B) 梯度爆炸 / an exploding gradient, seen in grad_norm, stopped by clipping
# Plain SGD at lr 1.0; the third micro-batch's loss is multiplied by 10^4 (a bad batch). Watch
# grad_norm.

# %%
banner("故障排除 B: 梯度爆炸 / exploding gradients: grad_norm and clip_grad_norm_")
g = torch.Generator().manual_seed(0)
ROWS_B = []
for _ in range(8):
    ids = torch.randint(1, TINY["vocab_size"], (8,), generator=g).tolist()
    ROWS_B.append({"input_ids": ids, "labels": ids})
runs = {}
for max_grad_norm in (0.0, None):  # None: a threshold read off the unclipped run's ordinary steps
    if max_grad_norm is None:
        ordinary = [
            norm for step, _, norm in runs[0.0][1] if step < 3
        ]  # the steps before the bad one
        max_grad_norm = round(
            1.5 * max(ordinary), 2
        )  # above every ordinary norm: binds in the blow-up
    trainer = train(
        ROWS_B * 3,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
        max_steps=10,
        learning_rate=0.1,
        max_grad_norm=max_grad_norm,
    )
    printed, _ = run(trainer, bad_micro_batch=2)
    logged = [
        (h["step"], h["loss"], h["grad_norm"])
        for h in trainer.state.log_history
        if "grad_norm" in h
    ]
    runs[max_grad_norm] = (printed, logged)
    print(f"max_grad_norm={max_grad_norm} ({'no clipping' if max_grad_norm == 0 else 'clipping'}):")
    for step, loss, norm in logged:
        binds = " <- clipped" if 0 < max_grad_norm < norm else ""
        print(f"   step {step:2d}  loss {loss:12.4f}  grad_norm {norm:14.4f}{binds}")
    for line in printed.splitlines():
        if line.startswith("Stopping"):
            print(f"   trainer: {line}")
CLIP = max_grad_norm
no_clip, clip = runs[0.0][1], runs[CLIP][1]
clipped_steps = [step for step, _, norm in clip if norm > CLIP]
print(
    f"max_grad_norm={CLIP} binds at steps {clipped_steps} only "
    f"(ordinary grad_norm <= {max(ordinary):.2f})"
)
assert clipped_steps == [3]  # the bad micro-batch is step 3; every other step runs unclipped
assert clip[:2] == no_clip[:2]  # before the blow-up the two runs are the same run
assert (
    no_clip[2][2] > 1e4 and clip[2][2] > 1e4
)  # the bad step shows in grad_norm either way (pre-clip)
after = [loss for _, loss, _ in no_clip[3:]]
assert len(no_clip) < 10 or any(
    not math.isfinite(x) or x > 100 for x in after
)  # no clipping: ruined
assert len(clip) == 10 and all(math.isfinite(loss) and math.isfinite(n) for _, loss, n in clip)
assert clip[-1][1] < 10  # back to an ordinary loss after the bad batch
print("the bad step's own loss is huge in both runs; what differs is every step after it: with the")
print(
    f"threshold at {CLIP} the bad batch moves the weights by at most lr * {CLIP} "
    "and training goes on"
)

# %% [markdown]
# ## C) 梯度消失 / vanishing gradients: per-layer gradient norms of a badly initialised deep stack
# "症状: 损失下降缓慢, 参数更新微小; 解决方案: 调整网络架构, 使用残差连接". Twenty tanh layers whose
# weights start too small (std 0.05 / sqrt(width)): each layer shrinks the backward signal, so the
# first layers get almost no gradient. The same stack with residual connections (x + f(x), as every
# decoder layer of the Llama has) passes the gradient through the identity path.

# %%
banner("故障排除 C: 梯度消失 / vanishing gradients: per-layer grad norms, plain vs residual")
DEPTH, WIDTH = 20, 32


def layer_grad_norms(residual):
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH))
    for layer in layers:
        torch.nn.init.normal_(layer.weight, std=0.05 / math.sqrt(WIDTH))  # the bad init
    x = torch.randn(16, WIDTH)
    for layer in layers:
        x = x + torch.tanh(layer(x)) if residual else torch.tanh(layer(x))
    x.pow(2).mean().backward()
    return [layer.weight.grad.norm().item() for layer in layers]


plain, residual = layer_grad_norms(False), layer_grad_norms(True)
print("layer        " + " ".join(f"{i:>8d}" for i in (0, 5, 10, 15, DEPTH - 1)))
for name, norms in (("plain", plain), ("residual", residual)):
    print(f"{name:12s} " + " ".join(f"{norms[i]:8.1e}" for i in (0, 5, 10, 15, DEPTH - 1)))
print(
    f"first / last layer grad norm: plain {plain[0] / plain[-1]:.1e}, "
    f"residual {residual[0] / residual[-1]:.1e}"
)
assert plain[0] / plain[-1] < 1e-6  # vanished: the first layer barely learns
assert residual[0] / residual[-1] > 1e-1  # the identity path carries the gradient down

# %% [markdown]
# ## D) 梯度累积错误 / accumulation mistakes
# "症状: 内存不足或参数更新异常; 解决方案: 正确设置累积步数, 确保梯度清零".
# Two classic ones: a loop that forgets zero_grad() after the optimizer step (each step's gradient
# adds the previous one), and the mean of per-micro-batch means (tutorial 11 measures that one
# against one big batch).

# %%
banner("故障排除 D: 梯度累积错误 / no zero_grad(): the next step's gradient carries the last one")
model = tiny_model()
batch = COLLATOR(ROWS_B[:2])
model(**batch).loss.backward()
first = model.lm_head.weight.grad.clone()
model(**batch).loss.backward()  # the same batch again, with no model.zero_grad() in between
doubled = (model.lm_head.weight.grad - 2 * first).abs().max().item()
print(
    "without zero_grad the second backward leaves 2 x the gradient: "
    f"max |grad - 2 g| = {doubled:.1e}"
)
model.zero_grad()
model(**batch).loss.backward()
fresh = (model.lm_head.weight.grad - first).abs().max().item()
print(
    f"with model.zero_grad() (the Trainer calls it after every optimizer step): max |grad - g| = "
    f"{fresh:.1e}"
)
assert doubled < 1e-6 and fresh < 1e-6

# %% [markdown]
# ## E, F) 同步失败 / a peer that hangs, and 内存同步问题 / parameters out of sync
# Two ranks (gloo, on this CPU). E: rank 1 never joins an all_reduce; rank 0 does not wait forever,
# the collective fails after the process group's timeout, which the Trainer sets from
# args.ddp_timeout (here 3 s instead of the default 1800). F: both ranks train the same model on the
# same data, but rank 1 skips one optimizer step; a checksum of the parameters, all-gathered across
# ranks after every step, names the step where they diverged.

# %%
banner("故障排除 E, F: ddp_timeout ends a hang; a cross-rank checksum catches a skipped update")


def sync_worker(rank, world, port, results):
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=TrainingArguments(ddp_timeout=3).ddp_timeout)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timeout
    )
    # F: the same model and batches on both ranks; rank 1 skips the optimizer step at step 2
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    checksums = []
    for step in range(1, 4):
        model.zero_grad()
        model(**COLLATOR(ROWS_B[2 * step : 2 * step + 2])).loss.backward()
        if not (rank == 1 and step == 2):
            optimizer.step()
        local = torch.stack([p.detach().double().sum() for p in model.parameters()]).sum()
        gathered = [torch.zeros((), dtype=torch.float64) for _ in range(world)]
        dist.all_gather(gathered, local)
        checksums.append([x.item() for x in gathered])
    # E: rank 1 hangs (it never enters the collective); rank 0's all_reduce times out
    waited, error = None, None
    if rank == 0:
        import time

        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1))
        except RuntimeError as exc:
            timed_out = "timed out" in str(exc).lower() or "timeout" in str(exc).lower()
            error = f"{type(exc).__name__} ({'timed out' if timed_out else str(exc)[:80]})"
        waited = time.monotonic() - start
    else:
        import time

        time.sleep(6)
    results[rank] = (checksums, waited, error)


def run_ranks():
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    results = mp.Manager().dict()
    # fork: the workers inherit this script's state instead of re-running it from the top
    mp.start_processes(
        sync_worker, args=(2, port, results), nprocs=2, join=True, start_method="fork"
    )
    return dict(results)


results = run_ranks()
checksums, waited, error = results[0]
for step, sums in enumerate(checksums, start=1):
    same = sums[0] == sums[1]
    print(
        f"step {step}: parameter checksum rank 0 {sums[0]:.10f}  rank 1 {sums[1]:.10f}  "
        f"{'in sync' if same else 'OUT OF SYNC'}"
    )
diverged = [step for step, sums in enumerate(checksums, start=1) if sums[0] != sums[1]]
print(f"first step out of sync: {diverged[0]} (rank 1 skipped its update there)")
print(
    f"rank 0's all_reduce with a hung peer returned after {waited:.1f} s (ddp_timeout=3): {error}"
)
assert diverged == [2, 3]  # once a rank skips an update it stays out of sync
assert checksums == results[1][0]  # both ranks gathered the same numbers
assert error is not None and 2.5 < waited < 30  # ended by the timeout, not by waiting forever

# %% [markdown]
# ## G) 负载不均衡 / load imbalance: tokens per rank, with and without group_by_length
# "症状: 部分GPU利用率低; 解决方案: 调整批次分配, 优化数据分布". Under DDP every optimizer step
# waits for the slowest rank, and a padded batch costs rows x its longest row. In the default random
# order one rank may draw long rows while the other draws short ones and idles.
# train_sampling_strategy="group_by_length" (transformers 4's group_by_length=True) orders the epoch
# with get_length_grouped_indices: a seeded permutation cut into megabatches of 50 x (batch x
# accumulation) examples (fewer for a small dataset, so it keeps 4), each sorted longest first.
# Neighbouring batches then have similar lengths, and DDP hands neighbours to the ranks of one
# step: batch i goes to rank i % 2 (accelerate's BatchSamplerShard). Two ranks are simulated here:
# each is the Trainer's own train sampler with that rank's num_replicas and rank, what it builds
# under torchrun.

# %%
banner("故障排除 G: 负载不均衡 / load imbalance: padded tokens per rank per step, group_by_length")
g = torch.Generator().manual_seed(1)
LENGTHS_G = [int(8 + 120 * u**2) for u in torch.rand(512, generator=g).tolist()]  # long-tailed
ROWS_G = [{"input_ids": [1] * n} for n in LENGTHS_G]  # only the lengths matter here


def rank_batches(strategy, world=2):
    """Each simulated rank's micro-batches for epoch 0, and the one-process order they split."""
    sampler = train(ROWS_G, per_device_train_batch_size=4, gradient_accumulation_steps=1,
                    train_sampling_strategy=strategy).get_train_dataloader().batch_sampler
    shares = []
    for rank in range(world):
        share = copy.copy(sampler)  # what build_dataloader makes on rank `rank` of `world`
        share.num_replicas, share.rank = world, rank
        shares.append(list(share))
    return shares, list(sampler)


def padded(batch):  # the tokens a rank computes for one micro-batch: rows x the longest row
    return len(batch) * max(LENGTHS_G[i] for i in batch)


imbalance = {}
for strategy in ("random", "group_by_length"):
    shares, whole = rank_batches(strategy)
    # the split is DDP's: rank 0 takes batches 0, 2, 4, ..., rank 1 batches 1, 3, 5, ...
    assert [b for pair in zip(*shares) for b in pair] == whole
    assert sorted(i for share in shares for b in share for i in b) == list(range(len(ROWS_G)))
    steps = [(padded(b0), padded(b1)) for b0, b1 in zip(*shares)]
    ratios = [max(step) / min(step) for step in steps]
    idle = sum(max(step) - min(step) for step in steps) / sum(2 * max(step) for step in steps)
    imbalance[strategy] = sum(ratios) / len(ratios)
    print(f"{strategy}:")
    print("   padded tokens per step (rank 0, rank 1), first 6 steps: "
          + ", ".join(f"({a}, {b})" for a, b in steps[:6]))
    print(f"   max/min tokens across ranks per step: mean {imbalance[strategy]:.2f}, worst "
          f"{max(ratios):.2f}; rank-time spent waiting for the other rank: {idle:.0%}")
print(f"load imbalance (mean max/min ratio) {imbalance['random']:.2f} -> "
      f"{imbalance['group_by_length']:.2f} with group_by_length")
assert imbalance["group_by_length"] < 1.2 < 1.5 < imbalance["random"]

try:
    from transformers.trainer_pt_utils import get_length_grouped_indices
except ImportError:
    print("reference check skipped: transformers not installed")
else:
    # the same permutation (the Trainer's generator: seed + epoch 0) through transformers
    reference = get_length_grouped_indices(LENGTHS_G, 4, generator=torch.Generator().manual_seed(0))
    assert [i for b in rank_batches("group_by_length")[1] for i in b] == reference
    print("reference check ran: transformers get_length_grouped_indices (group_by_length order)")

print("\nOK: troubleshooting checked")

"""Tutorial 12: mixed precision, bf16 autocast and the fp16 GradScaler (guide: 混合精度训练 / mixed
precision).

The guide's sequence: forward in half precision -> scaled_loss = loss * scale -> backward -> check
the gradients for overflow -> normal: unscale (grad /= scale) and update; overflow: skip the update
and lower the scale. Walkthrough 1 (核心训练逻辑) adds the consequence: `if not
self.accelerator.optimizer_step_was_skipped: self.lr_scheduler.step()`. bf16 needs no scaler (fp32's
exponent range), and runs under CPU autocast, so we train with it directly. fp16 needs CUDA in
nanosft (TrainingArguments refuses fp16 on CPU, where accelerate would silently run fp32), so on
this CPU we show the GradScaler mechanics with torch.amp.GradScaler("cpu"), then hand the same
scaler to a Trainer and inject an inf gradient on its second optimizer step.
Run:      python tutorials/12_mixed_precision.py
Runtime:  about 5 s on one CPU core with transformers installed, 4 s without.
You should see:
  - bf16: linear outputs in bfloat16, weights and grads in float32, logits handed back in float32;
  - the fp16-on-CPU refusal, then a GradScaler step skipped on inf (weights unchanged, scale 65536
    -> 32768);
  - a Trainer run whose step 2 is skipped: grad_norm inf, the learning rate not advanced at step 3;
  - "OK: mixed precision checked".
"""

# %%
import contextlib
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
ROWS = [
    {"input_ids": [5, 17, 42, 8, 9, 2], "labels": [-100, -100, 42, 8, 9, 2]},
    {"input_ids": [7, 33, 12, 2], "labels": [-100, 33, 12, 2]},
    {"input_ids": [3, 9, 14, 21, 8, 2], "labels": [-100, 9, 14, 21, 8, 2]},
    {"input_ids": [11, 6, 2], "labels": [-100, 6, 2]},
]
COLLATOR = DataCollatorForLanguageModeling(pad_token_id=0)


def banner(title):
    print(f"\n{'=' * 20} {title} {'=' * 20}")


def tiny_model():
    torch.manual_seed(0)
    return CausalLM(ModelConfig(**TINY))


def tiny_args(**overrides):
    return TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        use_cpu=True,
        report_to="none",
        disable_tqdm=True,
        save_strategy="no",
        **overrides,
    )


# %% [markdown]
# ## bf16 autocast: 前向传播 (BF16)
# Autocast runs matmuls in bfloat16 but keeps the weights (and so the gradients and the optimizer)
# in float32; the Trainer hands the logits back as float32 (accelerate's convert_outputs_to_fp32) so
# the loss's log-softmax is computed in full precision.

# %%
banner("混合精度 / mixed precision: bf16 autocast on CPU (no GradScaler needed)")
model = tiny_model()
inputs = COLLATOR(ROWS[:2])
fp32_loss = model(**inputs).loss.item()
trainer = Trainer(model, tiny_args(bf16=True))
seen = {}
hook = model.model.layers[0].self_attn.q_proj.register_forward_hook(
    lambda m, a, out: seen.update(q=out.dtype)
)
loss, outputs = trainer.compute_loss(model, dict(inputs), return_outputs=True)
loss.backward()
hook.remove()
grad = model.model.layers[0].self_attn.q_proj.weight.grad
print(
    f"q_proj output {seen['q']}, "
    f"q_proj.weight {model.model.layers[0].self_attn.q_proj.weight.dtype}, "
    f"its grad {grad.dtype}; logits returned as {outputs.logits.dtype}"
)
print(
    f"loss: bf16 autocast {loss.item():.5f}   fp32 {fp32_loss:.5f}   "
    f"(difference {abs(loss.item() - fp32_loss):.1e})"
)
assert (
    seen["q"] == torch.bfloat16
    and grad.dtype == torch.float32
    and outputs.logits.dtype == torch.float32
)
assert abs(loss.item() - fp32_loss) < 2e-2  # bf16 keeps ~3 significant digits; logits ~ 1e-1 here
try:
    import transformers
except ImportError:
    print("reference check skipped: transformers is not installed")
else:
    hf_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    hf_model.load_state_dict(tiny_model().state_dict())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hf_loss = hf_model(**inputs).loss
    print(f"transformers LlamaForCausalLM under the same autocast: loss {hf_loss.item():.5f}")
    assert abs(hf_loss.item() - loss.item()) < 2e-2  # both bf16: rounding order differs
    print("reference check ran: transformers LlamaForCausalLM under autocast")

# %%
banner("fp16 needs CUDA: TrainingArguments(fp16=True) on this CPU")
try:
    TrainingArguments(output_dir=tempfile.mkdtemp(), fp16=True)
except ValueError as error:
    print(f"ValueError: {error}")
    refused = True
else:
    refused = False  # a CUDA machine: fp16 is allowed there
print(
    "so below we use torch.amp.GradScaler('cpu') by hand: the same object fp16=True creates on CUDA"
)
assert refused or torch.cuda.is_available()

# %% [markdown]
# ## GradScaler: 缩放损失 -> 反向传播 -> 检查梯度溢出 -> 跳过更新 / 调整缩放因子
# scale starts at 2**16. step() unscales the grads and checks them for inf/nan; if any, it skips
# optimizer.step(). update() then multiplies the scale by 0.5 (backoff) after a skip, or by 2 after
# growth_interval (2000) clean steps in a row.

# %%
banner("GradScaler: scaled_loss = loss * scale; skip the update on inf; scale *= 0.5")
model = tiny_model()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu")
weight = model.lm_head.weight
for attempt, inject in (("step 1 (inf injected)", True), ("step 2 (clean)", False)):
    optimizer.zero_grad()
    loss = model(**inputs).loss
    scaled = scaler.scale(loss)
    scaled.backward()
    if inject:
        weight.grad[0, 0] = float("inf")  # what an fp16 overflow leaves in a gradient
    before = weight.detach().clone()
    scale_before = scaler.get_scale()
    scaler.step(optimizer)  # unscale_ + inf check + (maybe) optimizer.step()
    scaler.update()
    changed = not torch.equal(before, weight.detach())
    print(
        f"{attempt}: loss {loss.item():.4f}, scaled_loss {scaled.item():.1f} (x {scale_before:g}); "
        f"weights changed: {changed}; scale {scale_before:g} -> {scaler.get_scale():g}"
    )
    if inject:
        assert not changed and scaler.get_scale() == scale_before * 0.5
        assert math.isclose(scaled.item(), loss.item() * 2**16, rel_tol=1e-6)
    else:
        assert changed and scaler.get_scale() == scale_before

# %% [markdown]
# ## Inside the Trainer: optimizer_step_was_skipped -> no lr_scheduler.step()
# With fp16 the Trainer keeps a GradScaler in `trainer.scaler`: training_step backpropagates
# scaler.scale(loss), _clip_grad_norm unscales first (so grad_norm and clipping see true gradients),
# and the loop's GradScaler branch (scaler.step, scaler.update) reads a skip when update() lowered
# the scale. We give a Trainer the CPU scaler and make the gradient of its second optimizer step
# inf.

# %%
banner("1 核心训练逻辑: if not optimizer_step_was_skipped: self.lr_scheduler.step()")
model = tiny_model()
trainer = Trainer(
    model,
    tiny_args(
        per_device_train_batch_size=2,
        max_steps=3,
        learning_rate=1e-3,
        logging_steps=1,
        optim="adamw_torch",
    ),
    train_dataset=ROWS * 2,
    data_collator=COLLATOR,
)
trainer.scaler = torch.amp.GradScaler("cpu")  # what TrainingArguments(fp16=True) sets up on CUDA
calls, snapshots = [], []


def poison(grad):
    if len(calls) == 2:  # the micro-batch of optimizer step 2
        grad = grad.clone()
        grad[0, 0] = float("inf")
    return grad


model.lm_head.weight.register_hook(poison)


def record(module, args):  # a forward pre-hook: before each micro-batch's forward
    calls.append(trainer.scaler.get_scale())
    snapshots.append(model.lm_head.weight.detach().clone())


trainer.model.register_forward_pre_hook(record)
with contextlib.redirect_stdout(io.StringIO()):
    trainer.train()
logs = [h for h in trainer.state.log_history if "grad_norm" in h]
snapshots.append(model.lm_head.weight.detach().clone())
print(" step | scale before | grad_norm | learning_rate | weights changed")
for i, h in enumerate(logs):
    changed = not torch.equal(snapshots[i], snapshots[i + 1])
    print(
        f"   {h['step']}  | {calls[i]:10g}   | {h['grad_norm']:9.4f} | "
        f"{h['learning_rate']:.3e}     | {changed}"
    )
lrs = [h["learning_rate"] for h in logs]
assert (
    math.isinf(logs[1]["grad_norm"])
    and math.isfinite(logs[0]["grad_norm"])
    and math.isfinite(logs[2]["grad_norm"])
)
assert torch.equal(snapshots[1], snapshots[2]) and not torch.equal(
    snapshots[2], snapshots[3]
)  # step 2 skipped
assert calls == [2.0**16, 2.0**16, 2.0**15]  # halved after the skip
# linear schedule over 3 steps: 1e-3, 6.67e-4, ... but step 2 did not advance it, so step 3 reuses
# 6.67e-4
assert (
    math.isclose(lrs[0], 1e-3)
    and math.isclose(lrs[1], 1e-3 * 2 / 3)
    and math.isclose(lrs[2], lrs[1])
)
print(
    "step 2 skipped: weights kept, scale halved, and the scheduler not stepped "
    "(step 3 reuses step 2's lr)"
)

print("\nOK: mixed precision checked")

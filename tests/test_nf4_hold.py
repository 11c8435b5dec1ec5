"""nf4_dequantize="per_step": each 4-bit weight dequantized once per optimizer step, not twice per
micro-batch (nanosft.fast.nf4.hold_dequantized, monitoring.callbacks.HoldDequantizedCallback).

The base is frozen, so holding changes no number: a QLoRA Trainer run of 3 optimizer steps with
gradient accumulation 2 logs the same losses and ends with the same adapters, bit for bit, as the
per-call run, in fp32 and in the bf16 recipe (bf16 base, NF4 computing in bf16, bf16 autocast).
What changes is counted: bitsandbytes' CPU dequantize kernel runs once per 4-bit linear per step
and dtype (per call: in every micro-batch's forward and again in its backward, 3.6x that here).
What the hold keeps equals the memory ledger's row for it, and nothing is held after the step (nor
in evaluation).
Off in reference mode; a bad value is refused naming the field.
Run: python -m pytest -q tests/test_nf4_hold.py
"""

import pytest
import torch
from tiny import one_thread, tiny_model  # noqa: F401  (one_thread: autouse fixture)

from nanosft import memory, nf4
from nanosft.args import TrainingArguments
from nanosft.fast import nf4 as fast_nf4
from nanosft.peft import LoraConfig, get_peft_model
from nanosft.reference import reference_mode
from nanosft.sft import _cast_trainable_to_bf16
from nanosft.trainer import Trainer
from nanosft.trainer_callback import TrainerCallback

SIZES = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 128}
B, T, GA, STEPS = 2, 12, 2, 3
N_LINEARS = 2 * 7  # two layers of Llama's seven projections
_KERNEL = fast_nf4.dequantize_into_workspace  # the unpatched one, for every patch to call


def _qlora(bf16):
    model = tiny_model(**SIZES)
    if bf16:
        model = model.to(torch.bfloat16)
    nf4.quantize_model(model, compute_dtype=torch.bfloat16 if bf16 else None)
    model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))
    _cast_trainable_to_bf16(model) if bf16 else None
    for name, p in model.named_parameters():
        if "lora_B" in name:  # B random: every adapter gradient is nonzero from the first step
            torch.nn.init.normal_(p, std=0.05)
    return model


def _rows():
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(3, 96, (T,), generator=g).tolist(),
             "labels": torch.randint(3, 96, (T,), generator=g).tolist()}
            for _ in range(B * GA * STEPS)]


class _Watch(TrainerCallback):
    """What the hold keeps at the end of each micro-batch, and after each step."""

    def __init__(self):
        self.during, self.after = [], []

    def on_substep_end(self, args, state, control, **kwargs):
        self.during.append(fast_nf4.held_bytes())

    def on_log(self, args, state, control, **kwargs):
        self.after.append(fast_nf4.held_bytes())


def _train(tmp_path, mode, bf16, monkeypatch):
    calls = []

    def counted(packed, quant_state, absmax, dtype):
        calls.append(dtype)
        return _KERNEL(packed, quant_state, absmax, dtype)

    monkeypatch.setattr(fast_nf4, "dequantize_into_workspace", counted)
    model, watch = _qlora(bf16), _Watch()
    args = TrainingArguments(output_dir=str(tmp_path / mode), max_steps=STEPS, logging_steps=1,
                             per_device_train_batch_size=B, gradient_accumulation_steps=GA,
                             learning_rate=1e-2, save_strategy="no", disable_tqdm=True,
                             bf16=bf16, nf4_dequantize=mode, seed=0)
    trainer = Trainer(model, args, train_dataset=_rows(), callbacks=[watch])
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return losses, adapters, calls, watch, model


@pytest.mark.parametrize("bf16", [False, True])
def test_per_step_trains_bit_for_bit_with_a_quarter_of_the_dequantizes(tmp_path, monkeypatch,
                                                                        bf16):
    per_call = _train(tmp_path, "per_call", bf16, monkeypatch)
    per_step = _train(tmp_path, "per_step", bf16, monkeypatch)
    assert per_step[0] == per_call[0] and len(per_call[0]) == STEPS
    for name, p in per_call[1].items():
        assert torch.equal(per_step[1][name], p), name
    dtype = torch.bfloat16 if bf16 else torch.float32
    # per call: every linear in each micro-batch's forward, and again in its backward where the
    # input takes a gradient (not layer 0's q/k/v: their input is the frozen embedding's, normed)
    micro_batches = GA * STEPS
    assert per_call[2] == [dtype] * ((N_LINEARS + N_LINEARS - 3) * micro_batches)
    assert per_step[2] == [dtype] * (N_LINEARS * STEPS)


def test_what_is_held_is_the_ledger_row_and_released_after_each_step(tmp_path, monkeypatch):
    *_, watch, model = _train(tmp_path, "per_step", False, monkeypatch)
    plan = memory.MemoryPlan(load_in_4bit=True, r=4, target_modules="all-linear",
                             per_device_train_batch_size=B, max_length=T, nf4_held=True)
    row = memory.estimate_memory(model.get_base_model().config, plan).rows
    held = row["4-bit weights dequantized (held)"]
    weights = sum(m.out_features * m.in_features * 4 for m in model.modules()
                  if isinstance(m, nf4.Linear4bit))
    assert held == weights > 0
    # the first micro-batch of each step ends with every weight held (the last one's substep
    # end does not fire: the optimizer step ends the window)
    assert watch.during == [held] * STEPS
    assert len(watch.after) >= STEPS and set(watch.after) == {0}  # logs come after step end
    assert fast_nf4.held_bytes() == 0
    off = memory.MemoryPlan(load_in_4bit=True, r=4, per_device_train_batch_size=B, max_length=T)
    assert "4-bit weights dequantized (held)" not in memory.estimate_memory(
        model.get_base_model().config, off).rows


def test_reference_mode_holds_nothing_and_bad_values_are_named(tmp_path, monkeypatch):
    with reference_mode():
        losses, _, calls, watch, _ = _train(tmp_path, "per_step", False, monkeypatch)
        assert not memory.holds_dequantized(TrainingArguments(output_dir=str(tmp_path),
                                                              nf4_dequantize="per_step"))
    assert set(watch.during) == {0} and len(calls) == 0  # the speed path itself is off
    with pytest.raises(ValueError, match="nf4_dequantize.*per_call.*per_step"):
        TrainingArguments(output_dir=str(tmp_path), nf4_dequantize="once")


def test_a_hold_inside_a_hold_starts_empty_and_gives_the_outer_back():
    model = _qlora(False)
    x = torch.randint(3, 96, (1, 5))
    with fast_nf4.hold_dequantized():
        model(x)
        outer = fast_nf4.held_bytes()
        with fast_nf4.hold_dequantized():
            assert fast_nf4.held_bytes() == 0
        assert fast_nf4.held_bytes() == outer > 0
    assert fast_nf4.held_bytes() == 0

"""Model FLOPs, FLOP/s and MFU in the Trainer's logs and in the summary of `nanosft train` (the
demo's line: tests/test_cli.py).

Compared: trainer_utils.model_flops on a live nanosft model (full fine-tuning, and LoRA on a frozen
base) against the matmul FLOPs torch.utils.flop_counter.FlopCounterMode counts in one forward and
backward (SDPA forced onto its math path, so attention shows as bmm products; torch counts the
whole T x T square, the formula its causal half); the documents of a padding-free row against the
products the model's per-document attention runs; each logged train_model_flops_per_second against
6N per token plus attention written out in the test from the config; mfu against
train_model_flops_per_second over a passed peak_flops; total_flos and model FLOPs of two DDP ranks
(gloo, spawned on localhost) against one process seeing the same micro-batches; the CLI's summary
line. Negative controls: 6N on a frozen base, and padded rows or a packed row as one sequence, are
other numbers. transformers' total_flos is compared in tests/parity/test_trainer_flops_parity.py.
Hermetic: CPU, fp32, tiny models (hidden 32), the package's own tiny default model for the CLI.
Run: python -m pytest -q tests/test_model_flops.py
"""

import json
import os
import re
import socket

import pytest
import torch
import torch.multiprocessing as mp
from tiny import (  # noqa: F401 (one_thread: an autouse fixture)
    TINY_LLAMA, join_as_rank, one_thread, tiny_model)
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from nanosft.cli import demo
from nanosft.args import TrainingArguments
from nanosft.cli import main
from nanosft.collator import DataCollatorForLanguageModeling
from nanosft.distributed import cleanup
from nanosft.peft import LoraConfig, get_peft_model
from nanosft.trainer import Trainer
from nanosft.monitoring.callbacks import ThroughputCallback, find_callback
from nanosft.monitoring.flops import (attention_shape, calibrate_matmul_flops, matmul_parameters,
                                      model_flops, sequence_lengths)


def counted_flops(model, **inputs):
    """(matmul FLOPs, attention bmm FLOPs) torch counts in one forward + backward."""
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(**inputs).loss.backward()
    counts = counter.get_flop_counts()["Global"]
    attention = sum(v for op, v in counts.items() if "bmm" in str(op))
    return sum(counts.values()) - attention, attention


def config_matmul_weights(c) -> int:
    """N written out from the config: the seven layer linears of every layer plus lm_head."""
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    q = o = c["hidden_size"] * c["num_attention_heads"] * head_dim
    k = v = c["hidden_size"] * c["num_key_value_heads"] * head_dim
    mlp = 3 * c["hidden_size"] * c["intermediate_size"]
    return c["num_hidden_layers"] * (q + k + v + o + mlp) + c["hidden_size"] * c["vocab_size"]


@pytest.mark.parametrize("method", ["full", "lora"])
def test_model_flops_equals_torch_flop_counter(method):
    B, T = 2, 12
    model = tiny_model(tie_word_embeddings=True)
    if method == "lora":
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        # as under gradient checkpointing: layer 0's frozen q/k/v also get their input gradient
        model.enable_input_require_grads()
    ids = torch.randint(1, TINY_LLAMA["vocab_size"], (B, T),
                        generator=torch.Generator().manual_seed(0))
    matmul, attention = counted_flops(model, input_ids=ids, labels=ids)
    weights, trainable = matmul_parameters(model)
    width, layers = attention_shape(model)
    ours = model_flops(weights, trainable, width, layers, [T] * B)
    ours_attention = model_flops(0, 0, width, layers, [T] * B)
    assert ours - ours_attention == matmul
    # torch counts the whole T x T square; the causal triangle holds T(T+1)/2 of its T*T entries
    assert ours_attention * 2 * T == attention * (T + 1) and attention > 0
    base = config_matmul_weights(TINY_LLAMA)  # lm_head counted once though tied to the embedding
    if method == "full":
        assert (weights, trainable) == (base, base)
    else:
        assert weights > base and trainable == weights - base
        # negative control: 6 per weight, as if the frozen base trained, is another number
        assert 6 * weights * B * T != matmul


def test_padding_free_documents_are_the_model_s_attention_products():
    model = tiny_model()
    lengths = [5, 3, 9, 1]  # one packed row of four documents, position_ids restarting at 0
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    ids = torch.randint(1, TINY_LLAMA["vocab_size"], position_ids.shape,
                        generator=torch.Generator().manual_seed(1))
    _, attention = counted_flops(model, input_ids=ids, position_ids=position_ids, labels=ids)
    assert sequence_lengths(ids, None, position_ids) == lengths
    width, layers = attention_shape(model)
    # one causal SDPA per document: 12 x width x layers x t^2 (the whole t x t square) each
    assert attention == 12 * width * layers * sum(t * t for t in lengths)
    # negative control: the row as one sequence of 18 tokens attends over another square
    assert attention != 12 * width * layers * sum(lengths) ** 2
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    assert sequence_lengths(torch.zeros(2, 6), mask) == [4, 6]


def rows(n=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(4, 15, (1,), generator=g))
        ids = torch.randint(1, TINY_LLAMA["vocab_size"], (length,), generator=g).tolist()
        out.append({"input_ids": ids, "labels": ids})
    return out


def test_logs_carry_model_flops_per_second_and_mfu_over_the_passed_peak(tmp_path):
    peak = 3e9
    args = TrainingArguments(str(tmp_path), report_to="nanosft",
                             per_device_train_batch_size=2, logging_steps=1,
                             gradient_accumulation_steps=1, num_train_epochs=1, use_cpu=True,
                             save_strategy="no", disable_tqdm=True, peak_flops=peak)
    trainer = Trainer(tiny_model(), args, train_dataset=rows(),
                      data_collator=DataCollatorForLanguageModeling(pad_token_id=0))
    trainer.train()
    batches = list(trainer.get_train_dataloader())  # the epoch's order: seed + epoch 0
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == len(batches) == 5
    n, width, layers = (config_matmul_weights(TINY_LLAMA), TINY_LLAMA["hidden_size"],
                        TINY_LLAMA["num_hidden_layers"])

    def flops_per_token(lengths, tokens):  # 6N a token plus causal attention, over `tokens`
        attention = 6 * width * layers * sum(t * (t + 1) for t in lengths)
        return (6 * n * sum(lengths) + attention) / tokens

    padded_batches = 0
    for h, batch in zip(logs, batches):
        lengths = batch["attention_mask"].sum(-1).tolist()  # real tokens, padding left out
        # the rates share one clock: FLOP/s over tokens/s is FLOPs per token of the window
        per_token = h["train_model_flops_per_second"] / h["train_tokens_per_second"]
        rel = 0.1 / h["train_tokens_per_second"]  # tokens/s is logged rounded to 0.1
        assert per_token == pytest.approx(flops_per_token(lengths, sum(lengths)), rel=rel)
        assert h["mfu"] == pytest.approx(h["train_model_flops_per_second"] / peak, rel=1e-6)
        if not batch["attention_mask"].all():  # negative control: padded rows are other FLOPs
            padded_batches += 1
            rows_as_padded = [batch["input_ids"].shape[1]] * len(lengths)
            assert per_token != pytest.approx(flops_per_token(rows_as_padded, sum(lengths)),
                                              rel=rel)
    assert padded_batches > 0
    final = trainer.state.log_history[-1]
    achieved = find_callback(trainer, ThroughputCallback).model_flos / final["train_runtime"]
    assert final["train_model_flops_per_second"] == pytest.approx(achieved, rel=1e-6)
    assert final["mfu"] == pytest.approx(achieved / peak, rel=1e-6)


def flops_of_run(output_dir, gradient_accumulation_steps):
    """(state.total_flos, this call's model FLOPs) of one epoch at per-device batch 2."""
    args = TrainingArguments(output_dir, report_to="nanosft",
                             per_device_train_batch_size=2, num_train_epochs=1,
                             gradient_accumulation_steps=gradient_accumulation_steps,
                             logging_steps=1, use_cpu=True, save_strategy="no", disable_tqdm=True,
                             peak_flops=1e12)
    trainer = Trainer(tiny_model(), args, train_dataset=rows(12),
                      data_collator=DataCollatorForLanguageModeling(pad_token_id=0))
    trainer.train()
    return trainer.state.total_flos, find_callback(trainer, ThroughputCallback).model_flos


def _ddp_worker(rank, port, output_dir):
    join_as_rank(rank, port)
    flops = flops_of_run(output_dir, gradient_accumulation_steps=2)
    torch.save(flops, os.path.join(output_dir, f"flops_{rank}.pt"))
    cleanup()


@pytest.mark.skipif(not torch.distributed.is_available(),
                    reason="torch.distributed is not built in")
def test_two_ranks_count_the_flops_of_one_process(tmp_path):
    """Rank r trains global micro-batches r, r+2, ...: together the 6 micro-batches of batch 2 one
    process sees (GA 2 x 2 ranks = GA 4), padded alike, so both sums are the one process's."""
    single = flops_of_run(str(tmp_path / "single"), gradient_accumulation_steps=4)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_ddp_worker, args=(port, str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"flops_{r}.pt", weights_only=True) for r in range(2)]
    assert ranks[0] == ranks[1] == single  # every rank holds the sum over ranks
    assert single[0] > 0 and single[1] > 0


def test_peak_is_calibrated_without_peak_flops_and_leaves_the_rng_alone(tmp_path):
    state = torch.get_rng_state()
    rate = calibrate_matmul_flops(32)
    assert torch.equal(torch.get_rng_state(), state)  # dropout and init draw from it
    assert rate > 1e6  # FLOP/s: any CPU multiplies a (4096, 32) x (32, 32) product faster
    args = TrainingArguments(str(tmp_path), report_to="nanosft",
                             per_device_train_batch_size=2, max_steps=2,
                             logging_steps=1, use_cpu=True, save_strategy="no", disable_tqdm=True)
    trainer = Trainer(tiny_model(), args, train_dataset=rows(4),
                      data_collator=DataCollatorForLanguageModeling(pad_token_id=0))
    metrics = trainer.train().metrics
    assert find_callback(trainer, ThroughputCallback).peak_flops > 1e6
    assert metrics["mfu"] == pytest.approx(
        metrics["train_model_flops_per_second"]
        / find_callback(trainer, ThroughputCallback).peak_flops, rel=1e-6)
    with pytest.raises(ValueError, match="peak_flops"):
        TrainingArguments(str(tmp_path), peak_flops=0)


def test_nanosft_train_prints_gflops_and_mfu(tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"{a} plus {a} is {2 * a}."}) + "\n"
                            for a in range(4)))
    argv = ["train", "--model", demo.DEFAULT_DIR, "--data", data, "--output_dir", tmp_path / "out",
            "--max_steps", 2, "--per_device_train_batch_size", 2, "--save_strategy", "no",
            "--gradient_checkpointing", "false", "--bf16", "false", "--peak_flops", "2e11"]
    assert main([str(a) for a in argv]) == 0
    out = capsys.readouterr().out
    found = re.search(r"speed: ([\d.]+) GFLOP/s of model FLOPs, MFU ([\d.]+)% of 200\.0 GFLOP/s "
                      r"\(peak_flops\)", out)
    assert found, out[-2000:]
    gflops, mfu = float(found[1]), float(found[2])
    assert gflops > 0 and mfu == pytest.approx(100 * gflops / 200, abs=0.06)  # both printed rounded


def test_a_calibration_taken_under_load_never_shows_mfu_above_100_percent(tmp_path, monkeypatch):
    from nanosft.monitoring import callbacks

    monkeypatch.setattr(callbacks, "calibrate_matmul_flops", lambda *a, **k: 1.0)  # cores busy
    args = TrainingArguments(str(tmp_path), per_device_train_batch_size=2, max_steps=3,
                             logging_steps=1, use_cpu=True, save_strategy="no", disable_tqdm=True,
                             report_to="nanosft")
    trainer = Trainer(tiny_model(), args, train_dataset=rows(6),
                      data_collator=DataCollatorForLanguageModeling(pad_token_id=0))
    metrics = trainer.train().metrics
    shown = [h["mfu"] for h in trainer.state.log_history if "mfu" in h] + [metrics["mfu"]]
    assert len(shown) >= 4 and all(0 < mfu <= 1 for mfu in shown), shown  # before: ~1e9
    callback = find_callback(trainer, ThroughputCallback)
    assert callback.peak_flops >= metrics["train_model_flops_per_second"]
    assert "read lower, under load" in callback.speed_summary(args, metrics)

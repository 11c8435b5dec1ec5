"""The benchmark's pure functions are right: its bare PyTorch loop and nanosft's Trainer log
the same per-step losses.

benchmarks/bench_sft.py compares speeds, which only means something if every stack trains on the
same batches with the same numerics. Here the bare loop (its own collator, loss and AdamW) and
nanosft.trainer.Trainer run 3 steps on a tiny model built in-process (hidden 32, 2 layers, vocab
128) and must agree step by step; a different data seed is the negative control. No timing is
asserted. Hermetic: no network, no files outside tmp_path, fixed seeds.
Run: python -m pytest -q tests/test_bench_sft.py
"""

import importlib.util
import os

import pytest
import torch

from nanosft.collator import DataCollatorForLanguageModeling
from nanosft.model import CausalLM, ModelConfig
from nanosft.trainer import Trainer
from nanosft.trainer_utils import SeedableBatchSampler

BENCH = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "bench_sft.py")


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_sft", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _load_bench()
VOCAB, BATCH, GA, STEPS = 128, 4, 2, 3


def _tiny_model():
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
                         pad_token_id=bench.PAD_ID)
    return CausalLM(config)


def _rows():
    return bench.make_examples(BATCH * GA * STEPS, vocab_size=VOCAB, min_len=8, max_len=24, seed=3)


def _trainer_losses(model, rows, tmp_path, seed):
    opts = bench.Options(steps=STEPS, warmup=0, batch_size=BATCH, grad_accum=GA,
                         learning_rate=1e-2, seed=seed)
    kwargs = bench._trainer_kwargs(bench.Case("full"), opts, STEPS, str(tmp_path))
    from nanosft.args import TrainingArguments

    trainer = Trainer(model, TrainingArguments(**kwargs), train_dataset=rows,
                      data_collator=DataCollatorForLanguageModeling(pad_token_id=bench.PAD_ID))
    trainer.train()
    return bench._logged_losses(trainer.state.log_history)


def test_make_examples_is_deterministic_and_in_range():
    a, b = _rows(), _rows()
    assert a == b
    lengths = [len(r["input_ids"]) for r in a]
    assert min(lengths) >= 8 and max(lengths) <= 24
    assert all(r["input_ids"][-1] == bench.EOS_ID and r["labels"] == r["input_ids"] for r in a)
    assert all(3 <= t < VOCAB for r in a for t in r["input_ids"][:-1])  # no pad/bos/eos inside


def test_step_plan_is_the_trainer_sampler_order():
    plan = bench.step_plan(BATCH * GA * STEPS, BATCH, GA, STEPS, seed=42)
    sampler = SeedableBatchSampler(BATCH * GA * STEPS, BATCH, seed=42)
    assert [mb for step in plan for mb in step] == list(sampler)


def test_collate_padded_matches_nanosft_collator():
    rows = _rows()[:BATCH]
    ours = bench.collate_padded(rows)
    theirs = DataCollatorForLanguageModeling(pad_token_id=bench.PAD_ID)([dict(r) for r in rows])
    for key in ("input_ids", "attention_mask", "labels"):
        torch.testing.assert_close(ours[key], theirs[key], rtol=0, atol=0)


def test_bare_loop_and_nanosft_trainer_log_the_same_losses(tmp_path):
    rows = _rows()
    opts = bench.Options(steps=STEPS, warmup=0, batch_size=BATCH, grad_accum=GA, learning_rate=1e-2)
    plan = bench.step_plan(len(rows), BATCH, GA, STEPS, seed=42)
    bare = bench.bare_loop(_tiny_model(), rows, plan, opts)
    trained = _trainer_losses(_tiny_model(), rows, tmp_path, seed=42)
    # fp32, same ops in a different summation order (sliced vs padded shift);
    # 3 steps of lr 1e-2 keep it < 1e-5
    torch.testing.assert_close(torch.tensor(bare), torch.tensor(trained), rtol=0, atol=1e-5)
    assert bare[-1] < bare[0]  # the steps did train (the lr is not a no-op)


def test_negative_control_another_data_order_differs(tmp_path):
    rows = _rows()
    opts = bench.Options(steps=STEPS, warmup=0, batch_size=BATCH, grad_accum=GA, learning_rate=1e-2)
    plan = bench.step_plan(len(rows), BATCH, GA, STEPS, seed=42)
    bare = bench.bare_loop(_tiny_model(), rows, plan, opts)
    other = _trainer_losses(_tiny_model(), rows, tmp_path, seed=43)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(torch.tensor(bare), torch.tensor(other), rtol=0, atol=1e-5)


def _tiny_fixture(tmp_path, monkeypatch, length):
    """The benchmark's Fixture on a tiny shape, holding one sequence of `length` tokens."""
    monkeypatch.setitem(bench.SIZES, "tiny", {"hidden_size": 32, "intermediate_size": 64,
                                             "num_hidden_layers": 2, "num_attention_heads": 4,
                                             "num_key_value_heads": 2, "vocab_size": VOCAB})
    opts = bench.Options(steps=1, warmup=0, batch_size=1, grad_accum=1)
    fx = bench.Fixture("tiny", opts, str(tmp_path))
    fx.rows = [{"input_ids": list(range(3, 3 + length)), "labels": list(range(3, 3 + length))}]
    fx.plan = [[[0]]]
    return fx


def test_flops_per_step_counts_what_torch_flop_counter_counts(tmp_path, monkeypatch):
    """6N per token for full fine-tuning equals the matmul FLOPs torch counts in one forward and
    backward; the attention term is the causal half of the full (T x T) products torch counts."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import LlamaForCausalLM

    length = 24
    fx = _tiny_fixture(tmp_path, monkeypatch, length)
    model = LlamaForCausalLM(fx.hf_config)
    model.set_attn_implementation("eager")  # explicit bmm products, which the counter sees
    ids = torch.tensor([fx.rows[0]["input_ids"]])
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    counts = counter.get_flop_counts()["Global"]
    attention = sum(v for op, v in counts.items() if "bmm" in str(op))
    matmul = sum(counts.values()) - attention
    c = fx.hf_config
    ours = fx.flops_per_step("full")[0]
    ours_attention = 6 * c.hidden_size * c.num_hidden_layers * length * (length + 1)
    assert ours - ours_attention == matmul
    # torch counts the full square; the causal triangle holds T(T+1)/2 of its T*T entries
    assert ours_attention * 2 * length == attention * (length + 1)
    assert attention > 0 and matmul > 0


def test_results_sections_survive_each_other(tmp_path):
    """The small/medium run and a real-size run write one RESULTS.md without erasing each other."""
    path = tmp_path / "RESULTS.md"
    path.write_text("# main v1\n")
    sec = "<!-- section: real-size-cpu -->\nA\n<!-- end: real-size-cpu -->\n"
    path.write_text(bench.replace_section(str(path), sec))
    path.write_text(bench.replace_section(str(path), sec.replace("A", "B")))
    text = path.read_text()
    assert text.startswith("# main v1") and "B" in text and "\nA\n" not in text
    path.write_text(bench.keep_sections(str(path), "# main v2\n"))
    text = path.read_text()
    assert text.startswith("# main v2") and text.count("<!-- section: real-size-cpu -->") == 1
    assert "B" in text and "main v1" not in text


def test_dequantize_per_call_compares_the_same_bits_with_bitsandbytes_direct():
    """--real's dequantize row: nanosft's speed path and bitsandbytes.functional.dequantize_4bit
    on one NF4 weight give the same bits, and each gets a time and a page-fault count; the
    RESULTS.md line says so. A tiny weight and 3 calls: no timing is asserted."""
    torch.manual_seed(0)
    weight = torch.randn(128, 64) * 0.02
    result = bench.dequantize_per_call(weight, calls=3)
    assert result["equal"] is True
    for path in ("bitsandbytes", "nanosft"):
        ms, faults = result[path]
        assert ms > 0 and faults >= 0

    class Fx:
        state_dict = {"model.layers.0.mlp.gate_proj.weight": weight}

    lines = bench.dequantize_lines(Fx(), ["fp32", "bf16"], calls=3)
    assert len(lines) == 2 and all("same bits: yes" in line for line in lines)
    assert lines[0].startswith("- fp32, (128, 64): nanosft ")


def test_profile_ops_times_the_aten_ops_of_exactly_one_optimizer_step(tmp_path, monkeypatch):
    """--profile-ops: nanosft's bf16 QLoRA step on one thread, per-op CPU time. The ops counted
    are one optimizer step's: one fused AdamW call, one embedding lookup per micro-batch (2), the
    4-bit layers' bf16 products among the matmuls; their times add up to no more than the step's
    CPU time, and the thread count is restored. No time is asserted against a number."""
    monkeypatch.setitem(bench.SIZES, "tiny64", {"hidden_size": 64, "intermediate_size": 128,
                                               "num_hidden_layers": 1, "num_attention_heads": 4,
                                               "num_key_value_heads": 2, "vocab_size": VOCAB})
    opts = bench.Options(steps=1, warmup=1, batch_size=2, grad_accum=2)
    fx = bench.Fixture("tiny64", opts, str(tmp_path))
    case = bench.Case("qlora", bf16=True, weights_bf16=True)
    threads = torch.get_num_threads()
    lines = []
    step_ms, ops = bench.profile_ops(fx, case, str(tmp_path), log=lines.append)
    assert torch.get_num_threads() == threads
    assert ops["aten._fused_adamw_"][1] == 1
    assert ops["aten.embedding"][1] == 2
    assert ops["aten.mm"][1] > 0
    assert 0 < sum(ms for ms, _ in ops.values()) <= step_ms
    assert lines[0].startswith("nano qlora+bf16w, optimizer step 1, one thread")


def test_profile_shapes_key_names_the_op_and_its_tensor_arguments():
    """--profile-shapes: one row per op and its tensor arguments' dtypes and shapes."""
    a, b = torch.zeros(2, 3, dtype=torch.bfloat16), torch.zeros(3, 4)
    assert bench._op_key(torch.ops.aten.mm.default, (a, b), shapes=False) == "aten.mm"
    key = bench._op_key(torch.ops.aten.mm.default, (a, b), shapes=True)
    assert key == "aten.mm bf16[2, 3] f32[3, 4]"
    key = bench._op_key(torch.ops.aten.cat.default, ([b, b], 0), shapes=True)
    assert key == "aten.cat f32[3, 4] f32[3, 4]"

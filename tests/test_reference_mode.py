"""Reference mode (NANOSFT_REFERENCE=1): the walkthrough's own statements execute, and the default
(fast) mode gives the same numbers.

Compared: (1) a line tracer over one LoRA SFT step (fp32 adapters) and one QLoRA SFT step in
reference mode records every statement of nanosft.monitoring.trace.WALKTHROUGH_STATEMENTS as
executed; in fast mode the same run prints which entries the speed paths replace, and that list
is FAST_PATH_REPLACES below (also in the README). (2) losses and trained weights after a few LoRA,
QLoRA, DoRA and full fine-tuning steps, fast vs reference, fp32, within 1e-6. (3) the switch itself:
the environment variable (read once), the context manager, and fast_path() returning None.
(4) the same tracer over one reference-mode QLoRA optimizer step sees no statement of
nanosft/monitoring or nanosft/memory (report_to="all" outside reference mode as the negative
control), and report_to picks the reporting callbacks as transformers honours it. Tiny models, CPU.
Run: python -m pytest -q tests/test_reference_mode.py
"""

import os
import sys

import pytest
import torch
from tiny import one_thread  # noqa: F401 (an autouse fixture)

import nanosft
from nanosft.args import SFTConfig
from nanosft.model import CausalLM, ModelConfig
from nanosft.monitoring.trace import WALKTHROUGH_STATEMENTS
from nanosft.nf4 import quantize_model
from nanosft.peft import LoraConfig
from nanosft.reference import (REFERENCE_BANNER, REFERENCE_MODE_CALLBACKS, fast_path,
                               reference_mode, reference_mode_enabled, set_reference_mode)
from nanosft.sft import SFTTrainer
from nanosft.tokenizer import Tokenizer
from nanosft.trainer import default_callbacks

PACKAGE = os.path.dirname(nanosft.__file__)
# the mirrored statements that a default (fast) step does not execute, per run
ADAPTER_LOOP = {  # nanosft.fast.lora.add_lora adds every plain-LoRA adapter in place of the loop
    "for active_adapter in self.active_adapters:  #",
    "lora_A = self.lora_A[active_adapter]",
    "scaling = self.scaling[active_adapter]",
    "requires_conversion = not torch.is_autocast_enabled()\n"
    "            if requires_conversion:\n"
    "                expected_dtype = result.dtype\n"
    "                x = self._cast_input_dtype(x, lora_A.weight.dtype)\n            if not",
    "output = lora_B(lora_A(dropout(x))) * scaling",
    "result = result + output\n            else",
    "return result.to(torch_result_dtype)",
}
FAST_PATH_REPLACES = {
    "lora": {
        "tr_loss = tr_loss + tr_loss_step",  # the nan/inf filter runs as one torch.where
        "outputs = model(**inputs)\n",  # SFTTrainer.compute_loss asks for the fused LM head
        'loss = outputs["loss"]',
        *ADAPTER_LOOP,  # fp32 adapters: B's product added by one addmm
    },
    "qlora": {  # bf16 adapters: the scaling folded into the add, no defensive clone
        "tr_loss = tr_loss + tr_loss_step",
        "outputs = model(**inputs)\n",
        'loss = outputs["loss"]',
        "result = result.clone()",
        *ADAPTER_LOOP,
    },
}


def statement_lines():
    """{(module, line number): statement} for WALKTHROUGH_STATEMENTS, each found exactly once."""
    found = {}
    for section, module, statement in WALKTHROUGH_STATEMENTS:
        with open(os.path.join(PACKAGE, module), encoding="utf-8") as f:
            text = f.read()
        assert text.count(statement) == 1, f"{section} {module}: {statement!r} must occur once"
        line = text[: text.index(statement)].count("\n") + 1
        found[(os.path.join(PACKAGE, module), line)] = statement
    return found


TEXTS = ["What is 2 plus 3? 5.", "What is 7 plus 1? 8.", "Add 4 and 4: 8.", "Six minus two: 4."]


def tokenizer():
    return Tokenizer.train(TEXTS * 4, vocab_size=300, special_tokens=["<|endoftext|>"])


def make_trainer(tmp_path, kind, tok, steps=2, report_to=()):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, tie_word_embeddings=False)
    model = CausalLM(config)
    if kind == "qlora":
        quantize_model(model)
    peft_config = None
    if kind in ("lora", "qlora", "dora"):
        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                 use_dora=kind == "dora")
    # SGD: an update linear in the gradient, so rounding differences stay rounding-sized (Adam
    # would scale a 1e-9 gradient difference on a near-zero gradient up to the learning rate)
    args = SFTConfig(output_dir=str(tmp_path / kind), max_steps=steps, learning_rate=1e-2,
                     optim="sgd", per_device_train_batch_size=2, logging_steps=1,
                     save_strategy="no", disable_tqdm=True, report_to=list(report_to),
                     max_length=32, seed=0, bf16=False)
    rows = [{"text": t} for t in TEXTS]
    return SFTTrainer(model, args=args, train_dataset=rows, processing_class=tok,
                      peft_config=peft_config)


def executed_lines(run, under=PACKAGE):
    """(file, line) pairs executed under `under` (nanosft/) while `run()` runs."""
    seen = set()

    def tracer(frame, event, arg):
        if not frame.f_code.co_filename.startswith(under):
            return None
        if event == "line":
            seen.add((frame.f_code.co_filename, frame.f_lineno))
        return tracer

    sys.settrace(tracer)
    try:
        run()
    finally:
        sys.settrace(None)
    return seen


def traced_statements(tmp_path, reference, kinds=("lora", "qlora")):
    tok = tokenizer()
    seen = set()
    with reference_mode(reference):
        for kind in kinds:
            seen |= executed_lines(lambda: make_trainer(tmp_path, kind, tok, steps=1).train())
    return seen


def test_every_mirrored_statement_executes_in_reference_mode(tmp_path):
    lines = statement_lines()
    seen = traced_statements(tmp_path, reference=True)
    missing = [statement for key, statement in lines.items() if key not in seen]
    assert missing == []


@pytest.mark.parametrize("kind", ["lora", "qlora"])
def test_fast_mode_replaces_exactly_the_listed_statements(tmp_path, kind):
    lines = statement_lines()
    in_reference = traced_statements(tmp_path / "ref", reference=True, kinds=(kind,))
    in_fast = traced_statements(tmp_path / "fast", reference=False, kinds=(kind,))
    replaced = {lines[key] for key in lines if key in in_reference and key not in in_fast}
    print(f"{kind}: speed paths replace", sorted(replaced))
    assert replaced == FAST_PATH_REPLACES[kind]


@pytest.mark.parametrize("kind", ["lora", "qlora", "dora", "full"])
def test_fast_mode_equals_reference_mode(tmp_path, kind):
    tok = tokenizer()
    results = {}
    for reference in (True, False):
        with reference_mode(reference):
            trainer = make_trainer(tmp_path / str(reference), kind, tok, steps=3)
            trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        weights = {k: v.float().clone() for k, v in trainer.model.state_dict().items()
                   if v.is_floating_point()}
        results[reference] = losses, weights
    (ref_losses, ref_weights), (fast_losses, fast_weights) = results[True], results[False]
    assert len(ref_losses) == 3
    torch.testing.assert_close(torch.tensor(fast_losses), torch.tensor(ref_losses),
                               rtol=1e-6, atol=1e-6)
    for key, value in ref_weights.items():
        torch.testing.assert_close(fast_weights[key], value, rtol=1e-6, atol=1e-6, msg=key)


REPORTING = ("monitoring", "memory")  # the product packages a reader's step must not enter


def reporting_statements(seen):
    """{(package/file, line)} of `seen` in nanosft/monitoring and nanosft/memory."""
    return {(os.path.relpath(f, PACKAGE), n) for f, n in seen
            if os.path.relpath(f, PACKAGE).split(os.sep)[0] in REPORTING}


def test_a_reference_mode_step_runs_no_reporting_code(tmp_path):
    # one QLoRA optimizer step, train() from start to end; with report_to="all" as the negative
    # control (the tracer sees reporting code where it runs)
    tok = tokenizer()
    with reference_mode(True):
        trainer = make_trainer(tmp_path / "ref", "qlora", tok, steps=1, report_to=["all"])
        seen = executed_lines(trainer.train)
    assert [type(cb).__name__ for cb in trainer.callback_handler.callbacks] == list(
        REFERENCE_MODE_CALLBACKS)
    assert reporting_statements(seen) == set()
    assert "ProgressCallback" in REFERENCE_BANNER  # start_reference_mode says what stays on
    with reference_mode(False):
        trainer = make_trainer(tmp_path / "fast", "qlora", tok, steps=1, report_to=["all"])
        seen = executed_lines(trainer.train)
    files = {f for f, _ in reporting_statements(seen)}
    assert {"monitoring/callbacks.py", "monitoring/flops.py", "memory/plan.py"} <= files


@pytest.mark.parametrize("report_to, expected", [
    ("none", ["ProgressCallback", "StopOnNonFiniteCallback"]),
    ("nanosft", ["ThroughputCallback", "MemoryCallback", "ProgressCallback",
                 "MetricsFileCallback", "StopOnNonFiniteCallback"]),
    ("tensorboard", ["ThroughputCallback", "ProgressCallback", "TensorBoardCallback",
                     "StopOnNonFiniteCallback"]),
    ("all", ["ThroughputCallback", "MemoryCallback", "ProgressCallback", "MetricsFileCallback",
             "TensorBoardCallback", "StopOnNonFiniteCallback"]),
])
def test_report_to_picks_the_reporting_callbacks(report_to, expected):
    # as transformers honours report_to: "none" leaves the progress bar and the non-finite guard
    args = SFTConfig(output_dir="unused", report_to=report_to)
    with reference_mode(False):
        names = [type(cb).__name__ for cb in default_callbacks(args)]
    assert names == ["DefaultFlowCallback", *expected]
    with reference_mode(True):
        assert [type(cb).__name__ for cb in default_callbacks(args)] == list(
            REFERENCE_MODE_CALLBACKS)


def test_switch_follows_environment_and_python(monkeypatch):
    monkeypatch.setenv("NANOSFT_REFERENCE", "1")
    assert not reference_mode_enabled()  # read once: a changed environment alone changes nothing
    set_reference_mode(None)  # reads the environment again
    assert reference_mode_enabled() and fast_path("recomputed") is None
    monkeypatch.setenv("NANOSFT_REFERENCE", "0")
    set_reference_mode(None)
    assert not reference_mode_enabled() and fast_path("recomputed") is not None
    with reference_mode():
        assert reference_mode_enabled()
    assert not reference_mode_enabled()
    set_reference_mode(True)
    try:
        assert reference_mode_enabled()
    finally:
        set_reference_mode(None)
    assert not reference_mode_enabled()


def test_a_reference_mode_seam_is_one_statement():
    # the switch is a cached flag: each fast_path call runs one statement of reference.py, and a
    # 4-bit layer looks bitsandbytes up instead of running its import again on every call
    from nanosft.nf4 import Linear4bit

    layer = Linear4bit.from_linear(torch.nn.Linear(64, 64), compute_dtype=torch.float32)
    x = torch.randn(2, 64)
    layer(x)  # the first call may import
    with reference_mode(True):
        seen = executed_lines(lambda: layer(x))
        calls = []
        seen_switch = executed_lines(lambda: calls.append(fast_path("recomputed")))
    source = open(os.path.join(PACKAGE, "nf4.py"), encoding="utf-8").read().splitlines()
    ran = [source[n - 1].strip() for f, n in seen if f.endswith("nf4.py")]
    assert ran and not any(line.startswith("import bitsandbytes") for line in ran)
    assert calls == [None]
    assert len([n for f, n in seen_switch if f.endswith("reference.py")]) == 1


def test_a_speed_path_is_looked_up_once_per_process():
    # with the speed paths on, a seam after the first call only reads the resolved table: the
    # import and getattr lines of reference._speed_path run once, not per call
    with reference_mode(False):
        first = fast_path("recomputed")
        seen = executed_lines(lambda: fast_path("recomputed"))
        assert fast_path("recomputed") is first
    source = open(os.path.join(PACKAGE, "reference.py"), encoding="utf-8").read().splitlines()
    ran = [source[n - 1].strip() for f, n in seen if f.endswith("reference.py")]
    assert ran and not any("getattr(_fast" in line or "import_module" in line for line in ran)
    assert len(ran) == 3, ran  # fast_path's return, the table lookup, its return

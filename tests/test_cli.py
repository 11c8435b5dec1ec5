"""The `nanosft` command line: demo, train (three dataset formats, JSON config), generate, chat,
merge, trace, errors.

Compared: the demo's held-out exact match after SFT against before (a stated margin); trained
adapters against their zero-initialised lora_B; the token ids `generate` produces (recorded at
CausalLM.generate) with an adapter whose lora_B is non-zero, against the bare base (must differ),
the merged folder and the adapted model called directly (must be equal); `chat`'s second prompt
against the three messages of the first exchange rendered through the chat template; the `--trace`
lines against the walkthrough's section-1 outline, in order; user mistakes against a one-paragraph
message naming the culprit and exit status 2. Hermetic: everything runs on the tiny model shipped in
nanosft/cli/assets/default and small JSONL files written to tmp_path; CPU only, no network.
Run: python -m pytest -q tests/test_cli.py
"""

import json
import os
import re

import pytest
import torch
from safetensors.torch import load_file

from nanosft.cli import demo
from nanosft.monitoring import trace
from nanosft.reference import REFERENCE_BANNER, reference_mode_enabled
from nanosft.cli import main
from nanosft.model import CausalLM
from nanosft.peft import LoraConfig, PeftModelForCausalLM, get_peft_model
from nanosft.tokenizer import Tokenizer

DEFAULT = demo.DEFAULT_DIR
FAST = [
    "--max_steps",
    "2",
    "--per_device_train_batch_size",
    "2",
    "--save_strategy",
    "no",
    "--gradient_checkpointing",
    "false",
    "--bf16",
    "false",
    "--logging_steps",
    "1",
    "--learning_rate",
    "0.01",
]
EXAMPLES = {
    "text": [{"text": f"{a} plus {a + 1} equals {2 * a + 1}."} for a in range(4)],
    "prompt_completion": [
        {"prompt": f"{a} plus {a} equals", "completion": f" {2 * a}."} for a in range(4)
    ],
    "messages": [
        {
            "messages": [
                {"role": "user", "content": f"What is {a} plus 1?"},
                {"role": "assistant", "content": str(a + 1)},
            ]
        }
        for a in range(4)
    ],
}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def run(argv, capsys):
    """main(argv) in-process: (exit status, stdout, stderr)."""
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def random_adapter(tmp_path_factory):
    """A LoRA adapter on the default model with a non-zero (seeded) lora_B: it changes the output.

    Built in-process rather than trained: 2 training steps may leave the greedy text unchanged, and
    then a CLI that ignored --adapter would still pass."""
    folder = tmp_path_factory.mktemp("adapter")
    torch.manual_seed(0)  # lora_A's init draws from the global RNG: not from earlier tests' state
    peft_model = get_peft_model(CausalLM.from_pretrained(DEFAULT), LoraConfig(r=4, lora_alpha=8))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.2 * torch.randn(param.shape, generator=g))
    peft_model.save_pretrained(folder)
    assert all(
        v.abs().min() > 0
        for k, v in load_file(folder / "adapter_model.safetensors").items()
        if "lora_B" in k
    )
    return str(folder)


@pytest.fixture
def generate_calls(monkeypatch):
    """Every CausalLM.generate call the CLI makes: (prompt ids, new ids up to and without EOS)."""
    calls = []
    original = CausalLM.generate

    def spy(self, input_ids, *args, **kwargs):
        out = original(self, input_ids, *args, **kwargs)
        new = out[0, input_ids.shape[1] :].tolist()
        eos = kwargs.get("eos_token_id")
        calls.append((input_ids[0].tolist(), new[: new.index(eos)] if eos in new else new))
        return out

    monkeypatch.setattr(CausalLM, "generate", spy)
    return calls


# ----------------------------------------------------------------------------- demo


def test_demo_sft_beats_the_base_on_held_out_prompts(tmp_path, capsys):
    threads = torch.get_num_threads()
    code, out, err = run(
        ["demo", "--steps", 30, "--output_dir", tmp_path, "--device", "cpu"], capsys
    )
    assert code == 0, err[-2000:]
    # one thread for the tiny model, said once; the caller's count is back afterwards
    assert "nanosft demo: 1 torch thread on the CPU (a tiny model" in out
    assert torch.get_num_threads() == threads
    summary = json.loads((tmp_path / "demo_summary.json").read_text())
    # The base never answers a sum in chat form; 30 QLoRA steps must unlock most held-out sums.
    assert summary["accuracy_before"] <= 0.1
    assert summary["accuracy_after"] >= summary["accuracy_before"] + 0.5, summary
    assert "***** Running training *****" in out
    assert re.search(r"held-out exact match: before [\d.]+% -> after [\d.]+%", out)
    # the peak is the calibration, or (on a loaded machine, where the calibration reads low) the
    # training's own best rate; the line names which
    assert re.search(r"speed: [\d.]+ GFLOP/s of model FLOPs, MFU [\d.]+% of [\d.]+ GFLOP/s "
                     r"\((a matmul calibration at train start|the training's own best rate: "
                     r"the matmul calibration at train start read lower, under load)\)", out)
    assert 0 < summary["mfu"] < 1 and summary["train_model_flops_per_second"] > 0
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(
        os.listdir(tmp_path / "adapter")
    )
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any(
        "loss" in r and "grad_norm" in r and "learning_rate" in r and "train_tokens_per_second" in r
        for r in logged
    )


def test_demo_threads_flag_sets_and_checks_the_count():
    from nanosft.cli import demo

    threads = torch.get_num_threads()
    try:
        assert demo.pick_threads(2) == 2 and torch.get_num_threads() == 2
        assert demo.pick_threads() == 1 and torch.get_num_threads() == 1
        with pytest.raises(ValueError, match="--threads 0: give a whole number >= 1"):
            demo.pick_threads(0)
    finally:
        torch.set_num_threads(threads)


# ----------------------------------------------------------------------------- train


@pytest.mark.parametrize("fmt", sorted(EXAMPLES))
def test_train_each_dataset_format_saves_a_trained_adapter(fmt, tmp_path, capsys):
    data = write_jsonl(tmp_path / f"{fmt}.jsonl", EXAMPLES[fmt])
    code, _, err = run(
        [
            "train",
            "--model",
            DEFAULT,
            "--data",
            data,
            "--output_dir",
            tmp_path / "out",
            "--qlora",
            *FAST,
            "--target_modules",
            "all-linear",
        ],
        capsys,
    )
    assert code == 0, err[-2000:]
    adapter = load_file(tmp_path / "out" / "adapter_model.safetensors")
    lora_b = [v for k, v in adapter.items() if "lora_B" in k]
    assert lora_b and all(k.startswith("base_model.model.") for k in adapter)  # peft's key layout
    assert any(
        v.abs().max() > 0 for v in lora_b
    )  # lora_B starts at zero: non-zero means it trained
    assert (tmp_path / "out" / "tokenizer.json").is_file()


def test_train_reads_a_json_config_and_flags_override_it(tmp_path, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", EXAMPLES["messages"])
    config = tmp_path / "c.json"
    config.write_text(
        json.dumps({"r": 4, "lora_alpha": 4, "target_modules": ["q_proj"], "max_steps": 99})
    )
    code, _, err = run(
        [
            "train",
            "--model",
            DEFAULT,
            "--data",
            data,
            "--output_dir",
            tmp_path / "o",
            "--config",
            config,
            *FAST,
        ],
        capsys,
    )
    assert code == 0, err[-2000:]
    saved = json.loads((tmp_path / "o" / "adapter_config.json").read_text())
    assert (saved["r"], saved["lora_alpha"], saved["target_modules"]) == (4, 4, ["q_proj"])
    logged = [
        json.loads(line) for line in (tmp_path / "o" / "metrics.jsonl").read_text().splitlines()
    ]
    assert (
        max(r["step"] for r in logged) == 2
    )  # --max_steps 2 on the command line beat the file's 99


# ----------------------------------------------------------------------------- generate and merge


def test_generate_with_adapter_differs_from_base_and_equals_merged(
    random_adapter, tmp_path, capsys, generate_calls
):
    prompt = ["--prompt", "What is 2 plus 1?", "--max_new_tokens", 8]
    code, with_adapter, err = run(
        ["generate", "--model", DEFAULT, "--adapter", random_adapter, *prompt], capsys
    )
    assert code == 0, err
    code, bare, err = run(["generate", "--model", DEFAULT, *prompt], capsys)
    assert code == 0, err
    code, _, err = run(
        ["merge", "--model", DEFAULT, "--adapter", random_adapter, "--out", tmp_path / "m"], capsys
    )
    assert code == 0, err
    code, merged, err = run(["generate", "--model", tmp_path / "m", *prompt], capsys)
    assert code == 0, err
    (p_adapter, ids_adapter), (p_bare, ids_bare), (p_merged, ids_merged) = generate_calls
    chat = Tokenizer.from_pretrained(DEFAULT).apply_chat_template(
        [{"role": "user", "content": "What is 2 plus 1?"}], add_generation_prompt=True
    )
    assert p_adapter == p_bare == p_merged == chat  # the same chat-templated prompt each time
    assert ids_adapter != ids_bare and len(ids_adapter) >= 4  # the adapter changes the reply ...
    assert ids_adapter == ids_merged and with_adapter == merged  # ... exactly as merging it does
    # the CLI's ids are the adapted model's own greedy ids (not only self-consistent)
    reference = PeftModelForCausalLM.from_pretrained(
        CausalLM.from_pretrained(DEFAULT), random_adapter
    )
    expected = reference.generate(torch.tensor([chat]), max_new_tokens=8, eos_token_id=-1)[
        0, len(chat) :
    ]
    assert ids_adapter == expected.tolist()[: len(ids_adapter)]


def test_chat_keeps_the_adapter_and_the_history(
    random_adapter, capsys, monkeypatch, generate_calls
):
    import io

    turns = ["What is 2 plus 1?", "What is 3 plus 1?"]
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(t + "\n" for t in turns)))
    code, out, err = run(
        ["chat", "--model", DEFAULT, "--adapter", random_adapter, "--max_new_tokens", 6], capsys
    )
    assert code == 0, err
    assert out.count("assistant> ") == 2 and len(generate_calls) == 2
    tok = Tokenizer.from_pretrained(DEFAULT)
    first = [{"role": "user", "content": turns[0]}]
    (prompt1, reply1), (prompt2, _) = generate_calls
    assert prompt1 == tok.apply_chat_template(first, add_generation_prompt=True)
    # turn 2 sees turn 1: user, the assistant's reply, user again, through the chat template
    history = [
        *first,
        {"role": "assistant", "content": tok.decode(reply1, skip_special_tokens=True)},
        {"role": "user", "content": turns[1]},
    ]
    assert prompt2 == tok.apply_chat_template(history, add_generation_prompt=True)
    # the reply came from the adapted model, which answers differently from the bare base
    base = CausalLM.from_pretrained(DEFAULT)
    adapted = PeftModelForCausalLM.from_pretrained(
        CausalLM.from_pretrained(DEFAULT), random_adapter
    )
    x = torch.tensor([prompt1])
    expected, bare = (
        m.generate(x, max_new_tokens=6, eos_token_id=-1)[0, x.shape[1] :].tolist()
        for m in (adapted, base)
    )
    assert expected != bare
    assert reply1 == expected[: len(reply1)] and len(reply1) >= 1


# ----------------------------------------------------------------------------- walkthrough trace

WALKTHROUGH_ORDER = [
    "Trainer.train()",
    "_inner_training_loop()",
    "get_train_dataloader",
    "Setting up training control variables",
    "total_train_batch_size",
    "get_batch_samples",
    "training_step(model, inputs, num_items_in_batch)",
    "compute_loss -> outputs = model(**inputs)",
    "PeftModelForCausalLM.forward",
    "Linear4bit.forward",
    "result = self.base_layer(x",
    "output = lora_B(lora_A(dropout(x))) * scaling",
    "result = result + output",
    "PeftModelForCausalLM.forward returns",
    # the trace runs in reference mode: SFTTrainer.compute_loss goes through Trainer.compute_loss
    'loss = outputs["loss"]',
    "token metrics of this micro-batch",
    "loss.backward()",
    "do_sync_step = ",
    "do_sync_step: clip gradients",
    "self.optimizer.step()",
    "self.lr_scheduler.step()",
    "model.zero_grad()",
    "self.state.global_step += 1",
]


def test_trace_prints_the_walkthrough_steps_in_order_for_the_first_step_only(tmp_path, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", EXAMPLES["messages"])
    argv = [
        "train",
        "--model",
        DEFAULT,
        "--data",
        data,
        "--output_dir",
        tmp_path / "o",
        "--qlora",
        *FAST,
        "--gradient_accumulation_steps",
        2,
        "--per_device_train_batch_size",
        1,
    ]
    code, out, err = run([*argv, "--trace"], capsys)
    assert code == 0, err[-2000:]
    assert out.splitlines()[0] == REFERENCE_BANNER  # the trace runs the walkthrough's own lines
    assert not reference_mode_enabled()  # and hands the switch back when the command ends
    lines = [line for line in out.splitlines() if line.startswith(trace.PREFIX)]
    position = 0
    for step in WALKTHROUGH_ORDER:  # each appears after the previous one
        position = next((i for i in range(position, len(lines)) if step in lines[i]), None)
        assert position is not None, f"{step!r} missing or out of order in:\n" + "\n".join(lines)
    assert all(
        re.match(r"\[trace\] \[ ?\d(\.\d)?\] ", line) for line in lines
    )  # tagged with a section
    # GA=2: the first micro-batch does not sync, the second does; one optimizer step is traced, not
    # two
    syncs = re.findall(r"do_sync_step=(True|False)", out)
    assert syncs == ["False", "True"]
    assert out.count("global_step += 1") == 1
    counted = re.search(r"num_items_in_batch=([\d.]+)", out)
    assert counted and float(counted.group(1)) > 0
    # the trace reads the set-up at on_train_begin, the loop's first event, after the banner
    assert out.index("***** Running training *****") < out.index(
        "Setting up training control variables"
    ) < out.index("(banner above), then: for epoch in range(num_train_epochs)")
    assert "loss.backward()  (accelerator.backward)  params_with_grad=" in out
    # zero output when off
    code, out, _ = run([*argv[:6], tmp_path / "o2", *argv[7:]], capsys)
    assert code == 0 and trace.PREFIX not in out


# ----------------------------------------------------------------------------- user mistakes


def _assert_one_paragraph_error(code, err, *culprits):
    assert code == 2
    assert "Traceback" not in err
    message = err.strip().splitlines()[-1]
    assert message.startswith("nanosft ")
    for culprit in culprits:
        assert culprit in message, message


def test_bad_model_path_is_a_clear_error(tmp_path, capsys):
    code, _, err = run(["generate", "--model", tmp_path / "nope", "--prompt", "hi"], capsys)
    _assert_one_paragraph_error(code, err, "--model", "nope", "no such folder")


def test_bad_jsonl_line_names_file_and_line(tmp_path, capsys):
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps(EXAMPLES["text"][0]) + "\n{not json\n")
    code, _, err = run(
        ["train", "--model", DEFAULT, "--data", data, "--output_dir", tmp_path / "o", *FAST], capsys
    )
    _assert_one_paragraph_error(code, err, "bad.jsonl", "line 2")


def test_bad_values_and_flags_are_clear_errors(tmp_path, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", EXAMPLES["text"])
    base = ["train", "--model", DEFAULT, "--data", data, "--output_dir", tmp_path / "o"]
    code, _, err = run([*base, "--learning_rate", "-1"], capsys)
    _assert_one_paragraph_error(code, err, "learning_rate")
    code, _, err = run([*base, "--lerning_rate", "0.1"], capsys)
    _assert_one_paragraph_error(code, err, "--lerning_rate", "did you mean --learning_rate")
    code, _, err = run(
        [*base, "--learning_rat", "0.1"], capsys
    )  # a prefix is not silently taken as the flag
    _assert_one_paragraph_error(code, err, "--learning_rat", "did you mean --learning_rate")
    with pytest.raises(
        SystemExit
    ) as exit_info:  # argparse rejects a value of the wrong type itself
        main([*map(str, base), "--max_steps", "ten"])
    assert (
        exit_info.value.code == 2
        and "--max_steps expects int, got 'ten'" in capsys.readouterr().err
    )
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"learning_rat": 0.1}))
    code, _, err = run([*base, "--config", config], capsys)
    _assert_one_paragraph_error(
        code, err, "c.json", "'learning_rat'", "did you mean 'learning_rate'"
    )
    code, _, err = run([*base, "--qlora", "--full"], capsys)
    _assert_one_paragraph_error(code, err, "--qlora and --full")


def test_merge_refuses_to_overwrite(random_adapter, tmp_path, capsys):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("x")
    code, _, err = run(
        ["merge", "--model", DEFAULT, "--adapter", random_adapter, "--out", tmp_path / "taken"],
        capsys,
    )
    _assert_one_paragraph_error(code, err, "taken", "not empty")


def test_load_model_keeps_the_hub_id_it_was_given(monkeypatch, tmp_path):
    """`nanosft train --model org/name` must write base_model_name_or_path = "org/name", as peft
    does with transformers' _name_or_path, not the Hub cache's absolute snapshot path."""
    import nanosft.cli as cli

    monkeypatch.setattr(cli, "resolve_folder", lambda flag, name: DEFAULT)  # the cached snapshot
    model = cli.load_model("HuggingFaceTB/SmolLM2-135M")
    assert model.name_or_path == "HuggingFaceTB/SmolLM2-135M"
    get_peft_model(model, LoraConfig(r=4)).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M"
    # negative control: the folder itself, when that is what was given
    assert cli.load_model(DEFAULT).name_or_path == os.fspath(DEFAULT)

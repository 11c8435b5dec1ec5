"""Hostile and clumsy inputs to the command line end in one short message, never a traceback or a
silently wrong result (issue 25, findings 5-7).

Compared, for each case: the exit status (2 for a user's mistake, 130 for Ctrl-C, 0 where the input
is accepted with a warning), the words the message must hold (the file, field or flag, and the
fix), and that "Traceback" appears nowhere in stdout or stderr. Silent wrong results are checked
at their effect: empty rows refused or counted, a negative temperature refused, overlapping
safetensors byte ranges refused, saved files and folders given the umask's permissions, a Hub ref
holding `../..` refused, chat rows cut by max_length dropped with a count.
Hermetic: every case runs `nanosft.cli.main(argv)` in-process on a copy of the tiny default model
(nanosft/cli/assets/default) with one file broken, data files in tmp_path, CPU, no network
(HF_HUB_OFFLINE=1 where a Hub id is tried).
Run: python -m pytest -q tests/test_hostile_inputs.py
"""

import json
import logging
import os
import shutil
import stat
import struct
from pathlib import Path

import pytest
import torch

from nanosft.cli import demo, main
from nanosft.io import hub

DEFAULT = Path(demo.DEFAULT_DIR)
FAST = ["--max_steps", "1", "--per_device_train_batch_size", "2", "--save_strategy", "no",
        "--gradient_checkpointing", "false", "--bf16", "false", "--disable_tqdm", "true",
        "--report_to", "none"]
TEXT_ROWS = [{"text": f"{a} plus {a} equals {2 * a}."} for a in range(4)]


def run(argv, capsys):
    """main(argv) in-process: (exit status, stdout + stderr)."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:  # argparse's own errors
        code = e.code
    out, err = capsys.readouterr()
    return code, out + err


def assert_clean_failure(code, output, status, *words):
    assert code == status, output
    assert "Traceback" not in output
    for word in words:
        assert word in output, f"{word!r} missing from: {output}"


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def model_copy(tmp_path_factory):
    """make(edit) -> a fresh copy of the default model folder with `edit(folder)` applied."""
    root = tmp_path_factory.mktemp("models")

    def make(edit=None):
        folder = root / f"m{len(os.listdir(root))}"
        shutil.copytree(DEFAULT, folder)
        if edit is not None:
            edit(folder)
        return folder

    return make


# ----------------------------------------------------------------------------- broken model files

def _template(text):
    return lambda folder: (folder / "chat_template.jinja").write_text(text)


def _config(**changes):
    def edit(folder):
        config = json.loads((folder / "config.json").read_text())
        config.update(changes)
        (folder / "config.json").write_text(json.dumps(config))
    return edit


def _edit_header(change):
    """Rewrite model.safetensors' JSON header in place (same length, padded with spaces)."""
    def edit(folder):
        path = folder / "model.safetensors"
        data = path.read_bytes()
        n = struct.unpack("<Q", data[:8])[0]
        header = json.loads(data[8:8 + n])
        change(header)
        text = json.dumps(header, separators=(",", ":")).encode()
        assert len(text) <= n
        path.write_bytes(data[:8] + text + b" " * (n - len(text)) + data[8 + n:])
    return edit


def _first_weight(header):
    return next(k for k in header if k != "__metadata__")


def _as_i32(header):
    header[_first_weight(header)]["dtype"] = "I32"  # F32 -> I32: same bytes, not a float


def _overlap(header):
    norms = sorted(k for k in header if k.endswith("layernorm.weight"))
    header[norms[1]]["data_offsets"] = header[norms[0]]["data_offsets"]  # two names, one range


MODEL_CASES = {
    # name: (edit, command, words in the message)
    "template_syntax_error": (_template("{% for m in messages %}"), "generate",
                              ["chat template", "line 1", "endfor", "chat_template.jinja"]),
    "template_unknown_filter": (_template("{{ messages | nosuchfilter }}"), "generate",
                                ["chat template", "nosuchfilter", "chat_template.jinja"]),
    "template_empty": (_template(""), "generate", ["chat template is empty", "--no_chat_template"]),
    "template_raises": (_template("{{ raise_exception('no system role') }}"), "generate",
                        ["chat template", "no system role", "chat_template.jinja"]),
    "template_syntax_error_train": (_template("{% for m in messages %}"), "train",
                                    ["chat template", "endfor"]),
    "config_is_a_list": (lambda f: (f / "config.json").write_text("[1, 2]"), "generate",
                         ["config.json", "JSON object", "list"]),
    "config_negative_hidden_size": (_config(hidden_size=-128), "generate",
                                    ["config.json", "hidden_size=-128", "positive integer"]),
    "config_negative_layers": (_config(num_hidden_layers=-1), "generate",
                               ["config.json", "num_hidden_layers=-1", "positive integer"]),
    "config_hidden_size_a_string": (_config(hidden_size="128"), "generate",
                                    ["config.json", "hidden_size='128'", "positive integer"]),
    "config_pad_token_outside_vocab": (_config(pad_token_id=9999), "generate",
                                       ["config.json", "pad_token_id=9999", "0 to 475"]),
    "config_rope_theta_zero": (_config(rope_parameters={"rope_type": "default", "rope_theta": 0}),
                               "generate", ["config.json", "rope_theta=0", "positive number"]),
    "config_mistral_window_zero": (_config(model_type="mistral", sliding_window=0), "train",
                                   ["config.json", "sliding_window=0", "positive integer"]),
    "weight_declared_i32": (_edit_header(_as_i32), "generate",
                            ["model.safetensors", "torch.int32", "floating point"]),
    "weights_overlap": (_edit_header(_overlap), "generate",
                        ["model.safetensors", "overlap", "input_layernorm", "re-save"]),
    "memory_on_list_config": (lambda f: (f / "config.json").write_text("[]"), "memory",
                              ["config.json", "JSON object"]),
    "memory_on_negative_size": (_config(intermediate_size=-1), "memory",
                                ["config.json", "intermediate_size=-1"]),
}


@pytest.mark.parametrize("name", sorted(MODEL_CASES))
def test_broken_model_file_is_named_without_a_traceback(name, model_copy, tmp_path, capsys):
    edit, command, words = MODEL_CASES[name]
    folder = model_copy(edit)
    argv = {"generate": ["generate", "--model", folder, "--prompt", "hi", "--max_new_tokens", "2"],
            "memory": ["memory", "--model", folder],
            "train": ["train", "--model", folder, "--data", DEFAULT / "sft_train.jsonl",
                      "--output_dir", tmp_path / "out", *FAST]}[command]
    assert_clean_failure(*run(argv, capsys), 2, *words, "NANOSFT_DEBUG=1")


# ----------------------------------------------------------------------------- data files

def _ragged_csv(tmp_path):
    path = tmp_path / "ragged.csv"
    path.write_text("prompt,completion\nhi,there\na,b,c\n")
    return path, [str(path), "line 3", "as many fields as the header"]


def _number_csv(tmp_path):
    path = tmp_path / "numbers.csv"
    path.write_text("prompt,completion\nwhat is 1 plus 1,2\nwhat is 2 plus 2,4\n")
    return path, [str(path), "row 0", "'completion'", "got int 2", "JSONL"]


def _not_utf8(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    return path, [str(path), "line 2", "not UTF-8", "0xe9", "save the file as UTF-8"]


def _all_empty(tmp_path):
    path = write_jsonl(tmp_path / "empty.jsonl", [{"text": ""}] * 4)
    return path, [str(path), "no example has a token to train on"]


def _chat_cut_by_max_length(tmp_path):
    long = [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "yes"}]
    path = write_jsonl(tmp_path / "long.jsonl", [{"messages": long}])
    return path, [str(path), "all 1 examples", "raise max_length"]


def _lone_surrogate(tmp_path):
    path = tmp_path / "surrogate.jsonl"
    path.write_text('{"text": "fine"}\n{"text": "half of a pair: \\ud800"}\n')
    return path, [str(path), "line 2", "lone UTF-16 surrogate", "\\ud800"]


def _deep_json(tmp_path):
    path = tmp_path / "deep.jsonl"
    path.write_text('{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    return path, [str(path), "line 1", "nested deeper", "flatten"]


def _dev_null(tmp_path):
    return Path(os.devnull), [os.devnull, "is a character device, not a regular file"]


def _a_folder(tmp_path):
    (tmp_path / "saved").mkdir()
    return tmp_path / "saved", ["--data", "is a folder", "datasets.load_from_disk"]


DATA_CASES = {"ragged_csv": _ragged_csv, "csv_completion_numbers": _number_csv,
              "not_utf8": _not_utf8, "every_text_empty": _all_empty,
              "lone_surrogate": _lone_surrogate, "json_100000_deep": _deep_json,
              "dev_null": _dev_null, "a_folder": _a_folder,
              "chat_cut_by_max_length_loses_every_assistant_token": _chat_cut_by_max_length}


@pytest.mark.parametrize("name", sorted(DATA_CASES))
def test_bad_data_file_is_named_without_a_traceback(name, tmp_path, capsys, monkeypatch):
    # datasets' log handler may hold an earlier test's closed capsys stream; a failed emit would
    # print logging's own "--- Logging error ---" traceback, which a real terminal never shows
    monkeypatch.setattr(logging, "raiseExceptions", False)
    data, words = DATA_CASES[name](tmp_path)
    argv = ["train", "--model", DEFAULT, "--data", data, "--output_dir", tmp_path / "out", *FAST,
            "--max_length", "32", "--assistant_only_loss", str(name.startswith("chat")).lower()]
    assert_clean_failure(*run(argv, capsys), 2, *words)
    assert not (tmp_path / "out" / "adapter_model.safetensors").exists()


def test_some_empty_rows_train_with_a_warning_naming_the_count(tmp_path, capsys, caplog):
    data = write_jsonl(tmp_path / "some.jsonl", [{"text": ""}, {"text": "hello there"}] * 2)
    with caplog.at_level(logging.WARNING):
        code, output = run(["train", "--model", DEFAULT, "--data", data, "--output_dir",
                            tmp_path / "out", *FAST], capsys)
    assert code == 0, output
    assert f"{data}: 2 of 4 examples have no token to train on" in caplog.text


def test_chat_rows_cut_by_max_length_are_dropped_with_a_count(tmp_path, capsys, caplog):
    long = [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "yes"}]
    short = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}]
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": long}, {"messages": short}])
    with caplog.at_level(logging.WARNING):
        code, output = run(["train", "--model", DEFAULT, "--data", data, "--output_dir",
                            tmp_path / "out", *FAST, "--max_length", "32",
                            "--assistant_only_loss", "true"], capsys)
    assert code == 0, output
    assert f"{data}: dropped 1 of 2 examples with no trainable token" in caplog.text


@pytest.mark.parametrize("long, short", [
    ({"messages": [{"role": "user", "content": "word " * 200},
                   {"role": "assistant", "content": "yes"}]},
     {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}]}),
    ({"prompt": "word " * 200, "completion": " yes"}, {"prompt": "hi", "completion": " yes"}),
], ids=["chat", "prompt_completion"])
def test_rows_whose_answer_max_length_cuts_off_are_counted(long, short, caplog):
    from nanosft.data import prepare_dataset
    from nanosft.tokenizer import Tokenizer

    with caplog.at_level(logging.WARNING):  # the loss on every token: the cut rows still train
        rows = prepare_dataset([long, short], Tokenizer.from_pretrained(DEFAULT), max_length=32,
                               completion_only_loss=False, name="d.jsonl")
    assert len(rows) == 2
    assert ("d.jsonl: 1 of 2 examples lose every completion or assistant token to max_length=32"
            in caplog.text), caplog.text


# ----------------------------------------------------------------------------- flags

def _train(tmp_path, *extra):
    data = write_jsonl(tmp_path / "d.jsonl", TEXT_ROWS)
    return ["train", "--model", DEFAULT, "--data", data, "--output_dir", tmp_path / "out", *FAST,
            *extra]


def test_fsdp_in_one_process_names_the_torchrun_command(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert_clean_failure(*run(_train(tmp_path, "--fsdp", "true"), capsys), 2,
                         "--fsdp", "torchrun --nproc_per_node 2 -m nanosft train")


def test_a_csv_without_datasets_installed_is_one_paragraph(tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    data = tmp_path / "d.csv"
    data.write_text("text\nhello there\n")
    assert_clean_failure(*run(_train(tmp_path, "--data", data), capsys), 2, str(data),
                         'pip install "nanosft[data]"')


def test_an_abbreviated_flag_suggests_what_it_abbreviates(tmp_path, capsys):
    code, output = run(_train(tmp_path, "--lr", "1e-3"), capsys)
    assert_clean_failure(code, output, 2, "'--lr'",
                         "did you mean --learning_rate or --lora_r or --layer_replication?")


def test_memory_fsdp_reads_as_train_fsdp_and_ranks_are_nproc_per_node(capsys):
    assert_clean_failure(*run(["memory", "--model", DEFAULT, "--fsdp", "2"], capsys), 2,
                         "--fsdp 2", "--nproc_per_node 2")
    code, output = run(["memory", "--model", DEFAULT, "--fsdp", "true", "--nproc_per_node", "4"],
                       capsys)
    assert code == 0 and "per rank of 4" in output


def test_train_help_says_the_default_mode_and_where_fields_come_from(capsys):
    code, output = run(["train", "--help"], capsys)
    assert code == 0
    assert "The default is LoRA on the float base" in " ".join(output.split())
    assert "SFTConfig" in output and "LoraConfig" in output


def test_negative_learning_rate_reaches_validation_not_argparse(tmp_path, capsys):
    code, output = run(_train(tmp_path, "--learning_rate", "-1e-3"), capsys)
    assert_clean_failure(code, output, 2, "learning_rate=-0.001")
    assert "expected one argument" not in output


def test_config_file_value_of_the_wrong_type_names_file_and_field(tmp_path, capsys):
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"warmup_steps": "ten"}))
    assert_clean_failure(*run(_train(tmp_path, "--config", config), capsys), 2,
                         f"--config {config}", "'warmup_steps'", "expects float", "'ten'")


@pytest.mark.parametrize("temperature", ["-1", "nan"])
def test_negative_temperature_is_refused(temperature, capsys):
    argv = ["generate", "--model", DEFAULT, "--prompt", "hi", "--temperature", temperature]
    assert_clean_failure(*run(argv, capsys), 2, "--temperature", "greedy")


def test_generate_refuses_a_negative_temperature_as_transformers_does():
    from nanosft.model import CausalLM

    model = CausalLM.from_pretrained(DEFAULT)
    with pytest.raises(ValueError, match="strictly positive"):
        model.generate(torch.tensor([[1, 2]]), max_new_tokens=1, temperature=-1.0)


def test_empty_prompt_without_chat_template_is_refused(capsys):
    argv = ["generate", "--model", DEFAULT, "--prompt", "", "--no_chat_template"]
    assert_clean_failure(*run(argv, capsys), 2, "--prompt is empty", "--no_chat_template")


def test_missing_local_path_shaped_like_a_hub_id(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    argv = ["generate", "--model", "no_such/model", "--prompt", "hi"]
    assert_clean_failure(*run(argv, capsys), 2, "no_such/model", "no such folder",
                         "Hugging Face cache", "HF_HUB_OFFLINE")


def test_hub_ref_pointing_outside_the_cache_is_refused(tmp_path, capsys, monkeypatch):
    cache = tmp_path / "cache"
    repo = cache / "models--org--name"
    (repo / "refs").mkdir(parents=True)
    (repo / "snapshots").mkdir()
    (repo / "refs" / "main").write_text("../..")  # snapshots/../.. is the cache itself
    shutil.copytree(DEFAULT, tmp_path / "outside")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert_clean_failure(*run(["memory", "--model", "org/name"], capsys), 2,
                         "refs/main", "'../..'", "not a commit hash")


# ----------------------------------------------------------------------------- Ctrl-C

def _interrupt_at(monkeypatch, target, name, call):
    """Replace target.name with a wrapper that raises KeyboardInterrupt on call number `call`."""
    original, calls = getattr(target, name), []

    def wrapper(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(target, name, wrapper)


def _train_with_checkpoints(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", TEXT_ROWS)
    return ["train", "--model", DEFAULT, "--data", data, "--output_dir", tmp_path / "out",
            "--max_steps", "3", "--per_device_train_batch_size", "2", "--save_steps", "1",
            "--gradient_checkpointing", "false", "--bf16", "false", "--disable_tqdm", "true"]


def test_ctrl_c_during_a_step_names_the_last_checkpoint(tmp_path, capsys, monkeypatch):
    from nanosft.trainer import Trainer

    _interrupt_at(monkeypatch, Trainer, "training_step", 2)  # after checkpoint-1 is saved
    code, output = run(_train_with_checkpoints(tmp_path), capsys)
    assert_clean_failure(code, output, 130, "interrupted", "checkpoint-1",
                         "--resume_from_checkpoint")


def test_ctrl_c_during_a_save_keeps_the_last_checkpoint(tmp_path, capsys, monkeypatch):
    from nanosft.run import checkpoint

    _interrupt_at(monkeypatch, checkpoint, "_write_all", 2)  # while writing checkpoint-2
    code, output = run(_train_with_checkpoints(tmp_path), capsys)
    assert_clean_failure(code, output, 130, "checkpoint-1", "--resume_from_checkpoint")
    assert not (tmp_path / "out" / "checkpoint-2").exists()


def test_ctrl_c_before_any_checkpoint_says_nothing_was_saved(tmp_path, capsys, monkeypatch):
    from nanosft.trainer import Trainer

    _interrupt_at(monkeypatch, Trainer, "training_step", 1)
    code, output = run(_train_with_checkpoints(tmp_path), capsys)
    assert_clean_failure(code, output, 130, "no checkpoint was saved")


def test_ctrl_c_while_the_flags_load_exits_130_without_a_traceback(capsys, monkeypatch):
    from nanosft import cli

    def interrupted(**kwargs):
        raise KeyboardInterrupt  # the train flags import torch: seconds long

    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert_clean_failure(*run(["train", "--help"], capsys), 130, "interrupted (Ctrl-C) while "
                         "starting", "nothing was run")


def test_data_from_a_fifo_is_refused_at_once_naming_it(tmp_path, capsys):
    # a named pipe nobody writes to: reading it would block forever (it used to hang)
    from nanosft.data import read_dataset_file

    fifo = tmp_path / "rows"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match=r"is a named pipe \(FIFO\), not a regular file"):
        read_dataset_file(str(fifo))
    assert_clean_failure(*run(["train", "--model", str(tmp_path), "--data", str(fifo),
                               "--output_dir", str(tmp_path / "out")], capsys),
                         2, "--data", "named pipe (FIFO)")


@pytest.mark.parametrize("where", ["a_file", "unwritable"])
def test_merge_onto_a_file_or_an_unwritable_place_names_out(where, tmp_path, capsys):
    out = {"a_file": tmp_path / "merged", "unwritable": Path("/proc/nanosft-merged")}[where]
    if where == "a_file":
        out.write_text("not a folder")
    words = {"a_file": "is a file, not a folder", "unwritable": "cannot be written"}[where]
    argv = ["merge", "--model", DEFAULT, "--adapter", DEFAULT, "--out", out]
    assert_clean_failure(*run(argv, capsys), 2, f"--out {out}", words)


# ----------------------------------------------------------------------------- the backstop

def test_unexpected_error_type_gets_the_paragraph_and_the_debug_hint(capsys, monkeypatch):
    from nanosft import cli

    def broken(args):
        raise KeyError("rope_theta")

    monkeypatch.setattr(cli, "run_memory", broken)
    assert_clean_failure(*run(["memory", "--model", DEFAULT], capsys), 2, "KeyError",
                         "rope_theta", "NANOSFT_DEBUG=1")
    for off in ("0", "false", ""):  # NANOSFT_DEBUG=0 means off
        monkeypatch.setenv("NANOSFT_DEBUG", off)
        assert_clean_failure(*run(["memory", "--model", DEFAULT], capsys), 2, "KeyError")
    monkeypatch.setenv("NANOSFT_DEBUG", "1")
    with pytest.raises(KeyError):  # the traceback, when asked for
        main(["memory", "--model", str(DEFAULT)])


# ----------------------------------------------------------------------------- resume, API

def test_trainer_state_with_a_wrongly_typed_field_names_file_and_field(tmp_path, capsys):
    argv = _train_with_checkpoints(tmp_path)
    argv[argv.index("--max_steps") + 1] = "1"
    assert run(argv, capsys)[0] == 0
    state_file = tmp_path / "out" / "checkpoint-1" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state["global_step"] = "1"
    state_file.write_text(json.dumps(state))
    argv[argv.index("--max_steps") + 1] = "2"
    code, output = run(argv + ["--resume_from_checkpoint", "true"], capsys)
    assert_clean_failure(code, output, 2, "trainer_state.json", "'global_step'", "not int")


def test_trainer_without_train_dataset_says_so(tmp_path):
    from nanosft.args import TrainingArguments
    from nanosft.model import CausalLM
    from nanosft.trainer import Trainer

    trainer = Trainer(CausalLM.from_pretrained(DEFAULT),
                      TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True))
    with pytest.raises(ValueError, match="Trainer: training requires a train_dataset"):
        trainer.train()


# ----------------------------------------------------------------------------- permissions

@pytest.fixture
def umask():
    """set(mask): the process umask for this test (restored after); nanosft's cached copy too."""
    old = os.umask(0o022)

    def set_mask(mask):
        os.umask(mask)
        hub._umask.cache_clear()

    yield set_mask
    os.umask(old)
    hub._umask.cache_clear()


def _modes(folder):
    return {p.relative_to(folder).as_posix(): stat.S_IMODE(p.stat().st_mode)
            for p in [folder, *folder.rglob("*")]}


@pytest.mark.parametrize("mask", [0o022, 0o027])
def test_saved_files_get_the_umask_permissions(mask, umask, tmp_path, capsys):
    umask(mask)
    out = tmp_path / "out"
    assert run(_train(tmp_path, "--output_dir", out), capsys)[0] == 0
    merged = tmp_path / "merged"
    assert run(["merge", "--model", DEFAULT, "--adapter", out, "--out", merged], capsys)[0] == 0
    for folder in (out, merged):
        for name, mode in _modes(folder).items():
            want = (0o777 if (folder / name).is_dir() else 0o666) & ~mask
            assert mode == want, f"{folder / name}: {oct(mode)} != {oct(want)}"
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(os.listdir(out))
    assert {"model.safetensors", "config.json"} <= set(os.listdir(merged))

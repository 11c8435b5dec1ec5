"""No run destroys another run's results, and the command line resumes the latest checkpoint.

Compared: the bytes of every file under output_dir before and after a refused start (a sha256
per path), the error text (the folder, what it holds, and only choices the caller can pass:
Python names for the API, flags for the command line), the checkpoints present when
overwrite_output_dir writes its first one, the checkpoint a resume picks, and a command-line run
SIGKILLed part-way and resumed with a bare `--resume_from_checkpoint` in a fresh process.
Hermetic: tiny models (hidden 32) built in-process, the embedded default tokenizer, CPU, one
thread, fixed seeds; every file goes under tmp_path (the subprocesses run with cwd=tmp_path).
Run: python -m pytest -q tests/test_output_dir.py
"""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from tiny import one_thread, tiny_model  # noqa: F401 (one_thread: an autouse fixture)

from nanosft.run import checkpoint
from nanosft import cli
from nanosft.cli import demo
from nanosft.run import output_folder
from nanosft.args import TrainingArguments
from nanosft.collator import DataCollatorForLanguageModeling
from nanosft.peft import LoraConfig, get_peft_model
from nanosft.tokenizer import Tokenizer
from nanosft.trainer import Trainer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rows(n=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(1, 64, (int(torch.randint(4, 10, (1,), generator=g)),), generator=g)
        out.append({"input_ids": ids.tolist(), "labels": ids.tolist()})
    return out


def make_trainer(output_dir, model=None, **overrides):
    kwargs = {"output_dir": str(output_dir), "per_device_train_batch_size": 2, "max_steps": 3,
              "learning_rate": 1e-3, "logging_steps": 1, "save_strategy": "steps", "save_steps": 1,
              "use_cpu": True, "optim": "adamw_torch", "disable_tqdm": True, "seed": 3,
              "report_to": "nanosft"}  # metrics.jsonl: the run's own file in output_dir
    kwargs.update(overrides)
    return Trainer(
        model if model is not None else tiny_model(),
        TrainingArguments(**kwargs),
        train_dataset=rows(),
        data_collator=DataCollatorForLanguageModeling(pad_token_id=0),
    )


def tree_digest(folder) -> dict:
    """{relative path: sha256} of every file under `folder`, but the run lock file (no run's result:
    a SIGKILLed run leaves it, the next start takes it over and removes it)."""
    digest = {}
    for root, _, files in os.walk(folder):
        for name in files:
            if name == output_folder.LOCK_NAME:
                continue
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                digest[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
    return digest


def lora_model(r=4, target_modules=("q_proj", "v_proj"), seed=0):
    return get_peft_model(tiny_model(seed=seed), LoraConfig(r=r, lora_alpha=8,
                                                            target_modules=list(target_modules)))


def test_fresh_run_refuses_another_runs_folder_and_changes_no_byte(tmp_path, capsys):
    first = make_trainer(tmp_path / "run")
    first.train()
    first.save_model()  # the final model beside checkpoint-1..3, as `nanosft train` leaves it
    before = tree_digest(tmp_path / "run")
    assert "checkpoint-3/trainer_state.json" in before and "model.safetensors" in before
    second = make_trainer(tmp_path / "run", model=tiny_model(seed=7))
    with pytest.raises(ValueError) as error:
        second.train()
    message = str(error.value)
    assert str(tmp_path / "run") in message and "checkpoint-3" in message
    for choice in (
        "resume_from_checkpoint=True",
        "pick a new output_dir",
        "overwrite_output_dir=True",
    ):
        assert choice in message
    assert "--" not in message  # a Python caller cannot pass flags
    assert tree_digest(tmp_path / "run") == before  # every file of the first run, byte for byte
    assert second.state.global_step == 0


@pytest.mark.parametrize("layout", ["adapter", "demo_adapter", "full_model"])
def test_a_saved_model_or_adapter_alone_is_another_run(tmp_path, layout):
    out = tmp_path / "run"
    if layout == "full_model":
        tiny_model().save_pretrained(str(out))
    else:
        lora_model().save_pretrained(str(out / "adapter" if layout == "demo_adapter" else out))
    before = tree_digest(out)
    with pytest.raises(ValueError, match="holds another run"):
        make_trainer(out).train()
    assert tree_digest(out) == before


def test_empty_folder_or_only_user_files_is_fine(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("my notes")
    (out / "README.md").write_text("# my experiment")
    assert output_folder.output_dir_refusal(str(out)) is None
    make_trainer(out).train()
    assert (out / "notes.txt").read_text() == "my notes"
    assert (out / "README.md").read_text() == "# my experiment"
    assert output_folder.get_last_checkpoint(str(out)) == str(out / "checkpoint-3")


def test_overwrite_output_dir_removes_old_checkpoints_before_the_first_new_one(tmp_path):
    out = tmp_path / "run"
    make_trainer(out, max_steps=5).train()  # checkpoint-1 .. checkpoint-5
    (out / "notes.txt").write_text("keep me")
    os.makedirs(out / ".tmp-checkpoint-9")  # a save interrupted by a crash
    second = make_trainer(out, model=tiny_model(seed=7), max_steps=2, overwrite_output_dir=True)
    seen_at_first_save = []
    original = second._save_checkpoint

    def recording_save():
        if not seen_at_first_save:
            seen_at_first_save.append(sorted(os.listdir(out)))
        original()

    second._save_checkpoint = recording_save
    second.train()
    # the old run's logs went too; the run's lock file is there while it runs (and gone after)
    assert seen_at_first_save[0] == [output_folder.LOCK_NAME, "metrics.jsonl", "notes.txt"]
    assert sorted(p.name for p in out.iterdir()) == [
        "checkpoint-1",
        "checkpoint-2",
        "metrics.jsonl",
        "notes.txt",
    ]
    with open(out / "checkpoint-2" / "trainer_state.json") as f:
        assert json.load(f)["max_steps"] == 2  # the new run's, not the old run's checkpoint-2
    # negative control: without overwrite_output_dir, the new run's folder refuses a third run
    with pytest.raises(ValueError, match="holds another run"):
        make_trainer(out).train()


def test_overwrite_and_resume_together_is_an_error(tmp_path):
    make_trainer(tmp_path / "run").train()
    with pytest.raises(ValueError, match="drop one of the two"):
        make_trainer(tmp_path / "run", overwrite_output_dir=True).train(resume_from_checkpoint=True)


def test_resume_latest_without_a_valid_checkpoint_says_what_the_folder_holds(tmp_path):
    out = tmp_path / "run"
    os.makedirs(out / ".tmp-checkpoint-3")
    os.makedirs(out / "checkpoint-2")  # no trainer_state.json: not resumable
    with pytest.raises(ValueError) as error:
        make_trainer(out).train(resume_from_checkpoint=True)
    message = str(error.value)
    assert str(out) in message and ".tmp-checkpoint-3" in message
    assert "checkpoint-2 (no trainer_state.json)" in message
    assert "resume_from_checkpoint=None" in message and "--" not in message
    with pytest.raises(ValueError) as error:  # the command line's wording: flags only
        output_folder.resolve_resume_checkpoint(True, str(out), command_line=True)
    assert "--resume_from_checkpoint" in str(error.value) and "=True" not in str(error.value)
    with pytest.raises(ValueError, match="does not exist"):
        output_folder.resolve_resume_checkpoint(True, str(tmp_path / "missing"))


def test_latest_valid_checkpoint_skips_an_incomplete_newer_one(tmp_path):
    out = tmp_path / "run"
    make_trainer(out, max_steps=2).train()
    os.makedirs(out / "checkpoint-7")  # newer number, but nothing in it
    assert output_folder.get_last_checkpoint(str(out)) == str(out / "checkpoint-2")


@pytest.mark.parametrize("change,expected", [
    ({"r": 8}, "r: checkpoint 4, this run 8"),
    ({"target_modules": ("q_proj", "k_proj")}, "target_modules"),
    ("full", "holds an adapter"),
])
def test_a_checkpoint_of_another_setup_is_refused_before_training(tmp_path, change, expected):
    out = tmp_path / "run"
    make_trainer(out, model=lora_model(), max_steps=2).train()
    before = tree_digest(out)
    model = tiny_model(seed=5) if change == "full" else lora_model(seed=5, **change)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = make_trainer(out, model=model, max_steps=4)
    with pytest.raises(ValueError, match=expected):
        trainer.train(resume_from_checkpoint=True)
    assert tree_digest(out) == before
    assert all(torch.equal(v, start[k]) for k, v in model.state_dict().items())  # nothing trained


def test_a_full_checkpoint_resumed_as_lora_is_refused(tmp_path):
    out = tmp_path / "run"
    make_trainer(out, max_steps=2).train()
    with pytest.raises(ValueError, match="full fine-tuning checkpoint"):
        make_trainer(out, model=lora_model(), max_steps=4).train(resume_from_checkpoint=True)
    # the same set-up resumes (the check refuses only what differs)
    resumed = make_trainer(out, model=tiny_model(seed=5), max_steps=4)
    assert resumed.train(resume_from_checkpoint=True).global_step == 4


def test_rank_zero_decides_for_every_rank(tmp_path, monkeypatch):
    """Another rank never looks at the folder: the reduced flag from rank 0 is its answer."""
    out = tmp_path / "empty"
    out.mkdir()
    args = TrainingArguments(output_dir=str(out), use_cpu=True)
    looked = []
    monkeypatch.setattr(output_folder, "output_dir_refusal", lambda *a, **k: looked.append(a))
    monkeypatch.setattr(output_folder.distributed, "is_main_process", lambda: False)
    monkeypatch.setattr(output_folder.distributed, "all_reduce_sum", lambda t: t + 1)  # rank 0: no
    with pytest.raises(ValueError, match="rank 0"):
        output_folder.check_output_dir(args, resuming=False)
    assert looked == []


@pytest.mark.parametrize("spelling", [[], ["true"], ["True"], ["latest"]])
def test_command_line_resume_spellings_mean_the_latest_checkpoint(tmp_path, spelling):
    argv = ["train", "--model", "m", "--data", "d.jsonl", "--output_dir", str(tmp_path),
            "--resume_from_checkpoint", *spelling]
    args = cli.build_parser().parse_args(argv)
    sft_config, _ = cli.build_train_configs(args, args.sft_names, args.lora_names)
    assert sft_config.resume_from_checkpoint is True
    folder = ["train", "--model", "m", "--data", "d.jsonl", "--output_dir", str(tmp_path),
              "--resume_from_checkpoint", str(tmp_path / "checkpoint-4")]
    args = cli.build_parser().parse_args(folder)
    sft_config, _ = cli.build_train_configs(args, args.sft_names, args.lora_names)
    assert sft_config.resume_from_checkpoint == str(tmp_path / "checkpoint-4")


def test_demo_refuses_an_output_dir_holding_another_run(tmp_path, capsys):
    out = tmp_path / "demo"
    lora_model().save_pretrained(str(out))  # a training run's adapter, not a demo's adapter/
    (out / "demo_summary.json").write_text("{}")
    before = tree_digest(out)
    assert cli.main(["demo", "--output_dir", str(out), "--steps", "1"]) == 2
    error = capsys.readouterr().err
    assert str(out) in error and "--overwrite_output_dir" in error and "--output_dir" in error
    assert "--resume_from_checkpoint" not in error  # the demo saves no checkpoint to resume
    assert tree_digest(out) == before


def _train_command(model_dir, data, out, *extra):
    return [
        sys.executable,
        "-m",
        "nanosft",
        "train",
        "--model",
        str(model_dir),
        "--data",
        str(data),
        "--output_dir",
        str(out),
        "--max_steps",
        "12",
        "--save_steps",
        "1",
        "--save_total_limit",
        "2",
        "--logging_steps",
        "1",
        "--per_device_train_batch_size",
        "2",
        "--learning_rate",
        "1e-3",
        "--lr_scheduler_type",
        "constant",
        "--bf16",
        "false",
        "--gradient_checkpointing",
        "false",
        "--use_cpu",
        "true",
        "--max_length",
        "64",
        *extra,
    ]


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs POSIX signals (SIGKILL)")
def test_command_line_resumes_the_latest_checkpoint_after_sigkill(tmp_path):
    model_dir, out = tmp_path / "model", tmp_path / "out"
    tokenizer = Tokenizer.from_pretrained(demo.DEFAULT_DIR)
    tiny_model(vocab_size=len(tokenizer), max_position_embeddings=128).save_pretrained(
        str(model_dir)
    )
    tokenizer.save_pretrained(str(model_dir))
    data = tmp_path / "data.jsonl"
    with open(os.path.join(demo.DEFAULT_DIR, demo.TRAIN_FILE)) as f:
        data.write_text("".join(f.readlines()[:16]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    before_cwd = sorted(os.listdir(tmp_path))
    with open(tmp_path / "killed.log", "w") as log:
        child = subprocess.Popen(_train_command(model_dir, data, out), stdout=log,
                                 stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
        deadline = time.time() + 240
        while (
            not (out / "checkpoint-2").is_dir() and child.poll() is None and time.time() < deadline
        ):
            time.sleep(0.02)
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert child.returncode == -signal.SIGKILL, (tmp_path / "killed.log").read_text()[-2000:]
    killed_at = checkpoint.get_last_checkpoint(str(out))
    assert killed_at is not None and not (out / "adapter_model.safetensors").exists()
    step = int(killed_at.rsplit("-", 1)[1])
    assert step < 12  # killed part-way, not after the run finished

    # a fresh start into that folder is refused, offering the flags, and changes nothing
    before = tree_digest(out)
    fresh = subprocess.run(_train_command(model_dir, data, out), capture_output=True, text=True,
                           env=env, cwd=tmp_path)
    assert fresh.returncode == 2, fresh.stderr[-2000:]
    assert "--resume_from_checkpoint" in fresh.stderr and "--overwrite_output_dir" in fresh.stderr
    assert tree_digest(out) == before

    resumed = subprocess.run(_train_command(model_dir, data, out, "--resume_from_checkpoint"),
                             capture_output=True, text=True, env=env, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    latest = checkpoint.get_last_checkpoint(str(out))  # at least the one the kill left
    assert f"Resuming training from {out}{os.sep}checkpoint-" in resumed.stdout
    assert os.path.basename(latest) == "checkpoint-12" and "12 steps" in resumed.stdout
    with open(out / "metrics.jsonl") as f:
        steps = [json.loads(line)["step"] for line in f if '"loss"' in line]
    assert steps[-1] == 12 and set(range(1, 13)) <= set(steps)  # every step logged once or more
    assert (out / "adapter_model.safetensors").is_file()
    # nothing was written outside tmp_path: the processes ran there, and only these are new
    assert sorted(os.listdir(tmp_path)) == sorted(before_cwd + ["killed.log", "out"])
    shutil.rmtree(out)

"""One run per output folder, and what a run needs at its end checked at its start.

Compared: the exit status and stderr of two `nanosft train` processes released into one new
--output_dir at the same instant (one trains, the other stops naming the first's pid), and the
winner's metrics.jsonl (each step logged once: no interleaving); the bytes of a finished run's
folder before and after a fresh, resumed and overwriting start while another process holds the
lock, and after that holder is SIGKILLed (its stale lock file blocks nothing); whether the model
was loaded (the CLI's load_model is replaced by a tripwire) when output_dir cannot be written,
eval_strategy has no eval data or metric_for_best_model names nothing evaluate() returns; the
known metric names against the keys a real evaluate() returns; a final save that hits a full disk
(the tokenizer writer raises ENOSPC after the adapter files are written): no final file is left,
the error names checkpoint-N, and resuming from it writes the adapter of checkpoint-N.
Hermetic: the tiny default model (nanosft/cli/assets/default) or tests/tiny.py, CPU, one thread,
files under tmp_path, subprocesses with cwd=tmp_path.
Run: python -m pytest -q tests/test_output_lock.py
"""

import errno
import fcntl
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file
from tiny import one_thread, tiny_model  # noqa: F401 (one_thread: an autouse fixture)

from nanosft import cli, tokenizer
from nanosft.args import SFTConfig, TrainingArguments
from nanosft.cli import demo
from nanosft.collator import DataCollatorForLanguageModeling
from nanosft.run import output_folder, preflight
from nanosft.sft import SFTTrainer
from nanosft.tokenizer import Tokenizer
from nanosft.trainer import Trainer
from nanosft.trainer_callback import TrainerCallback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
       "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
FAST = ["--per_device_train_batch_size", "2", "--gradient_checkpointing", "false",
        "--bf16", "false", "--logging_steps", "1", "--learning_rate", "1e-3", "--use_cpu", "true",
        "--max_length", "64", "--disable_tqdm", "true"]


def rows(n=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(1, 64, (int(torch.randint(4, 10, (1,), generator=g)),), generator=g)
        out.append({"input_ids": ids.tolist(), "labels": ids.tolist()})
    return out


def make_trainer(output_dir, trainer_class=Trainer, **overrides):
    kwargs = {"output_dir": str(output_dir), "per_device_train_batch_size": 2, "max_steps": 2,
              "learning_rate": 1e-3, "logging_steps": 1, "save_strategy": "steps", "save_steps": 1,
              "use_cpu": True, "optim": "adamw_torch", "disable_tqdm": True, "seed": 3,
              "report_to": "nanosft"}  # metrics.jsonl: what each run wrote
    kwargs.update(overrides)
    return trainer_class(tiny_model(), TrainingArguments(**kwargs), train_dataset=rows(),
                         data_collator=DataCollatorForLanguageModeling(pad_token_id=0))


def tree(folder) -> dict:
    """{relative path: bytes} of every file under `folder`."""
    found = {}
    for root, _, files in os.walk(folder):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                found[os.path.relpath(os.path.join(root, name), folder)] = f.read()
    return found


def train_argv(data, out, *extra):
    argv = ["train", "--model", demo.DEFAULT_DIR, "--data", data, "--output_dir", out, *FAST,
            *extra]
    return [str(word) for word in argv]


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "data.jsonl"
    with open(os.path.join(demo.DEFAULT_DIR, demo.TRAIN_FILE)) as f:
        path.write_text("".join(f.readlines()[:8]))
    return path


@pytest.fixture
def no_model_load(monkeypatch):
    """The CLI's load_model, replaced by a tripwire: a check "at start" must fire before it."""
    loaded = []
    monkeypatch.setattr(cli, "load_model", lambda *a, **k: loaded.append(a) or 1 / 0)
    return loaded


def is_locked(folder) -> bool:
    """Whether some open file (of any process, this one too) holds folder's run lock."""
    path = os.path.join(folder, output_folder.LOCK_NAME)
    if not os.path.exists(path):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # flock: per open file, so this conflicts
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def start_holder(folder):
    """Another process that takes folder's run lock and sleeps; returns once it holds it."""
    code = ("import sys, time; from nanosft.run.output_folder import lock_output_dir; "
            "lock_output_dir(sys.argv[1]); print('locked', flush=True); time.sleep(300)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(folder)], stdout=subprocess.PIPE,
                              text=True, env=ENV, cwd=folder.parent)
    assert holder.stdout.readline() == "locked\n"
    return holder


# ----------------------------------------------------------------------------- one run at a time
def test_two_runs_started_at_once_into_one_folder_one_trains_the_other_stops(tmp_path, data):
    """Without the lock both pass the "holds another run" guard, exit 0 and mix their files."""
    out, gate = tmp_path / "out", tmp_path / "go"
    argv = train_argv(data, out, "--max_steps", "4", "--save_steps", "2")
    # both import everything, then wait at the gate: released together, they race for the folder
    code = ("import os, sys, time; import nanosft.sft; from nanosft.cli import main\n"
            "print('ready', flush=True)\n"
            "while not os.path.exists(sys.argv[1]): time.sleep(0.001)\n"
            "sys.exit(main(sys.argv[2:]))")
    runs = [subprocess.Popen([sys.executable, "-c", code, str(gate), *argv], env=ENV,
                             cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True) for _ in range(2)]
    assert [run.stdout.readline() for run in runs] == ["ready\n", "ready\n"]
    gate.write_text("")
    results = [(run, *run.communicate(timeout=240)) for run in runs]
    codes = sorted(run.returncode for run, _, _ in results)
    assert codes == [0, 2], [err[-2000:] for _, _, err in results]
    (winner, won_out, _), (_, lost_out, lost_err) = sorted(results, key=lambda r: r[0].returncode)
    message = " ".join(lost_err.split())
    assert f"--output_dir {out} is in use by another run (pid {winner.pid}" in message
    assert "Wait until that run ends, or pick another --output_dir" in message
    assert "saved the adapter" in won_out and "saved the adapter" not in lost_out
    assert "Running training" not in lost_out  # it stopped before loading the model
    with open(out / "metrics.jsonl") as f:
        steps = [json.loads(line)["step"] for line in f if '"loss"' in line]
    assert steps == [1, 2, 3, 4]  # one run's log, not two interleaved
    assert (out / "adapter_model.safetensors").is_file()
    assert output_folder.get_last_checkpoint(str(out)) == str(out / "checkpoint-4")
    assert not (out / output_folder.LOCK_NAME).exists()  # released at the end
    assert not any(output_folder.LOCK_NAME in os.listdir(c)
                   for c in output_folder.sorted_checkpoints(str(out)))


def test_a_held_lock_stops_fresh_resumed_and_overwriting_runs_before_they_write(
        tmp_path, data, capsys, no_model_load):
    out = tmp_path / "run"
    make_trainer(out).train()  # checkpoint-1, checkpoint-2: what --overwrite_output_dir removes
    before = tree(out)
    holder = start_holder(out)
    try:
        lock_text = (out / output_folder.LOCK_NAME).read_text()
        assert f"pid: {holder.pid}\n" in lock_text
        for overrides, call in (({}, {}),
                                ({}, {"resume_from_checkpoint": True}),
                                ({"overwrite_output_dir": True}, {})):
            trainer = make_trainer(out, **overrides)
            with pytest.raises(ValueError) as error:
                trainer.train(**call)
            message = str(error.value)
            assert f"output_dir {out} is in use by another run (pid {holder.pid}" in message
            assert "pick another output_dir" in message and "--" not in message
            assert trainer.state.global_step == 0
        for extra in ([], ["--resume_from_checkpoint"], ["--overwrite_output_dir"]):
            assert cli.main(train_argv(data, out, "--max_steps", "2", *extra)) == 2
            assert f"is in use by another run (pid {holder.pid}" in capsys.readouterr().err
        assert no_model_load == []
        assert tree(out) == {**before, output_folder.LOCK_NAME: lock_text.encode()}  # untouched
    finally:
        holder.kill()
        holder.wait()


def test_a_sigkilled_holder_leaves_a_lock_file_that_blocks_nothing(tmp_path):
    out = tmp_path / "run"
    make_trainer(out).train()
    holder = start_holder(out)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert f"pid: {holder.pid}\n" in (out / output_folder.LOCK_NAME).read_text()  # stale, left
    assert not is_locked(out)  # the OS dropped the lock with the process
    resumed = make_trainer(out, max_steps=3)
    assert resumed.train(resume_from_checkpoint=True).global_step == 3
    assert output_folder.get_last_checkpoint(str(out)) == str(out / "checkpoint-3")
    assert not (out / output_folder.LOCK_NAME).exists()


def test_train_holds_the_lock_to_its_end_and_releases_it_on_an_error(tmp_path):
    out = tmp_path / "run"
    seen = []

    class Watch(TrainerCallback):  # is the folder locked (by this process) while steps run?
        def on_step_end(self, args, state, control, **kwargs):
            seen.append((is_locked(out), (out / output_folder.LOCK_NAME).read_text()))
            if state.global_step == 3:
                raise RuntimeError("boom")

    trainer = make_trainer(out)
    trainer.add_callback(Watch())
    trainer.train()
    assert [held for held, _ in seen] == [True, True]
    assert f"pid: {os.getpid()}\n" in seen[0][1]
    assert not is_locked(out) and not (out / output_folder.LOCK_NAME).exists()
    failing = make_trainer(out, max_steps=3)
    failing.add_callback(Watch())
    with pytest.raises(RuntimeError, match="boom"):
        failing.train(resume_from_checkpoint=True)  # resumes at step 2, fails at step 3's end
    assert not is_locked(out) and output_folder._held == {}


# ----------------------------------------------------------------------------- checked at start
@pytest.mark.parametrize("case", ["parent_is_a_file", "read_only_folder"])
def test_an_unwritable_output_dir_fails_before_the_model_loads(
        tmp_path, data, capsys, no_model_load, case):
    if case == "read_only_folder":
        if os.geteuid() == 0:
            pytest.skip("root writes into a 0o500 folder anyway")
        parent = tmp_path / "read_only"
        parent.mkdir()
        parent.chmod(0o500)
        reason, fix = f"permission denied in {parent}", "Pick an --output_dir you can write to"
    else:
        parent = tmp_path / "notes.txt"
        parent.write_text("a file, not a folder")
        reason, fix = f"{parent} is a file, not a folder", "or move that file away"
    out = parent / "run"
    try:
        started = time.time()
        assert cli.main(train_argv(data, out, "--max_steps", "2")) == 2
        assert time.time() - started < 10  # at start, not after training
        err = " ".join(capsys.readouterr().err.split())
        assert f"--output_dir {out} cannot be written ({reason}" in err
        assert "nothing was trained" in err and fix in err
        assert no_model_load == []
        trainer = make_trainer(out)
        with pytest.raises(ValueError, match=f"output_dir {out} cannot be written") as error:
            trainer.train()
        assert "--" not in str(error.value) and trainer.state.global_step == 0
    finally:
        if case == "read_only_folder":
            parent.chmod(0o700)
    assert not os.path.exists(out)


def test_eval_strategy_without_eval_data_fails_at_start(tmp_path, data, capsys, no_model_load):
    out = tmp_path / "new" / "out"
    assert cli.main(train_argv(data, out, "--eval_strategy", "steps")) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--eval_strategy steps evaluates during training, but there is no eval data" in err
    assert "give --eval_data FILE, or set --eval_strategy no" in err
    assert no_model_load == [] and not (tmp_path / "new").exists()  # no empty folders left
    trainer = make_trainer(tmp_path / "api", eval_strategy="epoch")
    with pytest.raises(ValueError, match='eval_dataset to the trainer, or set eval_strategy="no"'):
        trainer.train()  # transformers refuses the same at Trainer init (a ValueError)
    assert trainer.state.global_step == 0 and not (tmp_path / "api").exists()
    trainer.eval_dataset = rows(4, seed=8)  # given after init, as transformers' users do
    assert trainer.train().global_step == 2


def test_a_mistyped_metric_for_best_model_fails_at_start(tmp_path, data, capsys, no_model_load):
    eval_data = tmp_path / "eval.jsonl"
    eval_data.write_text(data.read_text())
    assert cli.main(train_argv(data, tmp_path / "out", "--eval_strategy", "steps", "--eval_data",
                               eval_data, "--metric_for_best_model", "eval_los")) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--metric_for_best_model eval_los: evaluation will not produce 'eval_los'" in err
    assert "eval_loss" in err and "eval_mean_token_accuracy" in err
    assert no_model_load == []
    trainer = make_trainer(tmp_path / "api", metric_for_best_model="accuracy",
                           eval_strategy="steps")
    trainer.eval_dataset = rows()
    with pytest.raises(ValueError, match="'eval_accuracy'; it produces eval_loss, eval_perplexity"):
        trainer.train()
    assert trainer.state.global_step == 0
    # no evaluation ever runs: the metric is never read, so it is not checked (as transformers)
    trainer = make_trainer(tmp_path / "api-no-eval", metric_for_best_model="accuracy")
    trainer.train()
    assert trainer.state.global_step == 2


def eval_keys(metrics) -> set:
    return {key for key in metrics if key.startswith("eval_")}  # log() adds "epoch" too


def test_known_metric_names_are_the_keys_evaluate_returns(tmp_path):
    trainer = make_trainer(tmp_path / "a")
    assert eval_keys(trainer.evaluate(rows(4))) == set(preflight.known_eval_metrics(trainer))
    tok = Tokenizer.from_pretrained(demo.DEFAULT_DIR)
    sft = SFTTrainer(tiny_model(vocab_size=len(tok), max_position_embeddings=128),
                     args=SFTConfig(output_dir=str(tmp_path / "b"), use_cpu=True, bf16=False,
                                    max_length=64, report_to="none", disable_tqdm=True),
                     train_dataset=[{"text": "1 plus 1 equals 2."}] * 2,
                     eval_dataset=[{"text": "2 plus 2 equals 4."}] * 2, processing_class=tok)
    assert eval_keys(sft.evaluate()) == set(preflight.known_eval_metrics(sft))
    assert preflight.known_eval_metrics(SFTTrainer) == preflight.known_eval_metrics(sft)


def test_a_metric_only_an_evaluation_can_tell_is_checked_there_with_the_keys(tmp_path):
    class WithBleu(Trainer):  # an override may add any key: the start cannot know it
        def evaluate(self, eval_dataset=None, metric_key_prefix="eval"):
            return {**super().evaluate(eval_dataset, metric_key_prefix), "eval_bleu": 0.5}

    ok = make_trainer(tmp_path / "ok", WithBleu, eval_strategy="steps", eval_steps=1,
                      metric_for_best_model="bleu")
    ok.eval_dataset = rows(4, seed=8)
    ok.train()
    assert ok.state.best_metric == 0.5
    typo = make_trainer(tmp_path / "typo", WithBleu, eval_strategy="steps", eval_steps=1,
                        metric_for_best_model="blue")
    typo.eval_dataset = rows(4, seed=8)
    with pytest.raises(ValueError) as error:  # transformers: a KeyError
        typo.train()
    assert "the evaluation returned no 'eval_blue', only eval_bleu, eval_loss" in str(error.value)
    assert output_folder.get_last_checkpoint(str(tmp_path / "typo")) is None


# ----------------------------------------------------------------------------- the final save
def test_a_full_disk_at_the_final_save_keeps_the_last_checkpoint_and_names_it(
        tmp_path, data, capsys, monkeypatch):
    out = tmp_path / "out"
    argv = train_argv(data, out, "--max_steps", "2", "--save_steps", "2")
    real = tokenizer._write_files_atomically

    def disk_full(folder, files):  # the last writer of the final save: the adapter is written
        with open(os.path.join(folder, "tokenizer.json"), "w") as f:
            f.write('{"half": ')  # half a file, as a full disk leaves it
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(tokenizer, "_write_files_atomically", disk_full)
    assert cli.main(argv) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"saving the final model to {out} failed (No space left on device)" in err
    assert f"The last checkpoint, {out / 'checkpoint-2'}, is complete" in err
    assert "--resume_from_checkpoint" in err
    # nothing of the final save is left: no adapter without its tokenizer, no half file, no temp
    assert sorted(os.listdir(out)) == ["checkpoint-2", "metrics.jsonl"]
    monkeypatch.setattr(tokenizer, "_write_files_atomically", real)  # space freed
    assert cli.main(argv + ["--resume_from_checkpoint"]) == 0, capsys.readouterr().err[-2000:]
    final = load_file(out / "adapter_model.safetensors")
    saved = load_file(out / "checkpoint-2" / "adapter_model.safetensors")
    assert final.keys() == saved.keys()
    assert all(torch.equal(final[k], saved[k]) for k in final)
    assert (out / "tokenizer.json").is_file() and not (out / output_folder.LOCK_NAME).exists()

"""Faults during training: a kill in the middle of a save, a full disk, a non-finite loss, a DDP
peer that dies.

Compared: (1) a process SIGKILLed while checkpoint-3 is being written (tests/resume_worker.py
hooks the trainer_state.json write inside the temp folder) leaves checkpoint-2 loadable, the
partial folder ignored by get_last_checkpoint with a warning, and a fresh process resumes to
parameters bitwise equal (torch.equal) to an uninterrupted run. (2) OSError(ENOSPC) raised by a
write of checkpoint-3 (torch.save, os.fsync) surfaces as an OSError that names the folder and
the fix, with no temp folder left and checkpoint-2 resumable to the same bits; a real write
failure (RLIMIT_FSIZE in a child process: safetensors and torch raise their own error types)
also keeps checkpoint-2. (3) walkthrough 2.3's logging_nan_inf_filter adds the running average
instead of a nan step loss (value computed here from the step losses); a model whose logits turn
nan stops the run at that step with NonFiniteTrainingError naming the learning rate and clipping,
while nan step losses the filter replaces (weights still finite) do not stop it (negative control;
tests/test_nonfinite.py covers the rest). (4) under 2-process DDP, when rank 1 is SIGKILLed
(sockets close) or frozen with SIGSTOP (only the timeout can help), rank 0 exits non-zero within
ddp_timeout (10 s) plus a margin. Hermetic: tiny CausalLMs (hidden 32, 2 layers, vocab 64) on
random token rows, CPU, one thread, fixed seeds, tmp_path only, localhost gloo.
Run: python -m pytest -q tests/test_faults.py
"""

import errno
import math
import os
import shutil
import signal
import socket
import time

import pytest
import resume_worker as worker
import torch
from tiny import one_thread  # noqa: F401 (an autouse fixture)

from nanosft.run import checkpoint
from nanosft.args import TrainingArguments
from nanosft.collator import DataCollatorForLanguageModeling
from nanosft.optim import create_optimizer, get_scheduler
from nanosft.monitoring.callbacks import NonFiniteTrainingError, StopOnNonFiniteCallback
from nanosft.trainer import Trainer

posix_only = pytest.mark.skipif(
    not hasattr(signal, "SIGSTOP"), reason="needs POSIX signals and RLIMIT_FSIZE"
)
WAIT_S = 240


def _full_job(tmp_path, name, **extra):
    # 14 rows / batch 2 = 7 micro-batches, GA 2 -> 4 steps per epoch, 8 in all; one checkpoint per
    # step
    return {"name": name, "kind": "full", "ga": 2, "output_dir": str(tmp_path / name), **extra}


def _assert_same_state(got, want):
    assert got.keys() == want.keys()
    different = [k for k in want if not torch.equal(got[k], want[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


def _state(trainer):
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


# ----------------------------------------------------------------------------- killed while saving
@pytest.fixture(scope="module")
def killed_in_save(tmp_path_factory):
    root = tmp_path_factory.mktemp("kill_in_save")
    spec_path = str(root / "kill.json")
    proc = worker.spawn({"jobs": [_full_job(root, "run", kill_in_save=3)]}, spec_path)
    code = proc.wait(timeout=WAIT_S)
    assert code == -signal.SIGKILL, worker.log_tail(spec_path)
    left = sorted(os.listdir(root / "run"))
    partial = sorted(os.listdir(root / "run" / ".tmp-checkpoint-3"))
    return root, left, partial


@posix_only
def test_kill_during_save_leaves_previous_checkpoint_and_partial_one_ignored(killed_in_save):
    root, left, partial = killed_in_save
    # the killed run's lock file stays too (the OS dropped its lock: it blocks no later run)
    assert left == [".nanosft.lock", ".tmp-checkpoint-3", "checkpoint-1", "checkpoint-2"]
    # the kill came after the weights, optimizer, scheduler and RNG files, before trainer_state.json
    assert "model.safetensors" in partial and checkpoint.TRAINER_STATE_NAME not in partial
    with pytest.warns(UserWarning, match=r"\.tmp-checkpoint-3.*interrupted"):
        assert checkpoint.get_last_checkpoint(str(root / "run")) == str(
            root / "run" / "checkpoint-2"
        )
    with pytest.raises(
        FileNotFoundError, match=r"\.tmp-checkpoint-3 is not a checkpoint: missing trainer_state"
    ):
        checkpoint.check_is_checkpoint(str(root / "run" / ".tmp-checkpoint-3"))


@posix_only
def test_previous_checkpoint_loads_after_kill_during_save(killed_in_save, tmp_path):
    root, _, _ = killed_in_save
    trainer = worker.build_full(_full_job(tmp_path, "fresh"))
    trainer.optimizer = create_optimizer(trainer.model, trainer.args)  # the groups the run saved
    trainer.lr_scheduler = get_scheduler(
        "linear", trainer.optimizer, num_warmup_steps=1, num_training_steps=8
    )
    state = checkpoint.load_checkpoint(
        str(root / "run" / "checkpoint-2"),
        model=trainer.model,
        optimizer=trainer.optimizer,
        lr_scheduler=trainer.lr_scheduler,
    )
    assert state["global_step"] == 2 and len(trainer.optimizer.state) > 0


@posix_only
def test_resume_after_kill_during_save_is_bitwise_equal(killed_in_save):
    root, _, _ = killed_in_save
    work = root / "resume-copy"
    shutil.copytree(root / "run", work)
    jobs = [{**_full_job(root, "resume-copy"), "resume": True}, _full_job(root, "reference")]
    spec_path = str(root / "resume.json")
    proc = worker.spawn({"jobs": jobs, "result": str(root / "results.pt")}, spec_path)
    assert proc.wait(timeout=WAIT_S) == 0, worker.log_tail(spec_path)
    results = torch.load(root / "results.pt", weights_only=False)
    assert results["resume-copy"]["resumed_from"] == "checkpoint-2"
    _assert_same_state(results["resume-copy"]["state"], results["reference"]["state"])
    assert results["resume-copy"]["logs"] == results["reference"]["logs"]
    # the next save of step 3 replaced it
    assert not [d for d in os.listdir(work) if d.startswith(".tmp-")]


# ----------------------------------------------------------------------------- disk full while
# saving
def _enospc(path):
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


def _fail_torch_save(monkeypatch, partial):
    real = torch.save

    def save(obj, f, *args, **kwargs):
        if isinstance(f, str) and partial in f:
            raise _enospc(f)
        return real(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)


def _fail_fsync(monkeypatch, partial):
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc/self/fd to tell which file an fsync is for")
    real = os.fsync

    def fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        if partial in path:
            raise _enospc(path)
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


@pytest.mark.parametrize("fail", [_fail_torch_save, _fail_fsync],
                         ids=["torch.save-optimizer", "os.fsync"])
def test_disk_full_during_save_is_a_clear_error_and_keeps_last_checkpoint(
    tmp_path, monkeypatch, fail
):
    run = tmp_path / "run"
    trainer = worker.build_full(_full_job(tmp_path, "run"))
    with monkeypatch.context() as patch:
        fail(patch, ".tmp-checkpoint-3")
        with pytest.raises(OSError) as info:
            trainer.train()
    assert info.value.errno == errno.ENOSPC
    message = str(info.value)
    assert (
        str(run / "checkpoint-3") in message
        and "Free disk space" in message
        and "resume" in message
    )
    # no temp folder
    assert sorted(os.listdir(run)) == ["checkpoint-1", "checkpoint-2"]
    # the last good checkpoint resumes to the bits of an uninterrupted run
    resumed = worker.build_full(_full_job(tmp_path, "run"))
    resumed.train(resume_from_checkpoint=True)
    reference = worker.build_full(_full_job(tmp_path, "reference"))
    reference.train()
    _assert_same_state(_state(resumed), _state(reference))


@pytest.fixture(scope="module")
def real_write_failure(tmp_path_factory):
    """A child whose file-size limit drops to 4 KiB at checkpoint-3: real failing writes."""
    root = tmp_path_factory.mktemp("fsize")
    job = _full_job(root, "run", fsize_limit={"step": 3, "bytes": 4096}, record_error=True)
    spec_path = str(root / "fsize.json")
    proc = worker.spawn({"jobs": [job], "result": str(root / "results.pt")}, spec_path)
    assert proc.wait(timeout=WAIT_S) == 0, worker.log_tail(spec_path)
    return root, torch.load(root / "results.pt", weights_only=False)["run"]


@posix_only
def test_real_write_failure_keeps_last_checkpoint(real_write_failure):
    root, result = real_write_failure
    assert "error" in result and result["global_step"] == 3  # step 3 trained, its save failed
    assert sorted(os.listdir(root / "run")) == ["checkpoint-1", "checkpoint-2"]
    assert checkpoint.get_last_checkpoint(str(root / "run")) == str(root / "run" / "checkpoint-2")


@posix_only
def test_real_write_failure_message_names_checkpoint_and_fix(real_write_failure):
    root, result = real_write_failure
    assert str(root / "run" / "checkpoint-3") in result["message"]
    assert "Free disk space" in result["message"]


# ----------------------------------------------------------------------------- non-finite loss
def _trainer(tmp_path, **overrides):
    kwargs = {
        "output_dir": str(tmp_path),
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 1,
        "learning_rate": 1e-3,
        "logging_steps": 1,
        "save_strategy": "no",
        "use_cpu": True,
        "optim": "adamw_torch",
        "disable_tqdm": True,
        "seed": 3,
        "max_steps": 8,
    }
    kwargs.update(overrides)
    return Trainer(
        worker.tiny_model(worker.VOCAB),
        TrainingArguments(**kwargs),
        train_dataset=worker.random_rows(16),
        data_collator=DataCollatorForLanguageModeling(pad_token_id=0),
    )


def _poison_logits_from_step(trainer, first_bad_step):
    """The model itself produces nan logits from optimizer step `first_bad_step` (1-based) on."""
    def hook(module, inputs, output):
        return output * float("nan") if trainer.state.global_step + 1 >= first_bad_step else output

    trainer.model.lm_head.register_forward_hook(hook)


def _record_step_losses(trainer):
    losses, step = [], trainer.training_step

    def recording(model, inputs, num_items_in_batch=None):
        losses.append(step(model, inputs, num_items_in_batch).item())
        return torch.tensor(losses[-1])

    trainer.training_step = recording
    return losses


@pytest.mark.parametrize("use_filter", [True, False], ids=["filter-on", "filter-off"])
def test_nan_step_loss_is_replaced_by_running_average(tmp_path, use_filter):
    trainer = _trainer(tmp_path, logging_steps=2, max_steps=2, logging_nan_inf_filter=use_filter)
    trainer.remove_callback(StopOnNonFiniteCallback)  # it would stop the run: we read the log
    _poison_logits_from_step(trainer, 2)
    losses = _record_step_losses(trainer)
    trainer.train()
    # the model really returned a nan loss
    assert math.isfinite(losses[0]) and math.isnan(losses[1])
    logged = trainer.state.log_history[0]["loss"]
    if use_filter:
        # walkthrough 2.3: "tr_loss += tr_loss / (1 + global_step - _globalstep_last_logged)" = l1 +
        # l1 / 2
        assert math.isclose(logged, (losses[0] + losses[0] / 2) / 2, rel_tol=1e-6)
    else:  # negative control: without the filter the nan reaches the log
        assert math.isnan(logged)


def test_nan_logits_stop_the_run_at_once_with_advice(tmp_path):
    trainer = _trainer(tmp_path, max_steps=8, learning_rate=0.5)
    _poison_logits_from_step(trainer, 2)
    with pytest.raises(NonFiniteTrainingError) as error:
        trainer.train()
    # step 1 was fine; step 2's nan gradients made the weights nan: the run stopped there
    assert trainer.state.global_step == 2
    message = str(error.value)
    assert message.startswith("Training diverged at step 2:")
    assert "lower learning_rate (now 0.5)" in message and "max_grad_norm" in message


def test_filtered_nan_step_losses_with_finite_weights_do_not_stop(tmp_path):
    # negative control: the step losses are reported nan but the gradients are real, so the
    # weights stay finite; logging_nan_inf_filter replaces the nan, and the run ends normally
    n = 3
    bad = set(range(2, n + 1)) | set(range(n + 2, 2 * n + 1))
    trainer = _trainer(tmp_path, max_steps=2 * n + 2)
    step = trainer.training_step

    def loss_reported_nan_on_bad_steps(model, inputs, num_items_in_batch=None):
        loss = step(model, inputs, num_items_in_batch)
        return torch.tensor(float("nan")) if trainer.state.global_step + 1 in bad else loss

    trainer.training_step = loss_reported_nan_on_bad_steps
    assert trainer.train().global_step == 2 * n + 2
    assert all(math.isfinite(h["loss"]) for h in trainer.state.log_history if "loss" in h)


# ----------------------------------------------------------------------------- a DDP peer dies
@posix_only
@pytest.mark.skipif(not torch.distributed.is_available(),
                    reason="torch.distributed is not built in")
@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"], ids=["peer-killed", "peer-hung"])
def test_ddp_peer_failure_makes_survivor_exit_within_timeout(tmp_path, how):
    # killed: its sockets close and gloo fails at once; hung (SIGSTOP): only ddp_timeout can end the
    # wait
    ddp_timeout = 10
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    death_file = str(tmp_path / "rank1.died")
    job = {
        **_full_job(
            tmp_path,
            "run",
            rows=20,
            kill_at_step=1,
            kill_micro=0,
            kill_rank=1,
            signal=how,
            death_file=death_file,
        ),
        "ddp_timeout": ddp_timeout,
    }
    procs = []
    for rank in (0, 1):
        env = {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
        }
        procs.append(worker.spawn({"jobs": [job]}, str(tmp_path / f"rank{rank}.json"), env))
    try:
        survivor_code = procs[0].wait(timeout=WAIT_S)
        exited = time.time()
    finally:
        procs[1].kill()  # a stopped process still needs ending
        procs[1].wait(timeout=WAIT_S)
    with open(death_file) as f:
        died = float(f.read())
    log = worker.log_tail(str(tmp_path / "rank0.json"))
    assert survivor_code != 0, log
    # the bound: the timeout plus a margin for a loaded CI machine; without a timeout a hung peer
    # blocks forever
    assert exited - died < ddp_timeout + 20, (
        f"rank 0 took {exited - died:.1f} s after its peer failed"
    )
    if how == "SIGSTOP":
        assert exited - died >= ddp_timeout - 3, "rank 0 gave up before ddp_timeout"
    assert "RuntimeError" in log  # gloo's error reached the top, nothing swallowed it
    # the last save was complete
    assert os.path.isfile(tmp_path / "run" / "checkpoint-1" / "rng_state_1.pth")

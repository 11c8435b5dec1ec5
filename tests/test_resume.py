"""A run killed with SIGKILL and resumed in a fresh process ends bitwise equal to a run that was
never interrupted.

Compared, with torch.equal on every state-dict tensor (not a tolerance: the resumed process must
redo exactly the same float operations in the same order, so any lost or replayed batch, any RNG
draw or optimizer moment not restored, shows up as a changed bit): the final parameters, the
logged (step, loss, grad_norm, learning_rate) of every optimizer step, and the sequence of
micro-batches (a hash per batch). The killed process runs tests/resume_worker.py with
save_steps=1 and SIGKILLs itself part-way through the optimizer step after checkpoint-<k> (its
partial gradients die with it); a new process calls train(resume_from_checkpoint=True, or the
checkpoint path) and then, for the reference, trains the same job from scratch. Cases: full
fine- tuning (Trainer), LoRA with dropout and QLoRA (NF4 base) through SFTTrainer;
gradient_accumulation_steps 1 and 2; killed mid-window, in the short last window of an epoch and
right at an epoch boundary; with a GradScaler whose scale makes some steps overflow (scaler.pt);
2-process DDP (gloo); 2-process FSDP2 (fsdp="full_shard", gloo) for full fine-tuning and QLoRA,
where the gathered parameters, the last checkpoint's whole optimizer moments, scheduler and each
rank's RNG files are compared too. Negative controls: resuming without the RNG state (LoRA dropout
masks change; single process and FSDP), without skipping the seen batches (ignore_data_skip) or
without scaler.pt gives other parameters. Hermetic: tiny models (hidden 32/64, 2 layers,
vocab <= 300) and a dozen examples built in-process, a tokenizer trained in tmp_path, CPU, one
thread per process, fixed seeds, localhost-only process group; no network, no files outside
tmp_path.
Run: python -m pytest -q tests/test_resume.py
"""

import json
import os
import shutil
import signal
import socket

import pytest
import resume_worker as worker
import torch

pytestmark = pytest.mark.skipif(
    not hasattr(signal, "SIGKILL"), reason="needs POSIX signals (SIGKILL)"
)
WAIT_S = 240  # a hung child fails the test instead of hanging the suite

# name -> job; 14 random rows / batch 2 = 7 micro-batches per epoch (full), 12 SFT examples = 6
# (lora, qlora)
CASES = {
    # GA 2, windows [2, 2, 2, 1]: dies after the 1st micro-batch of the 3rd window (mid-epoch, mid-
    # window)
    "full-ga2-mid-window": {"kind": "full", "ga": 2, "kill_at_step": 2, "kill_micro": 0},
    # dies in the epoch's short last window (1 micro-batch): resume must rebuild a window of 1, not
    # 2
    "full-ga2-short-last-window": {"kind": "full", "ga": 2, "kill_at_step": 3, "kill_micro": 0},
    # GA 1, 7 steps per epoch: checkpoint-7 closes epoch 0, dies on epoch 1's first batch (epoch
    # boundary)
    "full-ga1-epoch-boundary": {"kind": "full", "ga": 1, "kill_at_step": 7, "kill_micro": 0},
    # a GradScaler at 2**120 doubling every step: steps 6 and 7 overflow and are skipped, from the
    # restored scale
    "full-ga2-grad-scaler": {
        "kind": "full",
        "ga": 2,
        "kill_at_step": 3,
        "kill_micro": 0,
        "grad_scaler": {"init_scale": 2.0**120, "growth_interval": 1},
    },
    # LoRA with dropout 0.1: the dropout masks after resuming come from the restored RNG state
    "lora-ga2-mid-epoch": {"kind": "lora", "ga": 2, "kill_at_step": 2, "kill_micro": 1},
    # QLoRA, 3 steps per epoch: checkpoint-3 closes epoch 0, dies at the end of epoch 1's first
    # window
    # ... resumed with an explicit checkpoint path instead of True
    "qlora-ga2-epoch-boundary": {
        "kind": "qlora",
        "ga": 2,
        "kill_at_step": 3,
        "kill_micro": 1,
        "by_path": True,
    },
}


def _trace(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def _job(name, case, root, tokenizer_dir, **extra):
    return {"name": name, "kind": case["kind"], "ga": case["ga"], "output_dir": str(root / name),
            "trace": str(root / f"{name}.trace"), "tokenizer_dir": tokenizer_dir, **extra}


@pytest.fixture(scope="module")
def single_process_runs(tmp_path_factory):
    """Kill every case in its own process, then resume all (and the references) in one fresh one."""
    root = tmp_path_factory.mktemp("resume")
    tokenizer_dir = str(root / "tokenizer")
    worker.make_tokenizer(tokenizer_dir)
    killed = {}
    for name, case in CASES.items():
        job = _job(
            name,
            case,
            root,
            tokenizer_dir,
            kill_at_step=case["kill_at_step"],
            kill_micro=case["kill_micro"],
            grad_scaler=case.get("grad_scaler"),
        )
        killed[name] = (
            worker.spawn({"jobs": [job]}, str(root / f"{name}.kill.json")),
            str(root / f"{name}.kill.json"),
        )
    codes = {}
    for name, (proc, spec_path) in killed.items():
        codes[name] = proc.wait(timeout=WAIT_S)
        assert codes[name] == -signal.SIGKILL, (
            f"{name} did not die by SIGKILL:\n{worker.log_tail(spec_path)}"
        )
    left = {name: sorted(os.listdir(root / name)) for name in CASES}  # what each kill left behind
    # negative controls resume copies of two killed runs (resuming writes new checkpoints into
    # output_dir)
    shutil.copytree(root / "lora-ga2-mid-epoch", root / "lora-no-rng")
    shutil.copytree(root / "full-ga2-mid-window", root / "full-no-data-skip")
    shutil.copytree(root / "full-ga2-grad-scaler", root / "full-no-scaler-state")
    os.remove(root / "full-no-scaler-state" / "checkpoint-3" / "scaler.pt")
    jobs = []
    for name, case in CASES.items():
        resume = (
            str(root / name / f"checkpoint-{case['kill_at_step']}") if case.get("by_path") else True
        )
        jobs.append(
            _job(
                name,
                case,
                root,
                tokenizer_dir,
                resume=resume,
                trace=str(root / f"{name}.resumed.trace"),
                grad_scaler=case.get("grad_scaler"),
            )
        )
        jobs.append(
            _job(
                f"{name}-reference", case, root, tokenizer_dir, grad_scaler=case.get("grad_scaler")
            )
        )
    jobs.append(
        _job(
            "lora-no-rng",
            CASES["lora-ga2-mid-epoch"],
            root,
            tokenizer_dir,
            resume=True,
            no_rng=True,
        )
    )
    jobs.append(
        _job(
            "full-no-data-skip",
            CASES["full-ga2-mid-window"],
            root,
            tokenizer_dir,
            resume=True,
            ignore_data_skip=True,
        )
    )
    scaler_case = CASES["full-ga2-grad-scaler"]
    jobs.append(_job("full-no-scaler-state", scaler_case, root, tokenizer_dir, resume=True,
                     grad_scaler=scaler_case["grad_scaler"]))
    spec_path = str(root / "resume.json")
    proc = worker.spawn({"jobs": jobs, "result": str(root / "results.pt")}, spec_path)
    assert proc.wait(timeout=WAIT_S) == 0, worker.log_tail(spec_path)
    return root, torch.load(root / "results.pt", weights_only=False), left


def _assert_same_state(got, want):
    assert got.keys() == want.keys()
    different = [k for k in want if not torch.equal(got[k], want[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


def _exact(logs):
    """Logged numbers as their repr: exact float round-trip; a nan (skipped grad_norm) is itself."""
    return repr(logs)


def _differs(got, want):
    return [k for k in want if not torch.equal(got[k], want[k])]


@pytest.mark.parametrize("name", list(CASES))
def test_killed_then_resumed_run_is_bitwise_equal(single_process_runs, name):
    root, results, _ = single_process_runs
    case, resumed, reference = CASES[name], results[name], results[f"{name}-reference"]
    k = case["kill_at_step"]
    # the newest complete checkpoint was the one written just before the kill, and resume found it
    assert resumed["resumed_from"] == f"checkpoint-{k}"
    assert resumed["global_step"] == reference["global_step"] > k
    _assert_same_state(resumed["state"], reference["state"])
    # 1..k from trainer_state.json, the rest recomputed
    assert _exact(resumed["logs"]) == _exact(reference["logs"])
    # the data order: the steps the killed run finished + what the resumed run did == the
    # uninterrupted run
    killed_trace = _trace(root / f"{name}.trace")
    lost = [t for t in killed_trace if t["step"] == k]
    # micro-batches of step k+1 whose work died with the process
    assert len(lost) == case["kill_micro"] + 1
    resumed_trace = _trace(root / f"{name}.resumed.trace")
    assert resumed_trace[0] == lost[0]  # resumes at the first batch the checkpoint had not seen
    assert [t for t in killed_trace if t["step"] < k] + resumed_trace == _trace(
        root / f"{name}-reference.trace"
    )


def _same_tree(a, b, where):
    """Nested dicts / lists / tuples of tensors, arrays and numbers, compared exactly."""
    if torch.is_tensor(a):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _same_tree(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same_tree(x, y, f"{where}[{i}]")
    elif hasattr(a, "shape"):  # numpy RNG key array
        assert (a == b).all(), where
    else:
        assert a == b, where


@pytest.mark.parametrize("name", list(CASES))
def test_final_checkpoint_equals_the_uninterrupted_runs(single_process_runs, name):
    # optimizer moments and step counts, scheduler position and the generators' final states: the
    # resumed run
    # did exactly the work of the uninterrupted one (an extra or missing dropout draw moves the RNG
    # state)
    root, results, _ = single_process_runs
    last = f"checkpoint-{results[name]['global_step']}"
    resumed, reference = root / name / last, root / f"{name}-reference" / last
    for file_name in ("optimizer.pt", "scheduler.pt", "rng_state.pth", "scaler.pt"):
        if file_name == "scaler.pt" and "grad_scaler" not in CASES[name]:
            assert not (resumed / file_name).exists()
            continue
        _same_tree(torch.load(resumed / file_name, weights_only=False),
                   torch.load(reference / file_name, weights_only=False), file_name)
    # SFT's running num_tokens restarts, as TRL's
    keys = ("step", "epoch", "loss", "grad_norm", "learning_rate")
    history = lambda path: [
        {k: h.get(k) for k in keys}
        for h in json.loads((path / "trainer_state.json").read_text())["log_history"]
    ]
    assert _exact(history(resumed)) == _exact(history(reference))


@pytest.mark.parametrize("name", list(CASES))
def test_a_kill_between_saves_leaves_two_complete_checkpoints(single_process_runs, name):
    _, _, left = single_process_runs
    k = CASES[name]["kill_at_step"]
    # save_total_limit=2 rotated as the run went; no temp folder: the kill did not hit a save;
    # the killed run's lock file stays (the OS dropped the lock itself: it blocks no later run)
    assert left[name] == [".nanosft.lock", f"checkpoint-{k - 1}", f"checkpoint-{k}"]


def test_negative_control_resume_without_rng_state_differs(single_process_runs):
    root, results, _ = single_process_runs
    reference, no_rng = results["lora-ga2-mid-epoch-reference"], results["lora-no-rng"]
    # same batches in the same order (the data position was restored) ...
    assert _trace(root / "lora-no-rng.trace") == _trace(root / "lora-ga2-mid-epoch.resumed.trace")
    # ... yet other LoRA weights: the dropout masks after resuming came from another RNG state
    changed = _differs(no_rng["state"], reference["state"])
    assert changed and all("lora_" in k for k in changed)


def test_negative_control_resume_without_data_skip_differs(single_process_runs):
    root, results, _ = single_process_runs
    reference, replayed = results["full-ga2-mid-window-reference"], results["full-no-data-skip"]
    assert (
        _trace(root / "full-no-data-skip.trace")[0]
        != _trace(root / "full-ga2-mid-window.resumed.trace")[0]
    )
    assert _differs(replayed["state"], reference["state"])


def test_negative_control_resume_without_scaler_state_differs(single_process_runs):
    root, results, _ = single_process_runs
    reference, fresh_scale = (
        results["full-ga2-grad-scaler-reference"],
        results["full-no-scaler-state"],
    )
    # same batches, but the scale restarts at 2**120: steps 6 and 7 no longer overflow and are not
    # skipped
    assert _trace(root / "full-no-scaler-state.trace") == _trace(
        root / "full-ga2-grad-scaler.resumed.trace"
    )
    assert _differs(fresh_scale["state"], reference["state"])
    # a skipped step leaves the scheduler (and lr) in place
    skipped = lambda logs: [lr for _, _, _, lr in logs]
    assert skipped(fresh_scale["logs"]) != skipped(reference["logs"])


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn_pair(spec, spec_path, extra_env=None):
    port = str(_free_port())
    procs = []
    for rank in (0, 1):
        env = {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            **(extra_env or {}),
        }
        jobs = [
            {**job, "trace": job["trace"] + f".rank{rank}"} if job.get("trace") else job
            for job in spec["jobs"]
        ]
        procs.append(worker.spawn({**spec, "jobs": jobs}, f"{spec_path}.rank{rank}", env))
    return procs


@pytest.mark.skipif(not torch.distributed.is_available(),
                    reason="torch.distributed is not built in")
def test_ddp_two_ranks_killed_then_resumed_is_bitwise_equal(tmp_path):
    # 20 rows / batch 2 = 10 global micro-batches, 5 per rank; GA 2 -> 3 steps per epoch, 6 in all.
    # Both ranks die in step 2 (a whole job killed, e.g. preempted); a new pair resumes from
    # checkpoint-1, in
    # which each rank has its own rng_state_<rank>.pth.
    base = {"kind": "full", "ga": 2, "rows": 20}
    kill = {
        **base,
        "name": "ddp",
        "output_dir": str(tmp_path / "ddp"),
        "trace": str(tmp_path / "ddp.trace"),
        "kill_at_step": 1,
        "kill_micro": 1,
    }
    procs = _spawn_pair({"jobs": [kill]}, str(tmp_path / "kill.json"))
    codes = [p.wait(timeout=WAIT_S) for p in procs]
    assert -signal.SIGKILL in codes, worker.log_tail(str(tmp_path / "kill.json.rank0"))
    assert sorted(os.listdir(tmp_path / "ddp" / "checkpoint-1")).count("rng_state_1.pth") == 1
    resume = {**base, "name": "resumed", "output_dir": str(tmp_path / "ddp"), "resume": True,
              "trace": str(tmp_path / "resumed.trace")}
    reference = {
        **base,
        "name": "reference",
        "output_dir": str(tmp_path / "ref"),
        "trace": str(tmp_path / "ref.trace"),
    }
    spec_path = str(tmp_path / "resume.json")
    procs = _spawn_pair(
        {"jobs": [resume, reference], "result": str(tmp_path / "results.pt")}, spec_path
    )
    codes = [p.wait(timeout=WAIT_S) for p in procs]
    assert codes == [0, 0], worker.log_tail(spec_path + ".rank0") + worker.log_tail(
        spec_path + ".rank1"
    )
    results = torch.load(tmp_path / "results.pt", weights_only=False)
    assert results["resumed"]["resumed_from"] == "checkpoint-1"
    assert results["resumed"]["global_step"] == results["reference"]["global_step"] == 6
    _assert_same_state(results["resumed"]["state"], results["reference"]["state"])
    assert _exact(results["resumed"]["logs"]) == _exact(results["reference"]["logs"])
    for rank in (0, 1):  # each rank went on with its own share of the batches
        done = [t for t in _trace(tmp_path / f"ddp.trace.rank{rank}") if t["step"] < 1]
        assert done + _trace(tmp_path / f"resumed.trace.rank{rank}") == _trace(
            tmp_path / f"ref.trace.rank{rank}"
        )


# FSDP2 (fsdp="full_shard", gloo): 20 rows -> 5 micro-batches per rank, GA 2 -> windows [2, 2, 1],
# 6 steps; full dies after the sync micro-batch of step 2 (reduce-scattered, not yet stepped).
# QLoRA (dropout 0.1): 12 examples -> 3 per rank, windows [2, 1], 4 steps; dies in the short last
# window of epoch 0, so resuming from checkpoint-1 skips 2 micro-batches per rank mid-epoch.
FSDP_CASES = {"full": {"kind": "full", "ga": 2, "rows": 20, "kill_at_step": 1, "kill_micro": 1},
              "qlora": {"kind": "qlora", "ga": 2, "kill_at_step": 1, "kill_micro": 0}}


def _wait_pair(procs, spec_path, codes_ok):
    codes = [p.wait(timeout=WAIT_S) for p in procs]
    assert codes_ok(codes), f"exit codes {codes}\n" + "".join(
        worker.log_tail(f"{spec_path}.rank{rank}") for rank in (0, 1))


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    """Both kills at once (two pairs), then one pair resumes each and trains the references."""
    root = tmp_path_factory.mktemp("fsdp_resume")
    tokenizer_dir = str(root / "tokenizer")
    worker.make_tokenizer(tokenizer_dir)

    def job(name, case, **extra):
        return {"kind": case["kind"], "ga": case["ga"], "rows": case.get("rows", 14), "fsdp": True,
                "name": name, "tokenizer_dir": tokenizer_dir, "output_dir": str(root / name),
                "trace": str(root / f"{name}.trace"), **extra}

    kills = {mode: _spawn_pair({"jobs": [job(mode, case, kill_at_step=case["kill_at_step"],
                                              kill_micro=case["kill_micro"])]},
                               str(root / f"{mode}.kill.json"))
             for mode, case in FSDP_CASES.items()}
    for mode, procs in kills.items():  # each rank kills itself (a whole job preempted)
        _wait_pair(procs, str(root / f"{mode}.kill.json"), lambda c: -signal.SIGKILL in c)
    # negative control: a copy of the killed QLoRA run resumed without its RNG state
    shutil.copytree(root / "qlora", root / "qlora-no-rng")
    jobs = []
    for mode, case in FSDP_CASES.items():
        jobs += [job(mode, case, resume=True, trace=str(root / f"{mode}.resumed.trace")),
                 job(f"{mode}-reference", case)]
    jobs.append(job("qlora-no-rng", FSDP_CASES["qlora"], resume=True, no_rng=True))
    spec_path = str(root / "resume.json")
    procs = _spawn_pair({"jobs": jobs, "result": str(root / "results.pt")}, spec_path)
    _wait_pair(procs, spec_path, lambda c: c == [0, 0])
    return root, torch.load(root / "results.pt", weights_only=False)


@pytest.mark.skipif(not torch.distributed.is_available(),
                    reason="torch.distributed is not built in")
@pytest.mark.parametrize("mode", list(FSDP_CASES))
def test_fsdp_two_ranks_killed_then_resumed_is_bitwise_equal(fsdp_runs, mode):
    root, results = fsdp_runs
    resumed, reference, k = results[mode], results[f"{mode}-reference"], 1
    assert resumed["resumed_from"] == f"checkpoint-{k}"
    assert resumed["global_step"] == reference["global_step"] == {"full": 6, "qlora": 4}[mode]
    # the gathered (whole) parameters, 4-bit bytes and absmax included, and every logged number
    _assert_same_state(resumed["state"], reference["state"])
    assert _exact(resumed["logs"]) == _exact(reference["logs"])
    for rank in (0, 1):  # each rank went on with its own share of the batches
        done = [t for t in _trace(root / f"{mode}.trace.rank{rank}") if t["step"] < k]
        assert done + _trace(root / f"{mode}.resumed.trace.rank{rank}") == _trace(
            root / f"{mode}-reference.trace.rank{rank}")
    # the last checkpoints: whole Adam moments and step counts, scheduler, each rank's generators
    last = f"checkpoint-{reference['global_step']}"
    for file_name in ("optimizer.pt", "scheduler.pt", "rng_state_0.pth", "rng_state_1.pth"):
        _same_tree(torch.load(root / mode / last / file_name, weights_only=False),
                   torch.load(root / f"{mode}-reference" / last / file_name, weights_only=False),
                   file_name)


@pytest.mark.skipif(not torch.distributed.is_available(),
                    reason="torch.distributed is not built in")
def test_fsdp_negative_control_resume_without_rng_state_differs(fsdp_runs):
    root, results = fsdp_runs
    reference, no_rng = results["qlora-reference"], results["qlora-no-rng"]
    for rank in (0, 1):  # the same batches after resuming ...
        assert _trace(root / f"qlora-no-rng.trace.rank{rank}") == _trace(
            root / f"qlora.resumed.trace.rank{rank}")
    # ... yet other LoRA weights: the dropout masks came from another RNG state
    changed = _differs(no_rng["state"], reference["state"])
    assert changed and all("lora_" in k for k in changed)

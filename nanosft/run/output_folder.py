"""What a run's output_dir holds: checkpoint-N folders (sorted, the latest valid one, rotated),
the guard that keeps a fresh run out of a folder holding another run, and the lock that keeps two
runs started at once apart (with a probe that the folder can be written at all).

Used by Trainer.train (`resume_from_checkpoint`) and Trainer._save_checkpoint (rotation).
transformers 5.23 writes into any output_dir; a second run there would replace the first run's
adapter and mix its checkpoints with the first run's, so that `resume_from_checkpoint=True` picks
the wrong one. nanosft refuses, as transformers 4's example scripts did (`overwrite_output_dir`).
"""

import contextlib
import datetime
import errno
import os
import re
import shutil
import socket
import stat
import sys
import time
import warnings

import torch

from nanosft import distributed
from nanosft.io.hub import FINAL_SAVE_MARKER
from nanosft.trainer_utils import PREFIX_CHECKPOINT_DIR

TEMP_PREFIX = ".tmp-"  # ".tmp-checkpoint-20" while checkpoint-20 is being written
TRAINER_STATE_NAME = "trainer_state.json"
WEIGHTS_NAME = "model.safetensors"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
ADAPTER_CONFIG_NAME = "adapter_config.json"
METRICS_NAME = "metrics.jsonl"
# in output_dir while the final save moves its files in; left there only by a kill in between
SAVED_WEIGHTS = (WEIGHTS_NAME, ADAPTER_WEIGHTS_NAME, ADAPTER_CONFIG_NAME)
SAVED_SUBFOLDERS = ("adapter", "model")  # where `nanosft demo` saves its adapter or model
_CHECKPOINT_RE = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
_PARTIAL_PREFIX = TEMP_PREFIX + PREFIX_CHECKPOINT_DIR


# ----------------------------------------------------------------------------- checkpoint folders
def sorted_checkpoints(output_dir) -> list[str]:
    """checkpoint-N folders of `output_dir`, oldest (smallest N) first.
    Mirrors: transformers trainer_utils.sort_checkpoints | Differs: by step number, never mtime."""
    if not os.path.isdir(output_dir):
        return []
    found = [(int(m.group(1)), d) for d in os.listdir(output_dir)
             if (m := _CHECKPOINT_RE.match(d)) and os.path.isdir(os.path.join(output_dir, d))]
    return [os.path.join(output_dir, d) for _, d in sorted(found)]


def partial_checkpoints(output_dir) -> list[str]:
    """Names of .tmp-checkpoint-* folders: saves that a crash interrupted (never resumable)."""
    if not os.path.isdir(output_dir):
        return []
    return sorted(d for d in os.listdir(output_dir) if d.startswith(_PARTIAL_PREFIX))


def get_last_checkpoint(output_dir):
    """The valid checkpoint-N folder (it has trainer_state.json) with the largest N, or None.
    Mirrors: transformers trainer_utils.get_last_checkpoint
    Differs: a missing output_dir gives None; partial .tmp- folders are skipped with a warning."""
    partial = partial_checkpoints(output_dir)
    if partial:
        warnings.warn(f"{output_dir} holds {', '.join(partial)}: left by a save that was "
                      "interrupted; ignored (safe to delete)", stacklevel=2)
    for folder in reversed(sorted_checkpoints(output_dir)):
        if os.path.isfile(os.path.join(folder, TRAINER_STATE_NAME)):
            return folder
    return None


def _no_checkpoint_message(output_dir, flag) -> str:
    """Why resuming the latest checkpoint of `output_dir` is impossible: what the folder holds."""
    if not os.path.isdir(output_dir):
        return f"{flag}: output_dir {output_dir} does not exist, so it holds no checkpoint"
    found = [os.path.basename(c) + f" (no {TRAINER_STATE_NAME})"
             for c in sorted_checkpoints(output_dir)]
    found += [f"{name} (a save interrupted by a crash)" for name in partial_checkpoints(output_dir)]
    held = f"it holds only {', '.join(found)}" if found else "it holds no checkpoint-<step> folder"
    return f"{flag}: no valid checkpoint to resume in {output_dir}; {held}"


def resolve_resume_checkpoint(resume_from_checkpoint, output_dir, command_line=False):
    """The folder to resume from: None (fresh run), the latest valid checkpoint-N for True, else the
    given folder. `command_line` words the errors as flags.
    Mirrors: transformers Trainer.train (resume_from_checkpoint handling)"""
    if command_line:
        flag, latest = "--resume_from_checkpoint", "--resume_from_checkpoint with no value"
        fresh = "drop --resume_from_checkpoint to start a fresh run"
    else:
        flag, latest = "resume_from_checkpoint=True", "resume_from_checkpoint=True"
        fresh = "pass resume_from_checkpoint=None to start a fresh run"
    if resume_from_checkpoint is True:
        found = get_last_checkpoint(output_dir)
        if found is None:
            raise ValueError(f"No valid checkpoint found in output directory ({output_dir}): "
                             f"{_no_checkpoint_message(output_dir, flag)}. {fresh}, or pass a "
                             "checkpoint-<step> folder.")
        return found
    if resume_from_checkpoint and not os.path.isdir(resume_from_checkpoint):
        name = flag if command_line else "resume_from_checkpoint"
        raise ValueError(f"Can't find a valid checkpoint at {resume_from_checkpoint}: {name}: "
                         f"{resume_from_checkpoint!r} is not a folder; pass a "
                         f"checkpoint-<step> folder written by this trainer, or {latest} for the "
                         "latest one.")
    return resume_from_checkpoint or None


def rotate_checkpoints(output_dir, save_total_limit, best_model_checkpoint=None) -> list[str]:
    """Delete the oldest checkpoints beyond save_total_limit, never the newest nor the best one.
    Mirrors: transformers trainer_utils.rotate_checkpoints"""
    if save_total_limit is None or save_total_limit <= 0:
        return []
    checkpoints = sorted_checkpoints(output_dir)
    if len(checkpoints) <= save_total_limit:
        return []
    protected = {os.path.abspath(checkpoints[-1])}  # the newest: what a resume needs
    if best_model_checkpoint is not None:
        protected.add(os.path.abspath(best_model_checkpoint))
    keep = max(save_total_limit, len(protected))
    deleted = []
    for path in checkpoints:
        if len(checkpoints) - len(deleted) <= keep:
            break
        if os.path.abspath(path) not in protected:
            shutil.rmtree(path, ignore_errors=True)
            deleted.append(path)
    return deleted


# ----------------------------------------------------------------------------- another run's folder
def find_previous_run(output_dir) -> list[str]:
    """Entries of `output_dir` that show another run: checkpoint folders (complete or partial)
    and a saved model or adapter (at the top, or in the demo's adapter/ or model/ subfolder)."""
    if not os.path.isdir(output_dir):
        return []
    found = [os.path.basename(c) for c in sorted_checkpoints(output_dir)]
    found += partial_checkpoints(output_dir)
    found += [name for name in (*SAVED_WEIGHTS, FINAL_SAVE_MARKER)
              if os.path.isfile(os.path.join(output_dir, name))]
    for sub in SAVED_SUBFOLDERS:
        inside = [n for n in SAVED_WEIGHTS if os.path.isfile(os.path.join(output_dir, sub, n))]
        found += [f"{sub}/{n}" for n in inside]
    return found


OVERWRITE_ENV = "NANOSFT_OVERWRITE_OUTPUT_DIR"  # =1: overwrite_output_dir, set outside a script


def overwrite_requested(args) -> bool:
    """overwrite_output_dir=True, or NANOSFT_OVERWRITE_OUTPUT_DIR=1 in the environment: the way a
    script that also runs under transformers 5 (which has no overwrite_output_dir) asks for it."""
    env = os.environ.get(OVERWRITE_ENV, "").strip().lower()
    return bool(getattr(args, "overwrite_output_dir", False)) or env in ("1", "true", "yes")


def output_dir_refusal(output_dir, command_line=False, can_resume=True):
    """The error when `output_dir` holds another run, else None: names the folder, what it holds
    and the choices the caller can pass. Mirrors: transformers 4 examples' overwrite_output_dir"""
    found = find_previous_run(output_dir)
    if not found:
        return None
    shown = ", ".join(found[:6]) + (f" and {len(found) - 6} more" if len(found) > 6 else "")
    if command_line:
        resume, new = "--resume_from_checkpoint", "--output_dir"
        overwrite = f"pass --overwrite_output_dir (or set {OVERWRITE_ENV}=1)"
    else:
        resume, new = "resume_from_checkpoint=True", "output_dir"
        overwrite = (f"set {OVERWRITE_ENV}=1 in the environment (the script stays as it is, and "
                     "runs under transformers too) or pass overwrite_output_dir=True (nanosft "
                     "only: transformers 5 has no such argument)")
    choices = [f"resume it ({resume})"] if can_resume else []
    choices += [f"pick a new {new}", f"or {overwrite} to remove its checkpoints and replace it"]
    return (f"output_dir {output_dir} holds another run ({shown}); a fresh run there would replace "
            f"its results, so nothing was written. Choose: {'; '.join(choices)}.")


def clear_previous_run(output_dir) -> list[str]:
    """overwrite_output_dir: remove the old run's checkpoints (complete and partial) and its
    metrics.jsonl, so rotation and resume see only the new run; other files stay. Returns them."""
    removed = sorted_checkpoints(output_dir)
    removed += [os.path.join(output_dir, name) for name in partial_checkpoints(output_dir)]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    metrics = os.path.join(output_dir, METRICS_NAME)
    if os.path.isfile(metrics):
        os.remove(metrics)
        removed.append(metrics)
    return removed


def set_aside_old_metrics(output_dir):
    """A fresh run's log starts empty: a metrics.jsonl left by a run that saved nothing (killed
    before its first checkpoint) is renamed metrics.<n>.jsonl (the first free n), never appended
    to. Returns the new name, or None when there was none."""
    path = os.path.join(output_dir, METRICS_NAME)
    if not os.path.isfile(path):
        return None
    stem, ext = os.path.splitext(METRICS_NAME)
    n = 1
    while os.path.exists(os.path.join(output_dir, f"{stem}.{n}{ext}")):
        n += 1
    kept = os.path.join(output_dir, f"{stem}.{n}{ext}")
    os.replace(path, kept)
    warnings.warn(f"{path} was left by an earlier run that saved no checkpoint; it was moved to "
                  f"{kept} so this run's log holds this run's steps only", stacklevel=3)
    return kept


def check_output_dir(args, resuming: bool) -> None:
    """Before a run writes anything: a fresh run refuses an output_dir holding another run, unless
    overwrite_output_dir, which first removes that run's checkpoints; a log left by a run that saved
    nothing is set aside. Rank 0 decides; every rank
    gets its answer. Mirrors: transformers 4 overwrite_output_dir
    Differs: transformers 5.23 removed overwrite_output_dir and writes into any folder."""
    if resuming:
        if args.overwrite_output_dir:  # the argument only: the variable may be set for all runs
            raise ValueError("overwrite_output_dir=True would remove the checkpoints that "
                             "resume_from_checkpoint resumes from; drop one of the two.")
        return
    refusal = None
    if distributed.is_main_process():
        if overwrite_requested(args):
            clear_previous_run(args.output_dir)
        else:
            refusal = output_dir_refusal(args.output_dir)
            if refusal is None:
                set_aside_old_metrics(args.output_dir)
    refused = torch.tensor(float(refusal is not None), device=args.device)
    if distributed.all_reduce_sum(refused).item() > 0:
        raise ValueError(refusal or f"output_dir {args.output_dir} holds another run (rank 0 "
                         "names it); nothing was written.")


# ----------------------------------------------------------------------------- one run at a time
LOCK_NAME = ".nanosft.lock"  # in output_dir while a run uses it: who holds it, as text
# this process's locks, {realpath of output_dir: [fd, depth]}: flock belongs to an open file, so a
# nested take (the CLI's, then Trainer.train's) must reuse the first one, not open a second
_held = {}


def _is_rank_zero() -> bool:
    # before the process group exists (the CLI, before the model loads) torchrun's RANK says it
    if distributed.is_initialized():
        return distributed.get_rank() == 0
    return int(os.environ.get("RANK", "0")) == 0


def _nearest_existing(path) -> str:
    """`path` if it exists, else its nearest existing ancestor (absolute)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def _missing_folders(path) -> list[str]:
    """The folders os.makedirs(path) would create, deepest first."""
    missing = []
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        missing.append(path)
        path = os.path.dirname(path)
    return missing


def check_writable(output_dir, command_line=False) -> None:
    """Create output_dir and write, then remove, a probe file, so a folder the final save could not
    write is found before training, not after it. The error names the folder, the reason and the
    fix. Differs: transformers finds out at the first save."""
    flag = "--output_dir" if command_line else "output_dir"
    probe = os.path.join(output_dir, f".nanosft-probe-{os.getpid()}")
    try:
        os.makedirs(output_dir, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"can this run write here?\n")
    except OSError as e:
        where = _nearest_existing(output_dir)  # where the write failed
        if os.path.isfile(where):
            is_it = "it is" if where == os.path.abspath(output_dir) else f"{where} is"
            reason = f"{is_it} a file, not a folder"
            fix = f"Pick another {flag}, or move that file away"
        else:
            reason = f"{(e.strerror or str(e)).lower()} in {where}"
            fix = f"Pick an {flag} you can write to"
            if isinstance(e, PermissionError):
                fix += ", or make that folder writable for this user"
        raise ValueError(f"{flag} {output_dir} cannot be written ({reason}), so this run could "
                         f"not save its checkpoints or its result; nothing was trained. {fix}.") \
            from e
    finally:
        with contextlib.suppress(OSError):
            os.remove(probe)


def _holder_text() -> str:
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    program = os.path.basename(sys.argv[0] or "python")
    if program == "__main__.py":  # python -m nanosft
        program = "python -m " + os.path.basename(os.path.dirname(sys.argv[0]))
    command = " ".join([program, *sys.argv[1:]])[:300]
    return (f"pid: {os.getpid()}\nhost: {socket.gethostname()}\nstarted: {started}\n"
            f"command: {command}\n")


def _describe_holder(fd) -> str:
    """'pid 12, host h, started T, command C' from the lock file another run holds."""
    fields = {}
    for _ in range(50):  # the holder writes its pid just after taking the lock: wait up to 0.5 s
        try:
            text = os.pread(fd, 4096, 0).decode("utf-8", "replace")
        except OSError:
            text = ""
        fields = dict(line.split(": ", 1) for line in text.splitlines() if ": " in line)
        if "command" in fields:  # the last line written
            break
        time.sleep(0.01)
    if "pid" not in fields:
        return "a run that is still starting (it has not written its pid yet)"
    shown = [f"pid {fields['pid']}"]
    shown += [f"{key} {fields[key]}" for key in ("host", "started") if key in fields]
    shown += [f"command `{fields['command']}`"] if "command" in fields else []
    return ", ".join(shown)


def _open_lock_file(path, output_dir, command_line):
    """Open (or create) the lock file itself, never what a symlink of that name points to: a
    copied or shared folder may hold a link to a file this run must not truncate. Anything but a
    plain file there is refused with what it is and the fix."""
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags, 0o666)  # mode: what the umask gives, as open()
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return fd
        os.close(fd)
        raise IsADirectoryError(errno.EISDIR, "not a plain file")
    except OSError as e:
        flag = "--output_dir" if command_line else "output_dir"
        if os.path.islink(path):
            what = f"a symlink (to {os.readlink(path)}), which this run will not write through"
        elif os.path.isdir(path):
            what = "a folder, not a plain file"
        elif os.path.exists(path) and not stat.S_ISREG(os.lstat(path).st_mode):
            what = "not a plain file"
        else:
            what = f"a file that cannot be opened for writing ({(e.strerror or str(e)).lower()})"
        raise ValueError(f"{flag} {output_dir}: the run lock {path} is {what}, so this run stopped "
                         f"before writing anything. Remove {path} (no run is using it unless one "
                         f"is running now), or pick another {flag}.") from None


def lock_output_dir(output_dir, command_line=False):
    """Take output_dir's run lock (an OS advisory lock, flock, on output_dir/.nanosft.lock holding
    this run's pid, host and start time); nested takes in one process share it. The OS drops it
    when the process dies, so a killed run never blocks the next. Returns the key for
    unlock_output_dir. Differs: transformers takes no lock."""
    key = os.path.realpath(output_dir)
    if key in _held:
        _held[key][1] += 1
        return key
    try:
        import fcntl
    except ImportError:  # Windows: no flock; runs are not kept apart there
        return None
    path = os.path.join(key, LOCK_NAME)
    while True:
        fd = _open_lock_file(path, output_dir, command_line)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe_holder(fd)
            os.close(fd)
            flag = "--output_dir" if command_line else "output_dir"
            raise ValueError(f"{flag} {output_dir} is in use by another run ({holder}); two runs "
                             "in one folder would overwrite each other's checkpoints and results, "
                             f"so this one stopped before writing anything. Wait until that run "
                             f"ends, or pick another {flag}.") from None
        # the holder we waited on may have removed the file as it released it: lock the new one
        try:
            if os.path.samestat(os.fstat(fd), os.lstat(path)):
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, _holder_text().encode("utf-8"), 0)
    _held[key] = [fd, 1]
    return key


def unlock_output_dir(key) -> None:
    """Release a lock_output_dir take; the last one removes the lock file, then lets the lock go."""
    if key is None or key not in _held:
        return
    _held[key][1] -= 1
    if _held[key][1] > 0:
        return
    fd = _held.pop(key)[0]
    with contextlib.suppress(OSError):  # removed while still held, so no run can take a stale one
        os.remove(os.path.join(key, LOCK_NAME))
    os.close(fd)


@contextlib.contextmanager
def holding_output_dir(output_dir, command_line=False):
    """`with` block form of lock_output_dir / unlock_output_dir (this process only)."""
    key = lock_output_dir(output_dir, command_line)
    try:
        yield
    finally:
        unlock_output_dir(key)


@contextlib.contextmanager
def hold_output_dir(args, command_line=False):
    """For the `with` block (a whole run): output_dir exists and can be written, and this run alone
    uses it. Only rank 0 probes and locks it: rank 0 writes everything in output_dir (a per-node
    lock on a shared disk would have the nodes stop each other); every rank gets its answer."""
    problem, key = None, None
    created = _missing_folders(args.output_dir)  # removed again if the run fails at its start
    if _is_rank_zero():
        try:
            check_writable(args.output_dir, command_line)
            key = lock_output_dir(args.output_dir, command_line)
        except ValueError as e:
            problem = e
    refused = torch.tensor(float(problem is not None), device=args.device)
    try:
        if distributed.all_reduce_sum(refused).item() > 0:
            raise problem or ValueError(f"output_dir {args.output_dir} could not be used (rank 0 "
                                        "says why); nothing was written.")
        yield
    finally:
        unlock_output_dir(key)
        if _is_rank_zero() and key not in _held:  # a run that failed at its start leaves no
            for folder in created:  # empty folders behind (deepest first; rmdir: only if empty)
                try:
                    os.rmdir(folder)
                except OSError:
                    break

"""Checkpoints: atomic save and exact resume of the whole training state, in transformers' layout.

A checkpoint-N folder holds the weights (model.safetensors, or adapter_model.safetensors +
adapter_config.json for a LoRA model), optimizer.pt, scheduler.pt, scaler.pt,
rng_state[_{rank}].pth, trainer_state.json and training_args.json (JSON instead of transformers'
pickled training_args.bin). Written by Trainer._save_checkpoint (from `_maybe_log_save_evaluate`);
a resumed run must equal an uninterrupted one. A checkpoint is written in a hidden
temp folder beside it, fsynced, then renamed into place, so a crash or a full disk never leaves half
of one. Finding the latest checkpoint and rotating old ones live in output_folder.py.
"""

import contextlib
import errno
import json
import os
import pickle
import random
import shutil
import signal
import threading
import warnings

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, safe_open, save_file

from nanosft import distributed
from nanosft.io.hub import FINAL_SAVE_MARKER
from nanosft.parallel import fsdp
from nanosft.run.output_folder import (  # noqa: F401 (finding and rotating checkpoints, re-exported)
    _CHECKPOINT_RE,
    ADAPTER_CONFIG_NAME,
    check_output_dir,
    ADAPTER_WEIGHTS_NAME,
    PREFIX_CHECKPOINT_DIR,
    TEMP_PREFIX,
    TRAINER_STATE_NAME,
    WEIGHTS_NAME,
    get_last_checkpoint,
    holding_output_dir,
    resolve_resume_checkpoint,
    rotate_checkpoints,
    sorted_checkpoints,
)
from nanosft.trainer_callback import TrainerState

TRAINING_ARGS_NAME = "training_args.json"
TRAINING_ARGS_BIN_NAME = "training_args.bin"  # written for transformers' tools; nanosft reads JSON
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"  # a sharded model.safetensors
OPTIMIZER_NAME = "optimizer.pt"
SCHEDULER_NAME = "scheduler.pt"
SCALER_NAME = "scaler.pt"
# a prompt-learning encoder's own weights: the adapter file holds only its output (peft's format),
# which cannot restore P-tuning's MLP / LSTM or a projected prefix when a run resumes
PROMPT_ENCODER_NAME = "prompt_encoder.safetensors"


# ----------------------------------------------------------------------------- small file helpers
def _fsync_tree(folder):
    # Data first, then the directory entries, so the rename below publishes complete files.
    for root, _, files in os.walk(folder):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(root)


def _fsync_dir(folder):
    if hasattr(os, "O_DIRECTORY"):  # POSIX only; Windows cannot open a directory
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_json(obj, path):
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _torch_save_atomic(obj, path):
    tmp = path + ".tmp"
    try:
        torch.save(obj, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _numpy_safe_globals():
    # np.random.get_state() pickles an ndarray; weights_only=True loads it only with these allowed.
    core = np._core if hasattr(np, "_core") else np.core
    return torch.serialization.safe_globals(
        [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))])


def _load_or_explain(path, load):
    """Run `load(path)`; any failure becomes one error naming the file and what to do."""
    try:
        return load(path)
    except Exception as e:
        folder = os.path.dirname(path)
        first_line = (str(e).strip().splitlines() or [""])[0][:200]  # torch's text is a page long
        raise ValueError(f"{path} could not be read ({type(e).__name__}: {first_line}). The "
                         "checkpoint is damaged or was written by an incompatible version; delete "
                         f"{folder} and resume from an earlier checkpoint.") from e


def _barrier(world_size):
    if world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


# ----------------------------------------------------------------------------- RNG state
def rng_state_file(checkpoint_dir, rank=0, world_size=1):
    """Path of this process's RNG file: rng_state.pth alone, rng_state_{rank}.pth with several.
    Mirrors: transformers Trainer._save_rng_state (file naming)"""
    name = "rng_state.pth" if world_size <= 1 else f"rng_state_{rank}.pth"
    return os.path.join(checkpoint_dir, name)


def save_rng_state(checkpoint_dir, rank=0, world_size=1):
    """Write the python, numpy, torch CPU and (if present) CUDA generator states of this process.
    Mirrors: transformers Trainer._save_rng_state"""
    states = {"python": random.getstate(), "numpy": np.random.get_state(),
              "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        cuda = torch.cuda.random
        states["cuda"] = cuda.get_rng_state_all() if world_size > 1 else cuda.get_rng_state()
    _torch_save_atomic(states, rng_state_file(checkpoint_dir, rank, world_size))


def load_rng_state(checkpoint_dir, rank=0, world_size=1) -> bool:
    """Restore this process's generators from its RNG file; False (with a warning) if it is absent.
    Mirrors: transformers Trainer._load_rng_state"""
    path = rng_state_file(checkpoint_dir, rank, world_size)
    if not os.path.isfile(path):
        warnings.warn(f"{path} not found: the data order and dropout masks after resuming will "
                      "not repeat the original run (was it saved with another number of "
                      "processes?)", stacklevel=2)
        return False

    def read(p):
        with _numpy_safe_globals():
            return torch.load(p, weights_only=True)

    states = _load_or_explain(path, read)
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.random.set_rng_state(states["cpu"])
    if torch.cuda.is_available() and "cuda" in states:
        if world_size > 1:
            torch.cuda.random.set_rng_state_all(states["cuda"])
        else:
            torch.cuda.random.set_rng_state(states["cuda"])
    return True


# ----------------------------------------------------------------------------- model weights
def _unwrap(model):
    # DistributedDataParallel keeps the model in .module; files must not carry a "module." prefix.
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def _has_adapter(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "save_pretrained")


def is_sharded(model) -> bool:
    """True when `model`'s parameters are split over ranks: FSDP2, tensor parallel, or both under
    parallelism_config (DTensor parameters). Its checkpoint files still hold whole tensors."""
    model = _unwrap(model)
    return fsdp.is_fsdp(model) or any(distributed.is_dtensor(p) for p in model.parameters())


def _dedupe_shared(state_dict):
    """Drop exact aliases (tied weights: lm_head.weight == embed_tokens.weight), clone views.
    safetensors refuses tensors that share memory. Returns (tensors, {dropped: kept name})."""
    seen, tensors, tied = {}, {}, {}
    for name, t in state_dict.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
               tuple(t.stride()), t.dtype)
        storage = t.untyped_storage().data_ptr()
        if key in seen:
            tied[name] = seen[key]
            continue
        shares = any(k[0] == storage for k in seen) and t.numel() > 0
        seen[key] = name
        tensors[name] = t.detach().clone().contiguous() if shares else t.detach().contiguous()
    return tensors, tied


def _trainable_prompt_encoder(model):
    """The active prompt-learning encoder of a PEFT model while it trains, else None."""
    encoders = getattr(model, "prompt_encoder", None)
    if encoders is None:
        return None
    encoder = encoders[getattr(model, "active_adapter", "default")]
    return encoder if any(p.requires_grad for p in encoder.parameters()) else None


def save_model_weights(model, folder, state_dict=None):
    """Write the adapter (PEFT format) of a PEFT model, plus a trainable prompt encoder's weights,
    else model.safetensors of the state dict (`state_dict`: whole tensors gathered under FSDP).
    Mirrors: transformers Trainer.save_model | Differs: prompt_encoder.safetensors (resume)"""
    model = _unwrap(model)
    if _has_adapter(model):
        model.save_pretrained(folder, state_dict=state_dict)
        encoder = _trainable_prompt_encoder(model)
        if encoder is not None:
            tensors = {k: v.detach().contiguous() for k, v in encoder.state_dict().items()}
            save_file(tensors, os.path.join(folder, PROMPT_ENCODER_NAME), metadata={"format": "pt"})
        return
    tensors, tied = _dedupe_shared(model.state_dict() if state_dict is None else state_dict)
    metadata = {"format": "pt", "tied": json.dumps(tied)}
    save_file(tensors, os.path.join(folder, WEIGHTS_NAME), metadata=metadata)
    config = getattr(model, "config", None)
    if hasattr(config, "save_pretrained"):  # config.json, as save_pretrained writes beside it
        config.save_pretrained(folder)


def load_model_weights(model, folder):
    """Copy what save_model_weights wrote into the live `model` in place; mismatches are errors.
    A model split over ranks (FSDP, tensor parallel) keeps each rank's part of the whole tensors.
    Mirrors: transformers Trainer._load_from_checkpoint"""
    with fsdp.whole_tensors_into_shards() if is_sharded(model) else contextlib.nullcontext():
        _copy_weights(_unwrap(model), folder)


def _copy_weights(model, folder):
    encoder = _trainable_prompt_encoder(model) if _has_adapter(model) else None
    if encoder is not None:
        encoder_path = os.path.join(folder, PROMPT_ENCODER_NAME)
        if os.path.isfile(encoder_path):
            encoder.load_state_dict(_load_or_explain(encoder_path, load_file))
            return
        if set(encoder.state_dict()) != {"embedding.weight"}:  # prompt tuning: output == table
            raise ValueError(f"{folder} has no {PROMPT_ENCODER_NAME}: its adapter file holds only "
                             "the prompt encoder's output, which cannot restore the encoder's "
                             "MLP / LSTM / prefix projection; resume from a checkpoint written by "
                             "this version, or start the run again.")
    if _has_adapter(model):
        from nanosft.peft import set_peft_model_state_dict  # only PEFT models need it

        path = os.path.join(folder, ADAPTER_WEIGHTS_NAME)
        state = _load_or_explain(path, load_file)
        adapter_name = getattr(model, "active_adapter", "default")
        set_peft_model_state_dict(model, state, adapter_name=adapter_name, source=path)
        return
    path = os.path.join(folder, WEIGHTS_NAME)
    if not os.path.isfile(path) and os.path.isfile(os.path.join(folder, WEIGHTS_INDEX_NAME)):
        state, tied = _load_sharded(folder), {}
    else:
        state = _load_or_explain(path, load_file)
        with safe_open(path, framework="pt") as f:
            tied = json.loads((f.metadata() or {}).get("tied", "{}"))
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as e:  # a shape mismatch: torch names the tensor and both shapes
        raise ValueError(f"{path} does not fit this model: {e}") from e
    missing = [k for k in result.missing_keys if k not in tied]
    if missing or result.unexpected_keys:
        raise ValueError(f"{path} does not fit this model: missing {missing[:5]}, unexpected "
                         f"{result.unexpected_keys[:5]}; was it saved from another architecture or "
                         "config?")


def _load_sharded(folder):
    """The state dict of a sharded checkpoint: each shard the index's weight_map names.
    Mirrors: transformers load_sharded_checkpoint"""
    index = _load_or_explain(os.path.join(folder, WEIGHTS_INDEX_NAME), _read_json)
    state = {}
    for shard in sorted(set(index["weight_map"].values())):
        state.update(_load_or_explain(os.path.join(folder, shard), load_file))
    return state


# ----------------------------------------------------------------------------- save / load
def _move_into_place(tmp, final):
    # os.replace cannot replace a non-empty folder: park the old one, swap, then delete it.
    old = None
    if os.path.exists(final):
        old = os.path.join(os.path.dirname(final), TEMP_PREFIX + "old-" + os.path.basename(final))
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(os.path.dirname(final) or ".")
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _write_all(folder, model, optimizer, lr_scheduler, scaler, trainer_state, args, world_size,
               gathered=(None, None)):
    model_state, optimizer_state = gathered  # FSDP: whole tensors, so the files equal one process's
    save_model_weights(model, folder, model_state)
    if optimizer is not None:
        optimizer_state = optimizer.state_dict() if optimizer_state is None else optimizer_state
        torch.save(optimizer_state, os.path.join(folder, OPTIMIZER_NAME))
    if lr_scheduler is not None:
        torch.save(lr_scheduler.state_dict(), os.path.join(folder, SCHEDULER_NAME))
    if scaler is not None:
        torch.save(scaler.state_dict(), os.path.join(folder, SCALER_NAME))
    save_rng_state(folder, 0, world_size)
    _write_json(trainer_state, os.path.join(folder, TRAINER_STATE_NAME))
    if hasattr(args, "to_dict"):  # transformers' pickled training_args.bin, never read back
        try:
            torch.save(args, os.path.join(folder, TRAINING_ARGS_BIN_NAME))
        except (pickle.PicklingError, TypeError, AttributeError):  # a field that cannot pickle
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(folder, TRAINING_ARGS_BIN_NAME))
    args = args.to_dict() if hasattr(args, "to_dict") else args
    _write_json(args, os.path.join(folder, TRAINING_ARGS_NAME))


def save_checkpoint(checkpoint_dir, *, model, optimizer, lr_scheduler, scaler=None,
                    trainer_state: dict, args, rank=0, world_size=1):
    """Write a complete checkpoint folder atomically: files go to a temp folder renamed at the end.
    Mirrors: transformers Trainer._save_checkpoint
    Rank 0 writes everything; other ranks add their rng_state_{rank}.pth once the folder exists."""
    checkpoint_dir = os.path.normpath(checkpoint_dir)
    parent, name = os.path.split(checkpoint_dir)
    gathered = _gather_sharded(model, optimizer)  # every rank takes part; rank 0 writes
    if rank == 0:
        os.makedirs(parent or ".", exist_ok=True)
        tmp = os.path.join(parent, TEMP_PREFIX + name)
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            os.makedirs(tmp)
            _write_all(tmp, model, optimizer, lr_scheduler, scaler, trainer_state, args, world_size,
                       gathered)
            _fsync_tree(tmp)
            _move_into_place(tmp, checkpoint_dir)
        except (OSError, RuntimeError, SafetensorError) as e:  # torch.save / safetensors wrap I/O
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, OSError) and e.strerror:
                reason = e.strerror
            else:
                reason = str(e).strip().splitlines()[0][:200]
            raise OSError(getattr(e, "errno", None) or errno.EIO,
                          f"saving {checkpoint_dir} failed ({reason}); the partial folder was "
                          "removed and earlier checkpoints are untouched. Free disk space or lower "
                          "save_total_limit, then resume from the last checkpoint") from e
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    _barrier(world_size)
    if rank != 0:
        save_rng_state(checkpoint_dir, rank, world_size)
    _barrier(world_size)


def _gather_sharded(model, optimizer):
    # (whole model state, whole optimizer state) of an FSDP or tensor-parallel model (DTensor
    # parameters), else (None, None); an adapter checkpoint gathers the trainable tensors only,
    # not the frozen (maybe 4-bit) base
    model = _unwrap(model)
    if not is_sharded(model):
        return None, None
    only = None
    if _has_adapter(model):
        only = {n for n, p in model.named_parameters() if p.requires_grad}
    optimizer_state = None
    if optimizer is not None:
        optimizer_state = fsdp.full_optimizer_state_dict(optimizer)
    return fsdp.full_state_dict(model, only), optimizer_state


def _missing_files(checkpoint_dir, model, optimizer, lr_scheduler):
    weights = ADAPTER_WEIGHTS_NAME if _has_adapter(_unwrap(model)) else WEIGHTS_NAME
    if weights == WEIGHTS_NAME and os.path.isfile(os.path.join(checkpoint_dir, WEIGHTS_INDEX_NAME)):
        weights = WEIGHTS_INDEX_NAME  # sharded
    needed = [TRAINER_STATE_NAME, weights]
    needed += [OPTIMIZER_NAME] if optimizer is not None else []
    needed += [SCHEDULER_NAME] if lr_scheduler is not None else []
    return [n for n in needed if not os.path.isfile(os.path.join(checkpoint_dir, n))]


def check_is_checkpoint(checkpoint_dir, model=None, optimizer=None, lr_scheduler=None):
    """Raise FileNotFoundError naming what is missing when `checkpoint_dir` is not resumable.
    Mirrors: transformers Trainer._load_from_checkpoint (its file checks)"""
    if not os.path.isdir(checkpoint_dir):
        raise FileNotFoundError(f"resume_from_checkpoint={checkpoint_dir!r} is not a folder. Point "
                                "it at an output_dir/checkpoint-N folder, or pass True to take the "
                                "newest one.")
    missing = _missing_files(checkpoint_dir, model, optimizer, lr_scheduler)
    if missing:
        inside = sorted(d for d in os.listdir(checkpoint_dir) if _CHECKPOINT_RE.match(d))
        if inside:
            hint = f" It holds {', '.join(inside)}: did you mean " \
                   f"{os.path.join(checkpoint_dir, inside[-1])}?"
        else:
            hint = " A checkpoint folder is what save_checkpoint writes (output_dir/checkpoint-N)."
        raise FileNotFoundError(f"{checkpoint_dir} is not a checkpoint: missing "
                                f"{', '.join(missing)}.{hint}")


# adapter_config.json fields that make another set-up: other layers, shapes or forward
_SETUP_FIELDS = ("peft_type", "r", "lora_alpha", "target_modules", "use_dora", "use_rslora",
                 "modules_to_save", "num_virtual_tokens")


def check_same_setup(checkpoint_dir, model) -> None:
    """Refuse, naming what differs, a checkpoint of another set-up: a full fine-tune resumed as LoRA
    (or back), other LoRA target modules, rank, alpha, DoRA or prompt length.
    Mirrors: nothing (transformers finds out when loading, or not at all)"""
    model = _unwrap(model)
    adapter_file = os.path.join(checkpoint_dir, ADAPTER_CONFIG_NAME)
    has_full = os.path.isfile(os.path.join(checkpoint_dir, WEIGHTS_NAME))
    if _has_adapter(model) and not os.path.isfile(adapter_file) and has_full:
        raise ValueError(f"{checkpoint_dir} is a full fine-tuning checkpoint (model.safetensors), "
                         "but this run trains an adapter; resume it without peft_config (--full on "
                         "the command line), or start the adapter run in a new output_dir.")
    if not _has_adapter(model) and os.path.isfile(adapter_file):
        raise ValueError(f"{checkpoint_dir} holds an adapter ({ADAPTER_CONFIG_NAME}), but this "
                         "run fine-tunes every weight; resume it with the same peft_config, or "
                         "start the full fine-tune in a new output_dir.")
    if not _has_adapter(model) or not os.path.isfile(adapter_file):
        return
    saved = _load_or_explain(adapter_file, _read_json)
    config = model.peft_config[getattr(model, "active_adapter", "default")].to_dict()
    differs = [f"{k}: checkpoint {saved.get(k)!r}, this run {config.get(k)!r}"
               for k in _SETUP_FIELDS
               if _sortable(saved.get(k)) != _sortable(config.get(k))]
    if differs:
        raise ValueError(f"{checkpoint_dir} was trained with another adapter set-up ("
                         f"{'; '.join(differs)}); resume with the checkpoint's settings, or start "
                         "this set-up in a new output_dir.")


def _sortable(value):  # target_modules in any order
    return sorted(value) if isinstance(value, (list, tuple, set)) else value


def _read_json(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


# JSON types of the trainer_state.json fields the resumed loop computes with
_STATE_TYPES = {"epoch": (int, float), "global_step": (int,), "total_flos": (int, float),
                "num_input_tokens_seen": (int,),
                "logging_steps": (int,), "eval_steps": (int,), "save_steps": (int,),
                "log_history": (list,), "best_metric": (int, float, type(None)),
                "best_global_step": (int, type(None))}


def _read_trainer_state(path):
    state = _read_json(path)
    if not isinstance(state, dict):
        raise TypeError(f"expected a JSON object, got a {type(state).__name__}")
    for key, kinds in _STATE_TYPES.items():
        value = state.get(key)
        if key in state and (isinstance(value, bool) or not isinstance(value, kinds)):
            names = " or ".join(k.__name__ for k in kinds)
            raise TypeError(f"field {key!r} is {value!r}, not {names}")
    return state


def _check_same_optimizer(checkpoint_dir, path, state, optimizer) -> None:
    """Refuse optimizer.pt of another kind of optimizer (its param groups name other
    hyperparameters): torch would load it, and the first step would fail on a missing key
    ('momentum') or run on the wrong ones."""
    saved = [group for group in state.get("param_groups", ()) if isinstance(group, dict)]
    if not saved:
        return
    saved_keys = set(saved[0]) - {"params"}
    keys = set(optimizer.param_groups[0]) - {"params"}
    if not (saved_keys - keys and keys - saved_keys):  # one side's extra keys: a torch version
        return
    try:
        was = _read_json(os.path.join(checkpoint_dir, TRAINING_ARGS_NAME)).get("optim")
    except (OSError, ValueError, AttributeError):
        was = None
    said = f"optim={was!r}, " if was else ""
    raise ValueError(f"{path} was saved by another optimizer ({said}hyperparameters "
                     f"{sorted(saved_keys - keys)[:4]} that this run's {type(optimizer).__name__} "
                     "has not), so it cannot be resumed with it. Resume with the optimizer the "
                     f"checkpoint was trained with ({'--optim ' + was if was else '--optim'}, "
                     "optim= in Python), or start a fresh run.")


def load_checkpoint(checkpoint_dir, *, model, optimizer, lr_scheduler, scaler=None, rank=0,
                    world_size=1) -> dict:
    """Restore weights, optimizer, scheduler, scaler and this rank's RNG in place; return the state.
    Mirrors: transformers Trainer._load_from_checkpoint,
    _load_optimizer_and_scheduler, _load_rng_state. Every torch.load uses weights_only=True."""
    check_same_setup(checkpoint_dir, model)
    check_is_checkpoint(checkpoint_dir, model, optimizer, lr_scheduler)
    sharded = is_sharded(model)
    load_model_weights(model, checkpoint_dir)  # FSDP / TP: each rank keeps its part of the file

    def read_pt(path):
        return torch.load(path, map_location="cpu", weights_only=True)

    parts = ((optimizer, OPTIMIZER_NAME), (lr_scheduler, SCHEDULER_NAME), (scaler, SCALER_NAME))
    for obj, file_name in parts:
        path = os.path.join(checkpoint_dir, file_name)
        if obj is None or not os.path.isfile(path):
            continue
        state = _load_or_explain(path, read_pt)
        if obj is optimizer:
            _check_same_optimizer(checkpoint_dir, path, state, optimizer)
        if obj is optimizer and sharded:  # one-process layout -> this rank's shards
            state = fsdp.shard_optimizer_state_dict(state, optimizer)
        try:
            obj.load_state_dict(state)
        except (ValueError, KeyError, RuntimeError) as e:
            raise ValueError(f"{path} does not fit this {type(obj).__name__} ({e}); was it saved "
                             "with other trainable parameters or another optimizer?") from e
    load_rng_state(checkpoint_dir, rank, world_size)
    return _load_or_explain(os.path.join(checkpoint_dir, TRAINER_STATE_NAME), _read_trainer_state)


def init_training_state(args, model, optimizer, lr_scheduler, scaler, max_steps,
                        num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint):
    """(TrainerState, epochs_trained, steps_trained_in_current_epoch): a fresh state, or the
    checkpoint's with model, optimizer, scheduler, scaler and RNG restored in place.
    Mirrors: transformers Trainer._init_training_state
    Differs: RNG restored here, not after skipping batches (the data order uses no global RNG)."""
    state = TrainerState(max_steps=max_steps, num_train_epochs=num_train_epochs,
                         train_batch_size=args.train_batch_size)
    state.compute_steps(args, max_steps)
    if resume_from_checkpoint is None:
        return state, 0, 0
    saved = load_checkpoint(resume_from_checkpoint, model=model, optimizer=optimizer,
                            lr_scheduler=lr_scheduler, scaler=scaler, rank=distributed.get_rank(),
                            world_size=args.world_size)
    state = TrainerState.from_dict(saved)
    # this run's schedule length, as TrainerState.init_training_references sets it after loading
    state.max_steps = max_steps
    state.num_train_epochs = num_train_epochs
    epochs_trained = state.global_step // num_update_steps_per_epoch
    steps_trained_in_current_epoch = 0
    if not args.ignore_data_skip:  # micro-batches already consumed in the interrupted epoch
        steps_trained_in_current_epoch = (state.global_step % num_update_steps_per_epoch
                                          * args.gradient_accumulation_steps)
    return state, epochs_trained, steps_trained_in_current_epoch


@contextlib.contextmanager
def _signals_deferred(signums=(signal.SIGTERM, signal.SIGINT, signal.SIGHUP)):
    """Hold SIGTERM, Ctrl-C and SIGHUP until the block ends, then deliver the first one that came
    (its own handler, or the default: the process ends). Main thread only: elsewhere a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    previous = {s: signal.signal(s, lambda signum, frame: caught.append(signum))
                for s in signums}
    try:
        yield
    finally:
        for s, handler in previous.items():  # None: a handler set outside Python
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        if caught:
            signal.raise_signal(caught[0])


def _move_final_files(tmp, output_dir):
    """Rename each file of `tmp` over its namesake in output_dir as one step: a signal waits until
    all are in, and a marker file, present only between the first rename and the last, lets the
    loaders refuse the mix a SIGKILL or power loss in between would leave."""
    marker = os.path.join(output_dir, FINAL_SAVE_MARKER)
    with _signals_deferred():
        with open(marker, "w", encoding="utf-8") as f:
            f.write("".join(f"{name}\n" for name in sorted(os.listdir(tmp))))
            os.fsync(f.fileno())
        _fsync_dir(output_dir)
        for name in sorted(os.listdir(tmp)):  # renames: they need no space
            os.replace(os.path.join(tmp, name), os.path.join(output_dir, name))
        _fsync_dir(output_dir)
        os.remove(marker)
        _fsync_dir(output_dir)


def save_model(model, processing_class, output_dir, checkpoints_dir=None) -> None:
    """The final model (a PEFT model: its adapter only) and the tokenizer in output_dir; every
    rank calls it (FSDP: the shards are gathered), rank 0 writes the one-process files: all of
    them into a hidden temp folder first, then moved in, so a failed save (a full disk) leaves
    none of them. Its error names the last checkpoint in `checkpoints_dir` to resume from.
    Mirrors: transformers Trainer.save_model | Differs: no training_args.bin; never half a save."""
    state_dict = _gather_sharded(model, None)[0]
    if distributed.get_rank() != 0:
        return
    os.makedirs(output_dir, exist_ok=True)
    with holding_output_dir(output_dir):  # no other run writes here meanwhile
        tmp = os.path.join(output_dir, TEMP_PREFIX + "save_model")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            if hasattr(_unwrap(model), "save_pretrained"):
                _unwrap(model).save_pretrained(tmp, state_dict=state_dict)
            else:  # "Trainer.model is not a PreTrainedModel, only saving its state dict"
                os.makedirs(tmp)
                save_model_weights(model, tmp, state_dict)
            if hasattr(processing_class, "save_pretrained"):
                processing_class.save_pretrained(tmp)
            _fsync_tree(tmp)
            _move_final_files(tmp, output_dir)
        except (OSError, RuntimeError, SafetensorError) as e:
            raise OSError(getattr(e, "errno", None) or errno.EIO,
                          _final_save_failed(output_dir, checkpoints_dir, e)) from e
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _final_save_failed(output_dir, checkpoints_dir, error) -> str:
    """The error of a failed final save: why, that nothing of it was left, where to resume."""
    reason = error.strerror if isinstance(error, OSError) and error.strerror else \
        (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
    last = get_last_checkpoint(checkpoints_dir) if checkpoints_dir else None
    if last is not None:
        then = (f"The last checkpoint, {last}, is complete and untouched: free disk space, then "
                "run the same training again resuming from it (resume_from_checkpoint=True; on "
                "the command line --resume_from_checkpoint) and it saves the final model.")
    else:
        then = ("No checkpoint was saved to resume from (save_strategy / save_steps); free disk "
                "space and run the training again.")
    return (f"saving the final model to {output_dir} failed ({reason}); nothing of it was left "
            f"there. {then}")


def _saved_world_size(checkpoint_dir) -> int:
    """The processes that wrote `checkpoint_dir`: one rng_state_{rank}.pth each, or one
    rng_state.pth."""
    names = os.listdir(checkpoint_dir)
    return sum(1 for n in names if n.startswith("rng_state_") and n.endswith(".pth")) or 1


def _layout(sizes, world_size) -> str:
    if sizes is None:
        return f"{world_size} data-parallel process{'es' if world_size > 1 else ''}"
    return "parallelism_config " + " x ".join(f"{k}={v}" for k, v in sorted(sizes.items()))


def check_resume_layout(checkpoint_dir, args) -> None:
    """A checkpoint saved under one mesh (parallelism_config, or N data-parallel processes) and
    resumed under another: its files hold whole tensors, so any mesh reloads the weights and the
    optimizer; but the data position (micro-batches already read) only means the same rows when
    each optimizer step still reads as many, so another global batch is refused, naming both
    layouts and the per-device batch that fits. Mirrors: nothing (transformers does not check)"""
    try:
        saved = _read_json(os.path.join(checkpoint_dir, TRAINING_ARGS_NAME))
    except (OSError, ValueError):
        return  # an older checkpoint: nothing to compare with
    config = getattr(args, "parallelism_config", None)
    sizes = None if config is None else config.to_dict()
    saved_sizes = saved.get("parallelism_config")
    if saved_sizes is None and sizes is None:
        return  # DDP / FSDP / one process: as transformers, the world size is the user's
    saved_world = _saved_world_size(checkpoint_dir)
    if saved_sizes == sizes:
        return
    saved_dp = (saved_sizes["dp_replicate_size"] * saved_sizes["dp_shard_size"]
                if saved_sizes else saved_world)
    dp = config.data_parallel_size if config is not None else args.world_size
    saved_batch = saved.get("per_device_train_batch_size", args.per_device_train_batch_size)
    saved_accumulation = saved.get("gradient_accumulation_steps", 1)
    saved_global = saved_batch * saved_accumulation * saved_dp
    current_global = args.per_device_train_batch_size * args.gradient_accumulation_steps * dp
    if saved_global != current_global:
        fits = saved_global / (args.gradient_accumulation_steps * dp)
        hint = (f"per_device_train_batch_size={int(fits)}" if fits == int(fits) else
                f"a layout with {saved_dp} data-parallel ranks")
        raise ValueError(
            f"{checkpoint_dir} was saved under {_layout(saved_sizes, saved_world)} with a global "
            f"batch of {saved_global} rows per optimizer step ({saved_batch} per device x "
            f"{saved_accumulation} accumulation x {saved_dp} data-parallel ranks), but this run "
            f"uses {_layout(sizes, args.world_size)} with {current_global} "
            f"({args.per_device_train_batch_size} x {args.gradient_accumulation_steps} x {dp}); "
            f"the saved data position would skip other rows. Resume with {hint}, or under the "
            "saved layout.")
    if distributed.get_rank() == 0:
        print(f"Resuming {checkpoint_dir}, saved under {_layout(saved_sizes, saved_world)}, under "
              f"{_layout(sizes, args.world_size)}: the whole tensors of its files are split over "
              "the new mesh; the same global batch keeps the data position.")


def resolve_and_check(args, model, resume_from_checkpoint):
    """Before training: the checkpoint to resume (None, the latest valid for True, or a folder);
    a fresh run refused in another run's output_dir; a checkpoint of another set-up, or of
    another global batch under another mesh, refused.
    Mirrors: transformers Trainer.train (resume handling)"""
    resume_from_checkpoint = resolve_resume_checkpoint(resume_from_checkpoint, args.output_dir)
    check_output_dir(args, resuming=resume_from_checkpoint is not None)
    if resume_from_checkpoint is not None:
        check_same_setup(resume_from_checkpoint, model)
        check_resume_layout(resume_from_checkpoint, args)
    return resume_from_checkpoint

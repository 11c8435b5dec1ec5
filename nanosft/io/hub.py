"""The files of a Hugging Face model folder: JSON configs, safetensors weights (single or sharded).

What `CausalLM.from_pretrained` / `save_pretrained` read and write: `model.safetensors`
(metadata {"format": "pt"}) or `model-0000k-of-0000n.safetensors` shards with
`model.safetensors.index.json`. Reads go tensor by tensor from the file headers' byte ranges;
every write goes to a temp file moved into place with os.replace; every read error names the file
and the fix.
"""

import ctypes
import ctypes.util
import dataclasses
import functools
import json
import os
import re
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

INDEX = "model.safetensors.index.json"
# in a folder while a final save moves its files in (removed last): a loader refuses such a folder
FINAL_SAVE_MARKER = ".nanosft-final-save"


def read_json(path):
    """Load a JSON file; a missing or malformed file raises an error naming it.
    Mirrors: transformers PreTrainedConfig._dict_from_json_file"""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: a model folder needs it "
                                "(save_pretrained writes it)")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON at line {e.lineno} column {e.colno}: "
                         f"{e.msg}") from e


@functools.cache
def _umask():
    # the process umask can only be read by setting it: set and restore once, at first use
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def default_mode(folder=False):
    """The permissions open() (0o666) or os.mkdir (0o777) would give under the current umask: what
    a file written by way of mkstemp / mkdtemp (0o600 / 0o700) is set to before it is moved into
    place, so another user or a serving account can read a saved model as with transformers."""
    return (0o777 if folder else 0o666) & ~_umask()


def atomic_write(path, write):
    """Call `write(tmp)` on a hidden temp file beside `path`, then os.replace it into place; on
    failure no file. Mirrors: transformers save_pretrained
    Differs: transformers writes in place; we never leave half a file."""
    folder, base = os.path.dirname(path) or ".", os.path.basename(path)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-" + base)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, default_mode())  # mkstemp makes 0600; open() would give 0666 & ~umask
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_json(obj, path, sort_keys=False):
    """Write JSON (indent 2) atomically.
    Mirrors: transformers PreTrainedConfig.to_json_file"""
    text = json.dumps(obj, indent=2, sort_keys=sort_keys)
    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def parse_size(size):
    """Bytes from an int or a string such as "5GB" (10**9) or "500MiB" (2**20 each).
    Mirrors: transformers utils.hub.convert_file_size_to_int"""
    units = {"GIB": 2**30, "MIB": 2**20, "KIB": 2**10,
             "GB": 10**9, "MB": 10**6, "KB": 10**3, "B": 1}
    m = re.fullmatch(r"(\d+)\s*([GMK]I?B|B)", str(size).strip().upper())
    if not isinstance(size, int) and not m:
        raise ValueError(f"max_shard_size={size!r} is not a size; pass bytes or a string such "
                         "as '5GB' or '500MiB'")
    return size if isinstance(size, int) else int(m.group(1)) * units[m.group(2)]


def check_state_dict(state_dict, expected, source):
    """Raise a ValueError listing missing / unexpected keys, or naming a tensor whose shape differs.
    Mirrors: transformers modeling_utils._find_missing_and_unexpected_keys,
    _find_mismatched_keys. Values need only a `.shape` (tensors, or TensorInfo from the headers)."""
    missing = sorted(expected.keys() - state_dict.keys())
    unexpected = sorted(state_dict.keys() - expected.keys())
    if missing or unexpected:
        raise ValueError(f"{source}: the weights do not match config.json: missing keys "
                         f"{missing[:8]}, unexpected keys {unexpected[:8]} ({len(missing)} and "
                         f"{len(unexpected)} in all); check model_type, num_hidden_layers, "
                         "attention_bias and tie_word_embeddings in config.json")
    for name, t in state_dict.items():
        dtype = getattr(t, "dtype", torch.float32)
        if expected[name].is_floating_point() and not dtype.is_floating_point:
            raise ValueError(f"{source}: tensor {name} is stored as {dtype} in "
                             f"{getattr(t, 'path', 'the checkpoint')}, but model weights are "
                             "floating point; re-save the model in float32, bfloat16 or float16")
        if t.shape != expected[name].shape:
            where = getattr(t, "path", "the checkpoint")
            raise ValueError(f"{source}: tensor {name} has shape {tuple(t.shape)} in {where} but "
                             f"{tuple(expected[name].shape)} from config.json; fix the sizes in "
                             "config.json")


SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                      "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
                      "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def torch_dtype(value, field="dtype"):
    """A torch.dtype from a dtype or its spelling ("bfloat16", "torch.float16"); others are named.
    Mirrors: transformers' getattr(torch, name) for config.json dtype strings"""
    if isinstance(value, torch.dtype):
        return value
    found = getattr(torch, str(value).removeprefix("torch."), None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"{field}={value!r} is not a torch dtype; spell it as torch names it: "
                         "'float32', 'bfloat16', 'float16' (or pass torch.bfloat16)")
    return found


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives in a safetensors file: its dtype, shape and byte range."""

    path: str
    dtype: torch.dtype
    shape: torch.Size
    begin: int  # absolute byte offsets in the file
    end: int


def _check_no_overlap(infos):
    # two tensors sharing bytes would load as aliases of one another (safetensors refuses too)
    spans = sorted((info.begin, info.end, name) for name, info in infos.items()
                   if info.end > info.begin)
    for (_, end, name), (begin, _, other) in zip(spans, spans[1:]):
        if begin < end:
            raise ValueError(f"tensors {name} and {other} overlap in the file (their data_offsets "
                             "share bytes)")


def _read_header(path):
    # 8 bytes little-endian header length, a JSON header {name: {dtype, shape, data_offsets}},
    # then the data; offsets count from the end of the header
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n > size - 8:
                raise ValueError(f"header length {n} exceeds the file size {size}")
            header = json.loads(f.read(n))
        infos = {}
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            dtype, shape = SAFETENSORS_DTYPES[meta["dtype"]], torch.Size(meta["shape"])
            begin, end = (8 + n + offset for offset in meta["data_offsets"])
            if end > size or end - begin != shape.numel() * dtype.itemsize:
                raise ValueError(f"tensor {name} runs past the end of the file (truncated?)")
            infos[name] = TensorInfo(path, dtype, shape, begin, end)
        _check_no_overlap(infos)
        return infos
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{path}: no such file; re-save or re-download the model") from e
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:  # foreign, cut short
        reason = str(e) if type(e) is ValueError else repr(e)
        raise ValueError(f"{path}: cannot read safetensors weights ({reason}); re-save or "
                         "re-download the model") from e


def safetensors_index(model_dir):
    """{name: TensorInfo} from the headers of model.safetensors or of every shard; no data read,
    so a missing shard or a wrong shape is found before any weight is loaded.
    Mirrors: transformers get_checkpoint_shard_files, safe_open(...).keys()"""
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.isfile(single):
        return _read_header(single)
    index_path = os.path.join(model_dir, INDEX)
    if not os.path.isfile(index_path):
        raise FileNotFoundError(f"no model.safetensors or {INDEX} in {model_dir}; nanosft reads "
                                "safetensors only (re-save a pytorch_model.bin with transformers' "
                                "save_pretrained)")
    weight_map = read_json(index_path)["weight_map"]
    infos = {}
    for shard in sorted(set(weight_map.values())):
        if not os.path.isfile(os.path.join(model_dir, shard)):
            raise FileNotFoundError(f"{os.path.join(model_dir, shard)}: shard named in {INDEX} is "
                                    "missing; re-download the model or re-save it")
        infos.update(_read_header(os.path.join(model_dir, shard)))
    lost = [k for k, shard in weight_map.items()
            if k not in infos or infos[k].path != os.path.join(model_dir, shard)]
    if lost:
        raise ValueError(f"{index_path}: {len(lost)} tensors are not in the shard it names, e.g. "
                         f"{lost[:4]}; re-save the model")
    return infos


@functools.cache
def _libc():
    path = ctypes.util.find_library("c")
    libc = ctypes.CDLL(path) if path else None
    return libc if hasattr(libc, "malloc_trim") else None  # glibc only


def release_freed_memory():
    """Hand whole free pages of the C heap back to the OS (glibc malloc_trim; no-op elsewhere).
    Freed temporaries (a float weight just quantized, bitsandbytes' scratch) sit in malloc's heap
    between tensors that are kept; without this, RSS stays above what the model holds."""
    if _libc() is not None:
        _libc().malloc_trim(0)


def count_nonfinite(tensor, chunk=1 << 20) -> int:
    """How many nan/inf values a floating tensor holds. Any nan/inf makes the sum nan/inf, so a
    finite sum (one fast pass, no scratch) means none; else count exactly, 1 MB at a time."""
    tensor = tensor.detach()
    if tensor.element_size() == 1:  # float8: no isfinite kernel
        tensor = tensor.float()
    if torch.isfinite(tensor.sum()):
        return 0
    counts = [part.numel() - torch.isfinite(part).sum() for part in tensor.reshape(-1).split(chunk)]
    return int(sum(counts))  # 0 when only the sum overflowed


def check_finite_tensor(tensor, name, path, file_dtype):
    """Refuse a checkpoint tensor holding nan/inf, naming the file, the tensor and the count."""
    bad = count_nonfinite(tensor)
    if not bad:
        return
    to = str(tensor.dtype).removeprefix("torch.")
    read = str(file_dtype).removeprefix("torch.")
    cast = "" if to == read else (f" once cast from the file's {read} to {to} (a value too large "
                                  f"for {to} becomes inf too: try float32 or bfloat16)")
    raise ValueError(f"{path}: tensor {name!r} holds {bad:,} nan/inf values of "
                     f"{tensor.numel():,}{cast}; the checkpoint is damaged (a broken download or "
                     "conversion, or a diverged run saved as a model): re-download or re-convert "
                     "it, or load another checkpoint")


def iter_tensors(index, dtype=None, device="cpu", keep_fp32=None):
    """(name, tensor) one at a time, each file read in byte order, cast to dtype/device as read;
    names the `keep_fp32` pattern finds are cast to float32 instead.
    Mirrors: transformers' per-tensor loading (safe_open(...).get_slice), its dtype_plan
    Differs: plain reads, not a memory map whose touched pages would all stay resident."""
    by_file = {}
    for name, info in index.items():
        by_file.setdefault(info.path, []).append((info.begin, name))
    for path, entries in by_file.items():
        with open(path, "rb") as f:
            for _, name in sorted(entries):
                info = index[name]
                tensor = torch.empty(info.shape, dtype=info.dtype)
                f.seek(info.begin)
                if f.readinto(tensor.view(-1).view(torch.uint8).numpy()) != info.end - info.begin:
                    raise ValueError(f"{path}: tensor {name} is cut short; re-download the model")
                if dtype is not None and tensor.is_floating_point():
                    kept = keep_fp32 is not None and keep_fp32.search(name)
                    # the file's copy is freed here, not later
                    tensor = tensor.to(device, torch.float32 if kept else dtype)
                tensor = tensor.to(device)
                if tensor.is_floating_point():  # one pass, on the device: a nan base never trains
                    check_finite_tensor(tensor, name, path, info.dtype)
                yield name, tensor
                del tensor  # the caller's next tensor must not overlap this one in memory
                release_freed_memory()


def load_state_dict_from_hf(model_dir):
    """Read model.safetensors, or every shard named in model.safetensors.index.json, into a dict.
    Mirrors: transformers modeling_utils.load_state_dict"""
    return dict(iter_tensors(safetensors_index(model_dir)))


def save_state_dict_to_hf(state_dict, model_dir, max_shard_size="5GB"):
    """Write model.safetensors, or shards + index past max_shard_size, each file atomically.
    Mirrors: transformers PreTrainedModel.save_pretrained,
    huggingface_hub split_torch_state_dict_into_shards"""
    os.makedirs(model_dir, exist_ok=True)
    limit, shards, used = parse_size(max_shard_size), [{}], 0
    # fill shards in key order; a tensor over the limit gets its own
    for name, t in state_dict.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and used + nbytes > limit:
            shards, used = shards + [{}], 0
        shards[-1][name], used = t.detach().contiguous().cpu(), used + nbytes
    n = len(shards)
    names = [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    names = ["model.safetensors"] if n == 1 else names
    for name, shard in zip(names, shards):
        write = lambda tmp, shard=shard: save_file(shard, tmp, metadata={"format": "pt"})
        atomic_write(os.path.join(model_dir, name), write)
    if n > 1:
        total = sum(t.numel() * t.element_size() for t in state_dict.values())
        weight_map = {k: name for name, shard in zip(names, shards) for k in shard}
        write_json({"metadata": {"total_size": total}, "weight_map": weight_map},
                   os.path.join(model_dir, INDEX))
        names.append(INDEX)
    pattern = r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?"
    for old in os.listdir(model_dir):  # an earlier save's other layout would shadow or mix with it
        if re.fullmatch(pattern, old) and old not in names:
            os.remove(os.path.join(model_dir, old))


# ----------------------------------------------------------------------- Hub ids from the cache

HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"]  # no .bin, .gguf
TRUE_VALUES = {"1", "ON", "YES", "TRUE"}  # huggingface_hub's ENV_VARS_TRUE_VALUES


def hub_cache_dir():
    """(cache folder, the variable that chose it) as huggingface_hub resolves it: HF_HUB_CACHE,
    else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub.
    Mirrors: huggingface_hub.constants.HF_HUB_CACHE | Differs: read at call time, not at import."""
    def expand(path):
        return os.path.expandvars(os.path.expanduser(path))

    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):  # the second is the legacy spelling
        if os.environ.get(var):
            return expand(os.environ[var]), var
    if os.environ.get("HF_HOME"):
        return os.path.join(expand(os.environ["HF_HOME"]), "hub"), "HF_HOME"
    if os.environ.get("XDG_CACHE_HOME"):
        xdg = expand(os.environ["XDG_CACHE_HOME"])
        return os.path.join(xdg, "huggingface", "hub"), "XDG_CACHE_HOME"
    return os.path.join(os.path.expanduser("~"), ".cache", "huggingface", "hub"), "the default"


def is_offline():
    """True when HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is 1/ON/YES/TRUE.
    Mirrors: huggingface_hub.constants.HF_HUB_OFFLINE"""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.upper() in TRUE_VALUES


def repo_cache_folder(repo_id, cache_dir=None):
    """`<cache>/models--org--name`, the folder huggingface_hub keeps one model repo in.
    Mirrors: huggingface_hub.file_download.repo_folder_name"""
    return os.path.join(cache_dir or hub_cache_dir()[0], "models--" + repo_id.replace("/", "--"))


def cached_snapshot(repo_id, revision=None, cache_dir=None):
    """The cached `snapshots/<sha>` of a model repo, or None. `refs/<revision>` holds the sha;
    a revision that is itself a cached sha is used directly; revision None means "main".
    Mirrors: huggingface_hub.try_to_load_from_cache | Differs: returns the folder, models only."""
    repo_folder = repo_cache_folder(repo_id, cache_dir)
    revision = revision or "main"
    ref = os.path.join(repo_folder, "refs", revision)
    if os.path.isfile(ref):
        with open(ref, encoding="utf-8") as f:
            revision = f.read().strip()
        if not re.fullmatch(r"[0-9a-f]{40}", revision):  # a ref holds a commit hash, nothing else
            raise ValueError(f"{ref} holds {revision[:60]!r}, not a commit hash (40 hex digits); "
                             "the cache is damaged: delete that file and download the model again")
    snapshots = os.path.join(repo_folder, "snapshots")
    snapshot = os.path.join(snapshots, revision)
    # a revision such as "../.." must not lead outside the repo's snapshots folder
    if os.path.dirname(os.path.realpath(snapshot)) != os.path.realpath(snapshots):
        raise ValueError(f"revision {revision!r} of {repo_id} points outside {snapshots}; give a "
                         "branch, tag or commit hash")
    return snapshot if os.path.isdir(snapshot) else None


def _cached_revisions(repo_folder):
    names = []
    for sub in ("refs", "snapshots"):
        folder = os.path.join(repo_folder, sub)
        names += sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    return names


def interrupted_final_save(folder, flag="--adapter"):
    """The error for a folder whose final save was killed while moving its files in (some new, some
    from the save before: a mix no loader should take), else None."""
    marker = os.path.join(folder, FINAL_SAVE_MARKER)
    if not os.path.exists(marker):
        return None
    return (f"{flag} {folder}: its final save was interrupted while moving its files in "
            f"({marker} is still there), so its weights, config and tokenizer files may come from "
            "two different saves and were not loaded. Run the same training again resuming from "
            "its last checkpoint (--resume_from_checkpoint) to write the final save whole, or "
            "load one of its checkpoint-<step> folders.")


def resolve_pretrained_path(name_or_path, revision=None, what="model"):
    """A local folder for a folder or Hub id: the folder, else the id's cached snapshot, else
    snapshot_download (huggingface_hub installed, HF_HUB_OFFLINE unset), else an error.
    Mirrors: transformers utils.hub.cached_files -> huggingface_hub snapshot_download
    Differs: downloads *.json, *.safetensors, *.jinja, *.txt and *.model only."""
    name = os.fspath(name_or_path)
    if os.path.isdir(name):
        problem = interrupted_final_save(name, what)  # a SIGKILL mid-save left two saves' files
        if problem:
            raise ValueError(problem)
        return name
    if not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", name) or ".." in name:
        raise FileNotFoundError(f"{what} {name}: no such folder, and not a Hub id (org/name); "
                                "give a local folder or a Hub id like HuggingFaceTB/SmolLM2-135M")
    cache_dir, chosen_by = hub_cache_dir()
    snapshot = cached_snapshot(name, revision, cache_dir)
    if snapshot is not None:
        return snapshot
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        snapshot_download = None
    if snapshot_download is not None and not is_offline():
        try:
            return snapshot_download(name, revision=revision, allow_patterns=HUB_ALLOW_PATTERNS)
        except Exception as error:  # noqa: BLE001 (no network, unknown repo, gated, ...)
            reason = " ".join(str(error).split())[:300]
            raise FileNotFoundError(
                f"{what} {name}: no such folder ({os.path.abspath(name)}), not in the Hugging Face "
                f"cache ({repo_cache_folder(name, cache_dir)}), and the download failed "
                f"({type(error).__name__}: {reason}); fix: check the path, or the Hub id and "
                "the network (HF_HUB_OFFLINE=1 skips the download)") from error
    repo_folder = repo_cache_folder(name, cache_dir)
    if os.path.isdir(repo_folder):  # cached, but not at this revision
        raise FileNotFoundError(
            f"{what} {name}: revision {revision or 'main'!r} is not cached at {repo_folder} "
            f"(cached refs, snapshots: {_cached_revisions(repo_folder)}); fix: pass one of those "
            "as revision=, or download that revision")
    offline = "HF_HUB_OFFLINE is set, so nothing is downloaded; unset it to download"
    why = (offline if snapshot_download
           else 'huggingface_hub is not installed; fix: pip install "nanosft[hub]" to download it')
    raise FileNotFoundError(
        f"{what} {name} was not found. Looked in {os.path.abspath(name)} (no such folder) and "
        f"{repo_folder} (the Hugging Face cache, chosen by {chosen_by}; no snapshot of revision "
        f"{revision or 'main'!r}). {why}; or give a local model folder")

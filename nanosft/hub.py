"""The files of a Hugging Face model folder: JSON configs and safetensors weights, single or sharded.

What `CausalLM.from_pretrained` / `save_pretrained` (walkthrough 2.1's model loading) read and write:
`model.safetensors` (metadata {"format": "pt"}) or `model-0000k-of-0000n.safetensors` shards with
`model.safetensors.index.json`. Every write goes to a temp file moved into place with os.replace, and
every read error names the file and the fix.
"""

import json
import os
import re
import tempfile
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

INDEX = "model.safetensors.index.json"


def read_json(path):
    """Load a JSON file; a missing or malformed file raises an error naming it.
    Walkthrough 2.1 | Mirrors: transformers PreTrainedConfig._dict_from_json_file"""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: a model folder needs it (save_pretrained writes it)")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from e


def atomic_write(path, write):
    """Call `write(tmp)` on a hidden temp file beside `path`, then os.replace it into place; on failure no file.
    Walkthrough 2.1 | Mirrors: transformers save_pretrained (which writes in place; we never leave half a file)"""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=".tmp-" + os.path.basename(path))
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_json(obj, path, sort_keys=False):
    """Write JSON (indent 2) atomically.
    Walkthrough 2.1 | Mirrors: transformers PreTrainedConfig.to_json_file"""
    text = json.dumps(obj, indent=2, sort_keys=sort_keys)
    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def parse_size(size):
    """Bytes from an int or a string such as "5GB" (10**9) or "500MiB" (2**20 each).
    Walkthrough 2.1 | Mirrors: transformers utils.hub.convert_file_size_to_int"""
    units = {"GIB": 2**30, "MIB": 2**20, "KIB": 2**10, "GB": 10**9, "MB": 10**6, "KB": 10**3, "B": 1}
    m = re.fullmatch(r"(\d+)\s*([GMK]I?B|B)", str(size).strip().upper())
    if not isinstance(size, int) and not m:
        raise ValueError(f"max_shard_size={size!r} is not a size; pass bytes or a string such as '5GB' or '500MiB'")
    return size if isinstance(size, int) else int(m.group(1)) * units[m.group(2)]


def check_state_dict(state_dict, expected, source):
    """Raise a ValueError listing missing / unexpected keys, or naming a tensor whose shape differs.
    Walkthrough 2.1 | Mirrors: transformers modeling_utils._find_missing_and_unexpected_keys, _find_mismatched_keys"""
    missing, unexpected = sorted(expected.keys() - state_dict.keys()), sorted(state_dict.keys() - expected.keys())
    if missing or unexpected:
        raise ValueError(f"{source}: the weights do not match config.json: missing keys {missing[:8]}, unexpected "
                         f"keys {unexpected[:8]} ({len(missing)} and {len(unexpected)} in all); check model_type, "
                         "num_hidden_layers, attention_bias and tie_word_embeddings in config.json")
    for name, t in state_dict.items():
        if t.shape != expected[name].shape:
            raise ValueError(f"{source}: tensor {name} has shape {tuple(t.shape)} in the checkpoint but "
                             f"{tuple(expected[name].shape)} from config.json; fix the sizes in config.json")


def _read_safetensors(path):
    try:
        return load_file(path)
    except (SafetensorError, OSError) as e:  # a missing shard, a truncated or foreign file
        error = FileNotFoundError if isinstance(e, FileNotFoundError) else ValueError
        raise error(f"{path}: cannot read safetensors weights ({e}); re-save or re-download the model") from e


def load_state_dict_from_hf(model_dir):
    """Read model.safetensors, or every shard named in model.safetensors.index.json, into one dict.
    Walkthrough 2.1 | Mirrors: transformers modeling_utils.load_state_dict, get_checkpoint_shard_files"""
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.isfile(single):
        return _read_safetensors(single)
    if not os.path.isfile(os.path.join(model_dir, INDEX)):
        raise FileNotFoundError(f"no model.safetensors or {INDEX} in {model_dir}; nanosft reads safetensors "
                                "only (re-save a pytorch_model.bin with transformers' save_pretrained)")
    shards = sorted(set(read_json(os.path.join(model_dir, INDEX))["weight_map"].values()))
    return {k: v for shard in shards for k, v in _read_safetensors(os.path.join(model_dir, shard)).items()}


def save_state_dict_to_hf(state_dict, model_dir, max_shard_size="5GB"):
    """Write model.safetensors, or shards + index past max_shard_size, each file atomically.
    Walkthrough 2.1 | Mirrors: transformers PreTrainedModel.save_pretrained, split_torch_state_dict_into_shards"""
    os.makedirs(model_dir, exist_ok=True)
    limit, shards, used = parse_size(max_shard_size), [{}], 0
    for name, t in state_dict.items():  # fill shards in key order; a tensor over the limit gets its own
        nbytes = t.numel() * t.element_size()
        if shards[-1] and used + nbytes > limit:
            shards, used = shards + [{}], 0
        shards[-1][name], used = t.detach().contiguous().cpu(), used + nbytes
    n = len(shards)
    names = ["model.safetensors"] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    for name, shard in zip(names, shards):
        write = lambda tmp, shard=shard: save_file(shard, tmp, metadata={"format": "pt"})
        atomic_write(os.path.join(model_dir, name), write)
    if n > 1:
        total = sum(t.numel() * t.element_size() for t in state_dict.values())
        weight_map = {k: name for name, shard in zip(names, shards) for k in shard}
        write_json({"metadata": {"total_size": total}, "weight_map": weight_map}, os.path.join(model_dir, INDEX))
        names.append(INDEX)
    for old in os.listdir(model_dir):  # an earlier save's other layout would shadow or mix with this one
        if re.fullmatch(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?", old) and old not in names:
            os.remove(os.path.join(model_dir, old))


# ----------------------------------------------------------------------------- Hub ids from the cache

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
    snapshot = os.path.join(repo_folder, "snapshots", revision)
    return snapshot if os.path.isdir(snapshot) else None


def _cached_revisions(repo_folder):
    names = []
    for sub in ("refs", "snapshots"):
        folder = os.path.join(repo_folder, sub)
        names += sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    return names


def resolve_pretrained_path(name_or_path, revision=None, what="model"):
    """A local folder for a folder or Hub id: the folder, else the id's cached snapshot, else
    snapshot_download (huggingface_hub installed, HF_HUB_OFFLINE unset), else an error.
    Mirrors: transformers utils.hub.cached_files -> huggingface_hub snapshot_download
    Differs: downloads *.json, *.safetensors, *.jinja, *.txt and *.model only."""
    name = os.fspath(name_or_path)
    if os.path.isdir(name):
        return name
    if not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", name) or ".." in name:
        raise FileNotFoundError(f"{what} {name!r}: no such folder, and not a Hub id (org/name); "
                                "give a model folder or a Hub id like HuggingFaceTB/SmolLM2-135M")
    cache_dir, chosen_by = hub_cache_dir()
    snapshot = cached_snapshot(name, revision, cache_dir)
    if snapshot is not None:
        return snapshot
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        snapshot_download = None
    if snapshot_download is not None and not is_offline():
        return snapshot_download(name, revision=revision, allow_patterns=HUB_ALLOW_PATTERNS)
    repo_folder = repo_cache_folder(name, cache_dir)
    if os.path.isdir(repo_folder):  # cached, but not at this revision
        raise FileNotFoundError(
            f"{what} {name!r}: revision {revision or 'main'!r} is not cached at {repo_folder} "
            f"(cached refs, snapshots: {_cached_revisions(repo_folder)}); fix: pass one of those "
            "as revision=, or download that revision")
    offline = "HF_HUB_OFFLINE is set, so nothing is downloaded; unset it to download"
    why = (offline if snapshot_download
           else 'huggingface_hub is not installed; fix: pip install "nanosft[hub]" to download it')
    raise FileNotFoundError(
        f"{what} {name!r} was not found. Looked in {os.path.abspath(name)} (no such folder) and "
        f"{repo_folder} (the Hugging Face cache, chosen by {chosen_by}; no snapshot of revision "
        f"{revision or 'main'!r}). {why}; or give a local model folder")

"""Hub ids resolve from the local Hugging Face cache exactly as huggingface_hub lays it out.

Compared: the cache folder nanosft picks for HF_HUB_CACHE / HF_HOME / XDG_CACHE_HOME / the default
against huggingface_hub.constants.HF_HUB_CACHE under the same environment (read in a subprocess,
since huggingface_hub reads it at import); the snapshot nanosft resolves for a revision (none,
a branch, a tag, a commit sha) against huggingface_hub.snapshot_download(local_files_only=True);
a model loaded by id against the same folder loaded by path (equal logits), and revision="v2"
against main (different weights: the negative control); AutoTokenizer, PeftModel and the CLI's
--model / --adapter by id. Errors: an unknown revision lists the cached ones; an id not cached
names both folders looked in and the fix, offline and without huggingface_hub; online,
snapshot_download is called (replaced by a recorder: no test touches the network).
Hermetic: the cache is built in tmp_path; HF_HUB_OFFLINE=1 unless a test replaces the download.
Run: python -m pytest -q tests/test_hub_cache.py
"""

import os
import subprocess
import sys

import huggingface_hub
import pytest
import torch
from tiny import one_thread, tiny_model  # noqa: F401 (one_thread: an autouse fixture)

from nanosft import AutoModelForCausalLM, AutoTokenizer, PeftModel
from nanosft import cli
from nanosft.io import hub
from nanosft.model import CausalLM
from nanosft.peft import LoraConfig, get_peft_model
from nanosft.tokenizer import Tokenizer

REPO, ADAPTER = "org/tiny-llama", "org/tiny-adapter"
SHA_MAIN, SHA_V2 = "a" * 40, "b" * 40
ENV_VARS = ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME", "HF_HUB_OFFLINE",
            "TRANSFORMERS_OFFLINE")


def add_snapshot(cache, repo_id, sha, refs, write):
    """models--org--name/{refs/<ref> = sha, snapshots/<sha>/...} as huggingface_hub writes it."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    write(repo / "snapshots" / sha)
    for ref in refs:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(sha)  # no trailing newline, as huggingface_hub
    return repo / "snapshots" / sha


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A cache with org/tiny-llama at main (seed 0) and v2 (seed 1), and a LoRA adapter repo."""
    root = tmp_path_factory.mktemp("hub")
    tokenizer = Tokenizer.train(["two plus two is four", "the sky is blue"] * 3, vocab_size=300)

    def model_writer(seed):
        def write(folder):
            tiny_model(seed, vocab_size=len(tokenizer)).save_pretrained(folder)
            tokenizer.save_pretrained(folder)
        return write

    add_snapshot(root, REPO, SHA_MAIN, ["main"], model_writer(0))
    add_snapshot(root, REPO, SHA_V2, ["v2"], model_writer(1))
    torch.manual_seed(2)
    adapter = get_peft_model(tiny_model(0, vocab_size=len(tokenizer)), LoraConfig(r=2))
    with torch.no_grad():
        for name, param in adapter.named_parameters():
            if "lora_B" in name:
                param.normal_()  # non-zero B: the adapter changes the output
    add_snapshot(root, ADAPTER, "c" * 40, ["main"], adapter.save_pretrained)
    return root


def hf_hub_cache_in(env):
    """huggingface_hub's own HF_HUB_CACHE under `env` (it is read once, at import)."""
    code = "import huggingface_hub.constants as c; print(c.HF_HUB_CACHE)"
    full_env = {k: v for k, v in os.environ.items() if k not in ENV_VARS} | env
    return subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True,
                          text=True, check=True).stdout.strip()


@pytest.mark.parametrize("env", [
    {"HF_HUB_CACHE": "/tmp/x/hub-cache", "HF_HOME": "/tmp/x/home"},  # HF_HUB_CACHE wins
    {"HF_HOME": "/tmp/x/home", "XDG_CACHE_HOME": "/tmp/x/xdg"},
    {"XDG_CACHE_HOME": "/tmp/x/xdg"},
    {"HOME": "/tmp/x/user"},
], ids=["HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME", "default"])
def test_cache_folder_is_huggingface_hubs(env, monkeypatch):
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert hub.hub_cache_dir()[0] == hf_hub_cache_in(env)


@pytest.mark.parametrize("revision", [None, "main", "v2", SHA_V2])
def test_snapshot_is_the_one_huggingface_hub_resolves(cache, monkeypatch, revision):
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    theirs = huggingface_hub.snapshot_download(REPO, revision=revision, cache_dir=str(cache),
                                               local_files_only=True)
    assert os.path.samefile(hub.resolve_pretrained_path(REPO, revision), theirs)


def test_model_by_id_equals_model_by_path_and_revision_picks_weights(cache, monkeypatch, tmp_path):
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "hub").symlink_to(cache)  # HF_HOME/hub is the cache folder
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    ids = torch.tensor([[1, 5, 9, 4, 2]])
    by_id = AutoModelForCausalLM.from_pretrained(REPO)
    by_path = CausalLM.from_pretrained(cache / "models--org--tiny-llama" / "snapshots" / SHA_MAIN)
    v2 = AutoModelForCausalLM.from_pretrained(REPO, revision="v2")
    with torch.no_grad():
        torch.testing.assert_close(by_id(ids).logits, by_path(ids).logits, rtol=0, atol=0)
        assert (v2(ids).logits - by_id(ids).logits).abs().max() > 1e-3  # another snapshot's weights


def test_tokenizer_and_adapter_by_id(cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    snapshot = cache / "models--org--tiny-llama" / "snapshots" / SHA_MAIN
    text = "two plus two is four"
    assert AutoTokenizer.from_pretrained(REPO).encode(text) == \
        Tokenizer.from_pretrained(snapshot).encode(text)
    ids = torch.tensor([[1, 5, 9, 4, 2]])
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(REPO)(ids).logits
        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(REPO), ADAPTER)
        by_path = PeftModel.from_pretrained(CausalLM.from_pretrained(snapshot),
                                            str(cache / "models--org--tiny-adapter" / "snapshots"
                                                / ("c" * 40)))
        torch.testing.assert_close(adapted(input_ids=ids).logits, by_path(input_ids=ids).logits,
                                   rtol=0, atol=0)
        assert (adapted(input_ids=ids).logits - base).abs().max() > 1e-3  # the adapter is applied


def test_cli_takes_ids_for_model_and_adapter(cache, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    argv = ["generate", "--model", REPO, "--adapter", ADAPTER, "--prompt", "two plus",
            "--max_new_tokens", "2", "--no_chat_template"]
    assert cli.main(argv) == 0
    assert cli.main(["generate", "--model", "org/not-cached", "--prompt", "hi"]) == 2
    assert "--model org/not-cached was not found" in capsys.readouterr().err


def test_unknown_revision_lists_the_cached_ones(cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    with pytest.raises(FileNotFoundError, match="revision 'v3' is not cached") as error:
        AutoModelForCausalLM.from_pretrained(REPO, revision="v3")
    assert all(name in str(error.value) for name in ("main", "v2", SHA_MAIN, SHA_V2))


def test_id_not_cached_offline_names_both_folders(cache, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as error:
        hub.resolve_pretrained_path("org/absent")
    message = str(error.value)
    assert str(tmp_path / "org" / "absent") in message  # the folder it looked for
    assert str(cache / "models--org--absent") in message and "HF_HUB_CACHE" in message
    assert "HF_HUB_OFFLINE is set" in message


def test_id_not_cached_without_huggingface_hub_says_how_to_install(cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # `import huggingface_hub` fails
    with pytest.raises(FileNotFoundError, match=r'pip install "nanosft\[hub\]"'):
        hub.resolve_pretrained_path("org/absent")


def test_id_not_cached_online_calls_snapshot_download(cache, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HF_HUB_OFFLINE")
    calls = []

    def recorder(repo_id, **kwargs):  # stands in for the network
        calls.append((repo_id, kwargs))
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", recorder)
    assert hub.resolve_pretrained_path("org/absent", revision="v1") == str(tmp_path)
    assert calls == [("org/absent", {"revision": "v1", "allow_patterns": hub.HUB_ALLOW_PATTERNS})]
    assert hub.resolve_pretrained_path(REPO) == str(cache / "models--org--tiny-llama" / "snapshots"
                                                    / SHA_MAIN)  # cached: no download
    assert len(calls) == 1


def test_a_path_that_is_not_an_id_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such folder, and not a Hub id"):
        hub.resolve_pretrained_path(str(tmp_path / "missing" / "model"))


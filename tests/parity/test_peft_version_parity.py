"""peft_version in adapter configs against peft 0.21.2: a release is recorded as it is; a dev
version gets "@<commit>" from the install's direct_url.json, "@UNKNOWN" when there is none, and
"@UNKNOWN" with a warning when looking it up fails; a config read back keeps the writer's string.
Run: python -m pytest -q tests/parity/test_peft_version_parity.py
"""

import warnings

import peft
import peft.config
import pytest

from nanosft import adapter_files
from nanosft.adapter_files import LoraConfig, PeftConfig, PrefixTuningConfig, PromptTuningConfig

CONFIGS = [  # (nanosft class, peft class, arguments both take)
    (LoraConfig, peft.LoraConfig, {}),
    (PromptTuningConfig, peft.PromptTuningConfig, {"num_virtual_tokens": 4}),
    (PrefixTuningConfig, peft.PrefixTuningConfig, {"num_virtual_tokens": 4}),
]


def _both(monkeypatch, version, commit_hash):
    for module in (adapter_files, peft.config):
        monkeypatch.setattr(module, "__version__", version)
        monkeypatch.setattr(module, "_get_commit_hash", commit_hash)


def _raises(pkg_name):
    raise OSError("unreadable metadata")


@pytest.mark.parametrize("version", ["0.21.2", "0.15.0.dev7"])
@pytest.mark.parametrize("commit_hash", [lambda pkg: "abcdef012345", lambda pkg: None],
                         ids=["hash", "none"])
@pytest.mark.parametrize("ours,theirs,kwargs", CONFIGS, ids=lambda v: getattr(v, "__name__", ""))
def test_recorded_version_matches_peft(ours, theirs, kwargs, version, commit_hash, monkeypatch,
                                       tmp_path):
    _both(monkeypatch, version, commit_hash)
    expected = theirs(**kwargs).peft_version
    assert expected.startswith(version)
    config = ours(**kwargs)
    assert config.peft_version == expected
    config.save_pretrained(tmp_path)
    monkeypatch.setattr(adapter_files, "__version__", "0.1.another")  # the file's string wins
    assert PeftConfig.from_pretrained(tmp_path).peft_version == expected


@pytest.mark.parametrize("ours,theirs,kwargs", CONFIGS, ids=lambda v: getattr(v, "__name__", ""))
def test_failed_commit_lookup_warns_and_records_unknown(ours, theirs, kwargs, monkeypatch):
    _both(monkeypatch, "0.15.0.dev7", _raises)
    with pytest.warns(UserWarning, match="dev version of PEFT"):
        expected = theirs(**kwargs).peft_version
    with pytest.warns(UserWarning, match="dev version of PEFT"):
        assert ours(**kwargs).peft_version == expected == "0.15.0.dev7@UNKNOWN"


@pytest.mark.parametrize("package", ["peft", "torch", "nanosft", "no-such-package-here"])
def test_commit_hash_lookup_matches_peft(package):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert adapter_files._get_commit_hash(package) == peft.config._get_commit_hash(package)

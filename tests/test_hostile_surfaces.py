"""Hostile inputs on the Python API, family configs, the run lock, resume and the final save: each
ends in a one-paragraph error naming the file, field or argument and the fix, or in the right
result, never in lost data, a hang or a silent success on a wrong result (issue 30).

Compared, for each case: the exception type and the words its message must hold; where an input is
accepted, the effect (the lock's symlink target keeps its bytes, an endless iterable trains
max_steps steps, the final save's files all come from one run, a killed run's metrics.jsonl is set
aside rather than appended to).
Hermetic: tests/tiny.py's 2-layer model or the tiny default model (nanosft/cli/assets/default),
CPU, one thread, files under tmp_path, no network.
Run: python -m pytest -q tests/test_hostile_surfaces.py
"""

import os

import pytest
from tiny import one_thread, tiny_model  # noqa: F401 (one_thread: an autouse fixture)

from nanosft.io import output_folder

# ----------------------------------------------------------------------------- the run lock


def test_a_symlinked_lock_is_refused_and_its_target_keeps_its_bytes(tmp_path):
    outside = tmp_path / "precious.txt"
    outside.write_text("do not truncate\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / output_folder.LOCK_NAME).symlink_to(outside)
    with pytest.raises(ValueError, match="symlink") as e:
        output_folder.lock_output_dir(str(out))
    assert "Remove" in str(e.value) and output_folder.LOCK_NAME in str(e.value)
    assert outside.read_text() == "do not truncate\n"
    assert (out / output_folder.LOCK_NAME).is_symlink()  # not removed either


def test_a_lock_that_is_a_folder_is_refused_by_name(tmp_path):
    out = tmp_path / "out"
    (out / output_folder.LOCK_NAME).mkdir(parents=True)
    with pytest.raises(ValueError, match="is a folder, not a plain file"):
        output_folder.lock_output_dir(str(out), command_line=True)

"""scripts/mutate.py still points at the code it breaks: each mutation applies to a copy of its file
(the function exists where the mutation says and holds each snippet once), so `python
scripts/mutate.py` measures the tests rather than failing on moved code.

Compared: the copy's text before and after apply(). Hermetic: files copied into tmp_path, no test
runs. Run: python -m pytest -q tests/test_mutate.py
"""

import importlib.util
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("mutate", ROOT / "scripts" / "mutate.py")
mutate = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mutate)


@pytest.mark.parametrize("mutation", mutate.MUTATIONS, ids=lambda m: m.name)
def test_each_mutation_applies_to_the_code_it_names(tmp_path, mutation):
    copy = tmp_path / mutation.path
    copy.parent.mkdir(parents=True)
    shutil.copy(ROOT / mutation.path, copy)
    before = copy.read_text()
    mutate.apply(mutation, tmp_path)
    assert copy.read_text() != before
    assert all((ROOT / test).is_file() for test in mutation.tests)


def test_a_moved_function_is_named(tmp_path):
    # negative control: the mutation's function absent from its file
    moved = mutate.Mutation("moved", "nanosft/model.py", "sample_next_token",
                            (("/ temperature", "* temperature"),), ())
    (tmp_path / "nanosft").mkdir()
    shutil.copy(ROOT / "nanosft" / "model.py", tmp_path / "nanosft" / "model.py")
    with pytest.raises(LookupError):
        mutate.apply(moved, tmp_path)

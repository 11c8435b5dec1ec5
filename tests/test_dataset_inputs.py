"""train_dataset / eval_dataset in every shape a TRL user passes, all giving the same rows.

Compared: the rows SFTTrainer prepares from a list of dicts against those from a datasets.Dataset,
a plain sequence class, a datasets IterableDataset and a generator (with max_steps), and from
.jsonl, .json (array), .parquet and .csv files written by datasets itself; every row carries an
extra column no format uses, which must be ignored (TRL drops it too). A subprocess shows a
sequence is read without importing datasets. Errors: an iterable without max_steps, rows that are
not dicts, a dict of splits, a Parquet/CSV file without the columns its format needs, and a
missing `datasets` for .parquet (named with the pip command).
Hermetic: a tokenizer trained in-process, a tiny Llama, files in tmp_path; CPU.
Run: python -m pytest -q tests/test_dataset_inputs.py
"""

import json
import subprocess
import sys

import datasets
import pytest
from tiny import one_thread, tiny_model  # noqa: F401 (one_thread: an autouse fixture)

from nanosft.args import SFTConfig
from nanosft.data import load_examples, to_example_list
from nanosft.sft import SFTTrainer
from nanosft.tokenizer import Tokenizer

ROWS = [{"prompt": f"{a} plus {a} is", "completion": f" {2 * a} apples.", "source": "sums", "id": a}
        for a in range(6)]


class Rows:
    """A sequence that is neither a list nor a datasets.Dataset: __len__ and __getitem__ only."""

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.train([r["prompt"] + r["completion"] for r in ROWS] * 3, vocab_size=300)


def prepared(train_dataset, tokenizer, tmp_path, max_steps=2):
    config = SFTConfig(output_dir=str(tmp_path), max_steps=max_steps, use_cpu=True, bf16=False,
                       shuffle_dataset=False, gradient_checkpointing=False, report_to="none")
    trainer = SFTTrainer(tiny_model(0, vocab_size=len(tokenizer)), args=config,
                         train_dataset=train_dataset, processing_class=tokenizer)
    return trainer.train_dataset


def write(kind, path):
    """ROWS written by datasets itself (JSON Lines, Parquet, CSV) or as a JSON array."""
    if kind == "json":
        path.write_text(json.dumps(ROWS))
    else:
        getattr(datasets.Dataset.from_list(ROWS), {"jsonl": "to_json"}.get(kind, f"to_{kind}"))(
            str(path), **({"index": False} if kind == "csv" else {}))
    return str(path)


@pytest.fixture(scope="module")
def expected(tokenizer, tmp_path_factory):
    return prepared(ROWS, tokenizer, tmp_path_factory.mktemp("list"))


@pytest.mark.parametrize("make", [
    lambda: datasets.Dataset.from_list(ROWS),
    lambda: Rows(ROWS),
    lambda: datasets.Dataset.from_list(ROWS).to_iterable_dataset(),
    lambda: (row for row in ROWS),
], ids=["Dataset", "sequence", "IterableDataset", "generator"])
def test_in_memory_datasets_give_the_rows_of_a_list(make, tokenizer, expected, tmp_path):
    given = make()
    got = prepared(given, tokenizer, tmp_path)
    if type(given).__module__.startswith("datasets"):  # datasets in, datasets out (as TRL)
        assert isinstance(got, datasets.Dataset)
        got = [{"input_ids": row["input_ids"], "labels": row["labels"]} for row in got]
    assert got == expected


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet", "csv"])
def test_dataset_files_give_the_rows_of_a_list(kind, tokenizer, expected, tmp_path):
    path = write(kind, tmp_path / f"train.{kind}")
    assert prepared(path, tokenizer, tmp_path) == expected


def test_unused_columns_are_ignored(tokenizer, expected, tmp_path):
    bare = [{"prompt": r["prompt"], "completion": r["completion"]} for r in ROWS]
    assert prepared(bare, tokenizer, tmp_path) == expected
    # negative control: a column the format does use changes the rows
    changed = [{**r, "completion": r["completion"] + " ok"} for r in ROWS]
    assert prepared(changed, tokenizer, tmp_path) != expected


def test_a_sequence_is_read_without_importing_datasets():
    code = ("import sys; from nanosft.data import load_examples\n"
            "class Rows:\n"
            "    __len__ = lambda self: 2\n"
            "    __getitem__ = lambda self, i: {'text': str(i)}\n"
            "assert load_examples(Rows()) == [{'text': '0'}, {'text': '1'}]\n"
            "print('datasets' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_an_iterable_without_max_steps_is_refused(tokenizer, tmp_path):
    with pytest.raises(ValueError, match="iterable without a length.*set max_steps"):
        prepared(iter(ROWS), tokenizer, tmp_path, max_steps=-1)
    assert len(load_examples(iter(ROWS))) == len(ROWS)  # eval data: no step count needed


def test_rows_that_are_not_dicts_are_named():
    with pytest.raises(TypeError, match=r"example 1: expected a dict .* got a str"):
        to_example_list([ROWS[0], "plus"])
    with pytest.raises(TypeError, match=r"pass one split such as dataset\['train'\]"):
        to_example_list(datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}))


@pytest.mark.parametrize("kind", ["parquet", "csv"])
def test_columnar_file_missing_format_columns_is_named(kind, tmp_path):
    path = tmp_path / f"bad.{kind}"
    rows = [{"question": r["prompt"], "answer": r["completion"]} for r in ROWS]
    getattr(datasets.Dataset.from_list(rows), f"to_{kind}")(str(path))
    with pytest.raises(ValueError, match=rf"{path}, row 0: no 'text', 'messages' or "
                                         r"'prompt'/'completion' field \(keys: \['answer', "):
        load_examples(str(path))


def test_parquet_without_datasets_says_how_to_install(tmp_path, monkeypatch):
    path = write("parquet", tmp_path / "train.parquet")
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` fails
    with pytest.raises(ImportError, match=r'needs the datasets library; fix: pip install '
                                          r'"nanosft\[data\]"'):
        load_examples(path)

"""Checkpoints and resume under N-D meshes (parallelism_config dp_shard x tp, dp_shard x cp and cp
alone, 4 CPU processes each, gloo), and what a mesh run reports, against one process.

Resume: a 4-step run saves checkpoint-2 (whole tensors gathered from the DTensor pieces, the
optimizer state likewise, one RNG file per rank, trainer_state.json); a fresh launch (new
processes, a fresh Trainer) resumes from it. For full fine-tuning under the three meshes and LoRA
on 4 projections under dp_shard x tp and dp_shard x cp (the context-parallel wrapper saves and
loads the model it wraps), the logged loss and grad_norm of steps 3-4 and every trainable
parameter at the end equal the uninterrupted run (asserted within 1e-5; measured bitwise equal).
Resuming dp_shard x tp's checkpoint under another mesh with the same global batch (dp_shard x
cp) equals it within 1e-5 (measured 7.5e-9: the split over ranks changes the order of sums);
another global batch is refused before any work, naming both layouts. Negative control:
ignore_data_skip (the resumed run reads the interrupted epoch from its start) gives other losses.
Reporting: num_input_tokens_seen, total_flos, tokens/s x window time, and the eval example count
of the mesh run equal the one-process run with the same global batch (the tensor-parallel ranks of
one data shard read the same rows: counted once, not tp_size times); the run streams its rows
(an IterableDataset, split over the 2 data-parallel ranks, not the 4 processes): the logged losses
equal one process's.
Hermetic: torch.multiprocessing spawn on localhost (tests/nd_launch.py: the uninterrupted runs in
the 4-process launch the other N-D files share, the resumes in a second one), a tiny model
(hidden 32, 2 layers), random token rows, one thread per process.
Run: python -m pytest -q tests/test_nd_parallel_resume.py
"""

import functools
import os
from pathlib import Path
from unittest import mock

import nd_launch
import pytest
import torch
from nd_launch import largest_difference
from tiny import tiny_model

import nanosft.trainer
from nanosft import ParallelismConfig, distributed
from nanosft.args import TrainingArguments
from nanosft.collator import DataCollatorForLanguageModeling
from nanosft.monitoring.callbacks import ThroughputCallback
from nanosft.monitoring.flops import non_embedding_parameters
from nanosft.peft import LoraConfig, get_peft_model
from nanosft.trainer import Trainer

VOCAB = 64
TOL = 1e-5
BATCH = 2  # per data-parallel rank
# the uninterrupted runs (4 processes each, 2 data shards but under cp alone), the modes of each
FIRST = {"dp_shard x tp": ({"dp_shard_size": 2, "tp_size": 2}, ("full", "lora")),
         "dp_shard x cp": ({"dp_shard_size": 2, "cp_size": 2}, ("full", "lora")),
         "cp": ({"cp_size": 4}, ("full",))}
MESH = FIRST["dp_shard x tp"][0]
OTHER_MESH = {"tp_size": 2}  # 2 processes, 1 data shard: the refused layout's example
RESUMED = [(mesh, mode) for mesh, (_, modes) in FIRST.items() for mode in modes]


def rows(n=24, length=None, seed=4):
    """Random token rows, ragged unless `length` is given (then every row pads alike on every
    split, so counts that include padding are the same for one process and the mesh)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        size = length or int(torch.randint(4, 14, (1,), generator=g))
        ids = torch.randint(1, VOCAB, (size,), generator=g).tolist()
        out.append({"input_ids": ids,
                    "labels": [t if j >= size // 2 else -100 for j, t in enumerate(ids)]})
    return out


class Stream(torch.utils.data.IterableDataset):
    """The same rows without a length: streamed, never sampled."""

    def __init__(self, data):
        self.data = data

    def __iter__(self):
        return iter(self.data)


def build(mode):
    model = tiny_model(seed=0)
    if mode == "full":
        return model
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian",
                                            target_modules=["q_proj", "o_proj", "up_proj",
                                                            "down_proj"]))


def make_trainer(output_dir, batch_size, sizes=None, mode="full", **extra):
    """4 optimizer steps, checkpoint-2 and checkpoint-4 saved."""
    return nd_launch.make_trainer(output_dir, batch_size, sizes, model=build(mode), max_steps=4,
                                  save_strategy="steps", save_steps=2, **extra)


def reporting_trainer(output_dir, batch_size, sizes=None):
    """Streamed equal-length rows, evaluation every 2 steps, the token count and throughput on."""
    args = TrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=batch_size,
        per_device_eval_batch_size=batch_size, gradient_accumulation_steps=2, max_steps=4,
        learning_rate=1e-3, logging_steps=2, eval_strategy="steps", eval_steps=2,
        save_strategy="no", use_cpu=True, disable_tqdm=True, seed=5, report_to="none",
        include_num_input_tokens_seen="all", peak_flops=1e12,
        parallelism_config=None if sizes is None else ParallelismConfig(**sizes))
    return Trainer(build("full"), args, train_dataset=Stream(rows(64, length=10)),
                   eval_dataset=rows(12, length=10, seed=7),
                   data_collator=DataCollatorForLanguageModeling(0),
                   callbacks=[ThroughputCallback()])


def trained(trainer):
    return {
        "logged": [(h["step"], h["loss"], h["grad_norm"])
                   for h in trainer.state.log_history if "loss" in h],
        "params": {n: distributed.to_full(p.detach()).clone()
                   for n, p in trainer.model.named_parameters() if p.requires_grad},
    }


def reported(trainer, eval_examples):
    """The counts the mesh must report as one process does."""
    train = [h for h in trainer.state.log_history if "loss" in h]
    final = trainer.state.log_history[-1]
    return {
        "losses": [h["loss"] for h in train],
        "num_input_tokens_seen": [h["num_input_tokens_seen"] for h in train],
        "total_flos": final["total_flos"],
        # a rate times its window's time: the window's tokens (both rounded when logged)
        "window_tokens": [h["train_tokens_per_second"] * h["train_step_time"] * 2 for h in train],
        "eval_examples": eval_examples,
    }


def run_reporting(output_dir, batch_size, sizes=None):
    examples = []
    original = nanosft.trainer.evaluation_loop

    def counted(*args, **kwargs):
        out = original(*args, **kwargs)
        examples.append(out[1])
        return out

    trainer = reporting_trainer(output_dir, batch_size, sizes)
    with mock.patch.object(nanosft.trainer, "evaluation_loop", counted):
        trainer.train()
    return reported(trainer, examples)


def _first_case(folder, sizes, modes, reporting=False):
    """Uninterrupted runs saving checkpoint-2 and checkpoint-4 (and the reporting run)."""
    result = {}
    for mode in modes:
        trainer = make_trainer(os.path.join(folder, mode), BATCH, sizes, mode)
        trainer.train()
        result[mode] = trained(trainer)
    if reporting:
        result["reporting"] = run_reporting(os.path.join(folder, "reporting"), BATCH, sizes)
    return result


def _resume_case(folder):
    """A fresh launch (new processes, fresh Trainers) from each checkpoint-2, as after a crash."""
    root = Path(folder).parent
    result = {}
    for mesh, (sizes, modes) in FIRST.items():
        first = nd_launch.case_folder(root, f"resume/{mesh}")
        for mode in modes:
            trainer = make_trainer(os.path.join(folder, f"{mesh}-{mode}".replace(" ", "")),
                                   BATCH, sizes, mode)
            trainer.train(resume_from_checkpoint=str(first / mode / "checkpoint-2"))
            result[mesh, mode] = trained(trainer)
    first = nd_launch.case_folder(root, "resume/dp_shard x tp") / "full" / "checkpoint-2"
    trainer = make_trainer(os.path.join(folder, "replayed"), BATCH, MESH, ignore_data_skip=True)
    trainer.train(resume_from_checkpoint=str(first))
    result["replayed"] = trained(trainer)
    # another mesh, the same global batch: dp_shard x tp's checkpoint under dp_shard x cp
    trainer = make_trainer(os.path.join(folder, "other-mesh"), BATCH, FIRST["dp_shard x cp"][0])
    trainer.train(resume_from_checkpoint=str(first))
    result["other mesh"] = trained(trainer)
    return result


for _mesh, (_sizes, _modes) in FIRST.items():
    nd_launch.register(4, f"resume/{_mesh}", functools.partial(
        _first_case, sizes=_sizes, modes=_modes, reporting=_mesh == "dp_shard x tp"))
nd_launch.register(4, "resume/resumed", _resume_case, phase="resume")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("nd-resume")
    single = run_reporting(str(out / "single-reporting"), 2 * BATCH)  # the same global batch
    first = nd_launch.results(tmp_path_factory, 4)
    return {"out": out, "single": single, "root": nd_launch.launch_root(tmp_path_factory, 4),
            "first": {mesh: first[f"resume/{mesh}"] for mesh in FIRST},
            "resume": nd_launch.results(tmp_path_factory, 4, "resume")["resume/resumed"]}


@pytest.mark.parametrize("mesh, mode", RESUMED)
def test_resumed_run_equals_the_uninterrupted_one(runs, mesh, mode):
    first, resumed = runs["first"][mesh][mode], runs["resume"][mesh, mode]
    # log_history: steps 1-2 from trainer_state.json, then 3-4 trained after the resume
    assert [s for s, *_ in resumed["logged"]] == [1, 2, 3, 4]
    torch.testing.assert_close(resumed["logged"], first["logged"], rtol=0, atol=TOL)
    worst = largest_difference(resumed["params"], first["params"])
    print(f"{mesh} {mode}: largest parameter difference, resumed vs uninterrupted {worst:.2e}")
    assert worst <= TOL
    assert largest_difference(first["params"], trained_start(mode)) > 100 * TOL  # they moved


def trained_start(mode):
    return {n: p.detach() for n, p in build(mode).named_parameters() if p.requires_grad}


def test_replaying_the_epoch_is_not_resuming(runs):
    # negative control: ignore_data_skip reads the interrupted epoch from its first batch again
    first, replayed = runs["first"]["dp_shard x tp"]["full"], runs["resume"]["replayed"]
    assert [s for s, *_ in replayed["logged"]] == [1, 2, 3, 4]
    assert max(abs(a[1] - b[1]) for a, b in zip(replayed["logged"][2:], first["logged"][2:])) \
        > 1e-3


@pytest.mark.parametrize("mesh", FIRST)
def test_checkpoint_holds_whole_tensors_and_every_ranks_rng(runs, mesh):
    from safetensors.torch import load_file

    folder = nd_launch.case_folder(runs["root"], f"resume/{mesh}") / "full" / "checkpoint-2"
    names = {p.name for p in folder.iterdir()}
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json",
            "training_args.json"} <= names
    assert {f"rng_state_{r}.pth" for r in range(4)} <= names
    weights = load_file(folder / "model.safetensors")
    assert weights["model.layers.0.self_attn.q_proj.weight"].shape == (32, 32)  # not a piece
    assert weights["model.layers.0.mlp.down_proj.weight"].shape == (32, 64)
    assert not [p.name for p in folder.parent.iterdir() if p.name.startswith(".")]  # no temp


def test_resume_under_another_mesh_with_the_same_global_batch(runs):
    first, other = runs["first"]["dp_shard x tp"]["full"], runs["resume"]["other mesh"]
    assert [s for s, *_ in other["logged"]] == [1, 2, 3, 4]
    torch.testing.assert_close(other["logged"], first["logged"], rtol=0, atol=TOL)
    worst = largest_difference(other["params"], first["params"])
    print(f"dp_shard x tp's checkpoint resumed under dp_shard x cp vs uninterrupted: {worst:.2e}")
    assert worst <= TOL


def test_another_global_batch_under_another_mesh_is_refused(runs, monkeypatch):
    from nanosft.run.checkpoint import check_resume_layout

    monkeypatch.setenv("WORLD_SIZE", "2")
    folder = nd_launch.case_folder(runs["root"], "resume/dp_shard x tp") / "full" / "checkpoint-2"
    args = TrainingArguments(output_dir=str(runs["out"] / "x"), per_device_train_batch_size=BATCH,
                             gradient_accumulation_steps=2, use_cpu=True,
                             parallelism_config=ParallelismConfig(**OTHER_MESH))
    with pytest.raises(ValueError, match=r"cp_size=1 x dp_replicate_size=1 x dp_shard_size=2 x "
                                         r"tp_size=2 with a global batch of 8 .* uses "
                                         r"parallelism_config .*tp_size=2 with 4 .*"
                                         r"per_device_train_batch_size=4"):
        check_resume_layout(str(folder), args)
    args.per_device_train_batch_size = 2 * BATCH
    check_resume_layout(str(folder), args)  # the same global batch: taken


# ----- reporting: counted once per data shard
def test_streamed_rows_shard_over_the_data_parallel_ranks(runs):
    single, nd = runs["single"], runs["first"]["dp_shard x tp"]["reporting"]
    assert len(nd["losses"]) == 2
    torch.testing.assert_close(nd["losses"], single["losses"], rtol=0, atol=TOL)


def test_num_input_tokens_seen_equals_one_process(runs):
    single, nd = runs["single"], runs["first"]["dp_shard x tp"]["reporting"]
    assert single["num_input_tokens_seen"] == [2 * 8 * 10, 4 * 8 * 10]  # steps x rows x length
    assert nd["num_input_tokens_seen"] == single["num_input_tokens_seen"]


def test_total_flos_equals_one_process(runs):
    single, nd = runs["single"], runs["first"]["dp_shard x tp"]["reporting"]
    parameters = non_embedding_parameters(tiny_model())
    assert single["total_flos"] == 6 * 4 * 8 * 10 * parameters  # 6 x input_ids x parameters
    assert nd["total_flos"] == single["total_flos"]


def test_tokens_per_second_counts_each_data_shard_once(runs):
    nd = runs["first"]["dp_shard x tp"]["reporting"]
    for tokens in nd["window_tokens"]:  # 2 steps x 8 rows x 10 tokens per window
        assert abs(tokens - 160) < 0.02 * 160, nd["window_tokens"]


def test_eval_example_count_equals_one_process(runs):
    single, nd = runs["single"], runs["first"]["dp_shard x tp"]["reporting"]
    assert single["eval_examples"] == [12, 12]
    assert nd["eval_examples"] == single["eval_examples"]

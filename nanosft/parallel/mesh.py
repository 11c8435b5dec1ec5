"""N-D parallel: accelerate's ParallelismConfig sizes -> one named DeviceMesh, checked first.

The guide's 3D_parallel.py lays every rank on a grid: `dp_replicate x dp_shard x cp x tp`
(tp innermost, so a tensor-parallel group is neighbouring ranks). Ranks along "tp" hold pieces of
the same weights and must read the same rows; ranks along the data-parallel dims ("dp_replicate",
"dp_shard", flattened into "dp") read different rows, and the loss, token counts and gradients are
summed over them. `ParallelismConfig` carries the sizes (accelerate's field names);
`check_parallelism` refuses sizes that cannot work before any step, naming the numbers.
Built on distributed.py; imports nothing else of nanosft but the tensor-parallel size check.
"""

from dataclasses import dataclass, field

from nanosft.distributed import get_rank

# accelerate's mesh order (ParallelismConfig._get_mesh): the last dim varies fastest
MESH_DIM_NAMES = ("dp_replicate", "dp_shard", "cp", "tp")


@dataclass
class ParallelismConfig:
    """How the ranks split the work: dp_replicate_size (DDP replicas), dp_shard_size (FSDP2
    shards), tp_size (tensor parallel), cp_size (context parallel); their product is the world
    size. Mirrors: accelerate ParallelismConfig (field names; None reads 1)
    Differs: the mesh keeps size-1 dims (mesh["tp"] always exists); dp_replicate_size > 1
    together with cp_size > 1 is refused (not implemented yet)."""

    dp_replicate_size: int | None = None
    dp_shard_size: int | None = None
    tp_size: int | None = None
    cp_size: int | None = None
    device_mesh: object = field(default=None, repr=False, compare=False)
    dp_mesh: object = field(default=None, repr=False, compare=False)
    dp_shard_cp_mesh: object = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        for name in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size"):
            value = 1 if getattr(self, name) is None else getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ParallelismConfig({name}={value!r}) is invalid: use a whole "
                                 "number >= 1")
            setattr(self, name, value)
        if self.dp_replicate_size > 1 and self.cp_size > 1:
            raise ValueError(
                f"ParallelismConfig(dp_replicate_size={self.dp_replicate_size}) together with "
                f"cp_size={self.cp_size}: replicas of a context-parallel model are not "
                "implemented yet; use dp_shard_size instead of dp_replicate_size")

    @property
    def sizes(self) -> dict:
        """{mesh dim name: size} in mesh order."""
        return dict(zip(MESH_DIM_NAMES, (self.dp_replicate_size, self.dp_shard_size,
                                         self.cp_size, self.tp_size)))

    def to_dict(self) -> dict:
        """The four sizes (what training_args.json holds)."""
        return {f"{k}_size": v for k, v in self.sizes.items()}

    @property
    def total_size(self) -> int:
        """The ranks the sizes lay out: their product. Mirrors: accelerate total_size"""
        return self.dp_replicate_size * self.dp_shard_size * self.tp_size * self.cp_size

    @property
    def data_parallel_size(self) -> int:
        """Ranks that read different rows. Mirrors: accelerate data_parallel_size"""
        return self.dp_replicate_size * self.dp_shard_size

    def data_parallel_rank(self, rank: int) -> int:
        """Which data shard global `rank` reads: its coordinate along dp_replicate x dp_shard
        (the cp and tp ranks of one data shard are rank // (cp * tp) alike)."""
        return rank // (self.cp_size * self.tp_size)

    def get_device_mesh(self, device_type: str = "cpu"):
        """The named DeviceMesh over all ranks (built once), with "dp" = dp_replicate x dp_shard
        flattened. Mirrors: accelerate ParallelismConfig.get_device_mesh / build_device_mesh"""
        if self.device_mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            sizes = self.sizes
            self.device_mesh = init_device_mesh(device_type, tuple(sizes.values()),
                                                mesh_dim_names=tuple(sizes))
            # the flattened dim is kept here: torch deprecates slicing it from the root mesh
            self.dp_mesh = self.device_mesh["dp_replicate", "dp_shard"]._flatten("dp")
            # FSDP's dim under context parallel: cp ranks hold the same weights, their grads add
            self.dp_shard_cp_mesh = self.device_mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        return self.device_mesh

    def data_parallel_group(self, device_type: str = "cpu"):
        """(size, rank, process group) of the data-parallel ranks ("dp"); group None when there
        is one data shard."""
        if self.data_parallel_size == 1:
            return 1, 0, None
        self.get_device_mesh(device_type)
        rank = self.data_parallel_rank(get_rank())
        return self.data_parallel_size, rank, self.dp_mesh.get_group()


def as_parallelism_config(value) -> ParallelismConfig | None:
    """nanosft's ParallelismConfig from itself, a dict of sizes, or accelerate's object (read by
    its four size fields; a sequence-parallel size it carries must be 1)."""
    if value is None or isinstance(value, ParallelismConfig):
        return value
    names = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size")
    if isinstance(value, dict):
        unknown = sorted(set(value) - set(names))
        if unknown:
            raise ValueError(f"parallelism_config has keys nanosft does not know: "
                             f"{', '.join(unknown)}; use {', '.join(names)}")
        return ParallelismConfig(**value)
    if all(hasattr(value, n) for n in names):  # accelerate.parallelism_config.ParallelismConfig
        if (getattr(value, "sp_size", 1) or 1) > 1:
            raise ValueError(f"parallelism_config.sp_size={value.sp_size}: sequence parallelism "
                             "(DeepSpeed Ulysses) is out of scope; use sp_size=1")
        return ParallelismConfig(**{n: getattr(value, n) for n in names})
    raise ValueError(f"parallelism_config={value!r} is invalid: pass nanosft.ParallelismConfig, "
                     "accelerate's ParallelismConfig or a dict of "
                     "dp_replicate_size / dp_shard_size / tp_size / cp_size")


def check_parallelism(config: ParallelismConfig, world_size: int, model=None) -> None:
    """Refuse, before any work, sizes whose product is not the world size, or a model whose heads
    or MLP width tp_size does not divide.
    Mirrors: accelerate ParallelismConfig._validate_accelerator (total_size vs num_processes)"""
    if config.total_size != world_size:
        listed = " x ".join(f"{k}_size={v}" for k, v in config.sizes.items())
        raise ValueError(
            f"parallelism_config lays out {listed} = {config.total_size} ranks, but "
            f"{world_size} processes run; make the product equal to torchrun's "
            f"--nproc_per_node x nodes ({world_size}), e.g. dp_shard_size="
            f"{max(world_size // (config.tp_size * config.cp_size * config.dp_replicate_size), 1)}")
    if config.tp_size > 1 and model is not None:
        from nanosft.parallel.tensor_parallel import check_tp_sizes

        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        check_tp_sizes(base.config, config.tp_size)

"""TrainingArguments and SFTConfig: every knob of a nanosft run, Hugging Face names and defaults.

Field names and defaults follow transformers 5.23 `TrainingArguments` and TRL 1.16 `SFTConfig`, so
a config written for one reads the same in the other (walkthrough 1 and 2.3: num_train_epochs,
gradient_accumulation_steps, max_steps; guide: optimizers and schedulers). Only the fields nanosft
acts on exist; a wrong value fails in `__post_init__` with the field, the value and the fix. Every
other field of the reference classes is refused by name with its reason (NOT_SUPPORTED below).
"""

import dataclasses
import difflib
import functools
import json
import math
import os
import warnings
from dataclasses import dataclass

import torch

from nanosft.optim import BITSANDBYTES_OPTIMIZERS


SCHEDULER_NAMES = (
    "linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
    "inverse_sqrt", "reduce_lr_on_plateau", "cosine_with_min_lr", "cosine_warmup_with_min_lr",
    "warmup_stable_decay",
)
OPTIMIZER_NAMES = ("adamw_torch_fused", "adamw_torch", "sgd", *BITSANDBYTES_OPTIMIZERS)
INTERVAL_STRATEGIES = ("no", "steps", "epoch")
REPORT_TO = ("none", "all", "nanosft", "tensorboard")
# Fields whose value may arrive as a JSON string (command line, JSON config), as in transformers.
DICT_FIELDS = ("lr_scheduler_kwargs", "gradient_checkpointing_kwargs",
               "activation_checkpointing_kwargs")


# push_to_hub=True is refused at once with this (the hub_* fields exist: scripts read them)
PUSH_NEEDS_NETWORK = ("pushing to the Hugging Face Hub needs the network, and nanosft does not "
                      "push: it trains offline. Leave push_to_hub=False and upload output_dir "
                      "yourself (e.g. `hf upload <repo_id> <output_dir>`)")
_TRACKIO = ("Trackio logging is out of scope (report_to takes \"none\", \"nanosft\", "
            "\"tensorboard\" or \"all\")")
_DDP = "not implemented yet (nanosft's DistributedDataParallel uses torch's defaults)"
_LOADER = "not implemented yet (the DataLoader takes the other dataloader_* fields)"
_LOGGING = "transformers' logging levels are out of scope (nanosft logs from the main process)"
# Each transformers 5.23 TrainingArguments field nanosft does not act on: {name: (reference
# default, reason)}. tests/test_unsupported_args.py checks the table against transformers' fields.
TRAINING_ARGS_NOT_SUPPORTED = {
    # out of scope: trackers, other launchers and kernels
    "project": ("huggingface", _TRACKIO), "trackio_space_id": (None, _TRACKIO),
    "trackio_bucket_id": (None, _TRACKIO), "trackio_static_space_id": (None, _TRACKIO),
    "deepspeed": (None, "DeepSpeed is out of scope (nanosft shards with FSDP2: fsdp=...)"),
    "accelerator_config": (None, "nanosft does not run on accelerate (no Accelerator to set up)"),
    "debug": ("", "TPU metrics and the underflow/overflow debugger are out of scope"),
    "use_liger_kernel": (False, "Liger kernels are out of scope (the fused LM-head loss is "
                                "nanosft's own speed path)"),
    "liger_kernel_config": (None, "Liger kernels are out of scope"),
    "optim_target_modules": (None, "GaLore / APOLLO optimizers are out of scope"),
    "local_rank": (-1, "torch.distributed.launch is out of scope; torchrun sets LOCAL_RANK"),
    # not implemented yet: speed, memory and robustness switches
    "tf32": (None, "not implemented yet (set torch.backends.cuda.matmul.allow_tf32 yourself)"),
    "torch_compile_backend": (None, "not implemented yet (torch_compile uses the default)"),
    "torch_compile_mode": (None, "not implemented yet (torch_compile uses the default)"),
    "neftune_noise_alpha": (None, "NEFTune embedding noise is not implemented yet"),
    "torch_empty_cache_steps": (None, "not implemented yet (the CUDA cache is never emptied)"),
    "full_determinism": (False, "not implemented yet (seed seeds the RNGs only)"),
    "ddp_find_unused_parameters": (None, _DDP), "ddp_bucket_cap_mb": (None, _DDP),
    "ddp_broadcast_buffers": (None, _DDP), "ddp_static_graph": (None, _DDP),
    "save_on_each_node": (False, "not implemented yet (the main process saves)"),
    "log_level": ("passive", _LOGGING), "log_level_replica": ("warning", _LOGGING),
    "log_on_each_node": (True, _LOGGING),
    "dataloader_in_order": (True, _LOADER),
    "dataloader_multiprocessing_context": (None, _LOADER),
    # not implemented yet: evaluation variants
    "bf16_full_eval": (False, "not implemented yet (eval runs in the training precision)"),
    "fp16_full_eval": (False, "not implemented yet (eval runs in the training precision)"),
    "eval_do_concat_batches": (True, "not implemented yet (predictions are always concatenated)"),
    "use_cache": (False, "not implemented yet (training runs without the KV cache)"),
}
# The same for the fields TRL 1.16's SFTConfig adds.
SFT_CONFIG_NOT_SUPPORTED = {
    "dataset_num_proc": (None, "not implemented yet (the dataset is prepared in one process)"),
    "activation_offloading": (False, "not implemented yet (gradient_checkpointing saves memory)"),
    "trust_remote_code": (False, "out of scope: nanosft runs its own model code, never a "
                                   "repository's custom code"),
}


def _refuses(not_supported):
    """Class decorator over @dataclass: its __init__ refuses a field of `not_supported` by name
    with the reason. The reference default changes nothing and is dropped silently, so a config
    that spells out reference fields at their defaults still loads."""
    def wrap(cls):
        dataclass_init = cls.__init__

        @functools.wraps(dataclass_init)
        def __init__(self, *args, **kwargs):
            for name in [k for k in kwargs if k in not_supported]:
                default, reason = not_supported[name]
                value = kwargs.pop(name)
                if value != default:
                    raise ValueError(f"{cls.__name__}({name}={value!r}): not supported by "
                                     f"nanosft: {reason}")
            dataclass_init(self, *args, **kwargs)

        cls.__init__ = __init__
        cls.not_supported = not_supported  # from_dict leaves these keys to __init__'s message
        return cls
    return wrap


def _fail(field_name, value, fix):
    """Raise the one error shape every check here uses: field, bad value, how to fix it."""
    raise ValueError(f"{field_name}={value!r} is invalid: {fix}")


def _check_choice(field_name, value, choices):
    if value not in choices:
        close = difflib.get_close_matches(str(value), choices, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        _fail(field_name, value, f"choose one of {', '.join(choices)}{hint}")


def _check_steps(field_name, value):
    # "Should be an integer or a float in range [0,1)": a value < 1 is a ratio of max_steps.
    if value < 0:
        _fail(field_name, value,
              "use a positive step count, or a float in [0, 1) for a ratio of max_steps")
    if value > 1 and value != int(value):
        _fail(field_name, value, "a value above 1 is a step count and must be a whole number")
    return int(value) if value >= 1 else value


@_refuses(TRAINING_ARGS_NOT_SUPPORTED)
@dataclass
class TrainingArguments:
    """Settings of one training run (batching, optimiser, schedule, logging, saving, precision).
    Mirrors: transformers TrainingArguments (5.23 names and defaults)
    Differs: report_to stays "none" (not []); bf16 runs on CPU without use_cpu; fp16 needs CUDA;
    overwrite_output_dir (transformers 4; 5.23 removed it) acts: see below."""

    output_dir: str | None = None  # None -> "trainer_output", as transformers 5
    # Differs: transformers 5.23 removed overwrite_output_dir and writes into any folder. Here a
    # fresh run refuses an output_dir holding another run (its checkpoints, its saved model or
    # adapter) unless overwrite_output_dir=True, which first removes that run's checkpoints.
    overwrite_output_dir: bool = False
    # Schedule length and batches (walkthrough 1: num_train_epochs, max_steps, total batch size)
    num_train_epochs: float = 3.0
    max_steps: int = -1
    per_device_train_batch_size: int = 8
    per_device_eval_batch_size: int = 8
    auto_find_batch_size: bool = False  # on out-of-memory, retry with int(0.9 x batch) (train only)
    gradient_accumulation_steps: int = 1
    average_tokens_across_devices: bool = True
    dataloader_drop_last: bool = False
    dataloader_num_workers: int = 0
    dataloader_pin_memory: bool = True  # page-locked batches (CUDA only; no effect on a CPU run)
    dataloader_persistent_workers: bool = False  # keep the worker processes between epochs
    dataloader_prefetch_factor: int | None = None  # batches each worker loads ahead
    remove_unused_columns: bool = True
    # random | sequential | group_by_length (batches of similar lengths: less padding, even ranks;
    # transformers 4's group_by_length=True). Differs: no "batch_rebalance".
    train_sampling_strategy: str = "random"
    length_column_name: str = "length"  # a datasets.Dataset column of precomputed lengths
    # Optimiser and schedule (guide: optimizers and schedulers).
    learning_rate: float = 5e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    optim: str = "adamw_torch_fused"
    optim_args: str | None = None
    lr_scheduler_type: str = "linear"
    lr_scheduler_kwargs: dict | str | None = None
    warmup_steps: float = 0  # >= 1: a step count; in [0, 1): a ratio of the total steps
    label_smoothing_factor: float = 0.0
    # Logging.
    logging_strategy: str = "steps"
    logging_steps: float = 500
    logging_first_step: bool = False
    logging_nan_inf_filter: bool = True
    include_num_input_tokens_seen: str | bool = "no"
    disable_tqdm: bool | None = None
    # "none": the progress bar and the non-finite guard only, as transformers honours report_to;
    # "nanosft": tokens/s, MFU, the memory ledger, metrics.jsonl; "tensorboard": tokens/s, MFU and
    # TensorBoard events; "all": both. Reference mode keeps the progress bar alone.
    report_to: str | list | None = "none"
    run_name: str | None = None
    # Differs: nanosft's own; transformers has no such field. The device's peak FLOP/s, the
    # denominator of the `mfu` log (achieved model FLOP/s / peak), as nanoGPT's estimate_mfu
    # divides by an A100's 312e12; e.g. 989e12 for an H100's dense bf16. None: the rate of a short
    # matmul calibration at the model's hidden size, taken at train start.
    peak_flops: float | None = None
    # Evaluation.
    eval_strategy: str = "no"
    eval_steps: float | None = None  # None -> logging_steps when eval_strategy="steps"
    eval_on_start: bool = False
    # steps (eval_strategy="steps") or epochs ("epoch") to wait before the first evaluation
    eval_delay: float = 0
    # compute_metrics: what EvalPrediction carries beside predictions / label_ids ("inputs",
    # "loss"), how often kept predictions move to the CPU, and per-batch metrics
    include_for_metrics: list = dataclasses.field(default_factory=list)
    label_names: list | None = None  # the batch keys holding labels (None: ["labels"])
    prediction_loss_only: bool = False  # evaluate / predict keep the loss alone
    # gather predictions with gather_object (objects of any shape): one process has nothing to
    # gather, so True changes nothing there; under torchrun compute_metrics is refused anyway
    eval_use_gather_object: bool = False
    eval_accumulation_steps: int | None = None
    batch_eval_metrics: bool = False
    # Saving and best model.
    save_strategy: str = "steps"
    save_steps: float = 500
    save_total_limit: int | None = None
    save_only_model: bool = False
    load_best_model_at_end: bool = False
    metric_for_best_model: str | None = None
    greater_is_better: bool | None = None
    # read by example scripts (run_glue.py & co.), not by the Trainer, as in transformers
    do_train: bool = False
    do_eval: bool = False
    do_predict: bool = False
    # a checkpoint folder, or True for the latest valid one in output_dir (command line: the flag
    # alone, true or latest); read by Trainer.train when its own argument is not given
    resume_from_checkpoint: str | bool | None = None
    ignore_data_skip: bool = False
    # resuming: rebuild the checkpoint's ExportableState callbacks (EarlyStoppingCallback's
    # patience counter, TrainerControl) from trainer_state.json's "stateful_callbacks"
    restore_callback_states_from_checkpoint: bool = False
    # on SIGTERM, save a checkpoint at the next step boundary and stop (nanosft.run.jit_checkpoint)
    enable_jit_checkpoint: bool = False
    # Seeds, precision, memory.
    seed: int = 42
    data_seed: int | None = None
    bf16: bool = False
    fp16: bool = False
    activation_checkpointing: bool | None = None
    activation_checkpointing_kwargs: dict | str | None = None
    gradient_checkpointing: bool | None = None  # alias of activation_checkpointing (transformers 5)
    gradient_checkpointing_kwargs: dict | str | None = None
    torch_compile: bool = False
    use_cpu: bool = False
    skip_memory_metrics: bool = True  # False: init_/train_mem_cpu_* (and _gpu_) deltas in metrics
    # Differs: nanosft's own. A 4-bit base's weights are dequantized in every forward and again
    # in backward ("per_call", bitsandbytes' way); "per_step" dequantizes each once per optimizer
    # step and holds it until the optimizer step (CPU speed path: the memory of every NF4 linear
    # in its compute dtype, counted by the memory ledger; off in reference mode)
    nf4_dequantize: str = "per_call"
    # Distributed.
    ddp_backend: str | None = None
    ddp_timeout: int = 1800
    # FSDP2 under torchrun: True / "full_shard" / "shard_grad_op"; fsdp_config a dict or JSON path
    # (guide: FSDP)
    fsdp: str | bool | list | None = None
    fsdp_config: dict | str | None = None
    # N-D parallel under torchrun: dp_replicate x dp_shard x tp (x cp) sizes, their product the
    # world size: a dict of them, nanosft.ParallelismConfig or accelerate's (made a
    # ParallelismConfig in __post_init__); guide: tensor parallel
    parallelism_config: dict | None = None
    # The Hub, as transformers names it (scripts read args.push_to_hub); read only when pushing,
    # which needs the network: push_to_hub=True is refused (PUSH_NEEDS_NETWORK)
    push_to_hub: bool = False
    hub_model_id: str | None = None
    hub_strategy: str = "every_save"
    hub_token: str | None = None
    hub_private_repo: bool | None = None
    hub_always_push: bool = False
    hub_revision: str | None = None

    def __post_init__(self):
        self._fill_defaults()
        self._validate()

    def _fill_defaults(self):
        if self.output_dir is None:
            self.output_dir = "trainer_output"
        self.output_dir = os.path.expanduser(self.output_dir)
        for name in DICT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, str) and value.lstrip().startswith("{"):
                setattr(self, name, json.loads(value))
        # The old name only fills the new one when the new one is unset; afterwards both agree.
        for old, new in (("gradient_checkpointing", "activation_checkpointing"),
                         ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs")):
            if getattr(self, new) is None and getattr(self, old) is not None:
                setattr(self, new, getattr(self, old))
            setattr(self, old, getattr(self, new))
        if self.activation_checkpointing is None:
            self.activation_checkpointing = self.gradient_checkpointing = False
        if self.use_cpu:  # "use_cpu: no pinned memory", as transformers' __post_init__
            self.dataloader_pin_memory = False
        if self.disable_tqdm is None:
            self.disable_tqdm = False  # transformers: True only if its logger is above WARNING
        if isinstance(self.include_num_input_tokens_seen, bool):
            seen = self.include_num_input_tokens_seen
            self.include_num_input_tokens_seen = "all" if seen else "no"
        if self.report_to is None or self.report_to == ["none"]:
            self.report_to = "none"
        if self.eval_strategy == "steps" and not self.eval_steps:
            self.eval_steps = self.logging_steps  # "eval_steps defaults to logging_steps"
        if self.metric_for_best_model is None and (
            self.load_best_model_at_end or self.lr_scheduler_type == "reduce_lr_on_plateau"
        ):
            self.metric_for_best_model = "loss"
        if self.greater_is_better is None and self.metric_for_best_model is not None:
            self.greater_is_better = not self.metric_for_best_model.endswith("loss")

    def _validate(self):
        if self.push_to_hub:
            _fail("push_to_hub", True, PUSH_NEEDS_NETWORK)
        self._validate_numbers()
        self._validate_choices()
        self._validate_strategies()
        self._validate_precision()
        self._validate_loader()
        self._validate_fsdp()
        self._validate_parallelism()
        if os.path.isfile(self.output_dir):
            _fail("output_dir", self.output_dir, "it is an existing file; pass a directory path")

    def _validate_numbers(self):
        for f in dataclasses.fields(self):  # inf and nan slip through every `< 0` check below
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                _fail(f.name, value, f"give a finite number (the default is {f.default!r}); a "
                      "nan/inf hyperparameter makes the weights nan/inf or the run endless")
        for name in ("per_device_train_batch_size", "per_device_eval_batch_size",
                     "gradient_accumulation_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                _fail(name, value, "it must be a whole number >= 1")
        if self.learning_rate < 0:
            _fail("learning_rate", self.learning_rate,
                  "a learning rate must be >= 0 (e.g. 2e-4 for LoRA)")
        if self.weight_decay < 0:
            _fail("weight_decay", self.weight_decay, "weight decay must be >= 0 (0.0 turns it off)")
        if self.warmup_steps < 0:
            _fail("warmup_steps", self.warmup_steps,
                  "use >= 1 for a step count or a float in [0, 1) for a ratio of the total steps")
        if self.warmup_steps > 1 and self.warmup_steps != int(self.warmup_steps):
            _fail("warmup_steps", self.warmup_steps,
                  "a value above 1 is a step count and must be whole")
        if not 0.0 <= self.label_smoothing_factor < 1.0:
            _fail("label_smoothing_factor", self.label_smoothing_factor, "use a value in [0, 1)")
        if self.peak_flops is not None and not self.peak_flops > 0:
            _fail("peak_flops", self.peak_flops, "give the device's peak FLOP/s (> 0, e.g. 989e12 "
                  "for an H100's dense bf16), or leave it unset for a matmul calibration")
        if self.ddp_timeout <= 0:
            _fail("ddp_timeout", self.ddp_timeout,
                  "give the process-group timeout in seconds (> 0)")

    def _validate_choices(self):
        _check_choice("lr_scheduler_type", self.lr_scheduler_type, SCHEDULER_NAMES)
        _check_choice("optim", self.optim, OPTIMIZER_NAMES)
        _check_choice("train_sampling_strategy", self.train_sampling_strategy,
                      ("random", "sequential", "group_by_length"))
        _check_choice("logging_strategy", self.logging_strategy, INTERVAL_STRATEGIES)
        _check_choice("eval_strategy", self.eval_strategy, INTERVAL_STRATEGIES)
        _check_choice("save_strategy", self.save_strategy, INTERVAL_STRATEGIES + ("best",))
        _check_choice("include_num_input_tokens_seen", self.include_num_input_tokens_seen,
                      ("no", "all", "non_padding"))
        _check_choice("nf4_dequantize", self.nf4_dequantize, ("per_call", "per_step"))
        for target in [self.report_to] if isinstance(self.report_to, str) else self.report_to:
            _check_choice("report_to", target, REPORT_TO)
        if self.lr_scheduler_kwargs is not None and not isinstance(self.lr_scheduler_kwargs, dict):
            _fail("lr_scheduler_kwargs", self.lr_scheduler_kwargs,
                  'pass a dict, e.g. {"num_cycles": 1}')

    def _validate_strategies(self):
        if self.logging_strategy == "steps":
            if self.logging_steps == 0:
                _fail("logging_steps", 0, 'logging_strategy="steps" needs a non-zero logging_steps')
            self.logging_steps = _check_steps("logging_steps", self.logging_steps)
        if self.eval_strategy == "steps":
            if not self.eval_steps:
                _fail("eval_steps", self.eval_steps,
                      'eval_strategy="steps" needs eval_steps or logging_steps')
            self.eval_steps = _check_steps("eval_steps", self.eval_steps)
        if self.save_strategy == "steps":
            self.save_steps = _check_steps("save_steps", self.save_steps)
        if self.save_strategy == "best" and self.metric_for_best_model is None:
            raise ValueError("`args.metric_for_best_model` must be provided when using 'best' "
                             "save_strategy (the metric that decides which checkpoint is best).")
        if self.lr_scheduler_type == "reduce_lr_on_plateau" and self.eval_strategy == "no":
            _fail("lr_scheduler_type", self.lr_scheduler_type,
                  'it steps on an eval metric: set eval_strategy="steps" or "epoch"')
        if self.load_best_model_at_end and self.save_strategy != "best":
            if self.eval_strategy != self.save_strategy:
                _fail("load_best_model_at_end", True,
                      f"it needs save_strategy ({self.save_strategy!r}) to equal eval_strategy "
                      f"({self.eval_strategy!r}), or save_strategy=\"best\"")
            if self.eval_strategy == "steps" and not _is_multiple(self.save_steps, self.eval_steps):
                _fail("save_steps", self.save_steps,
                      "load_best_model_at_end needs save_steps to be a multiple of eval_steps "
                      f"({self.eval_steps})")

    def _validate_loader(self):
        if self.dataloader_num_workers == 0 and (self.dataloader_persistent_workers
                                                 or self.dataloader_prefetch_factor is not None):
            _fail("dataloader_num_workers", 0, "dataloader_persistent_workers and "
                  "dataloader_prefetch_factor act on worker processes; set "
                  "dataloader_num_workers > 0, or leave them at their defaults")

    def _validate_precision(self):
        if self.fp16 and self.bf16:
            _fail("fp16", True, "fp16 and bf16 are both True; keep at most one")
        if self.fp16 and self.device.type != "cuda":
            # accelerate silently trains in fp32 when fp16 is asked for on a CPU; nanosft says so.
            _fail("fp16", True, "fp16 autocast with a GradScaler needs a CUDA device; on CPU use "
                  "bf16=True or leave both off")

    def _validate_fsdp(self):
        if self.fsdp in (None, False, "", []):  # FSDP off: both fields stay as given, as in
            return  # transformers, and the product layer's FSDP module stays unimported
        # transformers' normalisation (fsdp_ prefix stripped, legacy strings); unknown keys refused
        from nanosft.parallel.fsdp import check_fsdp_options, normalize_fsdp_config

        self.fsdp, self.fsdp_config = True, normalize_fsdp_config(self.fsdp, self.fsdp_config)
        check_fsdp_options(self)

    def _validate_parallelism(self):
        if self.parallelism_config is None:  # the parallel package stays unimported
            return
        from nanosft.parallel.fsdp import check_fsdp_options
        from nanosft.parallel.mesh import as_parallelism_config, check_parallelism

        self.parallelism_config = as_parallelism_config(self.parallelism_config)
        check_parallelism(self.parallelism_config, self.world_size)
        sizes = self.parallelism_config
        if self.fsdp and sizes.dp_shard_size * sizes.cp_size == 1:
            _fail("fsdp", True, "with parallelism_config, FSDP2 shards over dp_shard_size x "
                  "cp_size ranks, which is 1 here; set dp_shard_size or drop fsdp")
        check_fsdp_options(self, "parallelism_config")  # DTensor parameters: the same limits

    # ----- distributed environment (torchrun sets WORLD_SIZE / RANK / LOCAL_RANK) -----
    @property
    def world_size(self) -> int:
        """Number of processes in the job (torchrun WORLD_SIZE, 1 without torchrun).
        Guide: distributed training | Mirrors: transformers TrainingArguments.world_size"""
        return int(os.environ.get("WORLD_SIZE", "1"))

    @property
    def process_index(self) -> int:
        """Global rank of this process (torchrun RANK).
        Guide: distributed training | Mirrors: transformers TrainingArguments.process_index"""
        return int(os.environ.get("RANK", "0"))

    @property
    def local_process_index(self) -> int:
        """Rank of this process on its node (torchrun LOCAL_RANK); picks the GPU.
        Guide: distributed training | Mirrors: transformers TrainingArguments.local_process_index"""
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def should_save(self) -> bool:
        """Whether this process writes shared files (only the main process does).
        Mirrors: transformers TrainingArguments.should_save"""
        return self.process_index == 0

    @property
    def device(self) -> torch.device:
        """cuda:LOCAL_RANK when CUDA is there and use_cpu is off, else cpu.
        Mirrors: transformers TrainingArguments.device
        Differs: no accelerate PartialState, no MPS/XPU."""
        if torch.cuda.is_available() and not self.use_cpu:
            return torch.device("cuda", self.local_process_index)
        return torch.device("cpu")

    @property
    def n_gpu(self) -> int:
        """GPUs used by this process: 1 on CUDA, 0 on CPU (nanosft never uses DataParallel).
        Mirrors: transformers TrainingArguments.n_gpu"""
        return 1 if self.device.type == "cuda" else 0

    @property
    def train_batch_size(self) -> int:
        """Micro-batch size of one process (walkthrough 1: `self._train_batch_size`).
        Mirrors: transformers TrainingArguments.train_batch_size"""
        return self.per_device_train_batch_size

    @property
    def eval_batch_size(self) -> int:
        """Evaluation batch size of one process.
        Mirrors: transformers TrainingArguments.eval_batch_size"""
        return self.per_device_eval_batch_size

    def get_warmup_steps(self, num_training_steps: int) -> int:
        """Warmup length in optimizer steps: `int(w)` if w >= 1, else ceil(num_training_steps * w).
        Guide: optimizers and schedulers | Mirrors: TrainingArguments.get_warmup_steps"""
        if self.warmup_steps >= 1:
            return int(self.warmup_steps)
        return math.ceil(num_training_steps * self.warmup_steps)

    # ----- serialisation -----
    def to_dict(self) -> dict:
        """All fields as a plain, JSON-ready dict.
        Mirrors: transformers TrainingArguments.to_dict (a *_token value written as <NAME>)"""
        d = {f.name: _jsonable(getattr(self, f.name)) for f in dataclasses.fields(self)}
        return {k: f"<{k.upper()}>" if k.endswith("_token") and v is not None else v
                for k, v in d.items()}  # a token never reaches training_args.json

    def to_json_string(self) -> str:
        """The fields as indented, key-sorted JSON (what training_args.json holds).
        Mirrors: transformers TrainingArguments.to_json_string"""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, values: dict, source: str = "the config"):
        """Build from a dict, refusing unknown keys by name (with the closest known field).
        Mirrors: transformers HfArgumentParser.parse_dict
        Differs: transformers' parse_dict raises on unknown keys without suggestions."""
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in values if k not in known and k not in cls.not_supported]
        if unknown:
            hints = []
            for key in unknown:
                close = difflib.get_close_matches(key, known, n=1)
                hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise ValueError(f"{source} has keys {cls.__name__} does not know: {', '.join(hints)}. "
                             f"Remove or rename them.")
        return cls(**values)

    @classmethod
    def from_json_file(cls, path: str):
        """Build from a JSON file holding one object of field values; errors name the file and line.
        Mirrors: transformers HfArgumentParser.parse_json_file"""
        with open(path, encoding="utf-8") as f:
            text = f.read()
        try:
            values = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: line {e.lineno} column {e.colno}: not valid JSON "
                             f"({e.msg})") from e
        if not isinstance(values, dict):
            raise TypeError(f"{path}: expected a JSON object of field values, got "
                            f"{type(values).__name__}")
        return cls.from_dict(values, source=path)


def _is_multiple(save_steps, eval_steps) -> bool:
    # Ratios are compared on an integer grid so 0.3 % 0.1 is not a float-rounding false alarm.
    scale = 1_000_000
    return round(save_steps * scale) % round(eval_steps * scale) == 0


def _jsonable(value):
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if callable(getattr(value, "to_dict", None)):  # parallelism_config
        return _jsonable(value.to_dict())
    return str(value)


@_refuses({**TRAINING_ARGS_NOT_SUPPORTED, **SFT_CONFIG_NOT_SUPPORTED})
@dataclass
class SFTConfig(TrainingArguments):
    """TrainingArguments plus the dataset and loss settings of supervised fine-tuning.
    Mirrors: trl SFTConfig (1.16: lr 2e-5, logging_steps 10, checkpointing on)
    Differs: bf16 (None -> not fp16) is accepted on CPU; pad_to_multiple_of has no "auto"."""

    # CPU autocast runs bf16 on any CPU: fast with bf16 matrix units (avx512_bf16 or amx_bf16 in
    # /proc/cpuinfo; 1.6-1.85x fp32 on such a 2-core CPU, benchmarks/README.md), slow without
    # them: pass bf16=False there.
    # TRL's pad_to_multiple_of="auto" means 128 on Neuron, else None; nanosft has no Neuron path.
    learning_rate: float = 2e-5
    logging_steps: float = 10
    gradient_checkpointing: bool | None = True
    bf16: bool | None = None
    # Dataset preparation (TRL SFTTrainer._prepare_dataset).
    dataset_text_field: str = "text"
    max_length: int | None = 1024
    truncation_mode: str = "keep_start"
    shuffle_dataset: bool = False
    packing: bool = False
    packing_strategy: str = "bfd"
    padding_free: bool = False
    pad_to_multiple_of: int | None = None
    completion_only_loss: bool | None = None
    assistant_only_loss: bool = False
    eos_token: str | None = None
    pad_token: str | None = None
    # "nll", or "dft" (each token's NLL weighted by its probability, arXiv 2508.05629);
    # "chunked_nll" is TRL 1.16's deprecated alias of "nll"
    loss_type: str = "nll"
    eval_packing: bool | None = None  # None: as packing
    # MoE models: the load-balancing loss's weight; None: the model config's, 0.0: off
    router_aux_loss_coef: float | None = None
    # a .jinja / .j2 file whose template replaces the tokenizer's (TRL also takes a tokenizer folder
    # or Hub id, cloning its template, tokens and EOS into model and tokenizer; refused here)
    chat_template_path: str | None = None
    # from_pretrained keywords (dtype, quantization_config, device_map, revision) for a model id
    model_init_kwargs: dict | str | None = None
    # {"skip_prepare_dataset": True}: the datasets go to the collator as given (already tokenized,
    # truncated and labelled, or a with_transform dataset that yields such rows)
    dataset_kwargs: dict | str | None = None

    def __post_init__(self):
        if self.bf16 is None:
            self.bf16 = not self.fp16
        if isinstance(self.model_init_kwargs, str):  # a JSON string from the command line
            self.model_init_kwargs = json.loads(self.model_init_kwargs)
        if isinstance(self.dataset_kwargs, str):
            self.dataset_kwargs = json.loads(self.dataset_kwargs)
        unknown = sorted(set(self.dataset_kwargs or {}) - {"skip_prepare_dataset"})
        if unknown:
            _fail("dataset_kwargs", self.dataset_kwargs,
                  f"TRL 1.16 reads only 'skip_prepare_dataset' from it, not {unknown}")
        if self.loss_type == "chunked_nll":
            warnings.warn("loss_type='chunked_nll' is deprecated (as in TRL 1.16); it is "
                          "loss_type='nll'.", FutureWarning, stacklevel=3)
            self.loss_type = "nll"
        super().__post_init__()
        bad_length = not isinstance(self.max_length, int) or self.max_length < 1
        if self.max_length is not None and bad_length:
            _fail("max_length", self.max_length,
                  "use a whole number of tokens >= 1, or None for no truncation")
        _check_choice("packing_strategy", self.packing_strategy, ("bfd", "bfd_split", "wrapped"))
        _check_choice("truncation_mode", self.truncation_mode, ("keep_start", "keep_end"))
        _check_choice("loss_type", self.loss_type, ("nll", "dft"))
        if self.pad_to_multiple_of is not None and self.pad_to_multiple_of < 1:
            _fail("pad_to_multiple_of", self.pad_to_multiple_of, "use a whole number >= 1 or None")

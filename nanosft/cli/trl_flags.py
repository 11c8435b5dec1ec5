"""The `trl sft` flags on `nanosft train`: TRL's ScriptArguments and ModelConfig names.

`add_trl_flags` gives `nanosft train` the flags of trl's `examples/scripts/sft.py` that nanosft
does not already have under the same name (--lora_r, --lora_alpha, --lora_dropout, --use_dora,
--use_rslora and the SFTConfig fields already are flags); `apply_trl_flags` turns them into
nanosft's own (--model, --data, --eval_data, --full, --qlora, LoraConfig fields such as
--lora_target_parameters -> target_parameters, LoRA on MoE experts) before the configs are built,
so `trl sft ARGS` and `nanosft train ARGS` run the same. A TRL flag nanosft does not act on is
refused by name with its reason. Standard library only until a dataset is loaded.
"""

import argparse
import os

from nanosft.cli.flags import value_parser

DATA_FILES = (".jsonl", ".json", ".csv", ".parquet")
# trl ModelConfig's LoRA defaults, used when --model_name_or_path is given (a `trl sft` command
# line): a TRL user's `--use_peft` alone means r=16, lora_alpha=32, lora_dropout=0.05, not peft's
# LoraConfig defaults (r=8, lora_alpha=8, lora_dropout=0.0) that `nanosft train --model` keeps.
TRL_LORA_DEFAULTS = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.05}
# TRL flags nanosft does not act on: (TRL's default, which is accepted, and the reason)
REFUSED = {
    "model_revision": ("main", "give a local folder or a cached Hub id at the revision you want"),
    "attn_implementation": (None, "nanosft has one attention (torch SDPA); drop the flag"),
    "trust_remote_code": ("false", "nanosft runs no model code from the Hub; drop the flag"),
    "lora_task_type": ("CAUSAL_LM", "nanosft trains causal LMs only (CAUSAL_LM)"),
    "load_in_8bit": ("false", "nanosft quantizes to 4 bits only: use --load_in_4bit"),
    "bnb_4bit_quant_storage": (None, "nanosft stores 4-bit codes as uint8 only"),
    "dataset_streaming": ("false", "nanosft reads the whole dataset; drop the flag"),
    "ignore_bias_buffers": ("false", "a DDP workaround nanosft's models do not need"),
    "datasets": (None, "dataset mixtures are not supported; use --dataset_name"),
}


def add_trl_flags(parser):
    """TRL's ScriptArguments / ModelConfig flags nanosft lacks (dest `trl.<name>`, unset unless
    given); the refused ones parse so that their refusal names them.
    Mirrors: trl TrlParser((ScriptArguments, SFTConfig, ModelConfig, DatasetMixtureConfig))"""
    group = parser.add_argument_group("`trl sft` flags (TRL ScriptArguments / ModelConfig)")
    flag_bool = value_parser("flag", bool)

    def add(name, help, **kwargs):
        group.add_argument(f"--{name}", dest=f"trl.{name}", default=argparse.SUPPRESS,
                           help=help, **kwargs)

    add("model_name_or_path", "the model folder or cached Hub id (= --model)")
    add("dataset_name", "a .jsonl/.json/.csv/.parquet file, a dataset folder, or a dataset in the "
        "local datasets cache (with HF_HUB_OFFLINE=1)")
    add("dataset_config", "the datasets.load_dataset name= of --dataset_name")
    add("dataset_train_split", "default: 'train'")
    add("dataset_test_split", "default: 'test' (used when --eval_strategy is not 'no')")
    for name, help in (("use_peft", "LoRA; without it the full model trains, as in TRL"),
                       ("load_in_4bit", "QLoRA: quantize the base to 4 bits (needs --use_peft)"),
                       ("use_bnb_nested_quant", "double quantization (default: false)")):
        add(name, help, type=flag_bool, nargs="?", const=True, metavar="BOOL")
    add("lora_target_modules", "LoraConfig target_modules (= --target_modules)", nargs="+")
    # a list as given (one name too), as trl get_peft_config passes it to LoraConfig
    add("lora_target_parameters", "LoraConfig target_parameters (= --target_parameters): LoRA on "
        "parameters such as MoE experts' mlp.experts.gate_up_proj", nargs="+")
    add("lora_modules_to_save", "LoraConfig modules_to_save (= --modules_to_save)", nargs="+")
    add("bnb_4bit_quant_type", "default: 'nf4'", choices=("nf4", "fp4"))
    add("dtype", "the model's load dtype (default: float32)",
        choices=("auto", "bfloat16", "float16", "float32"))
    for name in REFUSED:
        add(name, f"refused: {REFUSED[name][1]}", nargs="?", const="true")


def apply_trl_flags(args):
    """Rewrite the TRL flags on `args` as nanosft's: --model, --data / --eval_data (a path or a
    datasets.Dataset), --full or LoRA with TRL's defaults, --qlora with its quantization_config,
    and the load dtype. Errors name the flags.
    Mirrors: trl.scripts.sft.main (get_peft_config, get_quantization_config, load_dataset)"""
    trl = {k[len("trl."):]: v for k, v in vars(args).items() if k.startswith("trl.")}
    for name, (default, reason) in REFUSED.items():
        if name in trl and str(trl[name]).lower() != str(default).lower():
            raise ValueError(f"--{name} {trl[name]}: not supported by nanosft train; {reason}")
    if trl.get("bnb_4bit_quant_type", "nf4") != "nf4" or "use_bnb_nested_quant" in trl:
        if not trl.get("load_in_4bit"):
            raise ValueError("--bnb_4bit_quant_type / --use_bnb_nested_quant set the 4-bit "
                             "quantization; add --load_in_4bit")
    _move(args, trl, "model_name_or_path", "model", "--model")
    if len(trl.get("lora_target_modules", ())) == 1:  # as trl ModelConfig.__post_init__
        trl["lora_target_modules"] = trl["lora_target_modules"][0]  # e.g. "all-linear"
    _move(args, trl, "lora_target_modules", "LoraConfig.target_modules", "--target_modules")
    _move(args, trl, "lora_target_parameters", "LoraConfig.target_parameters",
          "--target_parameters")
    _move(args, trl, "lora_modules_to_save", "LoraConfig.modules_to_save", "--modules_to_save")
    if "dataset_name" in trl:
        if args.data is not None:
            raise ValueError("--data and --dataset_name both name the train data; give one")
        args.data, test = load_trl_dataset(trl["dataset_name"], trl.get("dataset_config"),
                                           trl.get("dataset_train_split", "train"),
                                           trl.get("dataset_test_split", "test"))
        args.trl_test_split = test  # taken once eval_strategy is known: trl_eval_data
    if args.model is None or args.data is None:
        raise ValueError("give the model (--model or --model_name_or_path) and the train data "
                         "(--data or --dataset_name)")
    if "dtype" in trl:
        args.model_dtype = trl["dtype"]
    if "model_name_or_path" in trl:  # a `trl sft` command line: TRL's meaning of its flags
        if not trl.get("use_peft") and not (args.qlora or args.dora or args.prompt_tuning):
            args.full = True  # trl get_peft_config returns None: the full model trains
        args.lora_defaults = dict(TRL_LORA_DEFAULTS)
    if trl.get("load_in_4bit"):
        if args.full:
            raise ValueError("--load_in_4bit quantizes a base that only LoRA can train; add "
                             "--use_peft (TRL's 'Works only with LoRA')")
        from nanosft import nf4

        compute = trl.get("dtype") if trl.get("dtype") not in (None, "auto") else None
        # trl get_quantization_config: compute dtype = --dtype, quant type and nesting as given
        args.qlora, args.quantization_config = True, nf4.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_compute_dtype=compute,
            bnb_4bit_quant_type=trl.get("bnb_4bit_quant_type", "nf4"),
            bnb_4bit_use_double_quant=bool(trl.get("use_bnb_nested_quant", False)))


def trl_eval_data(args, sft_config):
    """--dataset_test_split as the eval data when evaluation is on and no --eval_data is given.
    Mirrors: trl.scripts.sft.main (dataset[test_split] if eval_strategy != "no" else None)"""
    if args.trl_test_split is not None and args.eval_data is None and \
            sft_config.eval_strategy != "no":
        args.eval_data = args.trl_test_split()


def _move(args, trl, name, dest, ours):
    """Copy TRL's `--name` to nanosft's flag `ours` (dest `dest`); both given is an error."""
    if name not in trl:
        return
    if getattr(args, dest, None) is not None:
        raise ValueError(f"{ours} and --{name} are the same setting; give one of them")
    setattr(args, dest, trl[name])


def load_trl_dataset(name, config, train_split, test_split):
    """(train data, a function giving the test split) of --dataset_name: a data file is passed on
    as a path (its one split is 'train'), a folder or cached dataset is loaded with datasets.
    Mirrors: trl.scripts.sft.main's load_dataset(dataset_name, name=dataset_config)"""
    if os.path.isfile(name):
        if not name.endswith(DATA_FILES):
            raise ValueError(f"--dataset_name {name}: a data file must end in "
                             f"{', '.join(DATA_FILES)}")

        def file_split(split):
            if split != "train":  # datasets.load_dataset(file) has the one split "train"
                raise ValueError(f"--dataset_name {name} is one file, whose only split is "
                                 f"'train', not {split!r}; give --eval_data FILE for evaluation, "
                                 "or --eval_strategy no")
            return name

        return file_split(train_split), lambda: file_split(test_split)
    splits = _load_dataset_dict(name, config)

    def pick(split):
        if split not in splits:
            raise ValueError(f"--dataset_name {name} has no split {split!r} (it has "
                             f"{', '.join(splits)}); set --dataset_train_split / "
                             "--dataset_test_split, or --eval_strategy no")
        return splits[split]

    return pick(train_split), lambda: pick(test_split)


def _load_dataset_dict(name, config):
    """A DatasetDict from a save_to_disk folder, a folder of data files, or (offline) the cache."""
    import datasets

    if os.path.isdir(name) and os.path.isfile(os.path.join(name, "dataset_dict.json")):
        return datasets.load_from_disk(name)
    if not os.path.isdir(name) and os.environ.get("HF_HUB_OFFLINE", "") in ("", "0") \
            and os.environ.get("HF_DATASETS_OFFLINE", "") in ("", "0"):
        raise ValueError(f"--dataset_name {name}: not a local file or folder. nanosft train never "
                         "downloads data: set HF_HUB_OFFLINE=1 to read it from the local datasets "
                         "cache, or give a .jsonl/.json/.csv/.parquet file")
    try:
        return datasets.load_dataset(name, name=config)
    except Exception as error:  # datasets raises many kinds; the user needs the name and the fix
        raise ValueError(f"--dataset_name {name}: datasets.load_dataset could not load it offline "
                         f"({type(error).__name__}: {error}); give a local data file or "
                         "folder") from None

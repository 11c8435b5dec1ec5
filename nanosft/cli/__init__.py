"""The `nanosft` command line (`python -m nanosft`): demo, train, generate, chat, merge, memory.

A thin door over the library: `train` builds an SFTConfig / LoraConfig from flags (one typed flag
per dataclass field, nanosft.cli.flags) and a JSON config file, then runs SFTTrainer (walkthrough
1: SFTTrainer.__init__ -> trainer.train()); `demo` does the same on the embedded default model
(nanosft.cli.demo); `generate` and `chat` stream replies (nanosft.cli.streamer). `--model` /
`--adapter` take a folder or a Hub id from the local Hugging Face cache. Mistakes a user can make
(bad path, bad JSONL line, bad value) end in a one-paragraph message on stderr and exit status 2;
NANOSFT_DEBUG=1 shows the traceback instead. `--trace` / NANOSFT_TRACE=1 prints the walkthrough
trace. Torch is imported only once a command runs, so `nanosft --help` and a mistyped flag answer
at once.
"""

import argparse
import difflib
import functools
import logging
import os
import shutil
import sys
import tempfile

# the flag machinery and the streamer, re-exported so their names import from here too
from nanosft.cli.flags import (  # noqa: F401
    FALSE, FIXED_FIELDS, FLAG_ALIASES, TRUE, add_dataclass_flags, check_value_types, collect,
    read_config_file, value_parser)
from nanosft.cli.streamer import make_streamer, stream_reply  # noqa: F401


def _trace():
    """nanosft.monitoring.trace, imported when a command runs (it imports torch)."""
    from nanosft.monitoring import trace

    return trace


# ----------------------------------------------------------------------------- loading models

def resolve_folder(flag, name):
    """The local folder of --model / --adapter: the folder itself or the Hub id's cached snapshot.
    Mirrors: transformers cached_files (a repo id or a path)"""
    from nanosft.io import hub

    return hub.resolve_pretrained_path(name, what=flag)  # refuses a half-moved final save too


def load_model(model_dir, adapter_dir=None, load_in_4bit=False, device="cpu", dtype=None,
               quantization_config=None):
    """A CausalLM (fp32 or `dtype`; NF4 when asked, or as `quantization_config` says) from a folder
    or Hub id, with a PEFT adapter when given.
    Mirrors: AutoModelForCausalLM.from_pretrained + PeftModel.from_pretrained"""
    from nanosft import nf4
    from nanosft.families.auto import AutoConfig, causal_lm_class
    from nanosft.peft import PeftModelForCausalLM

    given = os.fspath(model_dir)  # a Hub id stays the id in adapter_config.json, as transformers
    model_dir = resolve_folder("--model", model_dir)
    adapter_dir = None if adapter_dir is None else resolve_folder("--adapter", adapter_dir)
    # QLoRA's 4-bit options; each linear weight is quantized as it is read (no fp32 copy)
    if load_in_4bit and quantization_config is None:
        quantization_config = nf4.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)
    config = AutoConfig.from_pretrained(model_dir)  # the family's classes, by model_type
    model = causal_lm_class(config).from_pretrained(model_dir, config=config, dtype=dtype,
                                                    device_map=device,
                                                    quantization_config=quantization_config)
    model.name_or_path = given  # transformers keeps the name it was given (_name_or_path)
    if adapter_dir is not None:
        model = PeftModelForCausalLM.from_pretrained(model, adapter_dir)
    return model.eval()


def load_tokenizer(model_dir):
    """The tokenizer (tokenizer.json, chat template) of a model folder or Hub id.
    Mirrors: AutoTokenizer.from_pretrained"""
    from nanosft.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(resolve_folder("--model", model_dir))


def pick_device(name):
    """"cpu" / "cuda" as asked (an error if CUDA is missing), else cuda when available.
    Mirrors: TrainingArguments.device"""
    import torch

    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible to torch; use --device cpu")
    return name or ("cuda" if torch.cuda.is_available() else "cpu")


# ----------------------------------------------------------------------------- demo

def run_demo(args):
    """QLoRA SFT of the embedded default, with before/after held-out answers.
    Mirrors: a TRL QLoRA recipe run by `trl sft`"""
    from nanosft.cli import demo

    if args.full and (args.dora or args.no_quant):
        raise ValueError("--full trains every weight of a full-precision model; drop --dora / "
                         "--no-quant")
    mode = "full" if args.full else ("dora" if args.dora else "lora") if args.no_quant else \
        ("qdora" if args.dora else "qlora")
    import torch

    device, before = pick_device(args.device), torch.get_num_threads()
    if device == "cpu":
        threads = demo.pick_threads(args.threads)
        why = "--threads" if args.threads else \
            "a tiny model: its matmuls are too small to split; --threads N for more"
        print(f"nanosft demo: {threads} torch thread{'s' * (threads > 1)} on the CPU ({why})")
    try:
        return demo.run(output_dir=args.output_dir, mode=mode, device=device,
                        steps=args.steps, report_to=args.report_to, trace=_trace().is_enabled(),
                        overwrite_output_dir=args.overwrite_output_dir)
    finally:  # called in-process (a test, a notebook): the caller's thread count again
        torch.set_num_threads(before)


# ----------------------------------------------------------------------------- train

def build_train_configs(args, sft_names, lora_names):
    """(SFTConfig, LoraConfig | PromptTuningConfig | None) from --config then the flags (flags win).
    Mirrors: trl TrlParser (config file, then command line)"""
    from nanosft.args import SFTConfig
    from nanosft.peft import LoraConfig, PromptTuningConfig

    allowed = {**dict.fromkeys(sft_names, "sft"), **dict.fromkeys(lora_names, "lora"),
               "num_virtual_tokens": "pt"}
    from_file = read_config_file(args.config, allowed) if args.config else {}
    for cls in (SFTConfig, LoraConfig):
        check_value_types(f"--config {args.config}", from_file, cls)
    values = {"sft": {}, "lora": {}, "pt": {}}
    for key, value in from_file.items():
        values[allowed[key]][key] = value
    values["sft"].update(collect(args, "SFTConfig."))
    sizes = collect(args, "ParallelismConfig.")  # --tp_size 2 ...: one parallelism_config
    if sizes:
        values["sft"]["parallelism_config"] = {**(values["sft"].get("parallelism_config")
                                                  or {}), **sizes}
    values["lora"].update(collect(args, "LoraConfig."))
    for key, value in args.lora_defaults.items():  # `trl sft` flags: TRL ModelConfig's defaults
        values["lora"].setdefault(key, value)
    if args.num_virtual_tokens is not None:
        values["pt"]["num_virtual_tokens"] = args.num_virtual_tokens
    if not values["sft"].get("output_dir"):
        raise ValueError("--output_dir is required (where the adapter or model, metrics.jsonl and "
                         "checkpoints go)")
    chosen = [name for name in ("qlora", "full", "prompt_tuning") if getattr(args, name)]
    if len(chosen) > 1:
        raise ValueError(f"--{' and --'.join(chosen)} cannot be combined; pick one way to train")
    if args.dora:
        values["lora"]["use_dora"] = True
    if str(values["sft"].get("resume_from_checkpoint")).lower() in ("true", "latest"):
        values["sft"]["resume_from_checkpoint"] = True  # the latest valid checkpoint
    # the command line reports what a run did (tokens/s, MFU, the ledger, metrics.jsonl) unless
    # --report_to says otherwise; SFTConfig's own default is transformers' "none"
    values["sft"].setdefault("report_to", "nanosft")
    if _trace().is_enabled():
        values["sft"].setdefault("disable_tqdm", True)  # a progress bar would cut the trace lines
    sft_config = SFTConfig(**values["sft"])
    if args.full:
        return sft_config, None
    if args.prompt_tuning:
        n_tokens = values["pt"].get("num_virtual_tokens", 8)
        return sft_config, PromptTuningConfig(num_virtual_tokens=n_tokens)
    return sft_config, LoraConfig(**values["lora"])  # peft's defaults: r=8, lora_alpha=8, q/v_proj


def run_train(args):
    """SFT of --model on --data: SFTTrainer.__init__, trainer.train(); under torchrun rank 0 saves.
    Mirrors: `trl sft` (trl.scripts.sft.main)"""
    from nanosft.cli.trl_flags import apply_trl_flags, trl_eval_data
    from nanosft.run import output_folder

    apply_trl_flags(args)  # `trl sft` flags -> nanosft's (--model_name_or_path -> --model, ...)
    sft_config, peft_config = build_train_configs(args, args.sft_names, args.lora_names)
    trl_eval_data(args, sft_config)
    args.resume_hint_dir = sft_config.output_dir  # for the Ctrl-C line in main()
    if sft_config.fsdp and int(os.environ.get("WORLD_SIZE", "1")) < 2:
        raise ValueError("--fsdp shards the model over several processes, but this one runs "
                         "alone; launch it with torchrun, e.g. `torchrun --nproc_per_node 2 -m "
                         "nanosft train ...` (the same flags), or drop --fsdp for one process")
    # one run per --output_dir: locked before the guard below looks at the folder (two runs
    # started at once would both pass it), held through the final save; writable, or stop here
    with output_folder.hold_output_dir(sft_config, command_line=True):
        try:
            return _train(args, sft_config, peft_config)
        except BaseException:
            from nanosft import distributed

            distributed.cleanup(barrier=False)  # a gloo group left open can abort at exit
            raise


def _train(args, sft_config, peft_config):
    """run_train's body, inside the output_dir lock: checks, load, train, save, summary."""
    from nanosft import distributed
    from nanosft.data import check_data_path
    from nanosft.run import preflight
    from nanosft.sft import SFTTrainer

    _check_output_dir(sft_config)
    # what the run needs at its end (eval data, the best-model metric), before the model loads
    preflight.check_eval_data(sft_config.eval_strategy, args.eval_data, command_line=True,
                              eval_on_start=sft_config.eval_on_start)
    preflight.check_metric_name(sft_config.metric_for_best_model,
                                preflight.known_eval_metrics(SFTTrainer), command_line=True)
    for flag, path in (("--data", args.data), ("--eval_data", args.eval_data)):
        if isinstance(path, str):  # not a --dataset_name Dataset
            check_data_path(path, flag)
    model = load_model(args.model, load_in_4bit=args.qlora, device=sft_config.device,
                       dtype=args.model_dtype, quantization_config=args.quantization_config)
    model.train()
    tokenizer = load_tokenizer(args.model)
    trainer = SFTTrainer(model, args=sft_config, train_dataset=args.data,
                         eval_dataset=args.eval_data, processing_class=tokenizer,
                         peft_config=peft_config)
    _trace().attach(trainer)
    result = trainer.train()
    # adapter (PEFT format) or the model, and the tokenizer; every rank: FSDP gathers the shards
    trainer.save_model(sft_config.output_dir)
    if distributed.is_main_process():
        from nanosft.monitoring.callbacks import report_targets, speed_summary

        if "tensorboard" in report_targets(sft_config):
            _tensorboard(sft_config.output_dir)
        kind = "adapter" if peft_config is not None else "model"
        print(f"saved the {kind} and tokenizer to {sft_config.output_dir} "
              f"(train_loss {result.training_loss:.4f}, {result.global_step} steps)")
        print(speed_summary(trainer, result.metrics))  # model GFLOP/s and MFU
    del trainer, model  # the DDP wrapper's reducer holds the group: freed before it (cleanup)
    distributed.cleanup()
    return 0


def _check_output_dir(sft_config):
    """Before the model loads: resolve --resume_from_checkpoint (a folder, or the latest valid
    checkpoint), and refuse a fresh run in a folder holding another run; errors name the flags."""
    from nanosft.run import output_folder

    sft_config.resume_from_checkpoint = output_folder.resolve_resume_checkpoint(
        sft_config.resume_from_checkpoint, sft_config.output_dir, command_line=True)
    if sft_config.resume_from_checkpoint is None and \
            not output_folder.overwrite_requested(sft_config):
        refusal = output_folder.output_dir_refusal(sft_config.output_dir, command_line=True)
        if refusal:
            raise ValueError(refusal)


def _tensorboard(output_dir):
    import importlib.util

    log_dir = os.path.join(output_dir, "runs")
    if importlib.util.find_spec("tensorboard") is not None:  # the Trainer wrote them as it logged
        print(f"TensorBoard events: {log_dir}  (tensorboard --logdir {log_dir})")


# ----------------------------------------------------------------------------- generate, chat

def _check_sampling_flags(args):
    """Refuse sampling flags transformers' logits warpers refuse, before the model loads."""
    if not args.temperature >= 0:  # nan too
        raise ValueError(f"--temperature {args.temperature}: must be 0 (greedy, the default) or "
                         "positive (sampling; transformers refuses a temperature that is not "
                         "strictly positive)")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise ValueError(f"--top_p {args.top_p}: must be in (0, 1]")
    if args.top_k is not None and args.top_k < 0:
        raise ValueError(f"--top_k {args.top_k}: must be 0 (off) or positive")
    if args.max_new_tokens < 0:
        raise ValueError(f"--max_new_tokens {args.max_new_tokens}: must be 0 or positive")


def run_generate(args):
    """One chat-templated prompt -> streamed reply.
    Mirrors: model.generate(**tokenizer.apply_chat_template(...))"""
    _check_sampling_flags(args)
    if args.no_chat_template and not args.prompt:
        raise ValueError("--prompt is empty: with --no_chat_template the text is fed as it is, and "
                         "an empty text has no tokens; give a non-empty --prompt")
    model = load_model(args.model, args.adapter, args.load_in_4bit, pick_device(args.device))
    messages = [{"role": "user", "content": args.prompt}]
    stream_reply(model, load_tokenizer(args.model), messages, args)
    return 0


def run_chat(args):
    """An interactive chat: a user turn per stdin line, replies streamed, history kept, ends at EOF.
    Mirrors: `transformers chat` | Differs: an empty line resets the history; no slash commands."""
    _check_sampling_flags(args)
    model = load_model(args.model, args.adapter, args.load_in_4bit, pick_device(args.device))
    tokenizer = load_tokenizer(args.model)
    messages = []
    interactive = sys.stdin.isatty()
    if interactive:
        print("chat with the model; an empty line resets the history, Ctrl-D ends")
    while True:
        if interactive:
            print("you> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line:
            return 0
        if not line.strip():
            messages = []
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        print("assistant> ", end="", flush=True)
        reply = stream_reply(model, tokenizer, messages, args)
        messages.append({"role": "assistant", "content": reply})


def run_merge(args):
    """Fold the adapter into the full-precision base and write a Hugging Face folder transformers
    loads. Mirrors: peft merge_and_unload + save_pretrained"""
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise FileExistsError(f"--out {args.out} is a file, not a folder; give a new folder "
                              "(nothing is overwritten)")
    if os.path.exists(args.out) and os.listdir(args.out):
        raise FileExistsError(f"--out {args.out} exists and is not empty; give a new folder "
                              "(nothing is overwritten)")
    parent = os.path.dirname(os.path.abspath(args.out))
    try:  # the temp folder beside --out, made before the model loads: can --out be written?
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=parent, prefix=".merge-")
    except OSError as e:
        raise OSError(e.errno, f"--out {args.out} cannot be written ({(e.strerror or str(e))} "
                               f"in {parent}); give a folder you can write to") from e
    try:
        from nanosft.io.hub import default_mode

        model = load_model(args.model, args.adapter).merge_and_unload()
        os.chmod(tmp, default_mode(folder=True))  # mkdtemp makes 0700; as mkdir would instead
        try:
            model.save_pretrained(tmp)
            load_tokenizer(args.model).save_pretrained(tmp)
            if os.path.isdir(args.out):
                os.rmdir(args.out)  # empty, checked above
            os.replace(tmp, args.out)
        except OSError as e:
            raise OSError(e.errno, f"--out {args.out}: writing the merged model failed "
                                   f"({e.strerror or e}); nothing was left there. Free space or "
                                   "pick another --out") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"merged {args.adapter} into {args.model}: {args.out}")
    return 0


# ----------------------------------------------------------------------------- memory

def _fsdp_ranks(fsdp, nproc_per_node) -> int:
    """The ranks `memory --fsdp VALUE [--nproc_per_node N]` shards over: --fsdp reads as train's
    (true, full_shard, shard_grad_op, false); the count is torchrun's --nproc_per_node."""
    value = str(fsdp).strip().lower()
    if value.isdigit():
        raise ValueError(f"--fsdp {fsdp}: --fsdp takes what `nanosft train --fsdp` takes (true, "
                         "full_shard, false); give the number of ranks as --nproc_per_node "
                         f"{fsdp}, e.g. `nanosft memory --model M --fsdp true --nproc_per_node "
                         f"{fsdp}`")
    if value in ("", "false", "no", "0", "none"):
        return 1
    if value not in ("true", "yes", "full_shard", "shard_grad_op"):
        raise ValueError(f"--fsdp {fsdp}: use true, full_shard, shard_grad_op or false")
    ranks = 2 if nproc_per_node is None else nproc_per_node
    if ranks < 1:
        raise ValueError(f"--nproc_per_node {ranks}: give a positive number of ranks")
    return ranks


def run_memory(args):
    """Print the memory ledger of a run on --model's config.json (no weights are read).
    Mirrors: `accelerate estimate-memory` (which stops at weights and Adam)"""
    from nanosft import memory
    from nanosft.families.auto import AutoConfig
    from nanosft.reference import reference_mode_enabled

    chosen = [name for name in ("full", "lora", "qlora") if getattr(args, name)]
    if args.full and (args.dora or len(chosen) > 1):
        raise ValueError(f"--{' and --'.join(chosen + ['dora'] * args.dora)} cannot be combined: "
                         "--full trains every weight; pick --full, --lora, --dora or --qlora")
    ranks = _fsdp_ranks(args.fsdp, args.nproc_per_node)
    config = AutoConfig.from_pretrained(resolve_folder("--model", args.model))
    plan = memory.MemoryPlan(
        full=args.full, load_in_4bit=args.qlora or not (args.full or args.lora or args.dora),
        use_dora=args.dora, r=args.r, target_modules=args.target_modules,
        target_parameters=args.target_parameters, dtype=args.dtype,
        per_device_train_batch_size=args.per_device_train_batch_size, max_length=args.max_length,
        gradient_checkpointing=args.gradient_checkpointing, optim=args.optim, bf16=args.bf16,
        fsdp=ranks, fused_lm_head=not reference_mode_enabled())  # nanosft train's SFTTrainer
    _check_memory_target_parameters(config, args.target_parameters)
    ledger = memory.estimate_memory(config, plan, device_type=args.device)
    kind = "full" if plan.full else ("Q" if plan.load_in_4bit else "") + ("DoRA" if plan.use_dora
                                                                           else "LoRA")
    print(f"memory ledger: {args.model}, {kind}, {plan.dtype} weights, bf16 autocast={plan.bf16}, "
          f"per rank of {plan.fsdp}")
    print(ledger.format())
    return 0


def _check_memory_target_parameters(config, entries):
    """Each --target_parameters entry names a parameter of the config, as training checks on the
    model, and one the ledger counts LoRA on (an MoE layer's experts or router)."""
    from nanosft.expert_lora import no_parameter_message
    from nanosft.memory.plan import EXPERT_PARAMETERS, parameter_shapes

    names = [name for name, _ in parameter_shapes(config)]
    for entry in entries or []:
        hits = [n for n in names if n == entry or n.endswith("." + entry)]
        if not hits:
            owner = f"the --model config (model_type {config.model_type!r})"
            raise ValueError(no_parameter_message(entry, owner, names))
        if not all(n.endswith(tuple("." + p for p in EXPERT_PARAMETERS)) for n in hits):
            raise ValueError(f"--target_parameters {entry!r}: the ledger counts LoRA on an MoE "
                             f"layer's {', '.join(EXPERT_PARAMETERS)} only; name a linear layer "
                             "with --target_modules instead")


# ----------------------------------------------------------------------------- parser and main

def _add_sampling_flags(parser):
    parser.add_argument("--model", required=True, help="a Hugging Face model folder or Hub id")
    parser.add_argument("--adapter", help="a PEFT adapter folder (or Hub id) to put on the model")
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top_p", type=float, default=None)
    parser.add_argument("--top_k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--load_in_4bit", action="store_true",
                        help="quantize the base to NF4 first")
    parser.add_argument("--no_chat_template", action="store_true",
                        help="feed the text as is (base models)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")


def build_parser(train_fields=True):
    """The argparse parser, one sub-command per door; `train_fields=False` leaves out SFTConfig /
    LoraConfig flags, whose modules import torch (`nanosft --help` needs none of them).
    Mirrors: trl's `trl sft` CLI layout"""
    parser = argparse.ArgumentParser(prog="nanosft", description="A from-scratch QLoRA SFT path.",
                                     allow_abbrev=False)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # a prefix such as --learning_rat must not silently mean --learning_rate: it gets a hint
    add_parser = functools.partial(commands.add_parser, allow_abbrev=False)

    demo = add_parser("demo", help="QLoRA SFT of the embedded tiny model, before/after answers")
    demo.add_argument("--dora", action="store_true", help="DoRA instead of LoRA")
    demo.add_argument("--no-quant", dest="no_quant", action="store_true",
                      help="LoRA on a full-precision base")
    demo.add_argument("--full", action="store_true",
                      help="full fine-tuning (no adapter, no quantization)")
    demo.add_argument("--device", choices=("cpu", "cuda"), default=None,
                      help="default: cuda when available")
    demo.add_argument("--trace", action="store_true",
                      help="print the walkthrough trace of the first step")
    demo.add_argument("--steps", type=int, default=120, help="optimizer steps (default 120)")
    demo.add_argument("--threads", type=int, default=None,
                      help="torch threads on the CPU (default 1: the model is too small to split)")
    demo.add_argument("--output_dir", default="nanosft-demo", help="where adapter, metrics go")
    demo.add_argument("--report_to", choices=("nanosft", "tensorboard", "all", "none"),
                      default="nanosft", help="nanosft: tokens/s, MFU, ledger, metrics.jsonl")
    demo.add_argument("--overwrite_output_dir", action="store_true",
                      help="replace the run already in --output_dir")
    demo.set_defaults(run=run_demo)

    train = add_parser("train", help="SFT of your model (folder or Hub id) on your data",
                       description="Supervised fine-tuning of --model on --data. The default is "
                       "LoRA on the float base (peft's LoraConfig defaults); --qlora quantizes the "
                       "base to NF4 first, --full trains every weight. Every other flag is a field "
                       "of SFTConfig (TRL's, with transformers' TrainingArguments) or LoraConfig "
                       "(peft's), under the same name and default: their documentation describes "
                       "each.",
                       usage="nanosft train --model DIR_OR_ID --data FILE --output_dir DIR "
                             "[--config FILE.json] [--qlora | --full | --prompt_tuning] [--dora] "
                             "[--trace] [--<field> VALUE ...]")
    # not required=True: `trl sft`'s --model_name_or_path / --dataset_name may name them instead
    train.add_argument("--model",
                       help="a Hugging Face model folder or Hub id (weights + tokenizer)")
    train.add_argument("--data", help="train data: .jsonl, .json, .parquet or .csv "
                       "with text, prompt/completion or messages")
    train.add_argument("--eval_data", help="eval data (set --eval_strategy steps to use it)")
    train.add_argument("--config", help="JSON file of SFTConfig / LoraConfig fields (flags win)")
    train.add_argument("--qlora", action="store_true", help="quantize the base to NF4 (QLoRA)")
    train.add_argument("--dora", action="store_true", help="DoRA (use_dora=True)")
    train.add_argument("--full", action="store_true", help="full fine-tuning, no adapter")
    train.add_argument("--prompt_tuning", action="store_true", help="prompt tuning instead of LoRA")
    train.add_argument("--num_virtual_tokens", type=int, default=None,
                       help="prompt tuning length (default 8)")
    train.add_argument("--trace", action="store_true",
                       help="print the walkthrough trace of the first step")
    train.set_defaults(run=run_train, sft_names=[], lora_names=[], lora_defaults={},
                       model_dtype=None, quantization_config=None, trl_test_split=None)
    if train_fields:
        from nanosft.args import SFTConfig
        from nanosft.cli.trl_flags import add_trl_flags
        from nanosft.peft import LoraConfig

        train.set_defaults(sft_names=add_dataclass_flags(train, SFTConfig, "SFTConfig."),
                           lora_names=add_dataclass_flags(train, LoraConfig, "LoraConfig."))
        add_trl_flags(train)
        for size in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size"):
            train.add_argument(f"--{size}", dest=f"ParallelismConfig.{size}", type=int,
                               default=argparse.SUPPRESS, metavar="N",
                               help=f"parallelism_config's {size} (under torchrun)")

    generate = add_parser("generate", help="answer one prompt (streamed)")
    _add_sampling_flags(generate)
    generate.add_argument("--prompt", required=True, help="the user message")
    generate.set_defaults(run=run_generate)

    chat = add_parser("chat", help="interactive chat on stdin until EOF")
    _add_sampling_flags(chat)
    chat.set_defaults(run=run_chat)

    merge = add_parser("merge", help="fold an adapter into its base, write a HF folder")
    merge.add_argument("--model", required=True, help="the base model (folder or Hub id)")
    merge.add_argument("--adapter", required=True, help="the adapter (folder or Hub id)")
    merge.add_argument("--out", required=True, help="a new folder for the merged model")
    merge.set_defaults(run=run_merge)

    mem = add_parser("memory", help="predicted bytes per part of a training run (the ledger)")
    mem.add_argument("--model", required=True, help="a model folder or Hub id (config.json only)")
    for flag, text in (("full", "full fine-tuning"), ("lora", "LoRA on the float base"),
                       ("dora", "DoRA (with --qlora: QDoRA)"), ("qlora", "LoRA on NF4 (default)")):
        mem.add_argument(f"--{flag}", action="store_true", help=text)
    flag_bool = value_parser("flag", bool)
    numbers = (("per_device_train_batch_size", int, 8), ("max_length", int, 1024), ("r", int, 8),
               ("optim", str, "adamw_torch_fused"), ("dtype", str, "float32"))
    for flag, kind, default in numbers:
        mem.add_argument(f"--{flag}", type=kind, default=default, help=f"default: {default}")
    mem.add_argument("--fsdp", default="false", metavar="VALUE",
                     help="as `train --fsdp`: true / full_shard shards over --nproc_per_node ranks")
    mem.add_argument("--nproc_per_node", type=int, default=None,
                     help="the ranks torchrun would start (default 2 with --fsdp)")
    for flag in ("gradient_checkpointing", "bf16"):  # SFTConfig's defaults: both on
        mem.add_argument(f"--{flag}", type=flag_bool, nargs="?", const=True, default=True,
                         metavar="BOOL", help="default: true (as SFTConfig)")
    mem.add_argument("--target_modules", type=value_parser("target_modules", list | str),
                     default=None, help="default: peft's for the model type; or all-linear")
    mem.add_argument("--target_parameters", type=value_parser("target_parameters", list | None),
                     default=None, help="as `train --target_parameters`: LoRA on MoE experts, "
                     "e.g. mlp.experts.gate_up_proj,mlp.experts.down_proj")
    mem.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                     help="cpu keeps linears whose in_features is not a multiple of 64 in float")
    mem.set_defaults(run=run_memory)
    for command in (demo, train, generate, chat, merge, mem):  # "did you mean" on a mistyped flag
        command.set_defaults(known_flags=[o for a in command._actions for o in a.option_strings])
    return parser


def _debug() -> bool:
    """NANOSFT_DEBUG set to anything but empty, 0, false, no or off: show tracebacks."""
    return os.environ.get("NANOSFT_DEBUG", "").strip().lower() not in ("", "0", "false", "no",
                                                                        "off")


def _fail(command, message) -> int:
    print(f"nanosft {command}: error: {message}", file=sys.stderr)
    return 2


def _template_errors():
    # jinja2 is optional; evaluated only when an exception reaches main()
    try:
        from jinja2 import TemplateError
    except ImportError:
        return ()
    return (TemplateError,)


def _interrupt_summary(args):
    """What an interrupted command leaves: for train the last checkpoint and the resume flag."""
    output_dir = getattr(args, "resume_hint_dir", None)
    if args.command != "train" or output_dir is None:
        return "nothing was saved"
    from nanosft.run.output_folder import get_last_checkpoint

    last = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
    if last is None:
        return (f"no checkpoint was saved in {output_dir}; start again (with "
                "--overwrite_output_dir if the folder holds partial files)")
    return (f"the last checkpoint is {last}; resume with the same command plus "
            "--resume_from_checkpoint")


def _join_negative_numbers(argv):
    """`--flag -1e-3` -> `--flag=-1e-3`: argparse reads a word starting with '-' as a flag unless
    it looks like -1 or -0.5, so scientific notation and -inf would be 'expected one argument'."""
    joined = []
    for word in argv:
        previous = joined[-1] if joined else ""
        if previous.startswith("--") and "=" not in previous and _is_negative_number(word):
            joined[-1] = f"{previous}={word}"
        else:
            joined.append(word)
    return joined


def _is_negative_number(word):
    try:
        float(word)
    except ValueError:
        return False
    return word.startswith("-")


def _close_flags(flag, known) -> list:
    """Flags a mistyped one may mean: those it abbreviates by initials (--lr: --learning_rate,
    --lora_r), else the closest spelling."""
    typed = flag.lstrip("-").lower()
    initials = [k for k in known if k.startswith("--") and len(typed) > 1
                and "".join(w[:1] for w in k[2:].split("_")) == typed]
    return initials[:3] or difflib.get_close_matches(flag, known, n=1)


def _command(argv):
    """The sub-command named in argv (its first word that is not a flag), or None."""
    return next((word for word in argv if not word.startswith("-")), None)


def main(argv=None):
    """Parse argv and run the chosen command; returns the exit status.
    Mirrors: a console_scripts entry point"""
    # bitsandbytes warns at import time about an optional CPU kernel package; not the user's concern
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    argv = _join_negative_numbers(sys.argv[1:] if argv is None else argv)
    try:  # the train flags import torch: seconds in which Ctrl-C may come
        parser = build_parser(train_fields=_command(argv) == "train")
        args, unknown = parser.parse_known_args(argv)
    except KeyboardInterrupt:
        if _debug():
            raise
        print(f"\nnanosft {_command(argv) or ''}: interrupted (Ctrl-C) while starting; nothing "
              "was run", file=sys.stderr)
        return 130
    if unknown:
        flag = unknown[0].split("=")[0]
        close = _close_flags(flag, args.known_flags)
        hint = f" (did you mean {' or '.join(close)}?)" if close else ""
        return _fail(args.command, f"unrecognized argument {unknown[0]!r}{hint}; "
                                   f"`nanosft {args.command} --help` lists the flags.")
    if getattr(args, "trace", False) or os.environ.get("NANOSFT_TRACE", "") not in ("", "0"):
        _trace().enable_trace()
    try:
        return args.run(args) or 0
    except (OSError, ValueError, TypeError, ImportError) as error:  # a user's paths, files,
        # values and missing optional packages (datasets for .csv / .parquet)
        if _debug():
            raise
        message = " ".join(str(error).split())  # one paragraph
        return _fail(args.command, f"{message} (NANOSFT_DEBUG=1 shows the traceback)")
    except KeyboardInterrupt:
        if _debug():
            raise
        print(f"\nnanosft {args.command}: interrupted (Ctrl-C); {_interrupt_summary(args)}",
              file=sys.stderr)
        return 130  # 128 + SIGINT, as a shell reports it
    except _template_errors() as error:  # raise_exception(...) or an undefined name in it
        if _debug():
            raise
        message = " ".join(str(error).split())
        return _fail(args.command, f"the chat template of --model stopped: {message}; fix the "
                                   "template (chat_template.jinja) or the messages "
                                   "(NANOSFT_DEBUG=1 shows the traceback)")
    except (KeyError, RuntimeError) as error:  # the backstop: no traceback
        if _debug():
            raise
        message = " ".join(str(error).split())
        return _fail(args.command, f"{type(error).__name__}: {message}. Check the files and flags "
                                   "given; if they look right this may be a nanosft bug: run again "
                                   "with NANOSFT_DEBUG=1 for the traceback and report it")
    finally:
        # never imported (with torch) just to switch it off
        if "nanosft.monitoring.trace" in sys.modules:
            _trace().enable_trace(False)

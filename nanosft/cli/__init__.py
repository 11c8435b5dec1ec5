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
    FALSE, FIXED_FIELDS, FLAG_ALIASES, TRUE, add_dataclass_flags, collect, read_config_file,
    value_parser)
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

    return hub.resolve_pretrained_path(name, what=flag)


def load_model(model_dir, adapter_dir=None, load_in_4bit=False, device="cpu"):
    """A CausalLM (fp32, or NF4 when asked) from a folder or Hub id, with a PEFT adapter when given.
    Walkthrough 2.1 (model loading)
    Mirrors: AutoModelForCausalLM.from_pretrained + PeftModel.from_pretrained"""
    from nanosft import nf4
    from nanosft.model import CausalLM
    from nanosft.peft import PeftModelForCausalLM

    model_dir = resolve_folder("--model", model_dir)
    adapter_dir = None if adapter_dir is None else resolve_folder("--adapter", adapter_dir)
    # QLoRA's 4-bit options; each linear weight is quantized as it is read (no fp32 copy)
    quantization_config = nf4.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
    ) if load_in_4bit else None
    model = CausalLM.from_pretrained(model_dir, quantization_config=quantization_config,
                                     device_map=device)
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
    return demo.run(output_dir=args.output_dir, mode=mode, device=pick_device(args.device),
                    steps=args.steps, report_to=args.report_to, trace=_trace().is_enabled(),
                    overwrite_output_dir=args.overwrite_output_dir)


# ----------------------------------------------------------------------------- train

def build_train_configs(args, sft_names, lora_names):
    """(SFTConfig, LoraConfig | PromptTuningConfig | None) from --config then the flags (flags win).
    Mirrors: trl TrlParser (config file, then command line)"""
    from nanosft.args import SFTConfig
    from nanosft.peft import LoraConfig, PromptTuningConfig

    allowed = {**dict.fromkeys(sft_names, "sft"), **dict.fromkeys(lora_names, "lora"),
               "num_virtual_tokens": "pt"}
    from_file = read_config_file(args.config, allowed) if args.config else {}
    values = {"sft": {}, "lora": {}, "pt": {}}
    for key, value in from_file.items():
        values[allowed[key]][key] = value
    values["sft"].update(collect(args, "SFTConfig."))
    values["lora"].update(collect(args, "LoraConfig."))
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
    from nanosft import distributed
    from nanosft.sft import SFTTrainer

    sft_config, peft_config = build_train_configs(args, args.sft_names, args.lora_names)
    _check_output_dir(sft_config)
    for flag, path in (("--data", args.data), ("--eval_data", args.eval_data)):
        if path is not None and not os.path.isfile(path):
            raise FileNotFoundError(
                f"{flag} {path}: no such file; give a JSONL file with one example per line "
                '({"text": ...}, {"prompt": ..., "completion": ...} or {"messages": [...]}), '
                "or a .json array, .parquet or .csv file")
    model = load_model(args.model, load_in_4bit=args.qlora, device=sft_config.device)
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
        if "tensorboard" in sft_config.report_to:
            _tensorboard(sft_config.output_dir)
        kind = "adapter" if peft_config is not None else "model"
        print(f"saved the {kind} and tokenizer to {sft_config.output_dir} "
              f"(train_loss {result.training_loss:.4f}, {result.global_step} steps)")
        from nanosft.monitoring.callbacks import speed_summary

        print(speed_summary(trainer, result.metrics))  # model GFLOP/s and MFU
    distributed.cleanup()
    return 0


def _check_output_dir(sft_config):
    """Before the model loads: resolve --resume_from_checkpoint (a folder, or the latest valid
    checkpoint), and refuse a fresh run in a folder holding another run; errors name the flags."""
    from nanosft.io import output_folder

    sft_config.resume_from_checkpoint = output_folder.resolve_resume_checkpoint(
        sft_config.resume_from_checkpoint, sft_config.output_dir, command_line=True)
    if sft_config.resume_from_checkpoint is None and not sft_config.overwrite_output_dir:
        refusal = output_folder.output_dir_refusal(sft_config.output_dir, command_line=True)
        if refusal:
            raise ValueError(refusal)


def _tensorboard(output_dir):
    import importlib.util

    log_dir = os.path.join(output_dir, "runs")
    if importlib.util.find_spec("tensorboard") is not None:  # the Trainer wrote them as it logged
        print(f"TensorBoard events: {log_dir}  (tensorboard --logdir {log_dir})")


# ----------------------------------------------------------------------------- generate, chat

def run_generate(args):
    """One chat-templated prompt -> streamed reply.
    Mirrors: model.generate(**tokenizer.apply_chat_template(...))"""
    model = load_model(args.model, args.adapter, args.load_in_4bit, pick_device(args.device))
    messages = [{"role": "user", "content": args.prompt}]
    stream_reply(model, load_tokenizer(args.model), messages, args)
    return 0


def run_chat(args):
    """An interactive chat: a user turn per stdin line, replies streamed, history kept, ends at EOF.
    Mirrors: `transformers chat` | Differs: an empty line resets the history; no slash commands."""
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
    if os.path.exists(args.out) and os.listdir(args.out):
        raise FileExistsError(f"--out {args.out} exists and is not empty; give a new folder "
                              "(nothing is overwritten)")
    model = load_model(args.model, args.adapter).merge_and_unload()
    parent = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=".merge-")
    try:
        model.save_pretrained(tmp)
        load_tokenizer(args.model).save_pretrained(tmp)
        if os.path.isdir(args.out):
            os.rmdir(args.out)  # empty, checked above
        os.replace(tmp, args.out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"merged {args.adapter} into {args.model}: {args.out}")
    return 0


# ----------------------------------------------------------------------------- memory

def run_memory(args):
    """Print the memory ledger of a run on --model's config.json (no weights are read).
    Mirrors: `accelerate estimate-memory` (which stops at weights and Adam)"""
    from nanosft import memory
    from nanosft.model import ModelConfig

    chosen = [name for name in ("full", "lora", "qlora") if getattr(args, name)]
    if args.full and (args.dora or len(chosen) > 1):
        raise ValueError(f"--{' and --'.join(chosen + ['dora'] * args.dora)} cannot be combined: "
                         "--full trains every weight; pick --full, --lora, --dora or --qlora")
    config = ModelConfig.from_pretrained(resolve_folder("--model", args.model))
    plan = memory.MemoryPlan(
        full=args.full, load_in_4bit=args.qlora or not (args.full or args.lora or args.dora),
        use_dora=args.dora, r=args.r, target_modules=args.target_modules, dtype=args.dtype,
        per_device_train_batch_size=args.per_device_train_batch_size, max_length=args.max_length,
        gradient_checkpointing=args.gradient_checkpointing, optim=args.optim, bf16=args.bf16,
        fsdp=args.fsdp)
    ledger = memory.estimate_memory(config, plan, device_type=args.device)
    kind = "full" if plan.full else ("Q" if plan.load_in_4bit else "") + ("DoRA" if plan.use_dora
                                                                           else "LoRA")
    print(f"memory ledger: {args.model}, {kind}, {plan.dtype} weights, bf16 autocast={plan.bf16}, "
          f"per rank of {plan.fsdp}")
    print(ledger.format())
    return 0


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
    demo.add_argument("--output_dir", default="nanosft-demo", help="where adapter, metrics go")
    demo.add_argument("--report_to", choices=("none", "tensorboard"), default="none")
    demo.add_argument("--overwrite_output_dir", action="store_true",
                      help="replace the run already in --output_dir")
    demo.set_defaults(run=run_demo)

    train = add_parser("train", help="SFT of your model (folder or Hub id) on your data",
                       usage="nanosft train --model DIR_OR_ID --data FILE --output_dir DIR "
                             "[--config FILE.json] [--qlora | --full | --prompt_tuning] [--dora] "
                             "[--trace] [--<field> VALUE ...]")
    train.add_argument("--model", required=True,
                       help="a Hugging Face model folder or Hub id (weights + tokenizer)")
    train.add_argument("--data", required=True, help="train data: .jsonl, .json, .parquet or .csv "
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
    train.set_defaults(run=run_train, sft_names=[], lora_names=[])
    if train_fields:
        from nanosft.args import SFTConfig
        from nanosft.peft import LoraConfig

        train.set_defaults(sft_names=add_dataclass_flags(train, SFTConfig, "SFTConfig."),
                           lora_names=add_dataclass_flags(train, LoraConfig, "LoraConfig."))

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
               ("fsdp", int, 1), ("optim", str, "adamw_torch_fused"), ("dtype", str, "float32"))
    for flag, kind, default in numbers:
        mem.add_argument(f"--{flag}", type=kind, default=default, help=f"default: {default}")
    for flag in ("gradient_checkpointing", "bf16"):  # SFTConfig's defaults: both on
        mem.add_argument(f"--{flag}", type=flag_bool, nargs="?", const=True, default=True,
                         metavar="BOOL", help="default: true (as SFTConfig)")
    mem.add_argument("--target_modules", type=value_parser("target_modules", list | str),
                     default=None, help="default: peft's for the model type; or all-linear")
    mem.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                     help="cpu keeps linears whose in_features is not a multiple of 64 in float")
    mem.set_defaults(run=run_memory)
    for command in (demo, train, generate, chat, merge, mem):  # "did you mean" on a mistyped flag
        command.set_defaults(known_flags=[o for a in command._actions for o in a.option_strings])
    return parser


def _fail(command, message) -> int:
    print(f"nanosft {command}: error: {message}", file=sys.stderr)
    return 2


def _command(argv):
    """The sub-command named in argv (its first word that is not a flag), or None."""
    return next((word for word in argv if not word.startswith("-")), None)


def main(argv=None):
    """Parse argv and run the chosen command; returns the exit status.
    Mirrors: a console_scripts entry point"""
    # bitsandbytes warns at import time about an optional CPU kernel package; not the user's concern
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(train_fields=_command(argv) == "train")
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        flag = unknown[0].split("=")[0]
        close = difflib.get_close_matches(flag, args.known_flags, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        return _fail(args.command, f"unrecognized argument {unknown[0]!r}{hint}; "
                                   f"`nanosft {args.command} --help` lists the flags.")
    if getattr(args, "trace", False) or os.environ.get("NANOSFT_TRACE", "") not in ("", "0"):
        _trace().enable_trace()
    try:
        return args.run(args) or 0
    except (OSError, ValueError, TypeError) as error:  # what a user's paths, files and values cause
        if os.environ.get("NANOSFT_DEBUG"):
            raise
        message = " ".join(str(error).split())  # one paragraph
        return _fail(args.command, f"{message} (NANOSFT_DEBUG=1 shows the traceback)")
    finally:
        # never imported (with torch) just to switch it off
        if "nanosft.monitoring.trace" in sys.modules:
            _trace().enable_trace(False)

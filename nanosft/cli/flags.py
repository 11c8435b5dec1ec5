"""Command-line flags from dataclass fields, and the --config JSON file they may come from.

`nanosft train` gets one typed `--field VALUE` flag per SFTConfig / LoraConfig field
(`add_dataclass_flags`), parsed by the field's annotation (`value_parser`); `read_config_file`
reads the same fields from a JSON object and `collect` gathers what the user gave (the `args`
and `peft_config` SFTTrainer.__init__ receives). Mirrors transformers HfArgumentParser
and trl TrlParser. Standard library only, so `nanosft --help` stays free of torch.
"""

import argparse
import dataclasses
import difflib
import json
import os
import types
import typing

# Fields that are fixed by the command itself, so no flag is generated for them.
FIXED_FIELDS = {"peft_type", "task_type", "inference_mode", "base_model_name_or_path"}
TRUE, FALSE = {"true", "1", "yes", "on"}, {"false", "0", "no", "off"}
# Extra spellings of dataclass flags. `--r` alone is an ambiguous prefix of torchrun's own options
# (--rdzv-*, --role, --run-path, ...), so `torchrun ... -m nanosft train --r 16` fails inside
# torchrun's parser; `--lora_r` (axolotl's name) passes through.
FLAG_ALIASES = {"r": ["--lora_r"]}


def _kinds(annotation) -> tuple:
    """The plain types an annotation allows: `bool | None` -> (bool, NoneType)."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return tuple(k for arg in typing.get_args(annotation) for k in _kinds(arg))
    return (typing.get_origin(annotation) or annotation,)


def value_parser(name, annotation):
    """A function turning the text of `--name` into a value of the field's type (errors name both).
    Mirrors: transformers HfArgumentParser (one flag per dataclass field)
    Differs: unions parsed left to right; a list is `a,b`, JSON or one name (not nargs="+")."""
    kinds = _kinds(annotation)

    def parse(text):
        low = text.strip().lower()
        if type(None) in kinds and low in ("none", "null"):
            return None
        if bool in kinds and low in TRUE | FALSE:
            return low in TRUE
        for kind in (int, float):
            if kind in kinds:
                try:
                    return kind(text)
                except ValueError:
                    pass
        if (dict in kinds or list in kinds) and low[:1] in "{[":
            try:
                return json.loads(text)
            except json.JSONDecodeError as error:
                raise argparse.ArgumentTypeError(
                    f"--{name}: {text!r} is not valid JSON ({error.msg})") from None
        if list in kinds and "," in text:
            return [part.strip() for part in text.split(",") if part.strip()]
        if str in kinds:
            return text
        if list in kinds and text.strip():  # one name of a list field (--target_parameters x)
            return [text.strip()]
        names = " or ".join(k.__name__ for k in kinds)
        raise argparse.ArgumentTypeError(f"--{name} expects {names}, got {text!r}")

    parse.__name__ = "/".join(k.__name__ for k in kinds)  # argparse: "invalid <type> value"
    return parse


def add_dataclass_flags(parser, cls, prefix):
    """One `--field VALUE` flag per dataclass field (dest `<prefix>field`, unset unless given, plus
    FLAG_ALIASES); returns the names.
    Mirrors: transformers HfArgumentParser._add_dataclass_arguments"""
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(f"{cls.__name__} fields (Hugging Face names and defaults)")
    names = []
    for field in dataclasses.fields(cls):
        if field.name in FIXED_FIELDS or not field.init or field.name == "tokenizer":
            continue
        default = field.default if field.default is not dataclasses.MISSING else "(computed)"
        kinds = _kinds(hints[field.name])
        # a bool flag alone means True; --resume_from_checkpoint alone means the latest checkpoint
        flag_only_bool = (set(kinds) <= {bool, type(None)}
                          or field.name == "resume_from_checkpoint")
        group.add_argument(f"--{field.name}", *FLAG_ALIASES.get(field.name, []),
                           dest=prefix + field.name, default=argparse.SUPPRESS,
                           type=value_parser(field.name, hints[field.name]), metavar="VALUE",
                           nargs="?" if flag_only_bool else None,
                           const=True if flag_only_bool else None, help=f"default: {default!r}")
        names.append(field.name)
    return names


def read_config_file(path, allowed: dict) -> dict:
    """A JSON object of field values; an unknown key is an error naming it, the file and the closest
    field.
    Mirrors: transformers HfArgumentParser.parse_json_file(allow_extra_keys=False)"""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--config {path}: no such file; give a JSON file such as "
                                '{"learning_rate": 2e-4, "r": 16}')
    try:
        with open(path, encoding="utf-8") as f:
            values = json.load(f)
    except json.JSONDecodeError as error:
        raise ValueError(f"--config {path}: invalid JSON at line {error.lineno} column "
                         f"{error.colno} ({error.msg}); fix the file") from None
    if not isinstance(values, dict):
        raise TypeError(f"--config {path}: expected a JSON object of field names to values, "
                         f"got a {type(values).__name__}")
    for key in values:
        if key not in allowed:
            close = difflib.get_close_matches(key, list(allowed), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"--config {path}: unknown key {key!r}{hint}. Keys must be SFTConfig "
                             "or LoraConfig field names; `nanosft train --help` lists them all")
    return values


def _fits(value, kinds) -> bool:
    if isinstance(value, bool):  # a JSON true/false is a bool, never a number
        return bool in kinds
    if isinstance(value, int) and float in kinds:
        return True
    return isinstance(value, tuple(k for k in kinds if isinstance(k, type)))


def check_value_types(source, values: dict, cls) -> None:
    """Refuse a value whose JSON type the dataclass field does not take, naming file and field
    (the dataclass would fail later with a bare TypeError, or keep a string as a number)."""
    hints = typing.get_type_hints(cls)
    for key, value in values.items():
        if key in hints and not _fits(value, _kinds(hints[key])):
            names = " or ".join(k.__name__ for k in _kinds(hints[key]))
            raise TypeError(f"{source}: field {key!r} expects {names}, got "
                            f"{type(value).__name__} {value!r}; fix the value in the file")


def collect(args, prefix):
    """The flags the user actually gave for one dataclass, as {field: value}."""
    return {k[len(prefix):]: v for k, v in vars(args).items() if k.startswith(prefix)}

"""SFTTrainer.__init__'s checks and loading: TRL's set-up that walkthrough 2.1 does not print.

The arguments TRL refuses, a model id (a folder or a Hub-cache id) loaded with its tokenizer and
chat template, the train and eval data read and checked (with_transform, skip_prepare_dataset
without labels, token ids past the embedding), the MoE aux-loss coefficient written to the model
config, and TRL's tags on the model. nanosft.sft imports these inside SFTTrainer's methods, so
`import nanosft.sft` loads none of them; each step of SFTTrainer.__init__ stays one named call.
"""

import os
import warnings

from nanosft.collator import DataCollatorForLanguageModeling
from nanosft.data import is_datasets_object, to_example_list
from nanosft.peft import PeftModelForCausalLM


def dataset_name(dataset, default):
    """What warnings and errors about the data call it: the file when it is one."""
    return os.fspath(dataset) if isinstance(dataset, (str, os.PathLike)) else default


# ----------------------------------------------------------------------------- arguments

def check_arguments(args, data_collator, train_dataset, compute_loss_func) -> None:
    """The arguments TRL refuses before it builds anything (a collator passed positionally in
    train_dataset's place, no train_dataset, DFT with a loss function of one's own), and context
    parallel with a loss path that reads whole rows' logits (reference mode, compute_loss_func)."""
    if data_collator is not None and not callable(data_collator):
        raise TypeError("SFTTrainer: data_collator (the third positional argument, as in TRL) "
                        f"must be callable, got {type(data_collator).__name__}; pass "
                        "train_dataset= by keyword.")
    if train_dataset is None:
        raise ValueError("SFTTrainer: `train_dataset` is required (a datasets.Dataset, a JSONL "
                         "path or a list of dicts).")
    if args.loss_type == "dft" and compute_loss_func is not None:
        raise ValueError("SFTTrainer: loss_type='dft' sets the loss itself; drop "
                         "compute_loss_func or use loss_type='nll'.")
    parallelism = getattr(args, "parallelism_config", None)
    if parallelism is not None and parallelism.cp_size > 1:
        from nanosft.reference import fast_path

        if compute_loss_func is not None or fast_path("fused_lm_head_outputs") is None:
            raise ValueError(
                f"SFTTrainer with parallelism_config cp_size={parallelism.cp_size} and "
                f"{'compute_loss_func' if compute_loss_func is not None else 'reference mode'}: "
                "that loss path reads the whole rows' logits, which context parallel splits "
                "(not implemented yet); drop it (SFTTrainer's own loss, the fused LM head's "
                "per-token outputs, runs under cp) or use cp_size=1.")


def check_argument_types(processing_class, peft_config, formatting_func) -> None:
    """Refuse, naming the argument, what TRL would take to a later, unrelated failure: a path as
    processing_class, a dict as peft_config, a formatting_func that is not callable."""
    if isinstance(processing_class, (str, os.PathLike)):
        raise TypeError(f"SFTTrainer: processing_class={os.fspath(processing_class)!r} is a path; "
                        "pass the tokenizer itself, processing_class=Tokenizer.from_pretrained("
                        "path) (AutoTokenizer under transformers), or leave it None to load the "
                        "one beside a model folder.")
    if peft_config is not None and not hasattr(peft_config, "peft_type"):
        raise TypeError(f"SFTTrainer: peft_config must be a peft config such as LoraConfig, got "
                        f"{type(peft_config).__name__}; pass LoraConfig(**your_dict) (as TRL, "
                        "which also refuses a plain dict).")
    if formatting_func is not None and not callable(formatting_func):
        raise TypeError(f"SFTTrainer: formatting_func must be a function row -> text, got "
                        f"{type(formatting_func).__name__}.")


# ----------------------------------------------------------------------------- model, tokenizer

def _tokenizer_of_built_model(model):
    """The tokenizer beside the folder or Hub id a built model was loaded from (its name_or_path).
    Mirrors: trl SFTTrainer.__init__ (AutoProcessor.from_pretrained(get_config_model_id(...)))"""
    base = model.get_base_model() if isinstance(model, PeftModelForCausalLM) else model
    name = getattr(base, "name_or_path", None)
    if not name:
        raise ValueError("SFTTrainer: no processing_class, and the model was not loaded from a "
                         "folder or Hub id (it has no name_or_path) to read the tokenizer from; "
                         "fix: pass processing_class=AutoTokenizer.from_pretrained(model_dir)")
    from nanosft.families.auto import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)


def _load_model_and_tokenizer(model, args, quantization_config, processing_class):
    """A model id (folder or Hub-cache id) -> (model, its tokenizer unless one was passed), loaded
    with args.model_init_kwargs (dtype float32 unless given) plus quantization_config.
    Mirrors: trl SFTTrainer.__init__ (the model-id branch)"""
    if not isinstance(model, (str, os.PathLike)):
        if quantization_config is not None or args.model_init_kwargs is not None:
            warnings.warn("SFTTrainer: the model is already built, so quantization_config and "
                          "args.model_init_kwargs are not used (as in TRL); pass the model as a "
                          "folder or Hub id to load it with them.", stacklevel=3)
        if processing_class is None:
            processing_class = _tokenizer_of_built_model(model)
        return model, processing_class
    from nanosft.families.auto import AutoModelForCausalLM, AutoTokenizer

    init_kwargs = dict(args.model_init_kwargs or {})
    init_kwargs.setdefault("dtype", "float32")  # TRL's default, not transformers 5's "auto"
    if quantization_config is not None:
        if "quantization_config" in init_kwargs:
            raise ValueError("SFTTrainer: quantization_config is set both as a trainer argument "
                             "and in args.model_init_kwargs; keep one.")
        init_kwargs["quantization_config"] = quantization_config
    loaded = AutoModelForCausalLM.from_pretrained(os.fspath(model), **init_kwargs)
    if processing_class is None:
        processing_class = AutoTokenizer.from_pretrained(
            os.fspath(model), revision=init_kwargs.get("revision"))
    return loaded, processing_class


def _read_chat_template_path(path, tokenizer) -> None:
    """A .jinja / .j2 file's text replaces tokenizer.chat_template (in place, as TRL does).
    Mirrors: trl SFTTrainer.__init__ (args.chat_template_path)
    Differs: TRL's other branch (clone_chat_template from a tokenizer folder or Hub id: adds its
    tokens, copies its EOS, resizes the embeddings to a multiple of 64) is refused."""
    if not (os.path.isfile(path) and path.endswith((".jinja", ".j2"))):
        raise ValueError(f"SFTConfig(chat_template_path={path!r}): nanosft takes a .jinja or .j2 "
                         "template file; cloning a tokenizer folder's template (TRL's "
                         "clone_chat_template) is not implemented yet. Pass its "
                         "chat_template.jinja.")
    with open(path, encoding="utf-8") as f:
        tokenizer.chat_template = f.read()


def create_model(model, args, quantization_config, processing_class):
    """(model, processing_class): a model id loaded with its tokenizer (a built model keeps its
    own, or gets the one beside its folder), then args.chat_template_path read in.
    Mirrors: trl SFTTrainer.__init__ ("# Model": create_model_from_path; "# Processing class":
    AutoProcessor.from_pretrained, chat_template_path)"""
    model, processing_class = _load_model_and_tokenizer(model, args, quantization_config,
                                                        processing_class)
    if args.chat_template_path is not None:
        _read_chat_template_path(args.chat_template_path, processing_class)
    return model, processing_class


# ----------------------------------------------------------------------------- data collator

def check_data_collator(data_collator, padding_free, completion_only_loss, formatting_func):
    """Refuse a custom collator under padding-free (or bfd packing), and formatting_func with
    completion_only_loss (formatted rows are plain text: no completion to mask).
    Mirrors: trl SFTTrainer.__init__ ("# Data collator", "# Dataset": the same refusals)"""
    if padding_free and data_collator is not None:
        raise ValueError("SFTTrainer: a custom data_collator cannot be used with padding_free "
                         "or bfd packing.")
    if completion_only_loss and formatting_func is not None:
        raise ValueError("SFTTrainer: formatting_func turns rows into plain text, which has no "
                         "completion to mask; set completion_only_loss=False, or format the "
                         "data before passing it.")


# ----------------------------------------------------------------------------- datasets

def formatted(dataset, formatting_func, max_steps):
    """Each row plus "text" = formatting_func(row), or the dataset untouched when there is no
    formatting_func or it is already tokenized. Mirrors: trl SFTTrainer._prepare_dataset"""
    if formatting_func is None:
        return dataset
    name = dataset_name(dataset, "the dataset")
    rows, _ = to_example_list(dataset, name, max_steps)
    if "input_ids" in rows[0]:
        warnings.warn(f"SFTTrainer: {name} is already tokenized (input_ids), so formatting_func "
                      "is not applied (as in TRL).", stacklevel=3)
        return rows
    with_text = [{**row, "text": formatting_func(row)} for row in rows]
    for i, row in enumerate(with_text):
        if not isinstance(row["text"], str):
            raise TypeError(f"SFTTrainer: formatting_func returned {type(row['text']).__name__} "
                            f"for {name}'s example {i}, not a string; make it return the "
                            "example's text (e.g. a missing `return`).")
    return with_text


def rows_trained_on(args):
    """The most raw examples max_steps steps can use: one per row of each batch on each rank, or,
    when packing, up to max_length of them per packed row (each holds at least one token)."""
    rows = (args.max_steps * args.per_device_train_batch_size * args.gradient_accumulation_steps
            * args.world_size)
    if args.packing:
        return None if args.max_length is None else rows * args.max_length
    return rows


def refuse_with_transform(dataset, name) -> None:
    """A Dataset.with_transform() dataset would be read once here, freezing a random transform
    into the prepared rows. Mirrors: trl SFTTrainer._prepare_dataset (the same refusal)"""
    if is_datasets_object(dataset) and (getattr(dataset, "format", None) or {}).get(
            "type") == "custom":
        raise ValueError(f"SFTTrainer: {name} uses Dataset.with_transform(); preparing it would "
                         "read the transform once and freeze its output into the tokenized rows. "
                         "Fix: pass SFTConfig(dataset_kwargs={'skip_prepare_dataset': True}) "
                         "with a transform that returns trainer-ready rows (input_ids, labels), "
                         "or materialize a deterministic transform with Dataset.map() first.")


def reject_skip_prepare_without_labels(datasets, skip, data_collator) -> None:
    """With skip_prepare_dataset no labels are built, so a set with mask columns and no "labels"
    would train on every token: refused. Mirrors: trl SFTTrainer._reject_skip_prepare_without_labels
    """
    if not (skip and isinstance(data_collator, DataCollatorForLanguageModeling)):
        return
    for name, dataset in datasets.items():
        columns = getattr(dataset, "column_names", None)
        if columns is None:  # a list of rows, or an iterable: the first row's keys
            columns = list(next(iter(dataset), {}))
        if "labels" not in columns and ("completion_mask" in columns
                                        or "assistant_masks" in columns):
            raise ValueError(f"SFTTrainer: the {name} dataset has mask columns but no 'labels', "
                             "and skip_prepare_dataset=True skips label building, so it would "
                             "train on the full sequence. Fix: Add a 'labels' column (-100 for "
                             "tokens off the loss) or drop skip_prepare_dataset.")


def named_eval_sets(eval_dataset) -> dict:
    """{name: set}: a dict of named eval sets as it is, one set as "eval", none as {}."""
    if isinstance(eval_dataset, dict):
        return eval_dataset
    return {"eval": eval_dataset} if eval_dataset is not None else {}


def check_datasets(args, padding_free, train_dataset, eval_dataset, skip, data_collator) -> None:
    """Before preparing: padding-free rows without packing are not cut to max_length (refused, as
    in TRL), and reject_skip_prepare_without_labels over the train and eval sets.
    Mirrors: trl SFTTrainer.__init__ ("# Dataset": its checks)"""
    if padding_free and not args.packing and args.max_length is not None:
        raise ValueError("SFTTrainer: with padding_free=True and no packing, `max_length` is "
                         f"not enforced (max_length={args.max_length}), as in TRL; fix: enable "
                         "packing (packing=True, packing_strategy='bfd'), or set "
                         "max_length=None with already truncated rows.")
    reject_skip_prepare_without_labels({"train": train_dataset, **named_eval_sets(eval_dataset)},
                                       skip, data_collator)


def check_token_ids_fit(model, tokenizer, rows) -> None:
    """Refuse ids without an embedding row, naming both sizes (not torch's "index out of range")."""
    rows_in_model = model.get_input_embeddings().num_embeddings
    # a datasets.Dataset reads its column at once; a list (or a with_transform Dataset, whose
    # stored columns are the transform's inputs) is walked row by row
    stored = "input_ids" in (getattr(rows, "column_names", None) or ())
    column = rows["input_ids"] if stored else (r["input_ids"] for r in rows)
    largest = max((max(ids) for ids in column if len(ids)), default=-1)
    if largest >= rows_in_model:
        raise ValueError(f"SFTTrainer: the tokenizer ({len(tokenizer)} tokens) produced token id "
                         f"{largest}, but the model's embedding has only {rows_in_model} rows; use "
                         "the tokenizer saved with this model, or resize the model's embeddings to "
                         "the tokenizer before training")


# ----------------------------------------------------------------- after Trainer.__init__

def router_aux_loss(model, args):
    """(router_aux_loss_coef, aux_loss_enabled) of the MoE load-balancing loss: the config's coef
    unless args set one; a coef on a model without router logits is refused; the config's
    output_router_logits and coef set to match (the model's own forward reads them).
    Mirrors: trl SFTTrainer.__init__ ("# MoE load-balancing auxiliary loss")"""
    config = getattr(model, "config", None)
    coef = args.router_aux_loss_coef
    router_aux_loss_coef = getattr(config, "router_aux_loss_coef", 0.0) if coef is None else coef
    if coef and not hasattr(config, "output_router_logits"):
        raise ValueError(f"SFTConfig.router_aux_loss_coef={coef} but "
                         f"{type(model).__name__} is not a Mixture-of-Experts model that "
                         "returns its router logits; leave router_aux_loss_coef unset")
    aux_loss_enabled = hasattr(config, "output_router_logits") and router_aux_loss_coef != 0.0
    if hasattr(config, "router_aux_loss_coef"):
        config.output_router_logits = aux_loss_enabled
        config.router_aux_loss_coef = router_aux_loss_coef
    return router_aux_loss_coef, aux_loss_enabled


def add_model_tags(model, tags) -> None:
    """Append `tags` to the base model's model_tags (a PeftModelForCausalLM shows the same list,
    as peft forwards the attribute). Mirrors: transformers PreTrainedModel.add_model_tags"""
    base = model.get_base_model() if isinstance(model, PeftModelForCausalLM) else model
    model_tags = getattr(base, "model_tags", None) or []
    model_tags += [tag for tag in tags if tag not in model_tags]
    base.model_tags = model_tags
    if base is not model:
        model.model_tags = model_tags

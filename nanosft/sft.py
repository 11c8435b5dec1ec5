"""SFTTrainer: TRL's supervised fine-tuning set-up (dataset preparation, LoRA wrapping) on Trainer.

Walkthrough 2.1 (SFTTrainer.__init__ ends in Trainer.__init__). On the SFT path
SFTTrainer.compute_loss overrides 2.5's Trainer.compute_loss (TRL's loss and token metrics).
Papers: LoRA 2106.09685, QLoRA 2305.14314 (a 4-bit base with bf16 adapters).
Mirrors trl 1.16 SFTTrainer: __init__, compute_loss and log.
"""

import os
import warnings
from collections import defaultdict
from dataclasses import fields

import numpy as np
import torch

from nanosft import distributed, nf4
from nanosft.args import SFTConfig, TrainingArguments
from nanosft.collator import DataCollatorForLanguageModeling
from nanosft.data import (as_datasets_dataset, head_of_stream, is_datasets_object,
                          load_examples, prepare_dataset, to_example_list)
from nanosft.peft import PeftModelForCausalLM, get_peft_model
from nanosft.reference import fast_path
from nanosft.trainer import Trainer
from nanosft.trainer_utils import IGNORE_INDEX, set_seed


def _as_sft_config(args, model) -> SFTConfig:
    if args is None:
        return SFTConfig(output_dir=f"{type(model).__name__}-SFT")
    if isinstance(args, SFTConfig):
        return args
    if isinstance(args, TrainingArguments):  # TRL converts TrainingArguments, keeping the values
        return SFTConfig(**{f.name: getattr(args, f.name) for f in fields(TrainingArguments)})
    raise TypeError("SFTTrainer: args must be an SFTConfig or TrainingArguments, got "
                    f"{type(args).__name__}")


def _cast_trainable_to_bf16(model) -> None:
    """QLoRA: trainable params (the adapters) become bf16, except DoRA's magnitude (stays fp32).
    Mirrors: trl SFTTrainer.__init__ (is_loaded_in_4bit branch)
    On a CPU without native bf16 this is slower than fp32 adapters."""
    for name, param in model.named_parameters():
        if param.requires_grad and "lora_magnitude_vector" not in name:
            param.data = param.data.to(torch.bfloat16)


def _pad_token_id(args, tokenizer) -> int:
    """`args.pad_token or tokenizer.pad_token or tokenizer.eos_token`, as an id.
    Mirrors: trl SFTTrainer.__init__"""
    token = args.pad_token or tokenizer.pad_token or tokenizer.eos_token
    token_id = tokenizer.token_to_id(token) if token is not None else None
    if token_id is None:
        raise ValueError(f"SFTTrainer: pad token {token!r} is not in the tokenizer's vocabulary; "
                         "set SFTConfig(pad_token=...) to a token it has (the EOS token works).")
    return token_id


def token_metrics(logits, labels):
    """(supervised tokens, summed entropy, correct top-1 guesses) of logits (B, T, V) vs (B, T).
    Mirrors: trl ChunkedLogProbFunction entropy / is_top1 (first-index argmax)
    The label-smoothing path's metrics; the fused path gets the same three per token."""
    logits, targets = logits[:, :-1].float(), labels[:, 1:]
    mask = targets != IGNORE_INDEX
    log_probs = torch.log_softmax(logits, dim=-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)  # H = logZ - E_p[z]
    correct = logits.argmax(-1).eq(targets) & mask
    return torch.stack([mask.sum().float(), (entropy * mask).sum(), correct.sum().float()])


def with_virtual_prefix(labels, logits):
    """Labels with -100 for prompt tuning's virtual tokens, which lead each row of the logits
    (peft prepends them so in its forward)."""
    n_virtual = logits.size(1) - labels.size(1)
    if n_virtual <= 0:
        return labels
    return torch.cat([labels.new_full((labels.size(0), n_virtual), IGNORE_INDEX), labels], dim=1)


def _dataset_name(dataset, default):
    # what warnings and errors about the data call it: the file when it is one
    return os.fspath(dataset) if isinstance(dataset, (str, os.PathLike)) else default


def _tokenizer_of_built_model(model):
    """The tokenizer beside the folder or Hub id a built model was loaded from (its name_or_path).
    Mirrors: trl SFTTrainer.__init__ (AutoProcessor.from_pretrained(get_config_model_id(...)))"""
    base = model.get_base_model() if isinstance(model, PeftModelForCausalLM) else model
    name = getattr(base, "name_or_path", None)
    if not name:
        raise ValueError("SFTTrainer: no processing_class, and the model was not loaded from a "
                         "folder or Hub id (it has no name_or_path) to read the tokenizer from; "
                         "fix: pass processing_class=AutoTokenizer.from_pretrained(model_dir)")
    from nanosft.io.auto import AutoTokenizer  # product layer: loaders

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
    from nanosft.io.auto import AutoModelForCausalLM, AutoTokenizer  # product layer: loaders

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


def _check_argument_types(processing_class, peft_config, formatting_func) -> None:
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


def _formatted(dataset, formatting_func, max_steps):
    """Each row plus "text" = formatting_func(row), or the dataset untouched when there is no
    formatting_func or it is already tokenized. Mirrors: trl SFTTrainer._prepare_dataset"""
    if formatting_func is None:
        return dataset
    name = _dataset_name(dataset, "the dataset")
    rows, _ = to_example_list(dataset, name, max_steps)
    if "input_ids" in rows[0]:
        warnings.warn(f"SFTTrainer: {name} is already tokenized (input_ids), so formatting_func "
                      "is not applied (as in TRL).", stacklevel=3)
        return rows
    formatted = [{**row, "text": formatting_func(row)} for row in rows]
    for i, row in enumerate(formatted):
        if not isinstance(row["text"], str):
            raise TypeError(f"SFTTrainer: formatting_func returned {type(row['text']).__name__} "
                            f"for {name}'s example {i}, not a string; make it return the "
                            "example's text (e.g. a missing `return`).")
    return formatted


def _rows_trained_on(args):
    """The most raw examples max_steps steps can use: one per row of each batch on each rank, or,
    when packing, up to max_length of them per packed row (each holds at least one token)."""
    rows = (args.max_steps * args.per_device_train_batch_size * args.gradient_accumulation_steps
            * args.world_size)
    if args.packing:
        return None if args.max_length is None else rows * args.max_length
    return rows


def dft_loss(logits, labels, num_items_in_batch=None):
    """DFT (arXiv 2508.05629): each supervised token's -log p weighted by p itself (detached),
    summed, over num_items_in_batch (None: the batch's supervised tokens). logits (B, T, V).
    Mirrors: trl SFTTrainer.compute_loss (loss_type="dft")"""
    logits, targets = logits[:, :-1].float(), labels[:, 1:]
    mask = targets != IGNORE_INDEX
    log_probs = torch.log_softmax(logits, dim=-1)
    log_p = log_probs.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1) * mask  # (B, T-1)
    per_token_loss = -log_p * log_p.exp().detach()
    num_tokens = mask.sum() if num_items_in_batch is None else num_items_in_batch
    return per_token_loss.sum() / torch.as_tensor(num_tokens).clamp(min=1)


def _check_token_ids_fit(model, tokenizer, rows) -> None:
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


def _refuse_with_transform(dataset, name) -> None:
    """A Dataset.with_transform() dataset would be read once here, freezing a random transform
    into the prepared rows. Mirrors: trl SFTTrainer._prepare_dataset (the same refusal)"""
    if is_datasets_object(dataset) and (getattr(dataset, "format", None) or {}).get(
            "type") == "custom":
        raise ValueError(f"SFTTrainer: {name} uses Dataset.with_transform(); preparing it would "
                         "read the transform once and freeze its output into the tokenized rows. "
                         "Fix: pass SFTConfig(dataset_kwargs={'skip_prepare_dataset': True}) "
                         "with a transform that returns trainer-ready rows (input_ids, labels), "
                         "or materialize a deterministic transform with Dataset.map() first.")


def _reject_skip_prepare_without_labels(datasets, skip, data_collator) -> None:
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


def _add_model_tags(model, tags) -> None:
    """Append `tags` to the base model's model_tags (a PeftModelForCausalLM shows the same list,
    as peft forwards the attribute). Mirrors: transformers PreTrainedModel.add_model_tags"""
    base = model.get_base_model() if isinstance(model, PeftModelForCausalLM) else model
    model_tags = getattr(base, "model_tags", None) or []
    model_tags += [tag for tag in tags if tag not in model_tags]
    base.model_tags = model_tags
    if base is not model:
        model.model_tags = model_tags


def _check_arguments(args, data_collator, train_dataset, compute_loss_func) -> None:
    """The arguments TRL refuses before it builds anything (a collator passed positionally in
    train_dataset's place, no train_dataset, DFT with a loss function of one's own)."""
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


class SFTTrainer(Trainer):
    """Trainer for supervised fine-tuning: tokenizes / packs the data, wraps LoRA, logs TRL metrics.
    Walkthrough 2.1 | Mirrors: trl SFTTrainer (1.16)
    Differs: a model id is read from a local folder or the Hub cache (nothing is downloaded).

    Args (TRL 1.16's, in its order): model (a model, or a folder / Hub id loaded with
    args.model_init_kwargs); args; data_collator; train_dataset; eval_dataset (one set or a dict
    of named sets); processing_class (None: the tokenizer beside a model id); compute_loss_func;
    compute_metrics; callbacks; optimizers; optimizer_cls_and_kwargs;
    preprocess_logits_for_metrics (the Trainer's, see Trainer.__init__); quantization_config (for a
    model id); peft_config (LoraConfig: wrap the model); formatting_func (row -> text)."""

    _tag_names = ["trl", "sft"]  # TRL's tags on the model

    def __init__(self, model, args=None, data_collator=None, train_dataset=None,
                 eval_dataset=None, processing_class=None, compute_loss_func=None,
                 compute_metrics=None, callbacks=None, optimizers=(None, None),
                 optimizer_cls_and_kwargs=None, preprocess_logits_for_metrics=None,
                 quantization_config=None, peft_config=None, formatting_func=None):
        args = _as_sft_config(args, model)  # Args
        _check_arguments(args, data_collator, train_dataset, compute_loss_func)
        _check_argument_types(processing_class, peft_config, formatting_func)
        set_seed(args.seed)  # before get_peft_model: the LoRA A init draws from the global RNG
        model, processing_class = self._create_model(model, args, quantization_config,
                                                     processing_class)  # Model, Processing class
        model = self._prepare_peft_model(model, args, peft_config)  # PEFT
        # Dataset rows first: the data collator's completion_only_loss reads the first one
        train_name = _dataset_name(train_dataset, "train_dataset")
        returns_datasets = is_datasets_object(train_dataset)  # datasets in, datasets out
        train_dataset = self._read_train_dataset(train_dataset, args, formatting_func)
        data_collator = self._create_data_collator(data_collator, model, processing_class, args,
                                                   next(iter(train_dataset)), formatting_func)
        self._formatting_func = formatting_func
        train_dataset, eval_dataset = self._prepare_datasets(
            model, processing_class, args, train_dataset, train_name, eval_dataset,
            data_collator, returns_datasets)  # Dataset

        # TRL 1.16 passes optimizer_cls_and_kwargs by name; the walkthrough's call carries the
        # arguments it does not print in **super_init_kwargs
        super_init_kwargs = {"optimizer_cls_and_kwargs": optimizer_cls_and_kwargs}
        super().__init__(
            model=model,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            compute_loss_func=compute_loss_func,
            compute_metrics=compute_metrics,
            callbacks=callbacks,
            optimizers=optimizers,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
            **super_init_kwargs,
        )
        # TRL's _set_signature_columns_if_needed
        self._signature_columns = {"input_ids", "labels", "seq_lengths"}
        # MoE load-balancing loss: the config's router_aux_loss_coef unless args set one
        config = getattr(self.model, "config", None)
        coef = args.router_aux_loss_coef
        self.router_aux_loss_coef = getattr(config, "router_aux_loss_coef", 0.0) if coef is None \
            else coef
        if coef and not hasattr(config, "output_router_logits"):
            raise ValueError(f"SFTConfig.router_aux_loss_coef={coef} but "
                             f"{type(self.model).__name__} is not a Mixture-of-Experts model that "
                             "returns its router logits; leave router_aux_loss_coef unset")
        self.aux_loss_enabled = (hasattr(config, "output_router_logits")
                                 and self.router_aux_loss_coef != 0.0)
        if hasattr(config, "router_aux_loss_coef"):  # the model's own forward reads these
            config.output_router_logits = self.aux_loss_enabled
            config.router_aux_loss_coef = self.router_aux_loss_coef
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        self._total_train_tokens = 0
        _add_model_tags(self.model, self._tag_names)

    def _read_train_dataset(self, train_dataset, args, formatting_func):
        """Example rows of train_dataset (a stream cut to what max_steps trains on,
        formatting_func applied), or the dataset as given under skip_prepare_dataset.
        Mirrors: trl SFTTrainer._prepare_dataset's first steps (with_transform refused)"""
        self._skip_prepare_dataset = bool((args.dataset_kwargs or {}).get("skip_prepare_dataset"))
        if self._skip_prepare_dataset:
            return train_dataset
        _refuse_with_transform(train_dataset, "train_dataset")
        train_dataset = head_of_stream(train_dataset, args.max_steps, _rows_trained_on(args))
        return load_examples(_formatted(train_dataset, formatting_func, args.max_steps),
                             args.dataset_text_field, args.max_steps, name="train_dataset")

    def _prepare_eval_sets(self, eval_dataset, tokenizer, args):
        """One eval set, or a dict of named ones (evaluate() reports eval_<name>_loss), each
        through _prepare_eval. Mirrors: trl SFTTrainer.__init__ (eval_dataset branch)"""
        if isinstance(eval_dataset, dict):  # a DatasetDict too
            return {name: self._prepare_eval(dataset, tokenizer, args, name)
                    for name, dataset in eval_dataset.items()}
        if eval_dataset is None:
            return None
        return self._prepare_eval(eval_dataset, tokenizer, args,
                                  _dataset_name(eval_dataset, "eval_dataset"))

    def _create_model(self, model, args, quantization_config, processing_class):
        """(model, processing_class): a model id loaded with its tokenizer, the chat template of
        args.chat_template_path read in. Mirrors: trl SFTTrainer.__init__ ("# Model",
        "# Processing class": create_model_from_path, AutoProcessor.from_pretrained)"""
        model, processing_class = _load_model_and_tokenizer(model, args, quantization_config,
                                                            processing_class)
        if args.chat_template_path is not None:
            _read_chat_template_path(args.chat_template_path, processing_class)
        return model, processing_class

    def _prepare_peft_model(self, model, args, peft_config):
        """get_peft_model when peft_config is given; input grads for gradient checkpointing; a
        4-bit base's adapters cast to bf16. Mirrors: trl SFTTrainer.__init__ ("# PEFT")"""
        if peft_config is not None:
            if isinstance(model, PeftModelForCausalLM):
                raise ValueError("SFTTrainer: the model is already a PeftModelForCausalLM; "
                                 "merge_and_unload() it or drop peft_config.")
            model = get_peft_model(model, peft_config)
        if isinstance(model, PeftModelForCausalLM) and args.gradient_checkpointing:
            model.enable_input_require_grads()  # checkpointed blocks need an input needing grad
        if nf4.is_quantized(model):
            _cast_trainable_to_bf16(model)
        return model

    def _create_data_collator(self, data_collator, model, processing_class, args, first,
                              formatting_func):
        """The caller's collator, or DataCollatorForLanguageModeling over the pad token; sets
        padding_free and completion_only_loss (None: prompt-completion rows, read off `first`).
        Mirrors: trl SFTTrainer.__init__ ("# Data collator")"""
        bfd_packing = args.packing and args.packing_strategy in ("bfd", "bfd_split")
        self.padding_free = args.padding_free or bfd_packing
        if self.padding_free and data_collator is not None:
            raise ValueError("SFTTrainer: a custom data_collator cannot be used with padding_free "
                             "or bfd packing.")
        self.completion_only_loss = args.completion_only_loss
        if self.completion_only_loss is None:
            self.completion_only_loss = "prompt" in first and "completion" in first
        if self.completion_only_loss and formatting_func is not None:
            raise ValueError("SFTTrainer: formatting_func turns rows into plain text, which has no "
                             "completion to mask; set completion_only_loss=False, or format the "
                             "data before passing it.")
        if data_collator is not None:
            return data_collator
        pad_token_id = _pad_token_id(args, processing_class)
        base = model.get_base_model() if isinstance(model, PeftModelForCausalLM) else model
        if getattr(base, "config", None) is not None:
            base.config.pad_token_id = pad_token_id
        return DataCollatorForLanguageModeling(
            pad_token_id=pad_token_id, completion_only_loss=self.completion_only_loss,
            padding_free=self.padding_free, pad_to_multiple_of=args.pad_to_multiple_of)

    def _prepare_datasets(self, model, processing_class, args, train_dataset, train_name,
                          eval_dataset, data_collator, as_dataset=False):
        """(train, eval) through _prepare (tokenize, label, truncate or pack; datasets.Dataset out
        when a datasets object came in), token ids checked against the embedding; eval: one set
        or a dict of named sets; all handed through with skip_prepare_dataset.
        Mirrors: trl SFTTrainer.__init__ ("# Dataset": _prepare_dataset per set)"""
        if self.padding_free and not args.packing and args.max_length is not None:
            raise ValueError("SFTTrainer: with padding_free=True and no packing, `max_length` is "
                             f"not enforced (max_length={args.max_length}), as in TRL; fix: enable "
                             "packing (packing=True, packing_strategy='bfd'), or set "
                             "max_length=None with already truncated rows.")
        eval_sets = eval_dataset if isinstance(eval_dataset, dict) else (
            {"eval": eval_dataset} if eval_dataset is not None else {})
        _reject_skip_prepare_without_labels({"train": train_dataset, **eval_sets},
                                            self._skip_prepare_dataset, data_collator)
        if not self._skip_prepare_dataset:
            train_dataset = self._prepare(train_dataset, processing_class, args, train_name,
                                          as_dataset=as_dataset)
            eval_dataset = self._prepare_eval_sets(eval_dataset, processing_class, args)
        if "input_ids" in next(iter(train_dataset)):  # skip_prepare_dataset: rows as given
            _check_token_ids_fit(model, processing_class, train_dataset)
        return train_dataset, eval_dataset

    def _prepare_eval(self, dataset, tokenizer, args, name):
        """An eval set through _prepare: formatting_func, then packing if eval_packing (None:
        packing) asks. Mirrors: trl SFTTrainer.__init__ (eval_dataset branch)"""
        packing = args.packing if args.eval_packing is None else args.eval_packing
        _refuse_with_transform(dataset, name)
        as_dataset = is_datasets_object(dataset)
        return self._prepare(_formatted(dataset, self._formatting_func, args.max_steps),
                             tokenizer, args, name, packing=packing, as_dataset=as_dataset)

    def _prepare(self, dataset, tokenizer, args, name=None, packing=None, as_dataset=False):
        """Tokenize, label, truncate or pack, then shuffle if asked; a datasets.Dataset (with
        TRL's columns) when the input was a datasets object, else a list of rows.
        Mirrors: trl SFTTrainer._prepare_dataset"""
        packing = args.packing if packing is None else packing
        rows = prepare_dataset(dataset, tokenizer, max_length=args.max_length, packing=packing,
                               packing_strategy=args.packing_strategy,
                               completion_only_loss=self.completion_only_loss,
                               assistant_only_loss=args.assistant_only_loss,
                               dataset_text_field=args.dataset_text_field, eos_token=args.eos_token,
                               name=name, keep_columns=as_dataset)
        if args.shuffle_dataset:  # datasets.Dataset.shuffle(seed): numpy default_rng permutation
            rows = [rows[i] for i in np.random.default_rng(args.seed).permutation(len(rows))]
        return as_datasets_dataset(rows) if as_dataset else rows

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval") -> dict:
        """Trainer.evaluate, after preparing a raw eval set (one, or a dict / DatasetDict of them)
        passed here as __init__ prepares its eval_dataset; prepared rows pass unchanged.
        Mirrors: trl SFTTrainer.evaluate"""
        named = (isinstance(eval_dataset, str) and isinstance(self.eval_dataset, dict)
                 and eval_dataset in self.eval_dataset)
        if named:  # the name of a set prepared in __init__, as transformers selects it
            eval_dataset = self.eval_dataset[eval_dataset]
        elif not self._skip_prepare_dataset and eval_dataset is not None:
            eval_dataset = self._prepare_eval_sets(eval_dataset, self.processing_class, self.args)
        eval_sets = eval_dataset if isinstance(eval_dataset, dict) else (
            {"eval": eval_dataset} if eval_dataset is not None else {})
        _reject_skip_prepare_without_labels(eval_sets, self._skip_prepare_dataset,
                                            self.data_collator)
        return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The loss of Trainer.compute_loss, plus TRL's token metrics (entropy, accuracy).
        Mirrors: trl SFTTrainer.compute_loss (loss_type="nll"), over 2.5's Trainer.compute_loss
        Differs: TRL always asks for the fused LM head; here that is the speed path, and reference
        mode (or label smoothing, compute_loss_func, or a caller wanting the logits: evaluate with
        compute_metrics) goes through Trainer.compute_loss: `outputs = model(**inputs)`,
        `loss = outputs["loss"]`, the metrics from the full logits. loss_type="dft" as TRL's."""
        mode = "train" if model.training else "eval"
        inputs = {**inputs, "use_cache": False}
        if self.aux_loss_enabled:  # MoE: the model returns outputs.aux_loss
            inputs["output_router_logits"] = True
        fused = (self.args.label_smoothing_factor == 0 and self.compute_loss_func is None
                 and not return_outputs and fast_path("fused_lm_head_outputs"))
        if not fused:
            labels = inputs["labels"]  # Trainer.compute_loss pops it under label smoothing
            loss, outputs = super().compute_loss(model, inputs, return_outputs=True,
                                                 num_items_in_batch=num_items_in_batch)
            labels = with_virtual_prefix(labels, outputs.logits)
            stats = token_metrics(outputs.logits.detach(), labels)
            if self.args.loss_type == "dft":  # TRL's DFT ignores label smoothing
                loss = dft_loss(outputs.logits, labels, num_items_in_batch)
                if self.args.average_tokens_across_devices and num_items_in_batch is not None:
                    loss = loss * self.args.world_size
        else:  # speed path (nanosft.fast.lm_head): no (B, T, V) logits
            with self.compute_loss_context_manager():  # the model's loss: sum of -log p / tokens
                outputs = model(**inputs, num_items_in_batch=num_items_in_batch, fused_lm_head=True)
            loss = outputs.loss
            if self.args.loss_type == "dft":  # each token's NLL weighted by its p (no gradient)
                per_token_loss = -outputs.log_probs * outputs.log_probs.exp().detach()
                num_tokens = (outputs.label_mask.sum() if num_items_in_batch is None
                              else num_items_in_batch)
                loss = per_token_loss.sum() / torch.as_tensor(num_tokens).clamp(min=1)
            stats = torch.stack([outputs.label_mask.sum().float(), outputs.entropy.sum(),
                                 outputs.is_top1.sum().float()])
            if self.args.average_tokens_across_devices and num_items_in_batch is not None:
                loss = loss * self.args.world_size  # as Trainer.compute_loss: DDP averages ranks
        if self.aux_loss_enabled:
            loss = self._add_aux_loss(loss, outputs, num_items_in_batch)
        self._record_metrics(mode, stats.detach(), inputs)
        if self.aux_loss_enabled:
            aux = distributed.all_reduce_sum(outputs.aux_loss.detach().float())
            self._metrics[mode]["aux_loss"].append(aux.item() / self.args.world_size)
        return (loss, outputs) if return_outputs else loss

    def _add_aux_loss(self, loss, outputs, num_items_in_batch):
        """The loss plus router_aux_loss_coef * aux_loss, divided by the accumulation steps when
        num_items_in_batch normalises the loss (the aux loss is a per-micro-batch mean).
        Mirrors: trl SFTTrainer.compute_loss (weighted_aux_loss)
        Differs: the model's loss (fused head or not) holds coef * aux_loss once (transformers'
        forward, times world_size under average_tokens_across_devices), replaced here by TRL's."""
        if self.args.label_smoothing_factor != 0 or self.compute_loss_func is not None:
            return loss  # TRL adds none on these paths (the model saw no labels)
        weighted = self.router_aux_loss_coef * outputs.aux_loss
        steps = self.current_gradient_accumulation_steps if num_items_in_batch is not None else 1
        if self.args.loss_type == "dft":  # the model's loss was replaced by the DFT loss
            return loss + weighted / steps
        scale = (self.args.world_size if self.args.average_tokens_across_devices
                 and num_items_in_batch is not None else 1)
        if scale == 1 and steps == 1:  # the model's nll + coef * aux_loss is TRL's sum already
            return loss
        return loss - weighted * scale + weighted / steps

    def _record_metrics(self, mode, stats, inputs) -> None:
        """Per micro-batch entropy and mean_token_accuracy (summed over ranks: correct / valid of
        the batch) from `stats` = [valid, entropy sum, correct]; the running num_tokens (train).
        Mirrors: trl SFTTrainer.compute_loss metrics"""
        with torch.no_grad():
            if mode == "train":  # this batch's tokens ride along: one all-reduce, one sync
                mask = inputs.get("attention_mask")
                local = mask.sum() if mask is not None else inputs["position_ids"].size(1)
                local = torch.as_tensor(local, dtype=stats.dtype, device=stats.device)
                stats = torch.cat([stats, local[None]])
            sums = distributed.all_reduce_sum(stats).tolist()  # float32 counts exact below 2**24
        valid, entropy, correct = sums[:3]
        self._metrics[mode]["entropy"].append(entropy / valid if valid > 0 else 0.0)
        self._metrics[mode]["mean_token_accuracy"].append(correct / valid if valid > 0 else 0.0)
        if mode == "train":
            self._total_train_tokens += int(sums[3])
        self._metrics[mode]["num_tokens"] = [self._total_train_tokens]

    def log(self, logs: dict) -> None:
        """Merge the metric means since the last log (eval_ prefixed in eval), then Trainer.log.
        Mirrors: trl SFTTrainer.log: an unweighted mean over micro-batches, so eval
        mean_token_accuracy is the mean of the batches' accuracies | Differs: no start_time."""
        mode = "train" if self.model.training else "eval"
        metrics = {k: sum(v) / len(v) for k, v in self._metrics[mode].items() if v}
        logs.update({f"eval_{k}" if mode == "eval" else k: v for k, v in metrics.items()})
        super().log(logs)
        self._metrics[mode].clear()

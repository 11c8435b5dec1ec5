"""SFTTrainer: TRL's supervised fine-tuning set-up (dataset preparation, LoRA wrapping) on Trainer.

Walkthrough 2.1: SFTTrainer.__init__ is TRL's set-up steps, one call each as TRL names them,
ending in the printed super().__init__; the checks and model-id loading the walkthrough does
not print are in nanosft.run.sft_setup. On the SFT path SFTTrainer.compute_loss overrides 2.5's
Trainer.compute_loss (TRL's loss and token metrics).
Papers: LoRA 2106.09685, QLoRA 2305.14314 (a 4-bit base with bf16 adapters).
Mirrors trl 1.16 SFTTrainer: __init__, compute_loss and log.
"""

from collections import defaultdict
from dataclasses import fields

import numpy as np
import torch

from nanosft import distributed, nf4
from nanosft.args import SFTConfig, TrainingArguments
from nanosft.collator import DataCollatorForLanguageModeling
from nanosft.data import (as_datasets_dataset, head_of_stream, is_datasets_object,
                          load_examples, prepare_dataset)
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
        from nanosft.run.sft_setup import (add_model_tags, check_argument_types, check_arguments,
                                          create_model, router_aux_loss)  # product layer

        args = _as_sft_config(args, model)  # Args
        check_arguments(args, data_collator, train_dataset, compute_loss_func)  # TRL's refusals
        check_argument_types(processing_class, peft_config, formatting_func)  # and nanosft's
        set_seed(args.seed)  # before get_peft_model: the LoRA A init draws from the global RNG
        model, processing_class = create_model(model, args, quantization_config, processing_class)
        model = self._prepare_peft_model(model, args, peft_config)  # PEFT
        train_rows = self._read_train_dataset(train_dataset, args, formatting_func)  # its rows
        data_collator = self._create_data_collator(data_collator, model, processing_class, args,
                                                   train_rows)  # Data collator
        train_dataset, eval_dataset = self._prepare_datasets(  # Dataset
            model, processing_class, args, train_dataset, train_rows, eval_dataset, data_collator)
        super_init_kwargs = {"optimizer_cls_and_kwargs": optimizer_cls_and_kwargs}  # as TRL's
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
        self._set_signature_columns_if_needed()
        self.router_aux_loss_coef, self.aux_loss_enabled = router_aux_loss(self.model, args)  # MoE
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}  # TRL metrics
        self._total_train_tokens = 0
        add_model_tags(self.model, self._tag_names)

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

    def _training_chat_template(self, tokenizer, args):
        """Under assistant_only_loss, the prefix-preserving training variant of the tokenizer's
        official template (Qwen3's) that tokenizes the datasets; None: the tokenizer's own.
        Mirrors: trl SFTTrainer.__init__ (get_training_chat_template into self.chat_template)"""
        if not args.assistant_only_loss:
            return None
        from nanosft.families.chat_templates import training_chat_template  # product layer

        return training_chat_template(getattr(tokenizer, "chat_template", None))

    def _read_train_dataset(self, train_dataset, args, formatting_func):
        """Example rows of train_dataset (a stream cut to what max_steps trains on,
        formatting_func applied), or the dataset as given under skip_prepare_dataset.
        Mirrors: trl SFTTrainer._prepare_dataset's first steps (with_transform refused)"""
        from nanosft.run.sft_setup import formatted, refuse_with_transform, rows_trained_on

        self._skip_prepare_dataset = bool((args.dataset_kwargs or {}).get("skip_prepare_dataset"))
        self._formatting_func = formatting_func  # evaluate() formats a new eval set the same way
        if self._skip_prepare_dataset:
            return train_dataset
        refuse_with_transform(train_dataset, "train_dataset")
        train_dataset = head_of_stream(train_dataset, args.max_steps, rows_trained_on(args))
        return load_examples(formatted(train_dataset, formatting_func, args.max_steps),
                             args.dataset_text_field, args.max_steps, name="train_dataset")

    def _create_data_collator(self, data_collator, model, processing_class, args, train_rows):
        """The caller's collator, or DataCollatorForLanguageModeling over the pad token; sets
        padding_free and completion_only_loss (None: prompt-completion rows, read off the first).
        Mirrors: trl SFTTrainer.__init__ ("# Data collator")"""
        from nanosft.run.sft_setup import check_data_collator

        bfd_packing = args.packing and args.packing_strategy in ("bfd", "bfd_split")
        self.padding_free = args.padding_free or bfd_packing
        first = next(iter(train_rows))
        self.completion_only_loss = args.completion_only_loss
        if self.completion_only_loss is None:
            self.completion_only_loss = "prompt" in first and "completion" in first
        check_data_collator(data_collator, self.padding_free, self.completion_only_loss,
                            self._formatting_func)
        if data_collator is not None:
            return data_collator
        pad_token_id = _pad_token_id(args, processing_class)
        base = model.get_base_model() if isinstance(model, PeftModelForCausalLM) else model
        if getattr(base, "config", None) is not None:
            base.config.pad_token_id = pad_token_id
        return DataCollatorForLanguageModeling(
            pad_token_id=pad_token_id, completion_only_loss=self.completion_only_loss,
            padding_free=self.padding_free, pad_to_multiple_of=args.pad_to_multiple_of)

    def _prepare_datasets(self, model, processing_class, args, train_dataset, train_rows,
                          eval_dataset, data_collator):
        """(train, eval): train_rows (read off train_dataset, which names them and, a datasets
        object, makes the output one) and the eval set(s) through _prepare (tokenize, label,
        truncate or pack; chats under assistant_only_loss with TRL's training template), token
        ids checked against the embedding; all handed through with skip_prepare_dataset.
        Mirrors: trl SFTTrainer.__init__ ("# Dataset": _prepare_dataset)"""
        from nanosft.run.sft_setup import check_datasets, check_token_ids_fit, dataset_name

        check_datasets(args, self.padding_free, train_rows, eval_dataset,
                       self._skip_prepare_dataset, data_collator)
        self.chat_template = self._training_chat_template(processing_class, args)  # TRL's swap
        if not self._skip_prepare_dataset:
            train_rows = self._prepare(train_rows, processing_class, args,
                                       dataset_name(train_dataset, "train_dataset"),
                                       as_dataset=is_datasets_object(train_dataset))
            eval_dataset = self._prepare_eval_sets(eval_dataset, processing_class, args)
        if "input_ids" in next(iter(train_rows)):  # skip_prepare_dataset: rows as given
            check_token_ids_fit(model, processing_class, train_rows)
        return train_rows, eval_dataset

    def _prepare_eval_sets(self, eval_dataset, tokenizer, args):
        """One eval set, or a dict of named ones (evaluate() reports eval_<name>_loss), each
        through _prepare_eval. Mirrors: trl SFTTrainer.__init__ (eval_dataset branch)"""
        from nanosft.run.sft_setup import dataset_name

        if isinstance(eval_dataset, dict):  # a DatasetDict too
            return {name: self._prepare_eval(dataset, tokenizer, args, name)
                    for name, dataset in eval_dataset.items()}
        if eval_dataset is None:
            return None
        return self._prepare_eval(eval_dataset, tokenizer, args,
                                  dataset_name(eval_dataset, "eval_dataset"))

    def _prepare_eval(self, dataset, tokenizer, args, name):
        """An eval set through _prepare: formatting_func, then packing if eval_packing (None:
        packing) asks. Mirrors: trl SFTTrainer.__init__ (eval_dataset branch)"""
        from nanosft.run.sft_setup import formatted, refuse_with_transform

        packing = args.packing if args.eval_packing is None else args.eval_packing
        refuse_with_transform(dataset, name)
        as_dataset = is_datasets_object(dataset)
        return self._prepare(formatted(dataset, self._formatting_func, args.max_steps),
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
                               name=name, keep_columns=as_dataset, chat_template=self.chat_template)
        if args.shuffle_dataset:  # datasets.Dataset.shuffle(seed): numpy default_rng permutation
            rows = [rows[i] for i in np.random.default_rng(args.seed).permutation(len(rows))]
        return as_datasets_dataset(rows) if as_dataset else rows

    def _set_signature_columns_if_needed(self):
        """The columns the collator keeps (remove_unused_columns): the prepared rows' own.
        Mirrors: trl SFTTrainer._set_signature_columns_if_needed | Differs: called at the end of
        __init__; transformers calls it when it first drops columns."""
        if self._signature_columns is None:
            self._signature_columns = {"input_ids", "labels", "seq_lengths"}

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval") -> dict:
        """Trainer.evaluate, after preparing a raw eval set (one, or a dict / DatasetDict of them)
        passed here as __init__ prepares its eval_dataset; prepared rows pass unchanged.
        Mirrors: trl SFTTrainer.evaluate"""
        from nanosft.run.sft_setup import named_eval_sets, reject_skip_prepare_without_labels

        named = (isinstance(eval_dataset, str) and isinstance(self.eval_dataset, dict)
                 and eval_dataset in self.eval_dataset)
        if named:  # the name of a set prepared in __init__, as transformers selects it
            eval_dataset = self.eval_dataset[eval_dataset]
        elif not self._skip_prepare_dataset and eval_dataset is not None:
            eval_dataset = self._prepare_eval_sets(eval_dataset, self.processing_class, self.args)
        reject_skip_prepare_without_labels(named_eval_sets(eval_dataset),
                                           self._skip_prepare_dataset, self.data_collator)
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
                    loss = loss * distributed.data_parallel(self.args)[0]
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
                # as Trainer.compute_loss: DDP / FSDP average the data-parallel ranks
                loss = loss * distributed.data_parallel(self.args)[0]
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
        scale = (distributed.data_parallel(self.args)[0] if self.args.average_tokens_across_devices
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
            # over the ranks reading different rows (tensor-parallel ranks count theirs once);
            # float32 counts are exact below 2**24
            sums = distributed.all_reduce_data_parallel(stats, self.args).tolist()
        valid, entropy, correct = sums[:3]
        self._metrics[mode]["entropy"].append(entropy / valid if valid > 0 else 0.0)
        self._metrics[mode]["mean_token_accuracy"].append(correct / valid if valid > 0 else 0.0)
        if mode == "train":
            self._total_train_tokens += int(sums[3])
        self._metrics[mode]["num_tokens"] = [self._total_train_tokens]

    @classmethod
    def _logged_eval_metrics(cls):
        """TRL's token metrics, which log() adds as eval_<metric> in eval mode; None where this
        class overrides evaluate or log (see Trainer._logged_eval_metrics)."""
        if cls.evaluate is not SFTTrainer.evaluate or cls.log is not SFTTrainer.log:
            return None
        return ("eval_entropy", "eval_mean_token_accuracy", "eval_num_tokens")

    def log(self, logs: dict) -> None:
        """Merge the metric means since the last log (eval_ prefixed in eval), then Trainer.log.
        Mirrors: trl SFTTrainer.log: an unweighted mean over micro-batches, so eval
        mean_token_accuracy is the mean of the batches' accuracies | Differs: no start_time."""
        mode = "train" if self.model.training else "eval"
        metrics = {k: sum(v) / len(v) for k, v in self._metrics[mode].items() if v}
        logs.update({f"eval_{k}" if mode == "eval" else k: v for k, v in metrics.items()})
        super().log(logs)
        self._metrics[mode].clear()

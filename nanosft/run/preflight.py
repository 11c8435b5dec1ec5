"""What a run needs at its end, checked at its start: eval data when an eval_strategy asks for
evaluations, and a metric_for_best_model that evaluate() produces. (That output_dir can be written
is probed by output_folder.check_writable.)

transformers 5.23 refuses an eval_strategy without an eval_dataset at Trainer init; nanosft at
train() (so `trainer.eval_dataset = ...` after init still works) and, on the command line, before
the model loads. transformers finds a mistyped metric_for_best_model at the first evaluation (a
KeyError); nanosft refuses it at the start, as it knows the keys its evaluate() returns.
"""

import contextlib

# the keys Trainer.evaluate returns: the loss, its perplexity and speed_metrics("eval", ...)
TRAINER_EVAL_METRICS = ("eval_loss", "eval_perplexity", "eval_runtime",
                        "eval_samples_per_second", "eval_steps_per_second")


def check_eval_data(eval_strategy, eval_dataset, command_line=False, eval_on_start=False) -> None:
    """Refuse an eval_strategy of "steps" or "epoch" (or eval_on_start) without eval data (None or
    empty). Mirrors: transformers Trainer.__init__ (its eval_dataset check)"""
    if eval_strategy in (None, "no") and not eval_on_start:
        return
    if eval_dataset is not None and not (hasattr(eval_dataset, "__len__") and
                                         len(eval_dataset) == 0):
        return
    what = "no eval data" if eval_dataset is None else "empty eval data"
    if command_line:
        asks = f"--eval_strategy {eval_strategy}" if eval_strategy != "no" else "--eval_on_start"
        fix = "give --eval_data FILE, or set --eval_strategy no"
        fix += " and drop --eval_on_start" if eval_on_start else ""
    else:
        asks = f"eval_strategy={eval_strategy!r}" if eval_strategy != "no" else "eval_on_start=True"
        fix = 'pass an eval_dataset to the trainer, or set eval_strategy="no"'
        fix += " and eval_on_start=False" if eval_on_start else ""
    raise ValueError(f"{asks} evaluates during training, but there is {what}; {fix}. Nothing "
                     "was trained.")


def known_eval_metrics(trainer) -> tuple | None:
    """The eval_ keys `trainer`'s evaluate() returns (a trainer or its class; eval_<name>_... per
    set of a dict of eval sets), or None when they cannot be known before an evaluation: a
    compute_metrics function or an overridden evaluate / log may add any key. The trainer class
    says what its log() adds (Trainer._logged_eval_metrics, which SFTTrainer overrides)."""
    cls = trainer if isinstance(trainer, type) else type(trainer)
    if getattr(trainer, "compute_metrics", None) is not None:
        return None
    extra = cls._logged_eval_metrics()  # SFTTrainer: TRL's token metrics, one set or several
    if extra is None:
        return None
    named = getattr(trainer, "eval_dataset", None)
    if isinstance(named, dict):  # one evaluation per named set: eval_<name>_loss, ...
        return tuple(f"eval_{name}_{key.removeprefix('eval_')}" for name in named
                     for key in TRAINER_EVAL_METRICS) + extra
    return TRAINER_EVAL_METRICS + extra


def metric_key(name) -> str:
    """metric_for_best_model as a key of evaluate()'s dict: "loss" -> "eval_loss".
    Mirrors: transformers Trainer._determine_best_metric (metric_to_check)"""
    return name if name.startswith("eval_") else f"eval_{name}"


def check_metric_name(name, known, command_line=False) -> None:
    """Refuse a metric_for_best_model whose key is not among `known` (None: unknown, no check)."""
    if name is None or known is None or metric_key(name) in known:
        return
    given = f"--metric_for_best_model {name}" if command_line else \
        f"metric_for_best_model={name!r}"
    raise ValueError(f"{given}: evaluation will not produce "
                     f"{metric_key(name)!r}; it produces {', '.join(known)} (give the name with "
                     "or without eval_, e.g. loss). Nothing was trained.")


def metric_value(metrics, name):
    """metrics[eval_<name>] after an evaluation; a ValueError naming the key and the available ones
    where a compute_metrics or override did not produce it (transformers: a KeyError)."""
    key = metric_key(name)
    if key not in metrics:
        available = sorted(k for k in metrics if k.startswith("eval_"))  # not log()'s epoch
        raise ValueError(f"metric_for_best_model={name!r}: the evaluation returned no {key!r}, "
                         f"only {', '.join(available)}; pick one of these, or make evaluate "
                         "return it.")
    return metrics[key]


def check_eval_setup(trainer) -> None:
    """At train() start: eval data for the eval_strategy, and a metric_for_best_model the
    evaluation will produce."""
    args = trainer.args
    check_eval_data(args.eval_strategy, trainer.eval_dataset, eval_on_start=args.eval_on_start)
    if args.eval_strategy != "no" or args.eval_on_start:  # no evaluation: the metric is never read
        check_metric_name(args.metric_for_best_model, known_eval_metrics(trainer))


@contextlib.contextmanager
def guarded_run(trainer, resume_from_checkpoint=None):
    """The `with` block around one Trainer.train(): what the run needs at its end is checked first
    (train and eval data, metric_for_best_model), output_dir is writable and this run's alone
    (rank 0 holds its lock to the end), and a collective waiting past ddp_timeout ends with a
    message. Yields the checkpoint to resume (nanosft.run.checkpoint.resolve_and_check)."""
    from nanosft import distributed
    from nanosft.run.checkpoint import resolve_and_check
    from nanosft.run.output_folder import hold_output_dir

    if trainer.train_dataset is None:  # transformers' words, from get_train_dataloader
        raise ValueError("Trainer: training requires a train_dataset.")
    check_eval_setup(trainer)
    with distributed.explain_timeout(trainer.args.ddp_timeout), hold_output_dir(trainer.args):
        yield resolve_and_check(trainer.args, trainer.model, resume_from_checkpoint)

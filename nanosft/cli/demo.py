"""The pieces of `nanosft demo`: the embedded default model, held-out exact match, the before/after
table, plots.

The default (nanosft/cli/assets/default, made by scripts/make_default_model.py) is a tiny
Llama-family base that read sums as plain sentences ("7 plus 5 equals 12.") but was never asked one
in chat form. QLoRA SFT on 300 chat examples teaches the form; the 100 held-out prompts ask sums the
base read but SFT never showed, so a right answer after training means the adapter unlocked
knowledge of the base. It runs the walkthrough's prepare-train path (section 1) once; QLoRA
2305.14314.
"""

import importlib.util
import json
import os
import shutil
import time

import torch

from nanosft.data import load_examples
from nanosft.monitoring.callbacks import speed_summary

SUMMARY_FILE = "demo_summary.json"  # written last: marks a folder holding a finished demo
DEFAULT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "default")
TRAIN_FILE, EVAL_FILE = "sft_train.jsonl", "sft_eval.jsonl"


def default_model_dir() -> str:
    """The embedded default model folder; an error naming the fix if the package was installed
    without it.
    Mirrors: a Hub model id, here shipped in
    the package"""
    if not os.path.isfile(os.path.join(DEFAULT_DIR, "config.json")):
        raise FileNotFoundError(
            f"the embedded default model is missing from {DEFAULT_DIR}; reinstall nanosft, or "
            "rebuild it with `python scripts/make_default_model.py` from a source checkout"
        )
    return DEFAULT_DIR


def held_out_prompts(path):
    """(prompt messages, expected answer) pairs from a conversational JSONL whose last turn is
    the assistant's.
    Mirrors: an eval split in TRL's conversational format"""
    pairs = []
    for i, example in enumerate(load_examples(path)):
        messages = example.get("messages")
        if not messages or messages[-1]["role"] != "assistant":
            raise ValueError(
                f"{path}, example {i}: held-out prompts need 'messages' ending in an "
                "assistant turn (the expected answer)"
            )
        pairs.append((messages[:-1], messages[-1]["content"]))
    return pairs


def _reply_text(tokenizer, new_ids):
    if tokenizer.eos_token_id in new_ids:
        new_ids = new_ids[: new_ids.index(tokenizer.eos_token_id)]
    return tokenizer.decode(new_ids, skip_special_tokens=True).strip()


@torch.no_grad()
def chat_answers(model, tokenizer, chats, max_new_tokens=6, device="cpu"):
    """Greedy replies to many chats, cut at EOS and stripped; prompts of equal length share one
    batch (no padding).

    Mirrors: a batched transformers `generate` without padding
    """
    prompts = [
        tokenizer.apply_chat_template(messages, add_generation_prompt=True) for messages in chats
    ]
    replies = [None] * len(prompts)
    for length in sorted({len(p) for p in prompts}):
        rows = [i for i, p in enumerate(prompts) if len(p) == length]
        out = model.generate(
            torch.tensor([prompts[i] for i in rows], device=device),
            max_new_tokens=max_new_tokens,
            eos_token_id=tokenizer.eos_token_id,
        )
        for i, new_ids in zip(rows, out[:, length:].tolist()):
            replies[i] = _reply_text(tokenizer, new_ids)
    return replies


def exact_match(model, tokenizer, pairs, device="cpu"):
    """(answers, accuracy): a reply counts only if it equals the expected answer exactly (after
    strip)."""
    was_training = model.training
    model.eval()  # Linear4bit keeps dequantize + matmul in eval on CPU (not bnb's slower kernel)
    answers = chat_answers(model, tokenizer, [messages for messages, _ in pairs], device=device)
    model.train(was_training)
    correct = sum(a == expected for a, (_, expected) in zip(answers, pairs))
    return answers, correct / max(len(pairs), 1)


def before_after_table(pairs, before, after, rows=8) -> str:
    """A plain-text table: prompt | expected | before | after, for the first `rows` held-out
    prompts.
    Mirrors: nothing (the demo's report)"""

    def cell(text, width):
        text = text.replace("\n", "\\n")
        return (text[: width - 1] + "…") if len(text) > width else text.ljust(width)

    lines = [
        f"{'held-out prompt':<24} {'expected':<8} {'before SFT':<26} {'after SFT':<12}",
        "-" * 73,
    ]
    for (messages, expected), b, a in list(zip(pairs, before, after))[:rows]:
        mark_b, mark_a = ("✓" if b == expected else "✗"), ("✓" if a == expected else "✗")
        lines.append(
            f"{cell(messages[-1]['content'], 24)} {cell(expected, 8)} {mark_b} {cell(b, 24)} "
            f"{mark_a} {cell(a, 10)}"
        )
    return "\n".join(lines)


def save_loss_curve(log_history, path):
    """Write a PNG of the logged training loss; returns the path, or None when matplotlib is
    missing.
    Mirrors: the loss plot of trainer.state.log_history people draw after
    training"""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no window
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    points = [(r["step"], r["loss"]) for r in log_history if "loss" in r]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([s for s, _ in points], [v for _, v in points], marker="o")
    ax.set_xlabel("optimizer step (global_step)")
    ax.set_ylabel("training loss")
    ax.set_title("nanosft demo: QLoRA SFT loss")
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)
    return path


def write_summary(path, summary: dict) -> None:
    """demo_summary.json (accuracies, timings) written atomically. Mirrors:
    Trainer.save_metrics"""
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
    os.replace(tmp, path)


def is_demo_folder(output_dir) -> bool:
    """Whether output_dir holds only an earlier demo's result (its demo_summary.json, its adapter/
    or model/ folder): the demo may replace that, and nothing another run saved."""
    from nanosft.run import output_folder

    if not os.path.isfile(os.path.join(output_dir, SUMMARY_FILE)):
        return False
    found = output_folder.find_previous_run(output_dir)
    return all(name.split("/")[0] in output_folder.SAVED_SUBFOLDERS for name in found)


def demo_config(
    output_dir, steps, mode, device, report_to="nanosft", trace=False, overwrite_output_dir=False
):
    """The SFTConfig of the demo: small batches, a high LoRA learning rate, assistant-only loss,
    no checkpoints.

    Mirrors: trl SFTConfig | Differs: gradient checkpointing off (the
    model is tiny).
    """
    from nanosft.args import SFTConfig

    return SFTConfig(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=16,
        gradient_accumulation_steps=1,
        learning_rate=5e-4 if mode == "full" else 2e-3,
        lr_scheduler_type="cosine",
        warmup_steps=0.1,
        logging_steps=max(1, steps // 10),
        logging_first_step=True,
        save_strategy="no",
        report_to=report_to,
        gradient_checkpointing=False,
        bf16=False,
        use_cpu=device == "cpu",
        assistant_only_loss=True,
        max_length=64,
        seed=0,
        overwrite_output_dir=overwrite_output_dir,
        disable_tqdm=trace,
    )  # the trace prints its own lines: keep the bar out of them


def load_demo_model(model_dir, mode, device):
    """The base for the demo: NF4-quantized (qlora, qdora), or full precision (lora, dora with
    --no-quant; full).
    Mirrors:
    from_pretrained(quantization_config=BitsAndBytesConfig(nf4))"""
    from nanosft import nf4
    from nanosft.model import CausalLM

    quantization_config = None
    if mode in ("qlora", "qdora"):  # each linear weight quantized as it is read, on the device
        quantization_config = nf4.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True
        )
    return CausalLM.from_pretrained(
        model_dir, quantization_config=quantization_config, device_map=device
    )


def demo_peft_config(mode):
    """LoRA on every linear layer (r=16, alpha=32); DoRA adds the magnitude vector; None for
    full fine-tuning.
    Mirrors: peft LoraConfig as in TRL's QLoRA examples"""
    from nanosft.peft import LoraConfig

    if mode == "full":
        return None
    return LoraConfig(
        r=16, lora_alpha=32, target_modules="all-linear", use_dora=mode in ("qdora", "dora")
    )


def pick_threads(threads=None):
    """Set and return the CPU thread count for the demo: `threads` when given, else 1. The model's
    matmuls are (16 x 64 tokens) x 128 wide: split over threads, each waits on the others, and on
    a shared machine a waiting thread spins against the other jobs (40 steps on 2 busy cores:
    6.2 CPU s / 10.5 s wall on one thread, 20.4 / 32.2 on two)."""
    import torch

    threads = 1 if threads is None else threads
    if threads < 1:
        raise ValueError(f"--threads {threads}: give a whole number >= 1")
    torch.set_num_threads(threads)
    return threads


def run(
    output_dir,
    mode="qlora",
    device="cpu",
    steps=120,
    report_to="nanosft",
    trace=False,
    overwrite_output_dir=False,
):
    """Held-out answers before, SFTTrainer.train(), answers after; saves adapter, metrics, plots.
    Mirrors: a TRL QLoRA recipe (SFTTrainer.__init__ -> trainer.train())
    An output_dir holding another run is refused before anything runs, unless overwrite_output_dir.
    """
    from nanosft.run import output_folder
    from nanosft.monitoring import trace as walkthrough_trace
    from nanosft.sft import SFTTrainer
    from nanosft.tokenizer import Tokenizer

    refusal = output_folder.output_dir_refusal(output_dir, command_line=True, can_resume=False)
    if refusal and is_demo_folder(output_dir):  # the demo's own earlier result: replaced
        print(f"nanosft demo: replacing the earlier demo run in {output_dir}")
        for sub in output_folder.SAVED_SUBFOLDERS:  # adapter/ or model/, whichever it saved
            shutil.rmtree(os.path.join(output_dir, sub), ignore_errors=True)
        overwrite_output_dir = True
    elif refusal and not overwrite_output_dir:
        raise ValueError(refusal)
    start = time.time()
    model_dir = default_model_dir()
    tokenizer = Tokenizer.from_pretrained(model_dir)
    pairs = held_out_prompts(os.path.join(model_dir, EVAL_FILE))
    model = load_demo_model(model_dir, mode, device)
    print(
        f"nanosft demo: {mode} SFT of the embedded default ({model.num_parameters():,} parameters, "
        f"{len(tokenizer)} tokens) on {device}; {len(pairs)} held-out prompts"
    )
    before, accuracy_before = exact_match(model, tokenizer, pairs, device)
    print(f"before SFT: held-out exact match {accuracy_before:.1%}")

    config = demo_config(output_dir, steps, mode, device, report_to, trace, overwrite_output_dir)
    trainer = SFTTrainer(
        model,
        args=config,
        train_dataset=os.path.join(model_dir, TRAIN_FILE),
        processing_class=tokenizer,
        peft_config=demo_peft_config(mode),
    )
    walkthrough_trace.attach(trainer)
    train_start = time.time()
    result = trainer.train()
    train_seconds = time.time() - train_start
    after, accuracy_after = exact_match(trainer.model, tokenizer, pairs, device)

    print()
    print(before_after_table(pairs, before, after))
    print(
        f"\nheld-out exact match: before {accuracy_before:.1%} -> after {accuracy_after:.1%} "
        f"({result.global_step} steps, {train_seconds:.0f}s of training)"
    )
    print(speed_summary(trainer, result.metrics))  # model GFLOP/s and MFU
    saved = os.path.join(output_dir, "model" if mode == "full" else "adapter")
    trainer.model.save_pretrained(
        saved
    )  # PEFT adapter_config.json + adapter_model.safetensors, or a full model
    if mode == "full":
        tokenizer.save_pretrained(saved)
    print(
        f"saved the {'model' if mode == 'full' else 'adapter (PEFT format)'} to {saved}; "
        f"log: {os.path.join(output_dir, 'metrics.jsonl')}"
    )
    plot = save_loss_curve(trainer.state.log_history, os.path.join(output_dir, "loss.png"))
    print(
        f"loss curve: {plot}"
        if plot
        else 'loss curve: pip install "nanosft[plot]" to draw loss.png'
    )
    if report_to in ("tensorboard", "all") and importlib.util.find_spec("tensorboard") is not None:
        print(f"TensorBoard events (written as it logged): {os.path.join(output_dir, 'runs')}")
    write_summary(
        os.path.join(output_dir, SUMMARY_FILE),
        {
            "mode": mode,
            "steps": result.global_step,
            "accuracy_before": accuracy_before,
            "accuracy_after": accuracy_after,
            "train_seconds": round(train_seconds, 2),
            "total_seconds": round(time.time() - start, 2),
            "train_loss": result.training_loss,
            "train_model_flops_per_second": result.metrics.get("train_model_flops_per_second"),
            "mfu": result.metrics.get("mfu"),
        },
    )
    return 0

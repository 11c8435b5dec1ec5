"""Child process for tests/test_resume.py and tests/test_faults.py: train a tiny model, maybe die,
maybe resume.

Usage: python tests/resume_worker.py SPEC.json SPEC = {"jobs": [job, ...], "result": path}. Each
job builds a fresh tiny model and trainer and trains it:
  kind            "full" (Trainer, full fine-tuning), "lora" (SFTTrainer + LoRA with dropout) or
  "qlora" (NF4 base)
  ga              gradient_accumulation_steps
  output_dir      where checkpoint-N folders go (save_steps=1: one per optimizer step)
  resume          null, true (newest checkpoint) or a checkpoint path
  kill_at_step    SIGKILL this process during the optimizer step after checkpoint-<kill_at_step> was
  written,
                  after `kill_micro` + 1 micro-batches of that step (their gradients are lost with
                  the process)
  kill_in_save    SIGKILL this process while checkpoint-<kill_in_save> is being written (after the
  weights,
                  optimizer, scheduler and RNG files, before trainer_state.json)
  no_rng          negative control: do not restore the RNG state from the checkpoint
  ignore_data_skip  negative control: replay the interrupted epoch from its first batch
  kill_rank       with torchrun-style variables: only this rank kills itself (a peer that dies)
  death_file      the SIGKILLed process first writes time.time() here
  signal          "SIGKILL" (default) or "SIGSTOP": the process freezes instead of dying
  fsize_limit     {"step": K, "bytes": N}: from the save of checkpoint-K on, no file may grow past N
  bytes
                  (RLIMIT_FSIZE, SIGXFSZ ignored): every write then fails as on a full disk
  grad_scaler     {"init_scale": S, "growth_interval": G}: give the trainer a CPU
  torch.amp.GradScaler (what fp16
                  sets up on CUDA), so scaler.pt is saved and restored; a huge S makes some steps
                  overflow and skip
  record_error    store the exception of train() (type, errno, message) instead of failing the
  process
  trace           file that gets one JSON line per micro-batch: global step and a hash of the batch
  fsdp            with torchrun-style variables: fsdp="full_shard" (FSDP2); the stored state is
                  then gathered whole (a collective, so every rank stores it)
The SIGKILL comes from wrappers the worker puts on the trainer instance and on a checkpoint
function: the library is not edited. After every job that finishes, the final state dict, the
logged (step, loss, grad_norm, lr) and the checkpoint the job resumed from are stored under the
job's name in SPEC["result"] (rank 0 only under torchrun-style environment variables). One
thread and fixed seeds: two processes doing the same work get the same bits.
"""

import hashlib
import json
import os
import signal
import sys
import time

import torch

TEXTS = [
    ("What is two plus two?", " Four."),
    ("Name a primary colour.", " Red."),
    ("Capital of France?", " Paris."),
    ("Opposite of hot?", " Cold."),
    ("How many legs has a cat?", " Four legs."),
    ("Spell the word dog.", " D, O, G."),
    ("What comes after Monday?", " Tuesday."),
    ("Is ice cold?", " Yes, ice is cold."),
    ("What colour is grass?", " Green."),
    ("Three minus one?", " Two."),
    ("Which animal barks?", " A dog barks."),
    ("Freezing point of water in Celsius?", " Zero degrees."),
]
VOCAB = 64  # full fine-tuning runs on random ids from this vocabulary


def make_tokenizer(folder):
    """Train the byte-level BPE once and save it: every process loads the very same vocabulary."""
    from nanosft.tokenizer import Tokenizer

    corpus = [p + c for p, c in TEXTS] * 4
    Tokenizer.train(corpus, vocab_size=300).save_pretrained(folder)


def tiny_model(vocab_size, hidden=32, seed=0):
    from nanosft.model import CausalLM, ModelConfig

    torch.manual_seed(seed)
    return CausalLM(
        ModelConfig(
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
        )
    )


def random_rows(n=14, seed=1):
    """Rows of random lengths, the first third prompt (-100): each micro-batch has its count."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(4, 12, (1,), generator=g))
        ids = torch.randint(1, VOCAB, (length,), generator=g).tolist()
        rows.append(
            {
                "input_ids": ids,
                "labels": [t if j >= length // 3 else -100 for j, t in enumerate(ids)],
            }
        )
    return rows


def common_args(job):
    return {
        "output_dir": job["output_dir"],
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": job["ga"],
        "num_train_epochs": job.get("epochs", 2),
        "logging_steps": 1,
        "save_strategy": "steps",
        "save_steps": 1,
        "save_total_limit": 2,
        "use_cpu": True,
        "disable_tqdm": True,
        "ignore_data_skip": job.get("ignore_data_skip", False),
        "ddp_timeout": job.get("ddp_timeout", 1800),
        **({"fsdp": "full_shard", "fsdp_config": {"reshard_after_forward": True}}
           if job.get("fsdp") else {}),
    }


def build_full(job):
    from nanosft.args import TrainingArguments
    from nanosft.collator import DataCollatorForLanguageModeling
    from nanosft.trainer import Trainer

    args = TrainingArguments(
        learning_rate=1e-3,
        weight_decay=0.1,
        warmup_steps=1,
        optim="adamw_torch",
        seed=3,
        **common_args(job),
    )
    return Trainer(tiny_model(VOCAB), args, train_dataset=random_rows(job.get("rows", 14)),
                   data_collator=DataCollatorForLanguageModeling(pad_token_id=0))


def build_sft(job):
    from nanosft.args import SFTConfig
    from nanosft.nf4 import quantize_model
    from nanosft.peft import LoraConfig
    from nanosft.sft import SFTTrainer
    from nanosft.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(job["tokenizer_dir"])
    quantized = job["kind"] == "qlora"
    # NF4 blocks need in_features % 64 == 0
    model = tiny_model(len(tokenizer), hidden=64 if quantized else 32)
    if quantized:
        quantize_model(model)
    args = SFTConfig(
        learning_rate=1e-2,
        max_length=64,
        bf16=False,
        gradient_checkpointing=False,
        seed=5,
        **common_args(job),
    )
    peft_config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules="all-linear")
    data = [{"prompt": p, "completion": c} for p, c in TEXTS]
    return SFTTrainer(
        model, args, train_dataset=data, processing_class=tokenizer, peft_config=peft_config
    )


def die(job):
    if int(os.environ.get("RANK", "0")) != job.get("kill_rank", int(os.environ.get("RANK", "0"))):
        return
    if job.get("death_file"):
        with open(job["death_file"], "w") as f:
            f.write(repr(time.time()))
    sys.stdout.flush()
    # SIGSTOP: a hung, not a dead, peer
    os.kill(os.getpid(), getattr(signal, job.get("signal", "SIGKILL")))


def attach_hooks(trainer, job):
    """Per-micro-batch trace and SIGKILL points: wrappers on this trainer and checkpoint module."""
    from nanosft.run import checkpoint

    step = trainer.training_step
    micro_in_kill_step = [0]

    def traced_step(model, inputs, num_items_in_batch=None):
        loss = step(model, inputs, num_items_in_batch)
        if job.get("trace"):
            digest = hashlib.sha1(inputs["input_ids"].numpy().tobytes()).hexdigest()[:12]
            with open(job["trace"], "a") as f:
                f.write(json.dumps({"step": trainer.state.global_step, "batch": digest}) + "\n")
        if trainer.state.global_step == job.get("kill_at_step"):
            if micro_in_kill_step[0] == job.get("kill_micro", 0):
                die(job)
            micro_in_kill_step[0] += 1
        return loss

    trainer.training_step = traced_step
    if job.get("kill_in_save") is not None:
        write_json = checkpoint._write_json
        partial = f"{checkpoint.TEMP_PREFIX}checkpoint-{job['kill_in_save']}"

        def write_json_or_die(obj, path):
            if partial in path and path.endswith(checkpoint.TRAINER_STATE_NAME):
                die(job)
            write_json(obj, path)

        checkpoint._write_json = write_json_or_die
    if job.get("fsize_limit"):
        import resource

        save_weights, limit = checkpoint.save_model_weights, job["fsize_limit"]

        def save_weights_on_full_disk(model, folder, *args, **kwargs):
            if folder.endswith(f"checkpoint-{limit['step']}"):
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead
                resource.setrlimit(resource.RLIMIT_FSIZE, (limit["bytes"], resource.RLIM_INFINITY))
            save_weights(model, folder, *args, **kwargs)

        checkpoint.save_model_weights = save_weights_on_full_disk
    if job.get("no_rng"):
        checkpoint.load_rng_state = lambda *args, **kwargs: False


def run_job(job):
    from nanosft.run import checkpoint

    # whatever ran before this job, it starts from the same global RNG state
    torch.manual_seed(1234)
    trainer = build_full(job) if job["kind"] == "full" else build_sft(job)
    if job.get("grad_scaler"):
        trainer.scaler = torch.amp.GradScaler("cpu", **job["grad_scaler"])
    attach_hooks(trainer, job)
    resumed_from = None
    if job.get("resume") is True:
        resumed_from = checkpoint.get_last_checkpoint(job["output_dir"])
    elif job.get("resume"):
        resumed_from = job["resume"]
    try:
        trainer.train(resume_from_checkpoint=job.get("resume"))
    except Exception as error:
        if not job.get("record_error"):
            raise
        return {
            "error": type(error).__name__,
            "errno": getattr(error, "errno", None),
            "message": str(error),
            "global_step": trainer.state.global_step,
        }
    logs = [(h["step"], h["loss"], h["grad_norm"], h["learning_rate"])
            for h in trainer.state.log_history if "loss" in h]
    if job.get("fsdp"):  # sharded DTensors -> whole tensors, gathered on every rank
        from nanosft.parallel.fsdp import full_state_dict

        state = full_state_dict(trainer.model)
    else:
        state = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return {"state": state, "logs": logs, "global_step": trainer.state.global_step,
            "resumed_from": os.path.basename(resumed_from) if resumed_from else None}


def spawn(spec: dict, spec_path: str, env: dict | None = None):
    """Write `spec` to `spec_path`, start this script on it in a fresh process (output: .log)."""
    import subprocess

    with open(spec_path, "w") as f:
        json.dump(spec, f)
    child_env = {
        **os.environ,
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
        **(env or {}),
    }
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, child_env.get("PYTHONPATH")]))
    with open(spec_path + ".log", "w") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen([sys.executable, os.path.abspath(__file__), spec_path], stdout=log,
                                stderr=subprocess.STDOUT, env=child_env, cwd=repo)


def log_tail(spec_path, lines=25):
    """The last lines a worker printed, for assertion messages."""
    with open(spec_path + ".log") as f:
        return "".join(f.readlines()[-lines:])


def main(spec_path):
    # same thread count in every process: CPU kernels then give the same bits
    torch.set_num_threads(1)
    with open(spec_path) as f:
        spec = json.load(f)
    results = {}
    for job in spec["jobs"]:
        results[job["name"]] = run_job(job)
    if int(os.environ.get("RANK", "0")) == 0 and spec.get("result"):
        torch.save(results, spec["result"])
    from tiny import leave_group

    leave_group()  # FSDP runs shard with DTensors: see leave_group


if __name__ == "__main__":
    main(sys.argv[1])

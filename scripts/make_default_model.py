"""Make the embedded default that `nanosft demo` fine-tunes: tokenizer, pretrained base, SFT data.

The base is pretrained on plain text: sums written as sentences ("7 plus 5 equals 12.") for every
pair a, b in 0..19, plus a few ChatML small-talk chats, so it has seen the chat tokens but never a
sum asked in chat form. SFT data asks "What is 7 plus 5?" and answers "12"; the held-out prompts ask
about sums the base read in pretraining but that are absent from the SFT set. Walkthrough 1 (the
model and processing_class SFTTrainer starts from). Deterministic: fixed seeds, one thread;
re-running rewrites the same bytes. Run: `python scripts/make_default_model.py` (about 2-4 minutes
on 2 CPU cores).
"""

import argparse
import json
import math
import os
import random
import shutil
import tempfile
import time

import torch

from nanosft.model import CausalLM, ModelConfig
from nanosft.tokenizer import Tokenizer, render_chatml

OUT_DIR = os.path.join(os.path.dirname(__file__), "..", "nanosft", "cli", "assets", "default")
NUMBERS = range(20)
NUM_SFT_TRAIN = 300  # of the 400 sums; the other 100 are held out (sft_eval.jsonl)
SMALL_TALK = [
    ("Hello!", "Hello! How can I help you today?"),
    ("What is your name?", "I am a tiny language model."),
    ("Who are you?", "I am a small model that read many sums."),
    ("Thank you!", "You are welcome."),
    ("What color is the sky?", "The sky is blue."),
    ("Can you help me?", "Yes, ask me a question."),
    ("Good morning!", "Good morning to you too."),
    ("How are you?", "I am fine, thank you."),
]
MODEL = {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4,
         "num_attention_heads": 4, "max_position_embeddings": 256, "tie_word_embeddings": False}
PRETRAIN = {"steps": 700, "batch_size": 32, "docs_per_row": 6, "lr": 3e-3, "warmup": 50,
            "chat_fraction": 0.2}


def fact_sentences(a, b):
    """The plain-text phrasings of one sum that pretraining reads: two statements and a
    plain-text Q/A."""
    return [f"{a} plus {b} equals {a + b}.", f"The sum of {a} and {b} is {a + b}.",
            # the answer after a newline, as in ChatML: "9", not " 9", is a different token
            f"Question: {question(a, b)}\nAnswer:\n{a + b}"]


def question(a, b):
    """The chat-form question SFT teaches (and the held-out set asks)."""
    return f"What is {a} plus {b}?"


def chat_example(user, assistant):
    """One conversational (TRL `messages`) example."""
    return {"messages": [{"role": "user", "content": user},
                         {"role": "assistant", "content": assistant}]}


def split_sums(seed=0):
    """All (a, b) pairs, shuffled once with a fixed seed: (SFT train pairs, held-out pairs)."""
    pairs = [(a, b) for a in NUMBERS for b in NUMBERS]
    random.Random(seed).shuffle(pairs)
    return pairs[:NUM_SFT_TRAIN], pairs[NUM_SFT_TRAIN:]


def pretraining_rows(tokenizer, rng, batch_size, docs_per_row):
    """A (B, T) batch: each row concatenates documents (fact sentences or chats), separated
    by <|endoftext|>."""
    eot, rows = tokenizer.pad_token_id, []
    for _ in range(batch_size):
        ids = []
        for _ in range(docs_per_row):
            if rng.random() < PRETRAIN["chat_fraction"]:
                user, assistant = rng.choice(SMALL_TALK)
                ids += tokenizer.apply_chat_template(chat_example(user, assistant)["messages"])
            else:
                a, b = rng.choice(NUMBERS), rng.choice(NUMBERS)
                ids += tokenizer.encode(rng.choice(fact_sentences(a, b)))
            ids.append(eot)
        rows.append(ids)
    length = min(len(r) for r in rows)  # crop to the shortest row: no padding needed
    return torch.tensor([r[:length] for r in rows])


def pretrain(model, tokenizer, seed=0, log_every=100):
    """AdamW with linear warmup and cosine decay on next-token loss over every token.
    Plain loop, no Trainer."""
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=PRETRAIN["lr"], betas=(0.9, 0.95),
                                  weight_decay=0.0)
    steps, start = PRETRAIN["steps"], time.time()
    model.train()
    for step in range(steps):
        lr = (PRETRAIN["lr"] * min(1.0, (step + 1) / PRETRAIN["warmup"])
              * 0.5 * (1 + math.cos(math.pi * step / steps)))
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = pretraining_rows(tokenizer, rng, PRETRAIN["batch_size"], PRETRAIN["docs_per_row"])
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % log_every == 0 or step == steps - 1:
            print(f"pretrain step {step:4d}  loss {loss.item():.4f}  lr {lr:.2e}  "
                  f"{time.time() - start:.0f}s", flush=True)


@torch.no_grad()
def completion_accuracy(model, tokenizer, pairs):
    """Share of pairs whose greedy continuation of "a plus b equals" starts with the right sum:
    the base's knowledge."""
    model.eval()
    correct = 0
    for a, b in pairs:
        ids = tokenizer.encode(f"{a} plus {b} equals")
        out = model.generate(torch.tensor([ids]), max_new_tokens=4,
                             eos_token_id=tokenizer.pad_token_id)
        correct += tokenizer.decode(out[0, len(ids):].tolist()).strip().startswith(f"{a + b}.")
    return correct / len(pairs)


def write_jsonl(path, examples):
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(example) + "\n" for example in examples)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=OUT_DIR,
                        help="folder to (re)write (default: nanosft/cli/assets/default)")
    args = parser.parse_args()
    # one thread: the same float sums in the same order, so the same bytes each run
    torch.set_num_threads(1)
    torch.manual_seed(0)
    train_pairs, eval_pairs = split_sums()

    corpus = [s for a in NUMBERS for b in NUMBERS for s in fact_sentences(a, b)]
    chats = [chat_example(u, a)["messages"] for u, a in SMALL_TALK]
    # BPE merges come from the pretraining text, the small-talk chats and one question
    tokenizer = Tokenizer.train(corpus + [render_chatml(m)[0] for m in chats] + [question(1, 2)],
                                vocab_size=512)
    config = ModelConfig(vocab_size=len(tokenizer), bos_token_id=None,
                         eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, **MODEL)
    model = CausalLM(config)
    print(f"tokenizer: {len(tokenizer)} tokens; model: {model.num_parameters():,} parameters")
    pretrain(model, tokenizer)
    accuracy = completion_accuracy(model, tokenizer, eval_pairs)
    print(f"base model completes held-out sums in plain text: {accuracy:.0%}")
    assert accuracy >= 0.95, "pretraining did not memorise the sums; raise PRETRAIN['steps']"

    # Write everything into a temp folder, then move it into place
    # (atomic for readers of the folder).
    out = os.path.abspath(args.out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=os.path.dirname(out), prefix=".default-")
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the package folder is world-readable
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    write_jsonl(os.path.join(tmp, "sft_train.jsonl"),
                [chat_example(question(a, b), str(a + b)) for a, b in train_pairs])
    write_jsonl(os.path.join(tmp, "sft_eval.jsonl"),
                [chat_example(question(a, b), str(a + b)) for a, b in eval_pairs])
    if os.path.isdir(out):
        shutil.rmtree(out)
    os.replace(tmp, out)
    print(f"wrote {sorted(os.listdir(out))} to {out}")


if __name__ == "__main__":
    main()

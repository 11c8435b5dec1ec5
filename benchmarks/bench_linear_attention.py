"""Gated DeltaNet's chunked form against full attention, nanosft beside transformers' torch path.

One Qwen3.5 model of two layers (a Gated DeltaNet layer and a gated full-attention layer) is built
by transformers and loaded by nanosft (the same weights). For each length T: the seconds of one
training step (forward + backward, batch 1, fp32) of each token mixer in both libraries, and the
gated delta rule alone, recurrent (one token a step: generation's form) against chunked; then the
chunk-size sweep that chose nanosft's CHUNK_SIZE. Median of --reps after one warm-up; reference and
nanosft alternate so machine noise hits both. transformers runs its torch fallbacks
(torch_chunk_gated_delta_rule, causal_conv1d_fn: no fused kernel installed) and SDPA attention.
Run: python benchmarks/bench_linear_attention.py                     (512-4,096 tokens, minutes)
     python benchmarks/bench_linear_attention.py --smoke             (a few seconds)
Paper: Gated DeltaNet 2412.06464.
"""

import argparse
import statistics
import tempfile
import time
import warnings

import torch
import transformers

from nanosft.families.gated_deltanet import (CHUNK_SIZE, chunk_gated_delta_rule,
                                             recurrent_gated_delta_rule)
from nanosft.families.auto import AutoModelForCausalLM

# Qwen3.5's head shapes, fewer heads (a laptop CPU): attention 8 x 256 (2 kv heads), linear
# attention 4 key heads and 8 value heads of 128
CONFIG = {"vocab_size": 256, "hidden_size": 1024, "intermediate_size": 2048,
          "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
          "head_dim": 256, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
          "linear_num_key_heads": 4, "linear_num_value_heads": 8,
          "layer_types": ["linear_attention", "full_attention"]}
SMOKE = {**CONFIG, "hidden_size": 128, "intermediate_size": 256, "head_dim": 32,
         "linear_key_head_dim": 16, "linear_value_head_dim": 16}


def seconds(fn, reps):
    """Median wall seconds of fn() over reps runs, after one warm-up."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def train_step(module, *args, **kwargs):
    """One forward + backward of a token mixer (its output summed)."""
    def step():
        out = module(*args, **kwargs)
        (out[0] if isinstance(out, tuple) else out).sum().backward()
    return step


def build(config):
    """(transformers model, nanosft model) with the same random weights."""
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3_5TextConfig(**config),
                                                       attn_implementation="sdpa")
    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(folder)
        ours = AutoModelForCausalLM.from_pretrained(folder).train()
    return hf.train(), ours.train()


def layer_rows(hf, ours, lengths, reps):
    C = hf.config.hidden_size
    print(f"{'T':>6} {'GDN nanosft':>12} {'GDN HF torch':>13} {'attn nanosft':>13} "
          f"{'attn HF sdpa':>13}   seconds per forward + backward, batch 1")
    for T in lengths:
        x = torch.randn(1, T, C, requires_grad=True)
        pos = torch.arange(T)[None]
        cos, sin = ours.model.rotary(pos, x.dtype)
        hf_cos_sin = hf.model.rotary_emb(x, pos)
        row = [seconds(train_step(ours.model.layers[0].linear_attn, x), reps),
               seconds(train_step(hf.model.layers[0].linear_attn, x), reps),
               seconds(train_step(ours.model.layers[1].self_attn, x, cos, sin, None), reps),
               seconds(train_step(hf.model.layers[1].self_attn, x, position_embeddings=hf_cos_sin,
                                  attention_mask=None), reps)]
        print(f"{T:>6} " + " ".join(f"{s:>12.4f} " for s in row))


def rule_inputs(T, config):
    g = torch.Generator().manual_seed(0)
    Hk, Hv = config["linear_num_key_heads"], config["linear_num_value_heads"]
    Dk, Dv = config["linear_key_head_dim"], config["linear_value_head_dim"]
    q, k = (torch.randn(1, T, Hk, Dk, generator=g) for _ in range(2))
    v = torch.randn(1, T, Hv, Dv, generator=g)
    return q, k, v, -torch.rand(1, T, Hv, generator=g), torch.rand(1, T, Hv, generator=g)


def rule_rows(lengths, chunk_sizes, reps, config):
    print("\nthe gated delta rule alone, forward: recurrent (T steps) vs chunked "
          f"(T / {CHUNK_SIZE} steps)")
    for T in lengths:
        args = rule_inputs(T, config)
        with torch.no_grad():
            rec = seconds(lambda: recurrent_gated_delta_rule(*args), max(1, reps // 2))
            chunk = seconds(lambda: chunk_gated_delta_rule(*args), reps)
            diff = (recurrent_gated_delta_rule(*args)[0] - chunk_gated_delta_rule(*args)[0])
        print(f"{T:>6} recurrent {rec:.4f} s, chunked {chunk:.4f} s ({rec / chunk:.1f}x), "
              f"max |difference| {diff.abs().max():.1e}")
    T = lengths[-1]
    print(f"\nchunk-size sweep at T = {T}, forward + backward of the rule (CHUNK_SIZE = "
          f"{CHUNK_SIZE})")
    args = [t.requires_grad_() for t in rule_inputs(T, config)]
    for C in chunk_sizes:
        step = lambda: chunk_gated_delta_rule(*args, chunk_size=C)[0].sum().backward()
        print(f"{C:>6} {seconds(step, reps):.4f} s")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="512,1024,2048,4096")
    parser.add_argument("--chunk-sizes", default="16,32,64,128,256")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, 64 and 128 tokens")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    if args.threads:
        torch.set_num_threads(args.threads)
    config = SMOKE if args.smoke else CONFIG
    lengths = [64, 128] if args.smoke else [int(t) for t in args.lengths.split(",")]
    chunk_sizes = [int(c) for c in args.chunk_sizes.split(",")]
    reps = 1 if args.smoke else args.reps
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.get_num_threads()} threads; layer shapes {config}\n")
    hf, ours = build(config)
    layer_rows(hf, ours, lengths, reps)
    rule_rows(lengths, chunk_sizes, reps, config)


if __name__ == "__main__":
    main()

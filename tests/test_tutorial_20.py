"""Runs tutorials/20_monitoring.py as a user would and checks the monitoring figures it prints.

Compared: exit code 0 (the script asserts each logged tokens/s, samples/s, steps/s, model FLOP/s
and MFU against its own counts over a bracketed window time, the callback's model FLOPs and
total_flos against formulas, the ledger's parameter and optimizer rows against the live tensors,
a falling loss, TensorBoard events and metrics.jsonl equal to log_history, and transformers'
rewrite_logs tags) and the printed figures against formulas written out here from the tutorial's
config and printed row lengths: N = 6N's matmul weights, the run's model FLOPs (6N per token plus
causal attention 6 x width x layers x T(T+1)), transformers' total_flos, tokens per window (every
3 windows of 8 rows are 2 whole epochs of 12 rows), tokens/s / samples/s = tokens per row.
Timings are checked only for being positive (a shared CPU is noisy).
Hermetic: a tiny SFT run (hidden 32, 2 layers, 24 steps) on CPU in a temporary folder; no network.
Run: python -m pytest -q tests/test_tutorial_20.py
"""

import re

from run_tutorial import assert_reference_ran, run_tutorial

CONFIG = {"vocab_size": 300, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2}
ROWS, ROWS_PER_STEP, MAX_STEPS, LOGGING_STEPS = 12, 2 * 2, 24, 2  # batch 2 x accumulation 2


def matmul_weights(c) -> int:
    """N: the seven linears of every decoder layer plus lm_head (no biases)."""
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    q = o = c["hidden_size"] * c["num_attention_heads"] * head_dim
    k = v = c["hidden_size"] * c["num_key_value_heads"] * head_dim
    mlp = 3 * c["hidden_size"] * c["intermediate_size"]
    return c["num_hidden_layers"] * (q + k + v + o + mlp) + c["hidden_size"] * c["vocab_size"]


def number(text) -> float:
    return float(text.replace(",", ""))


def test_tutorial_20_monitoring_figures():
    out = run_tutorial("20_monitoring.py")
    n = matmul_weights(CONFIG)
    width, layers = CONFIG["hidden_size"], CONFIG["num_hidden_layers"]  # heads x head_dim = C
    lengths = [int(x) for x in re.search(r"row lengths \(tokens\): \[([0-9, ]+)\]", out)[1]
               .split(",")]
    epochs = MAX_STEPS * ROWS_PER_STEP // ROWS
    assert len(lengths) == ROWS and epochs == 8

    # samples/s and tokens/s: one table row per logging window
    table = re.findall(r"^ +(\d+) +(\d+) +(\d+) +\[([0-9.]+), ([0-9.]+)\] +([0-9.]+) +([0-9.]+) "
                       r"+([0-9.]+) = (\d+) / (\d+) = ([0-9.]+)$", out, flags=re.M)
    assert [int(r[0]) for r in table] == list(range(LOGGING_STEPS, MAX_STEPS + 1, LOGGING_STEPS))
    rows = [int(r[1]) for r in table]
    tokens = [int(r[2]) for r in table]
    assert rows == [LOGGING_STEPS * ROWS_PER_STEP] * len(table)
    for i in range(0, len(tokens), 3):  # 3 windows x 8 rows = 2 epochs of the 12 rows
        assert sum(tokens[i:i + 3]) == 2 * sum(lengths)
    for r, row_count, token_count in zip(table, rows, tokens):
        lo, hi, tokens_per_s, samples_per_s = map(float, r[3:7])
        assert 0 < lo <= hi and tokens_per_s > 0 and samples_per_s > 0
        assert (int(r[8]), int(r[9])) == (token_count, row_count)
        # both rates are rounded (0.1 and 0.001): their ratio is tokens per row within that
        slack = token_count / row_count * (0.05 / tokens_per_s + 5e-4 / samples_per_s) + 1e-3
        assert abs(tokens_per_s / samples_per_s - token_count / row_count) <= slack
    assert f"{sum(rows)} rows, {sum(tokens)} tokens = {epochs} epochs x {sum(lengths)}" in out

    # model FLOPs: 6N per token plus causal attention, and transformers' total_flos
    assert f"= {n:,} matmul weights" in out
    assert f"= 6 x {n:,} x T + 6 x {width} x {layers} x T(T+1)" in out
    run_flops = epochs * sum(6 * n * t + 6 * width * layers * t * (t + 1) for t in lengths)
    by_hand, callback = re.search(r"model FLOPs of the run: by hand ([0-9,]+); "
                                  r"ThroughputCallback ([0-9,]+)", out).groups()
    assert number(by_hand) == number(callback) == run_flops
    padded, params, total = re.search(r"total_flos \(transformers' estimate\) = 6 x ([0-9,]+) "
                                      r"input_ids x ([0-9,]+) parameters = ([0-9,]+)", out).groups()
    norms = (2 * layers + 1) * CONFIG["hidden_size"]
    assert number(params) == n + norms
    assert number(total) == 6 * number(padded) * (n + norms)
    assert number(padded) >= sum(tokens)  # padding counts there, not in the model FLOPs
    mfus = re.search(r"MFU per window: (.+)", out)[1].split(", ")
    assert len(mfus) == len(table) and all(0 < float(m.rstrip("%")) < 100 for m in mfus)

    # memory: a positive measured peak; a second run in the process grows less
    first, second = map(float, re.search(r"cpu peak growth: first run ([0-9.]+) MiB, a second "
                                         r"run in this process ([0-9.]+) MiB", out).groups())
    assert 0 < first and second < first  # the first run's RSS holds the process's one-time costs
    assert re.search(r"Memory predicted \(MiB, tensors of a step at \d+ x \d+ tokens\) = ", out)

    # loss curve: falling window by window; train_loss is the mean of the equal windows
    losses = [float(x) for x in re.findall(r"^step +\d+ \| #* *([0-9.]+)$", out, flags=re.M)]
    assert len(losses) == len(table)
    assert all(b < a for a, b in zip(losses, losses[1:]))
    train_loss = float(re.search(r"train_loss \(mean of the run\) ([0-9.]+)", out)[1])
    assert abs(train_loss - sum(losses) / len(losses)) < 1e-3  # printed to 4 decimals

    # where the figures land
    steps = list(range(LOGGING_STEPS, MAX_STEPS + 1, LOGGING_STEPS))
    assert f"train/loss at steps {steps}" in out
    assert "TensorBoard scalars equal log_history (float32) at the same steps" in out
    assert f"metrics.jsonl: {len(table) + 1} lines, equal to log_history" in out  # + train()'s
    assert_reference_ran(out, "transformers rewrite_logs")
    assert "OK: guide monitoring table checked" in out

"""Runs tutorials/09_optimizers_schedulers.py as a script and checks what it prints (guide:
optimizers, schedulers).

Compared: the decay split of the tiny Llama (2 layers x 7 linear weights + embedding + lm_head
decayed, 5 norm weights not), the fused-AdamW-by-hand line, each schedule's first learning rates
against the formulas (warmup starts at 0, "constant" ignores warmup), the guide's "when to use" line
beside every schedule, ReduceLROnPlateau's logged lr against torch's rule replayed here on the
printed eval losses, the warmup ratio ceil(0.1 * 37) = 4, that every transformers comparison ran,
and the script's own asserts (they fail the exit code). Hermetic: tiny model built in-process, no
network.
Run: python -m pytest -q tests/test_tutorial_09.py
"""

import re

from run_tutorial import assert_reference_ran, run_tutorial


def test_tutorial_09_runs_and_prints_groups_adamw_and_schedules():
    out = run_tutorial("09_optimizers_schedulers.py")
    assert "16 tensors get weight decay" in out  # embed + 2 * (4 attn + 3 mlp) + lm_head
    assert "5 tensors do not" in out  # 2 * (input, post_attention) layernorm + final norm
    assert "param groups: [(16, 0.1), (5, 0.0)]" in out
    # exact or by an ulp, as the CPU's kernels round (AVX2, AVX-512, AMX differ): both are right,
    # and the sentence says which happened
    found = re.search(r"max \|by hand - fused AdamW\| = (\d\.\d\de[-+]\d\d) \(on this CPU's "
                      r"\S+ kernels: (the same bits|~1 ulp apart)", out)
    assert found and (float(found[1]) == 0) == (found[2] == "the same bits")
    assert float(found[1]) < 1e-6
    assert re.search(
        r"^linear\s+\S+  0\.00 0\.33 0\.67 1\.00 0\.89", out, re.MULTILINE
    )  # W=3, T=12: (12-3)/9 ... 8/9
    assert re.search(r"^constant\s+\S+  1\.00 1\.00", out, re.MULTILINE)
    assert re.search(
        r"^constant_with_warmup\s+\S+  0\.00 0\.33 0\.67 1\.00 1\.00", out, re.MULTILINE
    )
    assert out.count("when to use: ") == 10 + 1  # every schedule row, and ReduceLROnPlateau
    assert "when to use: 验证集性能监控" in out  # the guide's column for ReduceLROnPlateau
    # ReduceLROnPlateau: replay torch's rule (min mode, rel threshold 1e-4, patience 1, factor 0.5)
    # on the printed eval losses; the printed (logged) lr of each next step must follow it.
    table = re.findall(r"^\s+(\d+) \|\s+([0-9.]+) \|\s+([0-9.]+) \|", out, re.MULTILINE)
    eval_losses, logged = [float(r[1]) for r in table], [float(r[2]) for r in table]
    assert len(table) == 12 and logged[0] == 0.03
    lr, best, bad = 0.03, float("inf"), 0
    for loss, next_lr in zip(eval_losses, logged[1:]):
        best, bad = (loss, 0) if loss < best * (1 - 1e-4) else (best, bad + 1)
        if bad > 1:
            lr, bad = lr / 2, 0
        assert abs(next_lr - lr) < 1e-6, (next_lr, lr)
    assert logged[-1] < 0.03 / 4
    assert "warmup_steps=0.1   with 37 total steps -> 4" in out
    assert out.count("transformers max|diff| 0e+00") == 10  # every schedule row compared
    assert_reference_ran(
        out,
        "transformers Trainer.get_decay_parameter_names",
        "transformers.get_scheduler, every schedule above",
    )
    assert out.rstrip().endswith("OK: decay groups, one AdamW step and every schedule checked")

"""The memory ledger (nanosft/memory*.py) against the tensors of a real run, and its metrics.

Compared: the weights, adapter, gradient and optimizer rows equal the distinct storage bytes of a
model trained by the Trainer (full fp32 / 8-bit AdamW, LoRA, QLoRA with double quantization, DoRA
with SGD momentum); the activations row is within 15% of the bytes autograd saves for backward,
counted here with torch.autograd.graph.saved_tensors_hooks, with and without checkpointing; the NF4
formula equals bitsandbytes' QuantState tensors; MemoryTracker reports what transformers'
TrainerMemoryTracker reports on the same allocations; for each family (Qwen3, SmolLM3, Gemma 3,
Mistral / Qwen2 with windows, Phi-3) the parameter list equals the real model's names and shapes
(Phi-3: the fused qkv_proj / gate_up_proj, and the LoRA and NF4 rows of a QLoRA run on them), the
full fine-tuning row its bytes, and the activations row the bytes its layers save (q/k norms,
Gemma's four norms, the fused outputs, the sliding-window mask). Tiny models (hidden 64), CPU,
seeded.
Run: timeout 900 python -m pytest -q tests/test_memory.py
"""

import dataclasses

import bitsandbytes.functional as bnbF
import pytest
import torch
from tiny import one_thread, tiny_model  # noqa: F401  (one_thread: autouse fixture)
from transformers.trainer_utils import TrainerMemoryTracker

from nanosft import nf4
from nanosft import memory
from nanosft.args import TrainingArguments
from nanosft.configuration import ModelConfig
from nanosft.peft import LoraConfig, get_peft_model
from nanosft.sft import _cast_trainable_to_bf16
from nanosft.trainer import Trainer

SIZES = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128}
B, T = 2, 16


def _model(method, target_modules=None, double_quant=True):
    model = tiny_model(**SIZES)
    if method == "full":
        return model
    if method.startswith("q"):
        nf4.quantize_model(model, compress_statistics=double_quant)
    model = get_peft_model(model, LoraConfig(r=4, target_modules=target_modules,
                                             use_dora=method.endswith("dora")))
    if method.startswith("q"):
        _cast_trainable_to_bf16(model)  # what SFTTrainer does to adapters on a 4-bit base
    return model


def _storages(tensors):
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in tensors if torch.is_tensor(t)}.values())


def _quant_tensors(model):
    out = []
    for m in model.modules():
        if isinstance(m, nf4.Linear4bit):
            qs = m.quant_state
            out += [qs.absmax, qs.code] + ([qs.state2.absmax, qs.state2.code, qs.offset]
                                           if qs.nested else [])
    return out


def measured_state_rows(model, optimizer, extra_frozen=()):
    """The ledger's four state rows as the distinct storage bytes of a model after a step: frozen
    weights (with 4-bit statistics and `extra_frozen`), trainable parameters, their gradients and
    the optimizer's states."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    frozen = [p for p in model.parameters() if not p.requires_grad] + _quant_tensors(model) + \
        list(extra_frozen)
    return {"base weights (frozen)": _storages(frozen),
            "trainable parameters": _storages(trainable),
            "gradients": _storages([p.grad for p in trainable]),
            "optimizer states": _storages([v for s in optimizer.state.values()
                                           for v in s.values()])}


CASES = [  # (method, optim, optim_args, target_modules, double_quant)
    ("full", "adamw_torch", None, None, True),
    ("full", "adamw_bnb_8bit", None, None, True),
    ("lora", "adamw_torch_fused", None, "all-linear", True),
    ("qlora", "adamw_torch", None, None, True),
    ("qlora", "adamw_torch", None, ["q_proj", "down_proj"], False),
    ("dora", "sgd", "momentum=0.9", None, True),
]


@pytest.mark.parametrize("method,optim,optim_args,targets,double_quant", CASES)
def test_state_rows_equal_a_real_run(tmp_path, method, optim, optim_args, targets, double_quant):
    model = _model(method, targets, double_quant)
    data = [{"input_ids": list(range(i, i + T)), "labels": list(range(i, i + T))} for i in range(8)]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=B,
                             optim=optim, optim_args=optim_args, save_strategy="no",
                             disable_tqdm=True, learning_rate=1e-3)
    trainer = Trainer(model, args, train_dataset=data)
    trainer.train()
    # one more backward: gradients exist between backward and zero_grad
    ids = torch.tensor([data[0]["input_ids"]] * B)
    model(input_ids=ids, labels=ids).loss.backward()
    measured = measured_state_rows(model, trainer.optimizer)
    plan = memory.MemoryPlan(full=method == "full", load_in_4bit=method.startswith("q"),
                             bnb_4bit_use_double_quant=double_quant,
                             use_dora=method.endswith("dora"), r=4, target_modules=targets,
                             per_device_train_batch_size=B, max_length=T, optim=optim,
                             optim_args=optim_args)
    ledger = memory.estimate_memory(tiny_model(**SIZES).config, plan)
    assert {k: ledger.rows[k] for k in measured} == measured


def test_nf4_formula_equals_bitsandbytes_quant_state():
    for shape, double_quant in (((64, 64), True), ((128, 64), False), ((96, 640), True)):
        w = torch.randn(shape)
        packed, qs = bnbF.quantize_4bit(w, blocksize=64, compress_statistics=double_quant,
                                        quant_type="nf4")
        tensors = [packed, qs.absmax, qs.code]
        if double_quant:
            tensors += [qs.state2.absmax, qs.state2.code, qs.offset]
        real = sum(t.numel() * t.element_size() for t in tensors)
        assert memory.nf4_bytes(w.numel(), double_quant=double_quant) == real
    # QLoRA's arithmetic: 4 bits + 1/64 B of uint8 absmax + 4/(64*256) B of fp32 absmax per weight,
    # plus 1,092 B of tables per layer (16 + 256 fp32 levels, the fp32 offset)
    n = 4096 * 4096
    assert memory.nf4_bytes(n) == n * (0.5 + 1 / 64 + 4 / (64 * 256)) + 16 * 4 + 256 * 4 + 4


def _saved_bytes(model, run):
    """Bytes of the distinct storages autograd saves for backward, less the model's own state."""
    own = list(model.parameters()) + _quant_tensors(model)
    state = {t.untyped_storage().data_ptr() for t in own}
    saved = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in state:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = run()
    loss.backward()
    return sum(saved.values())


@pytest.mark.parametrize("gradient_checkpointing", [False, True])
@pytest.mark.parametrize("method,bf16,targets", [("full", False, None), ("lora", False, None),
                                                 ("lora", True, "all-linear"),
                                                 ("qlora", True, None), ("qdora", True, None)])
def test_activation_row_within_15_percent(method, bf16, targets, gradient_checkpointing):
    model = _model(method, targets)
    if gradient_checkpointing:
        if method != "full":
            model.enable_input_require_grads()
        model.gradient_checkpointing_enable()
    model.train()
    ids = torch.randint(0, SIZES["vocab_size"], (B, T), generator=torch.Generator().manual_seed(0))

    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            return model(input_ids=ids, labels=ids).loss

    measured = _saved_bytes(model, run)
    plan = memory.MemoryPlan(full=method == "full", load_in_4bit=method.startswith("q"),
                             use_dora=method.endswith("dora"), r=4, target_modules=targets,
                             per_device_train_batch_size=B, max_length=T, bf16=bf16,
                             gradient_checkpointing=gradient_checkpointing)
    ledger = memory.estimate_memory(model.config if method == "full" else
                                    model.get_base_model().config, plan)
    # the logits row holds the loss's saved fp32 log-probs (B*T, V); the rest is the activations row
    predicted = ledger.rows["activations (saved for backward)"] + B * T * SIZES["vocab_size"] * 4
    assert abs(predicted - measured) <= 0.15 * measured
    if gradient_checkpointing:  # negative control: a ledger blind to checkpointing is far off
        plan.gradient_checkpointing = False
        blind = memory.estimate_memory(tiny_model(**SIZES).config, plan)
        assert blind.rows["activations (saved for backward)"] > 1.5 * measured


@pytest.mark.parametrize("method,bf16", [("full", False), ("lora", False), ("qlora", True)])
def test_fused_head_row_counts_its_tiles_not_the_logits(method, bf16):
    # SFTTrainer's fused LM head (nanosft.fast.lm_head): what autograd saves plus the tile buffers
    # it holds, against the activations row plus the fused row (within 15%); the ledger of
    # transformers' path, B x T x V logits and log-probs, is far off (the negative control)
    from nanosft.fast.nf4 import _workspace

    V = 4096  # the vocabulary dominates, as in a real model (49,152 against 576 wide)
    model = _model(method)
    base = model if method == "full" else model.get_base_model()
    head = base.lm_head
    base.lm_head = torch.nn.Linear(head.in_features, V, bias=False)  # a wider vocabulary
    base.config = dataclasses.replace(base.config, vocab_size=V)
    base.lm_head.requires_grad_(method == "full")
    model.train()
    rows, cols = 8, 64  # 512 tokens: two tiles of 256
    ids = torch.randint(0, SIZES["vocab_size"], (rows, cols),
                        generator=torch.Generator().manual_seed(0))
    _workspace.__dict__.pop("buffers", None)  # count only the buffers this step makes

    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            return model(input_ids=ids, labels=ids, fused_lm_head=True).loss

    saved = _saved_bytes(model, run)
    tiles = sum(b.numel() * b.element_size() for (name, _, _), b
                in _workspace.__dict__.get("buffers", {}).items() if name.startswith("lm_head."))
    assert tiles > 0  # the fused path ran
    plan = memory.MemoryPlan(full=method == "full", load_in_4bit=method == "qlora", r=4,
                             per_device_train_batch_size=rows, max_length=cols, bf16=bf16,
                             fused_lm_head=True)
    ledger = memory.estimate_memory(base.config, plan)
    predicted = (ledger.rows["activations (saved for backward)"]
                 + ledger.rows["LM head tiles (fused)"])
    measured = saved + tiles
    assert abs(predicted - measured) <= 0.15 * measured, (predicted, measured)
    unfused = memory.estimate_memory(base.config, dataclasses.replace(plan, fused_lm_head=False))
    blind = (unfused.rows["activations (saved for backward)"]
             + unfused.rows["logits and loss (B x T x V)"])
    assert blind > 2 * measured


def test_memory_tracker_matches_transformers():
    """Same allocations under both trackers: alloc_delta agree within 8 MiB (RSS noise)."""
    size = 64 * 2**20

    def train(tracker, stage_arg):
        metrics = {}
        tracker.start(*stage_arg)
        kept = torch.ones(size // 4)  # stays allocated: alloc_delta
        temp = torch.ones(size // 4)  # freed before the end: peaked_delta
        temp.add_(1)
        del temp
        tracker.stop_and_update_metrics(*stage_arg, metrics)
        del kept
        return metrics

    ours = train(memory.MemoryTracker(skip_memory_metrics=False), ("train",))
    reference = TrainerMemoryTracker(skip_memory_metrics=False)
    reference.init_reported = True  # no __init__ stage here; it would look up the missing "init"
    ref = train(reference, ())
    assert set(ours) == set(ref) == {"train_mem_cpu_alloc_delta", "train_mem_cpu_peaked_delta"}
    assert abs(ours["train_mem_cpu_alloc_delta"] - size) < 8 * 2**20
    assert abs(ours["train_mem_cpu_alloc_delta"] - ref["train_mem_cpu_alloc_delta"]) < 8 * 2**20
    assert abs(ours["train_mem_cpu_peaked_delta"] - size) < 8 * 2**20


def test_trainer_reports_memory_metrics_only_when_asked(tmp_path):
    data = [{"input_ids": list(range(i, i + T)), "labels": list(range(i, i + T))} for i in range(4)]
    names = {"init_mem_cpu_alloc_delta", "init_mem_cpu_peaked_delta", "train_mem_cpu_alloc_delta",
             "train_mem_cpu_peaked_delta"}
    for skip in (True, False):
        args = TrainingArguments(output_dir=str(tmp_path / str(skip)), max_steps=1,
                                 per_device_train_batch_size=B, save_strategy="no",
                                 disable_tqdm=True, skip_memory_metrics=skip)
        metrics = Trainer(tiny_model(**SIZES), args, train_dataset=data).train().metrics
        assert (names <= set(metrics)) is (not skip)


@pytest.mark.parametrize("field,value,fix", [
    ("per_device_train_batch_size", 0, "whole number >= 1"),
    ("optim", "adam", "choose one of"),
    ("dtype", "fp32", "choose one of float32"),
    ("fsdp", -2, "whole number >= 1"),
])
def test_bad_plan_names_the_field_and_the_fix(field, value, fix):
    with pytest.raises(ValueError, match=rf"{field}=.*{fix}"):
        memory.MemoryPlan(**{field: value})


def test_unmatched_target_modules_is_refused():
    with pytest.raises(ValueError, match="target_modules=.*matches none of q_proj"):
        config = tiny_model(**SIZES).config
        memory.estimate_memory(config, memory.MemoryPlan(target_modules=["qkv"]))


def test_fsdp_shards_state_rows_and_not_activations():
    config = tiny_model(**SIZES).config
    one = memory.estimate_memory(config, memory.MemoryPlan(full=True, max_length=T))
    four = memory.estimate_memory(config, memory.MemoryPlan(full=True, max_length=T, fsdp=4))
    # every tensor's first dim (64, 128, 256 or 64) divides by 4: exactly a quarter, no padding
    for row in ("trainable parameters", "gradients"):
        assert four.rows[row] * 4 == one.rows[row]
    activations = "activations (saved for backward)"
    assert four.rows[activations] == one.rows[activations]


def test_cli_memory_prints_the_ledger_and_refuses_bad_flags(capsys):
    from nanosft import cli
    from nanosft.model import ModelConfig

    folder = "nanosft/cli/assets/default"
    assert cli.main(["memory", "--model", folder, "--lora", "--max_length", "64",
                     "--gradient_checkpointing", "false"]) == 0
    out = capsys.readouterr().out
    plan = memory.MemoryPlan(max_length=64, bf16=True, fused_lm_head=True)  # as nanosft train
    ledger = memory.estimate_memory(ModelConfig.from_pretrained(folder), plan)
    for name, value in ledger.rows.items():
        assert f"{name:<34}{value / memory.MiB:>10.3f} MiB" in out
    assert cli.main(["memory", "--model", folder, "--full", "--qlora"]) == 2
    assert "--full and --qlora cannot be combined" in capsys.readouterr().err
    assert cli.main(["memory", "--model", folder, "--max_length", "0"]) == 2
    assert "max_length=0 is invalid" in capsys.readouterr().err


FAMILY_CONFIGS = {  # transformers config class name: overrides of a tiny shared config
    "Qwen3Config": {"head_dim": 32},  # H * D = 128 != hidden_size: q/k norms are (D,)
    "SmolLM3Config": {"no_rope_layer_interval": 2},
    "Gemma3TextConfig": {"head_dim": 32},
    "MistralConfig": {"sliding_window": 5},
    "Qwen2Config": {"use_sliding_window": True, "sliding_window": 5},
    "Phi3Config": {},
}


def _family_model(config_class_name):
    import transformers

    from nanosft.families.auto import config_from_dict, from_config

    tiny = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 64, "pad_token_id": 0, "bos_token_id": None,
            "eos_token_id": None}
    hf_config = getattr(transformers, config_class_name)(
        **{**tiny, **FAMILY_CONFIGS[config_class_name]})
    return from_config(config_from_dict(hf_config.to_dict()))


@pytest.mark.parametrize("name", list(FAMILY_CONFIGS))
def test_family_parameter_bytes_equal_the_real_model(name):
    model = _family_model(name)
    real = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert dict(memory.parameter_shapes(model.config)) == real  # Phi-3: fused qkv / gate_up
    ledger = memory.estimate_memory(model.config, memory.MemoryPlan(full=True, max_length=T))
    assert ledger.rows["trainable parameters"] == sum(p.numel() * 4 for p in model.parameters())
    if name == "Qwen3Config":  # negative control: the ledger without q_norm / k_norm is short
        D, L = model.config.head_dim, model.config.num_hidden_layers
        names = [n for n, _ in memory.parameter_shapes(model.config)]
        assert sum(n.endswith(("q_norm.weight", "k_norm.weight")) for n in names) == 2 * L
        llama = ModelConfig.from_dict({**model.config.to_dict(), "model_type": "llama"})
        as_llama = memory.estimate_memory(llama, memory.MemoryPlan(full=True, max_length=T))
        short = ledger.rows["trainable parameters"] - as_llama.rows["trainable parameters"]
        assert short == 2 * L * D * 4  # fp32 bytes of the (D,) q_norm and k_norm of L layers


@pytest.mark.parametrize("targets", ["all-linear", ["qkv_proj"]])
def test_phi3_qlora_rows_use_the_fused_linears(targets):
    model = _family_model("Phi3Config")
    nf4.quantize_model(model)
    model = get_peft_model(model, LoraConfig(r=4, target_modules=targets))
    _cast_trainable_to_bf16(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    frozen = [p for p in model.parameters() if not p.requires_grad] + _quant_tensors(model)
    plan = memory.MemoryPlan(load_in_4bit=True, r=4, target_modules=targets, max_length=T)
    ledger = memory.estimate_memory(model.config, plan)
    assert ledger.rows["base weights (frozen)"] == _storages(frozen)
    assert ledger.rows["trainable parameters"] == _storages(trainable)
    with pytest.raises(ValueError, match="no default for model_type='phi3'"):
        memory.estimate_memory(model.config, memory.MemoryPlan(load_in_4bit=True))


@pytest.mark.parametrize("method", ["full", "lora", "qlora"])
@pytest.mark.parametrize("name", list(FAMILY_CONFIGS))
def test_family_activation_row_equals_the_saved_bytes(name, method):
    """Each family's extra saves are predicted: q/k norm inputs (Qwen3, Gemma 3), Gemma's two
    extra norm inputs, Phi-3's fused outputs (v keeps the whole qkv output alive) and its o_proj
    input copy, the (T, T) mask of a sliding layer. Full fine-tuning within 1% (SmolLM3's RoPE
    tables are counted for a layer without RoPE: 0.8%); LoRA / QLoRA within 5%: both measure the
    first layer's input, which the ledger leaves out for a frozen embedding (N * C bytes)."""
    torch.manual_seed(0)
    model = _family_model(name)
    config, rows = model.config, 32  # T = 32 > the 5-token window
    if method == "qlora":
        nf4.quantize_model(model)
    if method != "full":
        model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))
    if method == "qlora":
        _cast_trainable_to_bf16(model)
    model.train()
    ids = torch.randint(0, 128, (B, rows), generator=torch.Generator().manual_seed(0))
    measured = _saved_bytes(model, lambda: model(input_ids=ids, labels=ids).loss)
    plan = memory.MemoryPlan(full=method == "full", load_in_4bit=method == "qlora", r=4,
                             target_modules=None if method == "full" else "all-linear",
                             per_device_train_batch_size=B, max_length=rows)
    predict = memory.estimate_memory
    logprobs = B * rows * 128 * 4  # the logits row's share of the saves
    predicted = predict(config, plan).rows["activations (saved for backward)"] + logprobs
    assert abs(predicted - measured) <= (0.01 if method == "full" else 0.05) * measured
    if method == "full" and name in ("Gemma3TextConfig", "Phi3Config"):  # negative control:
        # the same config read as Llama's layers
        as_llama = ModelConfig.from_dict({**config.to_dict(), "model_type": "llama"})
        blind = predict(as_llama, dataclasses.replace(plan, target_modules="all-linear"))
        assert abs(blind.rows["activations (saved for backward)"] + logprobs - measured) > (
            0.05 * measured)


def test_the_banner_line_says_which_batch_shape_it_predicts_not_an_upper_bound():
    plan = memory.MemoryPlan(per_device_train_batch_size=3, max_length=40)
    ledger = memory.estimate_memory(tiny_model(**SIZES).config, plan)
    line = memory.summary_line(ledger)
    # the ledger pads every row to max_length: data shorter than that needs less, and the process
    # adds memory it does not count, so it is no bound of a run's peak
    assert "tensors of a step at 3 x 40 tokens" in line and "upper bound" not in line
    assert f"= {ledger.total / memory.MiB:.1f} (" in line


def test_saved_tensor_count_keeps_only_what_backward_holds():
    """A save whose graph the forward drops (a branch that feeds no output) is freed before
    backward and does not count, and its address handed to the next save does not hide that
    one: the count is the same however the allocator places them."""
    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(256))

        def forward(self, x):
            for _ in range(4):  # four dropped branches, each freeing a (256,) fp32 save
                torch.exp(x * self.w)  # exp keeps its output; nothing reads it
            return torch.exp(x * self.w)  # kept: 1 KiB for exp, and x for the product

    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([Layer()])
    x = torch.randn(256)
    with memory.count_saved_tensors(model) as saved:
        out = model.model.layers[0](x)
    assert saved.per_layer == [2 * 256 * 4] and saved.total == 2 * 256 * 4
    out.sum().backward()

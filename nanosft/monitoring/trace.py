"""Walkthrough trace: print the live call tree of the first optimizer step, in section 1's order.

`enable_trace()` turns `trace(section, message, **values)` from a no-op into a print;
`attach(trainer)` then follows one `Trainer.train()` call: Trainer.train -> _inner_training_loop ->
get_batch_samples -> training_step -> compute_loss (SFTTrainer's: TRL's loss and token metrics) ->
PeftModelForCausalLM.forward -> Linear4bit.forward (LoRA) -> backward -> do_sync_step ->
optimizer.step -> lr_scheduler.step -> zero_grad -> global_step += 1, each line tagged with its
section. Library code is untouched: `attach` wraps methods of this one trainer instance and puts
forward hooks on this one model, and takes them all off after the first optimizer step.
"""

import functools

import torch

from nanosft.reference import reference_mode_enabled, set_reference_mode, start_reference_mode
from nanosft.trainer_callback import TrainerCallback

# Every printed line of walkthrough 1 and 2.1-2.7 that nanosft mirrors, as (section, module,
# statement): the statement is a substring of exactly one line of nanosft/<module>.py, the line that
# mirrors it. In reference mode (NANOSFT_REFERENCE=1) a LoRA and a QLoRA SFT step execute every one
# (tests/test_reference_mode.py); FAST_PATH_REPLACES names those the speed paths replace.
WALKTHROUGH_STATEMENTS = [
    ("2.1", "sft.py", "super().__init__(\n            model=model,"),
    ("2.2", "trainer.py",
     "return self._inner_training_loop(args, resume_from_checkpoint)\n            #"),
    ("2.3", "trainer.py", "train_dataloader = self.get_train_dataloader()"),
    ("2.3", "trainer.py", "total_train_batch_size = (self._train_batch_size"),
    ("2.3", "trainer.py", 'print("***** Running training *****")'),
    ("2.3", "trainer.py", "tr_loss = torch.tensor(0.0, device=args.device)"),
    ("2.3", "trainer.py", "self._total_loss_scalar = 0.0"),
    ("2.3", "trainer.py", "self._globalstep_last_logged = self.state.global_step"),
    ("1", "trainer.py", "for epoch in range(epochs_trained, num_train_epochs):"),
    ("2.3", "trainer.py", "epoch_iterator = iter(epoch_dataloader)"),
    ("2.3", "trainer.py", "remainder = steps_in_epoch % args.gradient_accumulation_steps"),
    ("1", "trainer.py", "batch_samples, num_items_in_batch = self.get_batch_samples("),
    ("1", "trainer.py", "for i, inputs in enumerate(batch_samples):"),
    ("2.3", "trainer.py", "do_sync_step = ((step + 1) % args.gradient_accumulation_steps == 0"),
    ("1", "trainer.py", "tr_loss_step = self.training_step(model, inputs, num_items_in_batch)"),
    ("1", "trainer.py", "tr_loss = tr_loss + tr_loss_step"),
    ("1", "trainer.py", "self.optimizer.step()"),
    ("2.3", "trainer.py", "learning_rate = self._get_learning_rate()"),
    ("1", "trainer.py", "self.lr_scheduler.step()"),
    ("1", "trainer.py", "model.zero_grad()\n                        self.state.global_step"),
    ("1", "trainer.py", "self.state.global_step += 1"),
    ("2.3", "trainer.py", "self.state.epoch = epoch + (step + 1) / steps_in_epoch"),
    ("1", "trainer.py", "self._maybe_log_save_evaluate(tr_loss, grad_norm, learning_rate)\n    "
     "                else"),
    ("2.4", "trainer.py", "model.train()"),
    ("2.4", "trainer.py", "inputs = self._prepare_inputs(inputs)"),
    ("2.4", "trainer.py", "loss = self.compute_loss(model, inputs, num_items_in_batch="),
    ("2.4", "trainer.py", "loss.backward()"),
    ("2.4", "trainer.py", "return loss.detach()"),
    ("2.5", "trainer.py", "outputs = model(**inputs)\n"),
    ("2.5", "trainer.py", 'loss = outputs["loss"]'),
    ("2.6", "peft.py", "return self.base_model(input_ids=input_ids, attention_mask="),
    ("2.7", "lora.py", "result = self.base_layer(x)  #"),
    ("2.7", "lora.py", "result = result.clone()"),
    ("2.7", "lora.py", "for active_adapter in self.active_adapters:  #"),
    ("2.7", "lora.py", "lora_A = self.lora_A[active_adapter]"),
    ("2.7", "lora.py", "scaling = self.scaling[active_adapter]"),
    ("2.7", "lora.py", "requires_conversion = not torch.is_autocast_enabled()\n"
     "            if requires_conversion:\n                expected_dtype = result.dtype\n"
     "                x = self._cast_input_dtype(x, lora_A.weight.dtype)\n            if not"),
    ("2.7", "lora.py", "output = lora_B(lora_A(dropout(x))) * scaling"),
    ("2.7", "lora.py", "result = result + output\n            else"),
    ("2.7", "lora.py", "return result.to(torch_result_dtype)"),
]


_enabled = False
PREFIX = "[trace]"


def enable_trace(on: bool = True) -> None:
    """Switch the walkthrough trace on (or off). The trace is for reading, so it runs in reference
    mode (the walkthrough's own statements, no speed paths) and says so on its first line; off
    hands reference mode back to NANOSFT_REFERENCE."""
    global _enabled
    if on and not _enabled:
        start_reference_mode()
    elif not on and _enabled:
        set_reference_mode(None)
    _enabled = on


def is_enabled() -> bool:
    """Whether `trace` prints. Mirrors: nothing (a teaching aid)"""
    return _enabled


def _show(value):
    if torch.is_tensor(value):
        if value.dim() == 0:
            return f"{value.item():.6g}" if value.is_floating_point() else str(value.item())
        return f"Tensor{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def trace(section: str, message: str, **values) -> None:
    """Print one line `[trace] [section] message  key=value ...`; a no-op unless enable_trace().

    Mirrors: nothing (a teaching aid)
    """
    if not _enabled:
        return
    pairs = "  ".join(f"{k}={_show(v)}" for k, v in values.items())
    print(f"{PREFIX} [{section}] {message}" + (f"  {pairs}" if pairs else ""), flush=True)


def _first_lora_layer(model):
    """The first module with `lora_A` (peft's LoraLayer), or None (full fine-tuning, prompts)."""
    return next((m for m in model.modules() if hasattr(m, "lora_A") and len(m.lora_A)), None)


class _TrainerTrace:
    """The instance wrappers and hooks of one traced `trainer.train()`; `detach()` removes them."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.wrapped = []
        self.hooks = []
        self.micro_step = -1
        self.steps_in_epoch = None
        self.forwards = 0
        self.in_forward = False
        self.done = False
        self.callback = None

    # ----- plumbing: wrap a bound method of one instance, put it back later -----
    def wrap(self, owner, name, before=None, after=None):
        original = getattr(owner, name)

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            if before is not None and not self.done:
                before(*args, **kwargs)
            result = original(*args, **kwargs)
            if after is not None and not self.done:
                after(result, *args, **kwargs)
            return result

        had_own = name in vars(owner)
        self.wrapped.append((owner, name, original if had_own else None))
        setattr(owner, name, wrapper)

    def detach(self):
        self.done = True
        for owner, name, original in reversed(self.wrapped):
            if original is None:
                delattr(owner, name)  # the class method shows through again
            else:
                setattr(owner, name, original)
        for hook in self.hooks:
            hook.remove()
        self.wrapped, self.hooks = [], []
        handler = self.trainer.callback_handler  # a new list: call_event may be iterating the old
        handler.callbacks = [cb for cb in handler.callbacks if cb is not self.callback]

    # ----- walkthrough 2.2 / 2.3: the loop around the micro-batches -----
    def install(self):
        t = self.trainer
        self.wrap(t, "train", before=lambda *a, **k: trace(
            "2.2", "Trainer.train()  -> _inner_training_loop"))
        self.wrap(t, "_inner_training_loop", before=lambda *a, **k: trace(
            "2.3", "_inner_training_loop()"))
        self.wrap(t, "get_train_dataloader", after=self.on_dataloader)
        self.wrap(t, "set_initial_training_values", after=self.on_initial_values)
        self.wrap(t, "_prepare_for_training", after=lambda model, *a, **k: self.on_prepared(model))
        self.wrap(t, "get_batch_samples",
                  after=lambda result, *a, **k: self.on_batch_samples(result, a))
        self.wrap(t, "training_step", before=self.on_training_step, after=self.on_training_step_end)
        self.wrap(t, "compute_loss", before=self.on_compute_loss, after=self.on_loss)
        self.wrap(t, "_clip_grad_norm", after=lambda norm, *a, **k: trace(
            "2.3", "  do_sync_step: clip gradients", grad_norm=norm,
            max_grad_norm=t.args.max_grad_norm))
        self.callback = _StepEndCallback(self.on_step_end)
        t.add_callback(self.callback)

    def on_dataloader(self, dataloader, *args, **kwargs):
        self.steps_in_epoch = len(dataloader)
        trace("2.3", "train_dataloader = self.get_train_dataloader()",
              micro_batches_per_epoch=len(dataloader),
              per_device_train_batch_size=self.trainer.args.per_device_train_batch_size)

    def on_initial_values(self, values, *args, **kwargs):
        epochs, per_epoch, examples, _, total_batch, _, max_steps = values
        trace("2.3", "Setting up training control variables", num_train_epochs=epochs,
              num_update_steps_per_epoch=per_epoch, max_steps=max_steps, num_examples=examples)
        trace("2.3", "total_train_batch_size = _train_batch_size * gradient_accumulation_steps * "
              "world_size", total_train_batch_size=total_batch)

    def on_prepared(self, model):
        t = self.trainer
        trace("2.3", "optimizer and lr_scheduler created", optimizer=type(t.optimizer).__name__,
              lr_scheduler=t.args.lr_scheduler_type)
        self.wrap(t.lr_scheduler, "step", before=lambda *a, **k: trace(
            "2.3", "  self.lr_scheduler.step()  (only when the optimizer step was not skipped)"))
        self.wrap(model, "zero_grad", before=lambda *a, **k: trace("2.3", "  model.zero_grad()"))
        self.hooks.append(t.optimizer.register_step_pre_hook(
            lambda *a: trace("2.3", "  self.optimizer.step()", lr=t.lr_scheduler.get_last_lr()[0])))
        self.install_model_hooks(model)
        trace("2.3", "***** Running training ***** (banner below), then: for epoch in "
              "range(num_train_epochs)")

    def on_batch_samples(self, result, args):
        batch_samples, num_items_in_batch = result
        asked = args[1] if len(args) > 1 else self.trainer.args.gradient_accumulation_steps
        trace("2.3", "batch_samples, num_items_in_batch = self.get_batch_samples(epoch_iterator, "
              "num_batches)", num_batches=asked, got=len(batch_samples),
              num_items_in_batch=num_items_in_batch if num_items_in_batch is not None else "None")

    # ----- walkthrough 2.4 / 2.5: one micro-batch -----
    def on_training_step(self, model, inputs, num_items_in_batch=None, *args, **kwargs):
        self.micro_step += 1
        shapes = {k: v for k, v in inputs.items() if torch.is_tensor(v)}
        trace("2.4", "for i, inputs in enumerate(batch_samples): training_step(model, inputs, "
              "num_items_in_batch)",
              step=self.micro_step, **shapes)

    def is_sft(self) -> bool:
        """SFTTrainer (TRL's own loss and token metrics) rather than the plain Trainer."""
        return hasattr(self.trainer, "_metrics")

    def is_fused(self) -> bool:
        """SFTTrainer taking the fused LM head (a speed path: off in reference mode)."""
        return (self.is_sft() and self.trainer.args.label_smoothing_factor == 0
                and not reference_mode_enabled())

    def on_compute_loss(self, model, inputs, *args, **kwargs):
        owner = type(self.trainer).__name__
        trace("2.5", f"compute_loss -> outputs = model(**inputs)  ({owner}.compute_loss)",
              model=type(model).__name__,
              num_items_in_batch=kwargs.get("num_items_in_batch", "None"))
        if self.is_fused():
            trace("2.5", "  SFTTrainer.compute_loss overrides Trainer.compute_loss: "
                  "outputs = model(**inputs, fused_lm_head=True), per-token log p without the "
                  "(B, T, V) logits (speed path)")
        elif self.is_sft():
            trace("2.5", "  SFTTrainer.compute_loss -> Trainer.compute_loss (reference mode): "
                  'outputs = model(**inputs); loss = outputs["loss"]')

    def on_loss(self, loss, *args, **kwargs):
        value = loss[0] if isinstance(loss, tuple) else loss
        if not self.is_fused():
            trace("2.5", 'loss = outputs["loss"]  (sum of token losses / num_items_in_batch)',
                  loss=value)
        else:
            trace("2.5", "  loss = outputs.loss  (the model's -log_probs.sum() / "
                  "num_items_in_batch; log p is zero on ignored positions)", loss=value,
                  num_items_in_batch=kwargs.get("num_items_in_batch", "None"))
        if not self.is_sft():
            return
        metrics = self.trainer._metrics["train" if self.trainer.model.training else "eval"]
        if metrics.get("mean_token_accuracy"):
            trace("2.5", "  token metrics of this micro-batch (logged as their mean)",
                  entropy=metrics["entropy"][-1],
                  mean_token_accuracy=metrics["mean_token_accuracy"][-1])

    def on_training_step_end(self, loss, *args, **kwargs):
        t = self.trainer
        gradient_accumulation_steps = t.args.gradient_accumulation_steps
        grads = [p.grad for p in t.model.parameters() if p.requires_grad and p.grad is not None]
        trace("2.4", "loss.backward()  (accelerator.backward)", loss_returned=loss,
              params_with_grad=len(grads))
        step = self.micro_step
        do_sync_step = ((step + 1) % gradient_accumulation_steps == 0
                        or (self.steps_in_epoch is not None and step + 1 == self.steps_in_epoch))
        trace("2.3", "do_sync_step = (step + 1) % gradient_accumulation_steps == 0 or "
              "(step + 1) == steps_in_epoch", step=step,
              gradient_accumulation_steps=gradient_accumulation_steps,
              do_sync_step=do_sync_step)

    def on_step_end(self, *args, **kwargs):
        trace("2.3", "  self.state.global_step += 1", global_step=self.trainer.state.global_step)
        trace("1", "first optimizer step done; trace off (the loop goes on as above)")
        self.detach()

    # ----- walkthrough 2.6 / 2.7: inside the model, first forward only -----
    def install_model_hooks(self, model):
        inner = getattr(model, "module", model)  # DDP keeps the model in .module
        self.hooks.append(inner.register_forward_pre_hook(self.on_model_forward, with_kwargs=True))
        self.hooks.append(inner.register_forward_hook(self.on_model_output))
        lora = _first_lora_layer(inner)
        if lora is None:
            return
        name = next(n for n, m in inner.named_modules() if m is lora)
        adapter = lora.active_adapters[0]
        formula = ("lora_magnitude_vector[...](x, lora_A, lora_B, scaling, base_layer)  (DoRA)"
                   if lora.use_dora.get(adapter, False) else "lora_B(lora_A(dropout(x))) * scaling")

        def on_lora_input(module, args):
            self.inside(f"{type(lora.base_layer).__name__}.forward  (the LoRA layer {name}: "
                        f"{type(lora).__name__})", x=args[0],
                        disable_adapters=lora.disable_adapters, merged=lora.merged,
                        active_adapters=lora.active_adapters)

        def on_base_output(module, args, out):
            self.inside("  result = self.base_layer(x, *args, **kwargs)", result=out,
                        base_layer=type(lora.base_layer).__name__)

        def on_lora_b_output(module, args, out):
            self.inside(f"  output = {formula}", output=out, r=lora.r[adapter],
                        scaling=lora.scaling[adapter])

        def on_lora_output(module, args, out):
            self.inside("  result = result + output; return result", result=out)

        self.hooks.append(lora.register_forward_pre_hook(on_lora_input))
        self.hooks.append(lora.base_layer.register_forward_hook(on_base_output))
        self.hooks.append(lora.lora_B[adapter].register_forward_hook(on_lora_b_output))
        self.hooks.append(lora.register_forward_hook(on_lora_output))

    def inside(self, message, **values):
        """A 2.7 line, printed in the first model forward only (not a checkpointed re-forward)."""
        if self.forwards == 1 and self.in_forward:
            trace("2.7", message, **values)

    def on_model_forward(self, module, args, kwargs):
        self.forwards += 1
        self.in_forward = True
        if self.forwards == 1:
            shapes = {k: v for k, v in kwargs.items() if torch.is_tensor(v)}
            trace("2.6", f"{type(module).__name__}.forward(**inputs) -> return "
                  "self.base_model(...)", **shapes)

    def on_model_output(self, module, args, output):
        self.in_forward = False
        if self.forwards == 1:
            trace("2.6", f"{type(module).__name__}.forward returns", logits=output["logits"])


class _StepEndCallback(TrainerCallback):
    """Calls `on_step_end()` after the first optimizer step (the trace then detaches)."""

    def __init__(self, on_step_end):
        self.step_end = on_step_end

    def on_step_end(self, args, state, control, **kwargs):
        self.step_end()


def attach(trainer):
    """Trace the next `trainer.train()` up to its first optimizer step; returns the handle.

    Mirrors: nothing (a teaching aid)
    A no-op returning None unless enable_trace() was called.
    """
    if not _enabled:
        return None
    handle = _TrainerTrace(trainer)
    handle.install()
    trace("1", f"{type(trainer).__name__} ready (walkthrough 2.1 done); calling trainer.train()")
    return handle

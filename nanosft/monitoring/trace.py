"""Walkthrough trace: print the live call tree of the first optimizer step, in section 1's order.

`enable_trace()` turns `trace(section, message, **values)` from a no-op into a print;
`attach(trainer)` then follows one `Trainer.train()` call: Trainer.train -> _inner_training_loop ->
get_batch_samples -> training_step -> compute_loss (SFTTrainer's: TRL's loss and token metrics) ->
PeftModelForCausalLM.forward -> Linear4bit.forward (LoRA) -> backward -> do_sync_step ->
optimizer.step -> lr_scheduler.step -> zero_grad -> global_step += 1, each line tagged with its
section. Library code is untouched and no method is replaced (a debugger's `s` at the loop's
`self.training_step(...)` lands in training_step): `attach` adds one callback, which reads the
loop's events (on_train_begin, on_step_begin, on_substep_end, on_pre_optimizer_step, on_step_end)
and puts forward hooks on this one model, post-accumulate-grad hooks on its trainable parameters
and a step pre-hook on its optimizer; all come off after the first optimizer step. The set-up lines
print at on_train_begin, the loop's first event, so after the "***** Running training *****" banner.
"""

import torch

from nanosft.reference import set_reference_mode, start_reference_mode
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


class _TrainerTrace(TrainerCallback):
    """The trace of one `trainer.train()`, read through the loop's callback events, forward hooks
    on the model, post-accumulate-grad hooks on its trainable parameters and a step pre-hook on
    the optimizer; no method of the trainer, model, optimizer or scheduler is replaced, so `s` at
    the loop's `self.training_step(...)` lands in training_step. `detach()` removes it all after
    the first optimizer step (or at on_train_end, when training ends before one)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.hooks = []
        self.micro_step = -1  # the loop's `step`: micro-batches since train() began
        self.window = []  # the micro-batches of this update step (on_step_begin's batch_samples)
        self.index = -1  # `i` of `for i, inputs in enumerate(batch_samples)`
        self.num_batches = None  # what get_batch_samples was asked for
        self.steps_in_epoch = self.per_epoch = None  # micro-batches, update steps per epoch
        self.forwards = 0
        self.in_forward = False
        self.fused = False
        self.num_items_in_batch = None
        self.grad_norms = {}  # id(param) -> norm of its .grad after its latest accumulation
        self.scheduler_steps = None
        self.done = False

    def remove_hooks(self):
        for hook in self.hooks:
            hook.remove()
        self.hooks = []

    def detach(self):
        self.done = True
        self.remove_hooks()
        handler = self.trainer.callback_handler  # a new list: call_event may be iterating the old
        handler.callbacks = [cb for cb in handler.callbacks if cb is not self]

    # ----- walkthrough 2.2 / 2.3: the set-up, read at on_train_begin (after the banner) -----
    def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
        t = self.trainer
        self.remove_hooks()  # auto_find_batch_size restarted the loop: a new optimizer, hooks anew
        trace("2.2", "Trainer.train()  -> _inner_training_loop")
        trace("2.3", "_inner_training_loop()")
        trace("2.3", "train_dataloader = self.get_train_dataloader()",
              micro_batches_per_epoch=len(train_dataloader),
              per_device_train_batch_size=args.per_device_train_batch_size)
        # a pure function of args and the dataloader: the numbers the loop got from it
        epochs, per_epoch, examples, _, total_batch, steps_in_epoch, max_steps = (
            t.set_initial_training_values(args, train_dataloader))
        trace("2.3", "Setting up training control variables", num_train_epochs=epochs,
              num_update_steps_per_epoch=per_epoch, max_steps=max_steps, num_examples=examples)
        trace("2.3", "total_train_batch_size = _train_batch_size * gradient_accumulation_steps * "
              "world_size", total_train_batch_size=total_batch)
        self.steps_in_epoch, self.per_epoch = steps_in_epoch, per_epoch
        trace("2.3", "optimizer and lr_scheduler created", optimizer=type(t.optimizer).__name__,
              lr_scheduler=args.lr_scheduler_type)
        self.hooks.append(t.optimizer.register_step_pre_hook(
            lambda *a: trace("2.3", "  self.optimizer.step()", lr=t.lr_scheduler.get_last_lr()[0])))
        self.install_model_hooks(getattr(t, "model_wrapped", t.model))
        trace("2.3", "***** Running training ***** (banner above), then: for epoch in "
              "range(num_train_epochs)")
        trace("2.3", "  model.zero_grad()")

    def on_step_begin(self, args, state, control, batch_samples=None, **kwargs):
        self.window, self.index = list(batch_samples or []), -1
        # section 1's num_batches: gradient_accumulation_steps, the remainder in an epoch's last
        update_step = state.global_step % self.per_epoch
        remainder = self.steps_in_epoch % args.gradient_accumulation_steps
        last = update_step == self.per_epoch - 1 and remainder
        self.num_batches = remainder if last else args.gradient_accumulation_steps

    # ----- walkthrough 2.4 / 2.5: one micro-batch, from the model's forward hooks -----
    def on_micro_batch(self, model, kwargs):
        """At the model's forward, called by compute_loss inside training_step."""
        self.micro_step += 1
        self.index += 1
        self.num_items_in_batch = kwargs.get("num_items_in_batch")
        if self.index == 0:
            trace("2.3", "batch_samples, num_items_in_batch = self.get_batch_samples("
                  "epoch_iterator, num_batches)", num_batches=self.num_batches,
                  got=len(self.window), num_items_in_batch=self._items())
        inputs = self.window[self.index] if self.index < len(self.window) else {}
        shapes = {k: v for k, v in inputs.items() if torch.is_tensor(v)}
        trace("2.4", "for i, inputs in enumerate(batch_samples): training_step(model, inputs, "
              "num_items_in_batch)",
              step=self.micro_step, **shapes)
        owner = type(self.trainer).__name__
        trace("2.5", f"compute_loss -> outputs = model(**inputs)  ({owner}.compute_loss)",
              model=type(model).__name__, num_items_in_batch=self._items())
        self.fused = bool(kwargs.get("fused_lm_head"))
        if self.fused:
            trace("2.5", "  SFTTrainer.compute_loss overrides Trainer.compute_loss: "
                  "outputs = model(**inputs, fused_lm_head=True), per-token log p without the "
                  "(B, T, V) logits (speed path)")
        elif self.is_sft():
            trace("2.5", "  SFTTrainer.compute_loss -> Trainer.compute_loss (reference mode): "
                  'outputs = model(**inputs); loss = outputs["loss"]')

    def _items(self):
        """num_items_in_batch as the model received it (None: the loss is the model's own mean)."""
        return "None" if self.num_items_in_batch is None else self.num_items_in_batch

    def is_sft(self) -> bool:
        """SFTTrainer (TRL's own loss and token metrics) rather than the plain Trainer."""
        return hasattr(self.trainer, "_metrics")

    def on_outputs(self, outputs):
        """At the model's forward hook: `outputs["loss"]`, the loss compute_loss returns."""
        loss = _field(outputs, "loss")
        if not self.fused:
            trace("2.5", 'loss = outputs["loss"]  (sum of token losses / num_items_in_batch)',
                  loss=loss)
        else:
            trace("2.5", "  loss = outputs.loss  (the model's -log_probs.sum() / "
                  "num_items_in_batch; log p is zero on ignored positions)", loss=loss,
                  num_items_in_batch=self._items())

    def after_micro_batch(self, args, do_sync_step):
        """At on_substep_end / on_pre_optimizer_step: training_step has returned."""
        t = self.trainer
        if self.is_sft():
            metrics = t._metrics["train" if t.model.training else "eval"]
            if metrics.get("mean_token_accuracy"):
                trace("2.5", "  token metrics of this micro-batch (logged as their mean)",
                      entropy=metrics["entropy"][-1],
                      mean_token_accuracy=metrics["mean_token_accuracy"][-1])
        grads = [p.grad for p in t.model.parameters() if p.requires_grad and p.grad is not None]
        trace("2.4", "loss.backward()  (accelerator.backward)", params_with_grad=len(grads))
        trace("2.3", "do_sync_step = (step + 1) % gradient_accumulation_steps == 0 or "
              "(step + 1) == steps_in_epoch", step=self.micro_step,
              gradient_accumulation_steps=args.gradient_accumulation_steps,
              do_sync_step=do_sync_step)

    # ----- walkthrough 2.3: the sync step -----
    def on_substep_end(self, args, state, control, **kwargs):
        self.after_micro_batch(args, do_sync_step=False)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.after_micro_batch(args, do_sync_step=True)
        # _clip_grad_norm's pre-clip norm, from the norms the gradient hooks saw before clipping
        norm = torch.nn.utils.get_total_norm(list(self.grad_norms.values()))
        if self.trainer.scaler is not None:
            norm = norm / self.trainer.scaler.get_scale()  # fp16: the clip unscales first
        # under DDP the hooks see this rank's gradients before the all-reduce
        key = "grad_norm" if args.world_size == 1 else "this_rank_grad_norm_before_all_reduce"
        trace("2.3", "  do_sync_step: clip gradients", **{key: norm},
              max_grad_norm=args.max_grad_norm)

    def on_optimizer_step(self, args, state, control, lr_scheduler=None, **kwargs):
        self.scheduler_steps = getattr(lr_scheduler, "last_epoch", None)

    def on_step_end(self, args, state, control, lr_scheduler=None, **kwargs):
        if getattr(lr_scheduler, "last_epoch", None) != self.scheduler_steps:
            trace("2.3", "  self.lr_scheduler.step()  (only when the optimizer step was not "
                  "skipped)")
        trace("2.3", "  model.zero_grad()")
        trace("2.3", "  self.state.global_step += 1", global_step=state.global_step)
        trace("1", "first optimizer step done; trace off (the loop goes on as above)")
        self.detach()

    def on_train_end(self, args, state, control, **kwargs):
        self.detach()  # training ended before an optimizer step

    # ----- walkthrough 2.6 / 2.7: inside the model, first forward only -----
    def install_model_hooks(self, model):
        inner = getattr(model, "module", model)  # DDP keeps the model in .module
        self.hooks.append(inner.register_forward_pre_hook(self.on_model_forward, with_kwargs=True))
        self.hooks.append(inner.register_forward_hook(self.on_model_output))
        for param in inner.parameters():
            if param.requires_grad:
                self.hooks.append(param.register_post_accumulate_grad_hook(self.on_grad))
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
        if not (module.training and torch.is_grad_enabled()):
            return  # an evaluation (eval_on_start), not a training step
        self.forwards += 1
        self.in_forward = True
        self.on_micro_batch(module, kwargs)
        if self.forwards == 1:
            shapes = {k: v for k, v in kwargs.items() if torch.is_tensor(v)}
            trace("2.6", f"{type(module).__name__}.forward(**inputs) -> return "
                  "self.base_model(...)", **shapes)

    def on_model_output(self, module, args, output):
        if not self.in_forward:
            return
        self.in_forward = False
        if self.forwards == 1:
            trace("2.6", f"{type(module).__name__}.forward returns",
                  logits=_field(output, "logits"))
        self.on_outputs(output)

    def on_grad(self, param):
        self.grad_norms[id(param)] = torch.linalg.vector_norm(param.grad.detach())


def _field(outputs, key):
    """outputs[key] of a dict or CausalLMOutput; None for other outputs (a tuple)."""
    try:
        return outputs[key]
    except (KeyError, TypeError, IndexError, AttributeError):
        return None


def attach(trainer):
    """Trace the next `trainer.train()` up to its first optimizer step; returns the handle.

    Mirrors: nothing (a teaching aid)
    A no-op returning None unless enable_trace() was called.
    """
    if not _enabled:
        return None
    handle = _TrainerTrace(trainer)
    trainer.add_callback(handle)  # the rest is installed at on_train_begin
    trace("1", f"{type(trainer).__name__} ready (walkthrough 2.1 done); calling trainer.train()")
    return handle

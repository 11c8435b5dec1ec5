"""Measuring memory: distinct storage bytes, peak RSS / CUDA allocation, saved-for-backward bytes.

`unique_bytes` counts the storages behind tensors once; `cpu_memory` reads RSS and
its peak from /proc; `MemoryTracker` reports per-stage deltas under transformers'
TrainerMemoryTracker metric names; `PeakMemory` measures a run's peak growth; `count_saved_tensors`
counts what autograd saves per decoder layer. These check nanosft.memory's predictions.
"""

import torch

from nanosft.trainer_utils import MemoryTracker, cpu_memory, cpu_peak_reset  # noqa: F401


def unique_bytes(tensors):
    """Bytes of the distinct storages behind `tensors` (views and shared tables counted once).
    Mirrors: torch UntypedStorage.nbytes"""
    seen = {}
    for t in tensors:
        if torch.is_tensor(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


class PeakMemory:
    """The peak a run reaches above its start: CPU RSS (VmHWM) and, on CUDA, allocated bytes.
    Mirrors: torch.cuda.max_memory_allocated, the kernel's VmHWM"""

    def __init__(self, device_type="cpu"):
        self.cuda = device_type == "cuda" and torch.cuda.is_available()

    def start(self):
        """Reset the peaks and remember where this run starts."""
        self.exact = cpu_peak_reset()
        self.cpu_start = cpu_memory()[0]
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            self.gpu_start = torch.cuda.memory_allocated()
        return self

    def stop(self):
        """{"cpu_peak_growth": bytes, "gpu_peak_growth": bytes on CUDA} since start()."""
        out = {"cpu_peak_growth": cpu_memory()[1] - self.cpu_start}
        if self.cuda:
            out["gpu_peak_growth"] = torch.cuda.max_memory_allocated() - self.gpu_start
        return out


def count_saved_tensors(model):
    """A context manager counting the bytes autograd saves for backward, per decoder layer, less
    the model's own weights and quantization state; `.per_layer`, `.outside`, `.total` after it.
    Mirrors: torch.autograd.graph.saved_tensors_hooks"""
    return _SavedTensorCounter(model)


class _SavedTensorCounter:
    def __init__(self, model):
        self.model = model
        inner = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.layers = list(inner.model.layers)
        state = [p for p in model.parameters()] + [b for b in model.buffers()]
        for m in model.modules():
            qs = getattr(m, "quant_state", None)
            if qs is not None:
                state += [qs.absmax, qs.code] + ([qs.state2.absmax, qs.state2.code, qs.offset]
                                                 if qs.nested else [])
        self.state_ptrs = {t.untyped_storage().data_ptr() for t in state if torch.is_tensor(t)}

    def _pack(self, t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.state_ptrs and ptr not in self.seen:
            storage = t.untyped_storage()
            # held until the count ends, so a save whose node is dropped mid-forward cannot give
            # its address to a later save; it counts only if autograd still holds it at the end
            self.seen[ptr] = (self.where, storage.nbytes(), storage)
        return t.detach()  # the tensor itself would close a cycle through a saved output's grad_fn

    def __enter__(self):
        self.seen, self.where = {}, "outside"
        self.handles = []
        for i, layer in enumerate(self.layers):  # attribute each save to the layer running
            enter = layer.register_forward_pre_hook(lambda m, a, i=i: setattr(self, "where", i))
            leave = layer.register_forward_hook(lambda m, a, o: setattr(self, "where", "outside"))
            self.handles += [enter, leave]
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)
        for h in self.handles:
            h.remove()
        # alive: something besides this counter's own reference holds the storage
        alive = [(w, b) for w, b, storage in self.seen.values()
                 if torch._C._storage_Use_Count(storage._cdata) > 1]
        self.seen = {}
        self.per_layer = [sum(b for w, b in alive if w == i) for i in range(len(self.layers))]
        self.outside = sum(b for w, b in alive if w == "outside")
        self.total = sum(b for _, b in alive)
        return False

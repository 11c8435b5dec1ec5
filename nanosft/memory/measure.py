"""Measuring memory: distinct storage bytes, peak RSS / CUDA allocation, saved-for-backward bytes.

Guide: memory. `unique_bytes` counts the storages behind tensors once; `cpu_memory` reads RSS and
its peak from /proc; `MemoryTracker` reports per-stage deltas under transformers'
TrainerMemoryTracker metric names; `PeakMemory` measures a run's peak growth; `count_saved_tensors`
counts what autograd saves per decoder layer. These check nanosft.memory's predictions.
"""

import gc

import torch


def unique_bytes(tensors):
    """Bytes of the distinct storages behind `tensors` (views and shared tables counted once).
    Guide: memory | Mirrors: torch UntypedStorage.nbytes"""
    seen = {}
    for t in tensors:
        if torch.is_tensor(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def cpu_peak_reset():
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS; False where /proc refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def cpu_memory():
    """(RSS, peak RSS since the last reset) of this process in bytes, from /proc/self/status.
    Mirrors: psutil Process.memory_info().rss (transformers' cpu_mem_used)"""
    values = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    values[line.split(":")[0]] = int(line.split()[1]) * 1024
    except OSError:
        import psutil

        rss = psutil.Process().memory_info().rss
        return rss, rss
    return values["VmRSS"], values["VmHWM"]


class MemoryTracker:
    """Memory deltas per stage (init, train, eval) under transformers' metric names.
    Guide: memory | Mirrors: transformers TrainerMemoryTracker (start, stop, update_metrics)
    Differs: the CPU peak is the kernel's VmHWM (reset per stage), not RSS polled by a thread."""

    def __init__(self, skip_memory_metrics=False):
        self.skip_memory_metrics = skip_memory_metrics
        self.cur_stage, self.cpu, self.gpu, self.init_reported = None, {}, {}, False
        self.cuda = torch.cuda.is_available()

    def start(self, stage):
        """Begin measuring `stage`; a stage inside another (eval inside train) is ignored."""
        if self.skip_memory_metrics or (self.cur_stage is not None and self.cur_stage != stage):
            return
        self.cur_stage = stage
        gc.collect()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.empty_cache()
            self.gpu_begin = torch.cuda.memory_allocated()
        cpu_peak_reset()
        self.cpu_begin = cpu_memory()[0]

    def stop(self, stage):
        """End `stage`: alloc = end - begin, peaked = max(0, peak - end), as in transformers."""
        if self.skip_memory_metrics or self.cur_stage != stage:
            return
        _, peak = cpu_memory()  # read before gc.collect can lower anything
        gc.collect()
        now = cpu_memory()[0]
        self.cpu[stage] = {"begin": self.cpu_begin, "end": now, "alloc": now - self.cpu_begin,
                           "peaked": max(0, peak - now)}
        if self.cuda:
            torch.cuda.empty_cache()
            now, peak = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
            self.gpu[stage] = {"begin": self.gpu_begin, "end": now, "alloc": now - self.gpu_begin,
                               "peaked": max(0, peak - now)}
        self.cur_stage = None

    def update_metrics(self, stage, metrics):
        """Add `{stage}_mem_cpu_alloc_delta`, `..._peaked_delta` (+ `_gpu_`); init's go first."""
        if self.skip_memory_metrics:
            return
        stages = [stage]
        if not self.init_reported and "init" in self.cpu:
            stages.insert(0, "init")
            self.init_reported = True
            metrics["before_init_mem_cpu"] = self.cpu["init"]["begin"]
            if self.cuda:
                metrics["before_init_mem_gpu"] = self.gpu["init"]["begin"]
        for s in stages:
            for kind in ("alloc", "peaked"):
                if s in self.cpu:
                    metrics[f"{s}_mem_cpu_{kind}_delta"] = self.cpu[s][kind]
                if self.cuda and s in self.gpu:
                    metrics[f"{s}_mem_gpu_{kind}_delta"] = self.gpu[s][kind]

    def stop_and_update_metrics(self, stage, metrics=None):
        """stop(stage), then update_metrics(stage, metrics) when a dict is given."""
        self.stop(stage)
        if metrics is not None:
            self.update_metrics(stage, metrics)


class PeakMemory:
    """The peak a run reaches above its start: CPU RSS (VmHWM) and, on CUDA, allocated bytes.
    Guide: memory | Mirrors: torch.cuda.max_memory_allocated, the kernel's VmHWM"""

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
    Guide: memory | Mirrors: torch.autograd.graph.saved_tensors_hooks"""
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
            self.seen[ptr] = (self.where, t.untyped_storage().nbytes())
        return t

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
        self.per_layer = [sum(b for w, b in self.seen.values() if w == i)
                          for i in range(len(self.layers))]
        self.outside = sum(b for w, b in self.seen.values() if w == "outside")
        self.total = sum(b for _, b in self.seen.values())
        return False

"""Reference mode: the one switch under which every walkthrough line nanosft mirrors is the line
that executes.

By default a few speed paths (nanosft.fast: the fused LM head, one addmm for fp32 adapters, bf16
adapter products as fp32 GEMMs, unpadded attention, recomputed norms, short half-precision CPU
attention on the fp32 kernel) replace mirrored statements; they are tested equal to reference mode.
`NANOSFT_REFERENCE=1` in the environment (read once, at import), or `with reference_mode():` /
`set_reference_mode(True)` from Python, switches them all off, and with them the product layer's
reporting callbacks, so a reader stepping through a tutorial in a debugger lands on the
walkthrough's own lines.
"""

import contextlib
import importlib
import os


def _from_environment() -> bool:
    return os.environ.get("NANOSFT_REFERENCE", "").strip().lower() not in ("", "0", "false", "no")


_enabled = _from_environment()  # the switch: read here and by set_reference_mode, never per call
_fast = None  # nanosft.fast once a speed path was asked for


def reference_mode_enabled() -> bool:
    """True when the walkthrough's own statements run (no speed paths)."""
    return _enabled


def set_reference_mode(enabled) -> None:
    """Switch reference mode on (True) or off (False); None reads NANOSFT_REFERENCE again."""
    global _enabled
    _enabled = _from_environment() if enabled is None else bool(enabled)


@contextlib.contextmanager
def reference_mode(enabled: bool = True):
    """Run a block in reference mode (or, with enabled=False, with the speed paths on)."""
    global _enabled
    previous = _enabled
    _enabled = bool(enabled)
    try:
        yield
    finally:
        _enabled = previous


_resolved = {}  # name -> the speed path: looked up once per process, not per call


def _speed_path(name: str):
    global _fast
    if (path := _resolved.get(name)) is None:
        if _fast is None:  # imported on first use, never at module level
            _fast = importlib.import_module("nanosft.fast")
        path = _resolved[name] = getattr(_fast, name)
    return path


def fast_path(name: str, asked: bool = False):
    """The speed path `name` of nanosft.fast, or None in reference mode: the one door from the
    teaching core to the speed paths (one statement in reference mode). asked=True: the caller
    asked for this path by name (`fused_lm_head=True`), so reference mode gives it too."""
    return None if _enabled and not asked else _speed_path(name)


# the callbacks a Trainer keeps in reference mode (trainer.default_callbacks): no
# throughput / MFU, memory ledger, metrics file, TensorBoard or non-finite guard
REFERENCE_MODE_CALLBACKS = ("DefaultFlowCallback", "ProgressCallback")
REFERENCE_BANNER = (
    "Reference mode: the walkthrough's own statements run, no speed paths; callbacks on: "
    f"{', '.join(REFERENCE_MODE_CALLBACKS)}, no reporting (NANOSFT_REFERENCE=1; nanosft.reference)"
)


def start_reference_mode() -> None:
    """Switch reference mode on for the rest of the process and say so, naming the callbacks a
    Trainer keeps (trainer.default_callbacks): the first printed line of the reading
    tutorials (01-08) and of `--trace`."""
    set_reference_mode(True)
    print(REFERENCE_BANNER, flush=True)

"""Reference mode: the one switch under which every walkthrough line nanosft mirrors is the line
that executes.

By default a few speed paths (nanosft.fast: the fused LM head, one addmm for fp32 adapters, bf16
adapter products as fp32 GEMMs, unpadded attention, recomputed norms) replace mirrored statements;
they are tested equal to reference mode. `NANOSFT_REFERENCE=1` in the environment, or
`with reference_mode():` / `set_reference_mode(True)` from Python, switches them all off, so a
reader stepping through a tutorial in a debugger lands on the walkthrough's own lines.
"""

import contextlib
import importlib
import os

_forced = None  # None: follow NANOSFT_REFERENCE; True / False: set from Python
_fast = None  # nanosft.fast once a speed path was asked for


def reference_mode_enabled() -> bool:
    """True when the walkthrough's own statements run (no speed paths)."""
    if _forced is not None:
        return _forced
    return os.environ.get("NANOSFT_REFERENCE", "").strip().lower() not in ("", "0", "false", "no")


def set_reference_mode(enabled) -> None:
    """Switch reference mode on (True) or off (False); None follows NANOSFT_REFERENCE again."""
    global _forced
    _forced = None if enabled is None else bool(enabled)


@contextlib.contextmanager
def reference_mode(enabled: bool = True):
    """Run a block in reference mode (or, with enabled=False, with the speed paths on)."""
    global _forced
    previous = _forced
    _forced = bool(enabled)
    try:
        yield
    finally:
        _forced = previous


def fast_path(name: str):
    """The speed path `name` of nanosft.fast, or None in reference mode: the one door from the
    teaching core to the speed paths (imported on first use, never at module level)."""
    global _fast
    if reference_mode_enabled():
        return None
    if _fast is None:  # called in every forward: import once, then a module attribute
        _fast = importlib.import_module("nanosft.fast")
    return getattr(_fast, name)


REFERENCE_BANNER = (
    "Reference mode: the walkthrough's own statements run, no speed paths "
    "(NANOSFT_REFERENCE=1; nanosft.reference)"
)


def start_reference_mode() -> None:
    """Switch reference mode on for the rest of the process and say so: the first printed line of
    the reading tutorials (01-08) and of `--trace`."""
    set_reference_mode(True)
    print(REFERENCE_BANNER, flush=True)

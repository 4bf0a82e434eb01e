"""Huge pages for XLA:CPU's buffers: the `python -m jaxrl.train` / `python -m jaxrl.bench` CLIs
re-execute themselves once with glibc's `glibc.malloc.hugetlb=1` tunable.

Why: XLA:CPU allocates each step's temporaries (activations, residuals, gradients: hundreds of
MB for a small model) with `malloc`, which serves large blocks by fresh `mmap`s and unmaps them
when they are freed. Every step then page-faults its whole working set back in, 4 KiB at a time,
with the kernel zeroing each page: measured on the issue-14 SFT point (Llama 4x256, 8 x 256
tokens, one core) as ~92k faults per step and 10-15% of the step time. With the tunable, glibc
asks for transparent huge pages (`madvise(MADV_HUGEPAGE)`) on those mappings: 9x fewer faults.
The tunable is read only when a process starts, hence the re-exec; it happens before anything
else is imported (`jaxrl/__init__.py` calls this first), so it costs one interpreter start-up.

Skipped when: not Linux with glibc, the kernel's THP mode is `never` (nothing to gain) or
`always` (the kernel already does it), the tunable is already set, or `JAXRL_HUGEPAGE_MALLOC=0`.
Only the two CLIs do it; importing jaxrl as a library never re-executes the host program (set
`GLIBC_TUNABLES=glibc.malloc.hugetlb=1` yourself there).

`trim_after_compiles` (installed by `import jaxrl`, library use included) gives each XLA compile's
freed scratch memory back to the OS before the compiled program first runs: peak host memory.
"""

from __future__ import annotations

import os
import platform
import sys
from typing import Any

_CLI_MODULES = ("jaxrl.train", "jaxrl.bench")
TUNABLE = "glibc.malloc.hugetlb=1"
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def _thp_mode() -> str | None:
    try:
        with open(_THP_MODE) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def wants_reexec(orig_argv: list[str], env: dict[str, str]) -> bool:
    """Whether this process is one of the CLIs and would gain from the tunable."""
    if len(orig_argv) < 3 or orig_argv[1] != "-m" or orig_argv[2] not in _CLI_MODULES:
        return False
    if env.get("JAXRL_HUGEPAGE_MALLOC", "1") == "0" or "glibc.malloc.hugetlb" in env.get(
        "GLIBC_TUNABLES", ""
    ):
        return False
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return False
    return _thp_mode() == "madvise"


def reexec_env(env: dict[str, str]) -> dict[str, str]:
    """`env` plus the tunable, marked as added by us (`JAXRL_HUGEPAGE_MALLOC=added`)."""
    tunables = env.get("GLIBC_TUNABLES", "")
    return {
        **env,
        "GLIBC_TUNABLES": f"{tunables}:{TUNABLE}" if tunables else TUNABLE,
        "JAXRL_HUGEPAGE_MALLOC": "added",
    }


def without_reexec(env: dict[str, str]) -> dict[str, str]:
    """`env` as it was before our re-exec: for child processes that are not jaxrl (the bench runs
    TRL as its users run it)."""
    if env.get("JAXRL_HUGEPAGE_MALLOC") != "added":
        return dict(env)
    env = {k: v for k, v in env.items() if k != "JAXRL_HUGEPAGE_MALLOC"}
    tunables = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t and t != TUNABLE]
    env.pop("GLIBC_TUNABLES", None)
    if tunables:
        env["GLIBC_TUNABLES"] = ":".join(tunables)
    return env


def maybe_reexec() -> None:
    orig_argv = getattr(sys, "orig_argv", [])
    if wants_reexec(orig_argv, dict(os.environ)):
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, *orig_argv[1:]], reexec_env(dict(os.environ)))


# ---------------------------------------------------------------- compiler scratch back to the OS

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
TRIM_MIN_COMPILE_S = 0.25  # a shorter compile frees too little to pay for the page faults after
_trim_listener: Any = None  # the installed `jax.monitoring` listener (one per process)


def _libc_malloc_trim() -> Any:
    """glibc's `malloc_trim`, or None off glibc."""
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return None
    import ctypes

    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def trim_after_compiles() -> bool:
    """After each XLA compile, return the compiler's freed scratch memory to the OS.

    Why: XLA frees a compile's scratch (HLO passes, LLVM modules: 100-250 MB for the issue-14
    models' train steps on CPU) into glibc arenas that keep it, so the first step's buffers come
    from fresh pages and the process peak is compile scratch + step buffers. On the issue-14 SFT
    point (Llama 4x256, 8 x 128 tokens, CPU) peak RSS was 1.11 GiB, and 0.97 GiB with
    `malloc_trim(0)` between the compile and the first execution. This installs a `jax.monitoring`
    listener on the backend-compile event that does that, once per process; glibc only;
    `JAXRL_MALLOC_TRIM=0` turns it off. Returns whether the listener is installed."""
    global _trim_listener
    if _trim_listener is not None:
        return True
    if os.environ.get("JAXRL_MALLOC_TRIM", "1") == "0":
        return False
    trim = _libc_malloc_trim()
    if trim is None:
        return False
    import jax

    def on_event(event: str, duration: float, **_: Any) -> None:
        if event == COMPILE_EVENT and duration >= TRIM_MIN_COMPILE_S:
            trim(0)

    jax.monitoring.register_event_duration_secs_listener(on_event)
    _trim_listener = on_event
    return True

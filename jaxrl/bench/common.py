"""What every `python -m jaxrl.bench` runner shares: flag splitting, peak memory, timing, MFU,
the synthetic rows both sides of a comparison train on, and reading a child's JSON line.

Must not import the runners (`step`, `compare`, `lora`, ...): they import from here, never the
other way round.
"""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

# The source checkout: the TRL-side scripts the comparisons run live in its `examples/`.
ROOT = Path(__file__).resolve().parents[2]

# Dense bf16 peak FLOP/s per device, for MFU. Unknown devices (e.g. CPU) report mfu=null.
PEAK_FLOPS = {
    "H100": 989e12,
    "H200": 989e12,
    "H800": 989e12,
    "A100": 312e12,
    "L4": 121e12,
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v5": 459e12,
    "TPU v6 lite": 918e12,
    "TPU v6e": 918e12,
}
BENCH_FLAGS = {
    "--preset": str,
    "--seq_len": int,
    "--steps": int,
    "--warmup": int,
    "--profile_dir": str,  # a jax.profiler trace (and Perfetto JSON) of the timed steps
    "--lengths": str,  # "fixed" (every row --seq_len tokens) or "longtail" (capped at it)
}
LENGTHS = ("fixed", "longtail")


def peak_flops(device) -> float | None:
    kind = device.device_kind
    for name, flops in sorted(PEAK_FLOPS.items(), key=lambda kv: -len(kv[0])):
        if name.lower() in kind.lower():
            return flops
    return None


def mfu_of(flops_per_step: float, step_s: float) -> float | None:
    """Model FLOPs utilisation over all devices; None where the device's peak is unknown."""
    devices = jax.devices()
    peak = peak_flops(devices[0])
    return (flops_per_step / step_s / (peak * len(devices))) if peak else None


def split_flags(
    argv: list[str], types: dict[str, Any], defaults: dict[str, Any]
) -> tuple[dict, list[str]]:
    """Pull the bench's own `--flag value` / `--flag=value` options (`types`: flag -> parser) out
    of `argv`; the rest goes on to the config parser."""
    opts = dict(defaults)
    rest, i = [], 0
    while i < len(argv):
        flag = argv[i].split("=", 1)[0]
        if flag in types:
            if "=" in argv[i]:
                value, i = argv[i].split("=", 1)[1], i + 1
            else:
                value, i = argv[i + 1], i + 2
            opts[flag[2:]] = types[flag](value)
        else:
            rest.append(argv[i])
            i += 1
    return opts, rest


def split_bench_flags(argv: list[str]) -> tuple[dict, list[str]]:
    return split_flags(
        argv,
        BENCH_FLAGS,
        {
            "preset": None,
            "seq_len": 512,
            "steps": 10,
            "warmup": 2,
            "profile_dir": None,
            "lengths": "fixed",
        },
    )


def long_tail_lengths(n: int, max_len: int, seed: int = 0, min_len: int = 8) -> list[int]:
    """`n` row lengths of a long-tailed distribution capped at `max_len`, shaped like chat SFT
    data: log-normal with median `max_len / 6` and sigma 0.75 (mean about `max_len / 4.5`,
    about 1% cut at the cap), at least `min_len`, and one row at the cap so that a run's
    static length is `max_len`, as for a real dataset cut at `max_length`."""
    rng = np.random.default_rng([seed, 7])
    x = np.exp(rng.normal(np.log(max_len / 6), 0.75, n))
    lengths = np.clip(np.round(x), min_len, max_len).astype(int)
    lengths[rng.integers(n)] = max_len
    return lengths.tolist()


def synthetic_examples(
    algo: str, n: int, seq_len: int, vocab: int, seed: int, lengths: list[int] | None = None
) -> list[dict]:
    """Token data of exactly `seq_len` per row, or of `lengths[i]` for row i (DPO/reward: half
    prompt, half completion; with DPO prefix sharing a row holds the prompt and both
    completions)."""
    rng = np.random.default_rng(seed)
    lengths = lengths or [seq_len] * n

    def ids(length):
        return rng.integers(3, vocab, size=length).tolist()

    if algo in ("sft", "forward"):
        return [{"input_ids": ids(length)} for length in lengths]
    if algo == "dpo":
        return [
            {
                "prompt_input_ids": ids(length // 2),
                "chosen_input_ids": ids(length - length // 2),
                "rejected_input_ids": ids(length - length // 2),
            }
            for length in lengths
        ]
    return [
        {"chosen_input_ids": ids(seq_len), "rejected_input_ids": ids(seq_len)} for _ in range(n)
    ]


def peak_memory() -> tuple[int, str]:
    """Peak bytes in use and where they were read: the first device's allocator, or this
    process's peak RSS where the device reports none (CPU)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return int(stats["peak_bytes_in_use"]), "device"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "host_rss"


def timed(fn: Any, steps: int) -> tuple[list[float], list[float]]:
    """Wall-clock and process CPU seconds of each call (CPU time is what a loaded, shared
    machine perturbs least)."""
    wall, cpu = [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return wall, cpu


def last_json_line(stdout: str) -> dict:
    """The result a bench process printed: its last stdout line, one JSON object."""
    return json.loads(stdout.strip().splitlines()[-1])

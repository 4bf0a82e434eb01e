"""`--compare trl [--sweep] [--reps N]` (sft, dpo): jaxrl against TRL's trainer
(`examples/bench_trl.py`, torch on this machine), each side in its own child process,
interleaved, with the median step times, their ratio and each side's peak RSS per point.
Must not time anything in this process: the children do (`step.py` and the TRL script).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

from jaxrl import _malloc
from jaxrl.bench.common import ROOT, split_bench_flags, split_flags

# (preset, batch, seq_len): the shapes of issue 14's table. DPO batches count pairs.
SWEEP = (
    ("llama-4x256", 8, 128),
    ("llama-4x256", 8, 256),
    ("llama-4x256", 8, 512),
    ("llama-4x256", 8, 1024),
    ("llama-4x256", 32, 256),
    ("llama-8x512", 8, 512),
)
_COMPARE_FLAGS = {"--compare": str, "--sweep": None, "--reps": int}


def _split_compare_flags(argv: list[str]) -> tuple[dict, list[str]]:
    opts: dict[str, Any] = {"compare": None, "sweep": False, "reps": 3}
    rest, i = [], 0
    while i < len(argv):
        flag = argv[i].split("=", 1)[0]
        if flag not in _COMPARE_FLAGS:
            rest.append(argv[i])
            i += 1
        elif _COMPARE_FLAGS[flag] is None:
            opts[flag[2:]], i = True, i + 1
        elif "=" in argv[i]:
            opts[flag[2:]], i = _COMPARE_FLAGS[flag](argv[i].split("=", 1)[1]), i + 1
        else:
            opts[flag[2:]], i = _COMPARE_FLAGS[flag](argv[i + 1]), i + 2
    return opts, rest


def run_child(cmd: list[str], env: dict[str, str] | None = None) -> dict:
    """Run one benchmark process; its last stdout line (JSON) plus its own peak RSS."""
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.PIPE, text=True, env=env)
        stderr = proc.stderr.read()  # until the child exits; stdout goes to a file
        # wait4 reports this child's own resource usage (ru_maxrss in KiB on Linux).
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        lines = out.read().strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{stderr[-3000:]}")
    result = json.loads(lines[-1])
    result["peak_rss_bytes"] = usage.ru_maxrss * 1024
    return result


def compare_commands(
    algo: str,
    point: tuple[str, int, int],
    steps: int,
    warmup: int,
    extra: list[str],
    lengths: str = "fixed",
) -> dict[str, tuple[list[str], list[str]]]:
    """label -> (jaxrl command, TRL command) for one sweep point."""
    preset, batch, seq_len = point
    common = ["--steps", str(steps), "--warmup", str(warmup), "--lengths", lengths]
    jaxrl = [sys.executable, "-m", "jaxrl.bench", "--algo", algo, "--preset", preset]
    jaxrl += ["--seq_len", str(seq_len), "--per_device_train_batch_size", str(batch), *common]
    jaxrl += ["--bf16", "false", "--gradient_checkpointing", "false"]
    script = ROOT / "examples" / "bench_trl.py"
    if not script.exists():
        raise ValueError(f"--compare trl runs {script}, which is missing (use a source checkout).")
    trl = [sys.executable, str(script), "--algo", algo, "--preset", preset]
    trl += ["--seq_len", str(seq_len), "--batch", str(batch), *common]
    # Precision and rematerialisation follow the jaxrl flags on both sides (f32, none by default).
    shared = split_flags(extra, {"--bf16": str, "--gradient_checkpointing": str}, {})[0]
    trl += [f"--{name}" for name, value in shared.items() if value.lower() == "true"]
    # Varying lengths: also jaxrl with one static row length (before `length_buckets`).
    static = ["--length_buckets", "null"]
    if algo == "sft":
        out = {"sft": (jaxrl + extra, trl)}
        if lengths != "fixed":
            out["sft static"] = (jaxrl + static + extra, trl)
            # Both sides padding-free (TRL: one flattened row per device, `max_length=None`).
            pf = ["--padding_free", "true"]
            out["sft padding_free"] = (jaxrl + pf + extra, trl + ["--padding_free"])
        return out
    # TRL's objective and layout: sigmoid loss only, prompt + completion rows per pair.
    dpo = ["--loss_type", "sigmoid", "--loss_weights", "null"]
    dpo += ["--max_prompt_length", str(seq_len // 2)]
    out = {
        "dpo": (jaxrl + dpo + ["--prefix_sharing", "false"] + extra, trl),
        "dpo prefix_sharing": (jaxrl + dpo + ["--prefix_sharing", "true"] + extra, trl),
    }
    if lengths != "fixed":
        out["dpo static"] = (jaxrl + dpo + ["--prefix_sharing", "false"] + static + extra, trl)
    return out


def _trl_env() -> dict[str, str]:
    """The TRL child's environment: the user's, without jaxrl's malloc tunable (TRL runs as its
    users run it), and with this checkout on `PYTHONPATH`: `examples/bench_trl.py` imports jaxrl,
    which a source checkout run as `python -m jaxrl.bench` has not installed."""
    env = _malloc.without_reexec(dict(os.environ))
    root = str(ROOT)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def compare(argv: list[str]) -> list[dict]:
    """jaxrl vs TRL, interleaved per point (see the module docstring); prints a line per point."""
    copts, rest = _split_compare_flags(argv)
    if copts["compare"] != "trl":
        raise ValueError(f"--compare {copts['compare']!r}: only `--compare trl` is supported.")
    opts, rest = split_bench_flags(rest)
    algo, extra, i = "sft", [], 0
    batch = 8
    while i < len(rest):
        flag, _, value = rest[i].partition("=")
        if not value and flag in ("--algo", "--per_device_train_batch_size"):
            value, i = rest[i + 1], i + 1
        if flag == "--algo":
            algo = value
        elif flag == "--per_device_train_batch_size":
            batch = int(value)
        else:
            extra.append(rest[i])
        i += 1
    if algo not in ("sft", "dpo"):
        raise ValueError(f"--compare trl supports --algo sft and dpo, not {algo!r}.")
    if copts["sweep"]:
        points = SWEEP
    elif opts["preset"] is None:
        raise ValueError("--compare trl needs --sweep or --preset NAME [--seq_len T].")
    else:
        points = ((opts["preset"], batch, opts["seq_len"]),)
    results = []
    for point in points:
        commands = compare_commands(
            algo, point, opts["steps"], opts["warmup"], extra, opts["lengths"]
        )
        # One rep runs every label's jaxrl command, then each distinct TRL command once (the
        # labels are jaxrl variants against the same TRL run), so all of them see the same load.
        trl_cmds = list(dict.fromkeys(tuple(trl) for _, trl in commands.values()))
        jaxrl_runs: dict[str, list[dict]] = {label: [] for label in commands}
        trl_runs: dict[tuple, list[dict]] = {cmd: [] for cmd in trl_cmds}
        loads = []
        for _ in range(copts["reps"]):
            loads.append(os.getloadavg()[0])
            for label, (jaxrl_cmd, _) in commands.items():
                jaxrl_runs[label].append(run_child(jaxrl_cmd))
            for cmd in trl_cmds:
                trl_runs[cmd].append(run_child(list(cmd), _trl_env()))
        for label, (_, trl_cmd) in commands.items():
            runs = {"jaxrl": jaxrl_runs[label], "trl": trl_runs[tuple(trl_cmd)]}
            step = {k: statistics.median(r["step_s"] for r in v) for k, v in runs.items()}
            rss = {k: max(r["peak_rss_bytes"] for r in v) for k, v in runs.items()}
            row = {
                "algo": label,
                "preset": point[0],
                "batch": point[1],
                "seq_len": point[2],
                "lengths": opts["lengths"],
                "jaxrl_step_s": step["jaxrl"],
                "trl_step_s": step["trl"],
                "speed_ratio": step["trl"] / step["jaxrl"],
                "jaxrl_step_s_all": [r["step_s"] for r in runs["jaxrl"]],
                "trl_step_s_all": [r["step_s"] for r in runs["trl"]],
                "jaxrl_peak_rss_bytes": rss["jaxrl"],
                "trl_peak_rss_bytes": rss["trl"],
                "load_avg_1m": loads,
                "reps": copts["reps"],
                "jaxrl_runs": runs["jaxrl"],  # each child's own JSON (tokens/s, mfu, memory)
                "trl_runs": runs["trl"],
            }
            print(
                f"{label:20s} {point[0]} B={point[1]:<3d} T={point[2]:<5d} "
                f"jaxrl {step['jaxrl']:.4f}s  TRL {step['trl']:.4f}s  "
                f"jaxrl/TRL speed {row['speed_ratio']:.2f}x  peak RSS jaxrl "
                f"{rss['jaxrl'] / 2**30:.2f} GiB, TRL {rss['trl'] / 2**30:.2f} GiB  "
                f"(load {min(loads):.1f}-{max(loads):.1f})",
                flush=True,
            )
            results.append(row)
    return results

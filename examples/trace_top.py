"""Sum the device-side ops of a `jax.profiler` trace: where a step's time goes.

    python examples/trace_top.py PROFILE_DIR [--steps N] [--top K] [--gaps G]

Reads the newest `perfetto_trace.json.gz` under PROFILE_DIR (what
`python -m jaxrl.bench ... --profile_dir PROFILE_DIR` writes), keeps the complete events of
the processes whose name mentions a GPU or TPU, and prints the ops with the largest total time
(per step when --steps is given: the number of steps traced), grouped by op name with digits
dropped so that the per-layer copies of one fusion add up. With --gaps G it also prints how
long the device sat idle (no op on any of its streams) within the traced span, and the G longest
idle gaps with the ops on either side: where wall time exceeds device time, this says where.
"""

import argparse
import collections
import gzip
import json
import re
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("profile_dir")
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--gaps", type=int, default=0)
    opts = p.parse_args()
    traces = sorted(
        Path(opts.profile_dir).rglob("perfetto_trace.json.gz"), key=lambda f: f.stat().st_mtime
    )
    if not traces:
        raise SystemExit(f"no perfetto_trace.json.gz under {opts.profile_dir}")
    events = json.load(gzip.open(traces[-1]))
    events = events["traceEvents"] if isinstance(events, dict) else events
    names = {
        e["pid"]: e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    device = {pid for pid, n in names.items() if re.search(r"GPU|TPU|gpu|tpu", n)}
    total: dict[str, float] = collections.defaultdict(float)
    count: dict[str, int] = collections.defaultdict(int)
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in device:
            key = re.sub(r"\d+", "#", e["name"])
            total[key] += e.get("dur", 0.0)
            count[key] += 1
    if opts.gaps:
        ops = [e for e in events if e.get("ph") == "X" and e.get("pid") in device]
        print_gaps(ops, opts.gaps, opts.steps)
    all_us = sum(total.values())
    print(f"device processes: {[names[p] for p in device]}")
    print(f"device op time: {all_us / 1e3 / opts.steps:.2f} ms per step over {opts.steps} step(s)")
    for key, us in sorted(total.items(), key=lambda kv: -kv[1])[: opts.top]:
        per = us / 1e3 / opts.steps
        print(
            f"{per:9.3f} ms {100 * us / all_us:5.1f}%  x{count[key] // opts.steps:<5d} {key[:110]}"
        )


def idle_gaps(ops: list[dict]) -> tuple[float, float, list[tuple[float, str, str]]]:
    """(span_us, busy_us, gaps): the traced span, the time some op ran on any stream, and each
    idle gap as (length_us, op that ended before it, op that started after it), longest first."""
    ops = sorted(ops, key=lambda e: float(e["ts"]))
    start, end, last = float(ops[0]["ts"]), float(ops[0]["ts"]), ops[0]["name"]
    busy, gaps = 0.0, []
    for e in ops:
        ts, te = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))
        if ts > end:
            gaps.append((ts - end, last, e["name"]))
            busy += end - start
            start = ts
        if te >= end:
            end, last = te, e["name"]
    busy += end - start
    span = end - float(ops[0]["ts"])
    return span, busy, sorted(gaps, key=lambda g: -g[0])


def print_gaps(ops: list[dict], n: int, steps: int) -> None:
    if not ops:
        print("no device ops in the trace: nothing to measure idle time against")
        return
    span, busy, gaps = idle_gaps(ops)
    print(
        f"traced span {span / 1e3 / steps:.2f} ms per step: device busy {busy / 1e3 / steps:.2f}"
        f" ms, idle {(span - busy) / 1e3 / steps:.2f} ms in {len(gaps)} gaps"
    )
    for us, before, after in gaps[:n]:
        print(f"  idle {us / 1e3:8.3f} ms  after {before[:60]}  before {after[:60]}")


if __name__ == "__main__":
    main()

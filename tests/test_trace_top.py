"""examples/trace_top.py: per-op device time and the device's idle gaps from a Perfetto trace."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "trace_top.py"


def _trace(tmp_path: Path) -> Path:
    meta = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
    ]
    ops = [  # two streams on the GPU; the host op must be ignored
        {"ph": "X", "pid": 1, "tid": 1, "name": "gemm_1", "ts": 0, "dur": 100},
        {"ph": "X", "pid": 1, "tid": 2, "name": "convert_2", "ts": 50, "dur": 100},  # overlaps
        {"ph": "X", "pid": 1, "tid": 1, "name": "gemm_3", "ts": 400, "dur": 100},  # idle 250
        {"ph": "X", "pid": 1, "tid": 1, "name": "reduce_4", "ts": 510, "dur": 90},  # idle 10
        {"ph": "X", "pid": 2, "tid": 1, "name": "host_op", "ts": 150, "dur": 250},
    ]
    d = tmp_path / "plugins" / "profile" / "run"
    d.mkdir(parents=True)
    with gzip.open(d / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": meta + ops}, f)
    return tmp_path


def test_op_totals_and_idle_gaps(tmp_path):
    out = subprocess.run(
        [sys.executable, str(EXAMPLE), str(_trace(tmp_path)), "--gaps", "5"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    # Span 0..600 us, busy 0..150 + 400..500 + 510..600 = 340 us, idle 260 us in two gaps.
    assert "traced span 0.60 ms per step: device busy 0.34 ms, idle 0.26 ms in 2 gaps" in out
    gaps = [line.split() for line in out.splitlines() if line.strip().startswith("idle ")]
    assert gaps == [
        ["idle", "0.250", "ms", "after", "convert_2", "before", "gemm_3"],
        ["idle", "0.010", "ms", "after", "gemm_3", "before", "reduce_4"],
    ]
    assert "device op time: 0.39 ms per step" in out  # 100 + 100 + 100 + 90, host op left out
    assert "host_op" not in out
    assert "gemm_#" in out  # digits dropped: the two GEMMs add up


def test_gaps_of_a_trace_without_device_ops_say_so(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    host_only = [{"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}}]
    with gzip.open(d / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": host_only}, f)
    out = subprocess.run(
        [sys.executable, str(EXAMPLE), str(tmp_path), "--gaps", "3"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "no device ops in the trace" in out

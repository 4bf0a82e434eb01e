"""examples/attention_mask_bench.py: the three ways of stating causal visibility agree (run
through XLA's attention on CPU; the cuDNN timings are a GPU-session measurement)."""

import json
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "attention_mask_bench.py"


def test_variants_agree_through_xla():
    args = ["--impl", "xla", "--batch", "2", "--seq_len", "16", "--heads", "4", "--kv_heads"]
    args += ["2", "--head_dim", "8", "--dtype", "float32", "--steps", "1", "--warmup", "0"]
    out = subprocess.run(
        [sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, check=True
    ).stdout
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["variant"] for r in rows] == ["dense_mask", "causal_only", "seq_lengths"]
    assert all(r["impl"] == "xla" and r["ms"] > 0 for r in rows)
    assert all(r["max_diff"] < 1e-5 for r in rows)

"""Multi-host, proven on one machine: 2 processes x 4 CPU devices over loopback
(`jax.distributed` with a local coordinator on 127.0.0.1) against 1 process x 8 devices.

Checks: per-host data loading gives the same per-step metrics and eval as one process (DPO; the
one process is this test process, which has the same 8 devices and XLA flags as a subprocess);
only process 0 writes metrics.jsonl and the export; a SIGTERM to one process makes both save
the same step and exit 143; a resume on 2 processes continues bit for bit (orbax save and
restore across both), with length buckets chosen alike on every host without talking.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from xla_flags import with_devices

from jaxrl.checkpoint import Checkpointer

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow

COMMON = ["--logging_steps", "1", "--eval_strategy", "no", "--disable_tqdm", "true"]
COMMON += ["--eval_on_start", "false"]
COMMON += ["--mesh_data", "-1", "--mesh_fsdp", "1", "--per_device_train_batch_size", "1"]
COMMON += ["--lr_scheduler_type", "constant", "--seed", "0"]


def run_here(out: Path, flags: list[str]) -> int:
    """`jaxrl.train` as the 1-process run, in this process: the same 8 CPU devices and XLA_FLAGS
    as a `launch(out, flags, 1)` subprocess (conftest sets them), without its ~7 s `import
    jaxrl`. The matmul precision is the CLI's default, not the one conftest sets for the tests."""
    from jaxrl.train import main

    with jax.default_matmul_precision(None):
        return main([*COMMON, *flags, "--output_dir", str(out)])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(out: Path, flags: list[str], processes: int) -> list[subprocess.Popen]:
    """Start `jaxrl.train` as `processes` processes sharing 8 CPU devices and one output_dir."""
    port = _free_port()
    procs = []
    for rank in range(processes):
        env = dict(
            os.environ,
            PYTHONPATH=str(ROOT),
            XLA_FLAGS=with_devices(8 // processes),
        )
        if processes > 1:
            env.update(
                JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                JAX_NUM_PROCESSES=str(processes),
                JAX_PROCESS_ID=str(rank),
            )
        cmd = [sys.executable, "-m", "jaxrl.train", *COMMON, *flags, "--output_dir", str(out)]
        with open(out.parent / f"{out.name}.p{rank}.log", "a") as log:  # the child keeps a copy
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


def wait_all(procs: list[subprocess.Popen], out: Path, timeout: float = 600) -> list[int]:
    deadline = time.time() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, deadline - time.time())))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            logs = [(out.parent / f"{out.name}.p{i}.log").read_text()[-2000:] for i in range(2)]
            raise AssertionError(f"timed out; logs: {logs}") from None
    return codes


def step_rows(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r]


def assert_same_metrics(got: list[dict], want: list[dict], keys: tuple[str, ...]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want, strict=True):
        for key in keys:
            # Different reduction trees over 2 processes: equal up to float32 rounding (atol:
            # step-1 DPO rewards are 0 up to rounding, policy == reference).
            np.testing.assert_allclose(
                g[key], w[key], rtol=2e-5, atol=1e-6, err_msg=f"{key} @ {g['step']}"
            )


def _data(tmp_path: Path) -> str:
    """Rows of 5 to 36 tokens in order (for `length_buckets` 16 and 32, sequential sampling,
    8 rows a step): 8 rows under 16 tokens (bucket 16), then 8 of 16 to 32 (bucket 32), then
    the longest row (the static length). So each epoch's three steps use the three lengths, and
    its third step holds one example: the second host fills its rows with copies of example 0."""
    rows = [{"text": f"{a}+{b}={a + b}"} for a in range(4) for b in range(2)]
    rows += [{"text": str(a) * (18 + a) + "=1"} for a in range(8)]
    rows += [{"text": "1" * 34 + "=2"}]
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_sft_sigterm_on_two_processes_saves_both_and_resume_is_exact(tmp_path, monkeypatch):
    # The reference is an uninterrupted 2-process run: the same reduction trees, so the resumed
    # run must equal it bit for bit. (1 vs 2 processes agree only up to float32 rounding, which
    # Adam at lr 1e-3 amplifies to ~1e-2 by step 9; the DPO test below compares those.)
    # Length buckets: each step's hosts pad to the bucket of the global batch's longest row
    # without talking (a disagreement would give the hosts different programs), before and
    # after the resume, also on the epochs' one-example steps.
    flags = ["--algo", "sft", "--dataset_name", _data(tmp_path), "--max_steps", "10"]
    flags += ["--save_steps", "1000", "--learning_rate", "1e-3", "--length_buckets", "16,32"]
    flags += ["--train_sampling_strategy", "sequential"]
    ref = tmp_path / "ref"
    # It needs no checkpoint (a 2-process save costs ~10 s): saving changes no number. Its
    # processes log their compiles, to show that the steps used all three lengths.
    monkeypatch.setenv("JAX_LOG_COMPILES", "1")
    ref_procs = launch(ref, [*flags, "--save_strategy", "no"], 2)
    monkeypatch.delenv("JAX_LOG_COMPILES")
    assert wait_all(ref_procs, ref) == [0, 0]
    want = step_rows(ref)
    assert [r["step"] for r in want] == list(range(1, 11))
    for rank in range(2):  # one train-step program per length: buckets 16 and 32, the static
        log = (tmp_path / f"ref.p{rank}.log").read_text()
        assert log.count("MLIR module conversion jit(train_step)") == 3, rank

    out = tmp_path / "two"
    procs = launch(out, flags, 2)
    deadline = time.time() + 600
    while not (out / "metrics.jsonl").exists() or not step_rows(out):
        assert all(p.poll() is None for p in procs), "a process ended before logging"
        assert time.time() < deadline
        time.sleep(0.2)
    procs[1].send_signal(signal.SIGTERM)  # only one host is told, as on a real preemption
    assert wait_all(procs, out) == [143, 143]
    saved = sorted(Checkpointer(out / "checkpoints").all_steps())
    assert len(saved) == 1 and 0 < saved[0] < 10  # one step, saved by both together
    for rank in range(2):
        log = (tmp_path / f"two.p{rank}.log").read_text()
        assert f"saved step {saved[0]}" in log

    # The resumed run saves nothing: with save_strategy "steps" it would also save its last step
    # (another 2-process save, ~10 s) that nothing reads; saving changes no number.
    resumed = launch(out, [*flags, "--resume_from_checkpoint", "true", "--save_strategy", "no"], 2)
    assert wait_all(resumed, out) == [0, 0]
    got = step_rows(out)
    # Written by process 0 only: each step exactly once (two writers would double every line).
    keys = ("loss", "grad_norm", "mean_token_accuracy", "num_tokens")
    assert [r["step"] for r in got] == list(range(1, 11))
    assert [[r[k] for k in keys] for r in got] == [[r[k] for k in keys] for r in want]
    assert not (out / "jaxrl.lock").exists()

    # The export is one HF directory with the same weights as the uninterrupted run's.
    from safetensors.numpy import load_file

    ours = load_file(out / "final" / "model.safetensors")
    theirs = load_file(ref / "final" / "model.safetensors")
    assert sorted(ours) == sorted(theirs)
    for key in theirs:
        np.testing.assert_array_equal(ours[key], theirs[key], err_msg=key)


def test_dpo_two_processes_match_one(tmp_path):
    # eval_on_start runs the recipe's compute_metrics (generated answers, gathered from both
    # hosts) before step 1.
    flags = [
        "--algo",
        "dpo",
        "--max_steps",
        "3",
        "--save_strategy",
        "no",
        "--eval_on_start",
        "true",
    ]
    ref, out = tmp_path / "one", tmp_path / "two"
    two = launch(out, flags, 2)  # the 1-process run goes here meanwhile
    try:
        assert run_here(ref, flags) == 0
    except BaseException:
        for p in two:
            p.kill()
        raise
    assert wait_all(two, out) == [0, 0]
    keys = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "logps/chosen")
    assert_same_metrics(step_rows(out), step_rows(ref), keys)
    evals = [
        [json.loads(r) for r in (o / "metrics.jsonl").read_text().splitlines()] for o in (ref, out)
    ]
    evals = [[r for r in rows if "eval_task_accuracy" in r] for rows in evals]
    assert len(evals[0]) == len(evals[1]) == 1
    assert evals[0][0]["step"] == 0
    assert_same_metrics(evals[1], evals[0], ("eval_task_accuracy", "eval_loss"))

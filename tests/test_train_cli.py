"""`python -m jaxrl.train`: clear errors on bad input, and kill-and-resume reproducing the
uninterrupted run's metrics.jsonl step for step (SIGKILL), and a SIGTERM save."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest
from xla_flags import with_devices

from jaxrl.checkpoint import Checkpointer
from jaxrl.train import main

FAST = [
    "--algo",
    "sft",
    "--max_steps",
    "12",
    "--logging_steps",
    "1",
    "--save_steps",
    "4",
    "--eval_strategy",
    "no",
    "--eval_on_start",
    "false",
    "--disable_tqdm",
    "true",
    "--mesh_fsdp",
    "1",
    "--mesh_data",
    "-1",
    # The recipe's 64 rows per device are 0.5 s of compute a step here; resuming exactly does
    # not depend on the batch size.
    "--per_device_train_batch_size",
    "8",
]


def cli(out: Path, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, XLA_FLAGS=with_devices(2))
    return subprocess.Popen(
        [sys.executable, "-m", "jaxrl.train", *FAST, "--output_dir", str(out), *extra],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def step_lines(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in rows if "train_runtime" not in r]  # wall-clock summary differs per run


def test_unknown_key_names_the_closest_field(capsys):
    assert main(["--algo", "sft", "--learning_rat", "0.1"]) == 2
    err = capsys.readouterr().err
    assert "learning_rat" in err and "learning_rate" in err


def test_missing_dataset_columns_is_a_clear_error(tmp_path, capsys):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"question": "1+1=", "answer": "2"}\n' * 16)
    assert main(["--algo", "sft", "--dataset_name", str(data), "--output_dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "question" in err and "text" in err


def test_bad_algo(capsys):
    assert main(["--algo", "ppo2"]) == 2
    assert "ppo2" in capsys.readouterr().err


@pytest.mark.slow
def test_sigkill_then_resume_reproduces_metrics(tmp_path):
    ref, killed = tmp_path / "ref", tmp_path / "killed"
    p_kill = cli(killed)
    deadline = time.time() + 300
    while not (killed / "checkpoints" / "checkpoint-8").exists():
        assert p_kill.poll() is None, p_kill.communicate()[1][-2000:]
        assert time.time() < deadline
        time.sleep(0.05)
    p_kill.send_signal(signal.SIGKILL)
    p_kill.wait()
    resumed = cli(killed, "--resume_from_checkpoint", "true")
    # The uninterrupted reference needs no process of its own (no signal, no exit status): it
    # runs here meanwhile, on the first 2 of this process's 8 devices (`--mesh_data 2`: the same
    # 2-device mesh as the subprocesses' `-1` over their 2), with the CLI's default matmul
    # precision instead of the one conftest sets. Saving changes no number; only `killed` resumes.
    try:
        with jax.default_matmul_precision(None):
            argv = [*FAST, "--output_dir", str(ref), "--save_strategy", "no", "--mesh_data", "2"]
            assert main(argv) == 0
    except BaseException:
        resumed.kill()
        raise
    assert resumed.wait() == 0, resumed.communicate()[1][-2000:]
    want = step_lines(ref / "metrics.jsonl")
    assert [r["step"] for r in want] == list(range(1, 13))
    assert step_lines(killed / "metrics.jsonl") == want  # bit-for-bit equal floats


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM])
def test_sigterm_saves_before_exit(tmp_path, sig):
    out = tmp_path / "run"
    proc = cli(out, "--max_steps", "400", "--save_steps", "1000")
    deadline = time.time() + 300
    while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text():
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.05)
    proc.send_signal(sig)
    assert proc.wait() == 143
    steps = sorted(Checkpointer(out / "checkpoints").all_steps())
    assert steps and 0 < steps[-1] < 400


@pytest.mark.parametrize(
    "argv, expected, absent",
    [
        (["--help"], ["--algo dpo", "--beta (float, default 0.1)", "--model_name_or_path"], []),
        (
            ["--algo", "grpo", "-h"],
            ["--num_generations", "--learning_rate"],
            ["--beta (float, default 0.1)"],
        ),
        (["--algo=sft", "--help"], ["--packing", "--dataset_text_field"], ["--num_generations"]),
    ],
)
def test_help_lists_the_algorithms_flags(capsys, argv, expected, absent):
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("`python -m jaxrl.train --algo")
    for text in expected:
        assert text in out, text
    for text in absent:
        assert text not in out, text


# A CLI run whose SIGTERM lands while its last checkpoint is written: the patched
# `wait_until_finished` signals the process itself once that save is in flight.
_SIGTERM_DURING_LAST_SAVE = """
import os, signal, sys
from jaxrl import checkpoint
from jaxrl.train import main

save, wait = checkpoint.Checkpointer.save, checkpoint.Checkpointer.wait_until_finished
armed = []

def save_then_arm(self, step, tree, meta):
    save(self, step, tree, meta)
    armed.append(step == 2)

def wait_with_sigterm(self):
    if armed and armed.pop():
        os.kill(os.getpid(), signal.SIGTERM)
    wait(self)

checkpoint.Checkpointer.save = save_then_arm
checkpoint.Checkpointer.wait_until_finished = wait_with_sigterm
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_sigterm_during_the_last_save_lets_it_finish_and_exits_143(tmp_path):
    """The handler stays installed until the last checkpoint is committed: the save completes
    (no temporary directory left), the run exits 143 with the resume command, and the resume
    finishes the run (was: killed by the default handler, status -15, a tmp dir left)."""
    out = tmp_path / "run"
    argv = [*FAST, "--output_dir", str(out), "--max_steps", "2", "--save_steps", "2"]
    env = dict(os.environ, XLA_FLAGS=with_devices(2))
    proc = subprocess.run(
        [sys.executable, "-c", _SIGTERM_DURING_LAST_SAVE, *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 143, proc.stderr[-3000:]
    assert "saved step 2" in proc.stderr and "--resume_from_checkpoint true" in proc.stderr
    assert Checkpointer(out / "checkpoints").all_steps() == [2]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["checkpoint-2"]
    assert [r["step"] for r in step_lines(out / "metrics.jsonl")] == [1, 2]
    # The resume has nothing left to train: it logs the summary and exports.
    assert main([*argv, "--resume_from_checkpoint", "true"]) == 0
    assert (out / "final").is_dir()

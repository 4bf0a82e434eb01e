"""run_dir: the output-dir guard and the lock file (holder pid/host, stale-lock takeover)."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from jaxrl import run_dir
from jaxrl.run_dir import OutputDirError


def _write_lock(out, pid, host):
    out.mkdir(exist_ok=True)
    path = out / run_dir.LOCK_NAME
    path.write_text(json.dumps({"pid": pid, "host": host, "started": 0}))
    return path


def test_lock_names_holder_and_a_second_run_refuses(tmp_path):
    lock = run_dir.prepare(tmp_path)
    holder = json.loads((tmp_path / run_dir.LOCK_NAME).read_text())
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    with pytest.raises(OutputDirError, match=f"pid {os.getpid()} on host"):
        run_dir.prepare(tmp_path)
    lock.release()
    assert not (tmp_path / run_dir.LOCK_NAME).exists()
    run_dir.prepare(tmp_path).release()  # free again


def test_lock_of_an_exited_process_is_taken_over(tmp_path, caplog):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)  # fmt: skip
    _write_lock(tmp_path, int(gone.stdout), socket.gethostname())
    with caplog.at_level("WARNING"):
        run_dir.prepare(tmp_path).release()
    assert f"process {int(gone.stdout)} has exited" in caplog.text


def test_lock_from_another_host_is_stale_only_once_its_heartbeat_stops(tmp_path):
    path = _write_lock(tmp_path, 1, "some-other-host")
    with pytest.raises(OutputDirError, match="some-other-host"):
        run_dir.prepare(tmp_path)
    old = time.time() - run_dir.STALE_AFTER_S - 1
    os.utime(path, (old, old))  # e.g. a preempted TPU VM: no more heartbeats
    run_dir.prepare(tmp_path).release()


def test_previous_run_needs_resume_or_overwrite(tmp_path):
    (tmp_path / "checkpoints" / "checkpoint-10").mkdir(parents=True)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "final").mkdir()
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(OutputDirError, match="--overwrite_output_dir.*--output_dir"):
        run_dir.prepare(tmp_path)
    run_dir.prepare(tmp_path, resume_from_checkpoint=True).release()
    assert (tmp_path / "checkpoints" / "checkpoint-10").is_dir()  # resuming deletes nothing
    run_dir.prepare(tmp_path, overwrite_output_dir=True).release()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_empty_leftovers_are_not_a_previous_run(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "metrics.jsonl").write_text("")
    run_dir.prepare(tmp_path).release()


def test_only_process_zero_locks(tmp_path):
    lock = run_dir.prepare(tmp_path, process_index=1)
    assert not (tmp_path / run_dir.LOCK_NAME).exists()
    lock.release()

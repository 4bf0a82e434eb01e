"""tpu/*.sh with a fake `gcloud` on PATH: the commands each script would issue, the babysitter's
decisions (resume after preemption or a crash, stop on success or a configuration error), and
the launch command run for real on this machine (detached, log and exit status on disk)."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TPU = ROOT / "tpu"

# The fake gcloud logs its argv as one JSON line, answers `queued-resources describe` and the
# babysitter's exit-status probe from scripted queues (the last answer repeats), and with
# FAKE_RUN_SSH=1 runs an ssh --command locally with bash.
FAKE_GCLOUD = """\
#!{python}
import json, os, subprocess, sys
fake = os.environ["FAKE_DIR"]
argv = sys.argv[1:]
with open(os.path.join(fake, "calls.jsonl"), "a") as f:
    f.write(json.dumps(argv) + "\\n")

def pop(name):
    path = os.path.join(fake, name)
    lines = open(path).read().splitlines() if os.path.exists(path) else []
    if not lines:
        return ""
    if len(lines) > 1:
        open(path, "w").write("\\n".join(lines[1:]) + "\\n")
    return lines[0]

if "describe" in argv:
    state = pop("states")
    if state == "NONE":
        sys.exit(1)
    print(state)
elif "ssh" in argv:
    command = argv[argv.index("--command") + 1]
    if "exit_code" in command and "nohup" not in command:
        print(pop("codes"))
    elif os.environ.get("FAKE_RUN_SSH") == "1":
        sys.exit(subprocess.run(["bash", "-c", command]).returncode)
"""


@pytest.fixture
def fake(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    gcloud = bin_dir / "gcloud"
    gcloud.write_text(FAKE_GCLOUD.format(python=sys.executable))
    gcloud.chmod(0o755)
    return tmp_path


def run_script(fake, name, *args, states=(), codes=(), **env):
    (fake / "states").write_text("".join(f"{s}\n" for s in states))
    (fake / "codes").write_text("".join(f"{c}\n" for c in codes))
    full_env = dict(
        os.environ,
        PATH=f"{fake / 'bin'}:{os.environ['PATH']}",
        FAKE_DIR=str(fake),
        TPU_NAME="tpu1",
        ZONE="us-west4-a",
        ACCELERATOR="v5litepod-8",
        RUNTIME="v2-alpha-tpuv5-lite",
        BUCKET="my-bucket",
        RUN_NAME="run1",
        POLL_S="0",
        **env,
    )
    proc = subprocess.run(
        ["bash", str(TPU / name), *args], env=full_env, capture_output=True, text=True, timeout=60
    )
    log = fake / "calls.jsonl"
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    log.unlink(missing_ok=True)
    return proc, calls


def verbs(calls):
    """`queued-resources create`, `tpu-vm ssh`, ... for each call, in order."""
    return [" ".join(c[2:4]) for c in calls]


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="apt-get install shellcheck")
def test_scripts_are_shellcheck_clean():
    scripts = sorted(str(p) for p in TPU.glob("*.sh"))
    proc = subprocess.run(["shellcheck", "-x", *scripts], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


@pytest.mark.parametrize("spot", ["1", "0"])
def test_create_requests_a_queued_resource_and_waits_until_active(fake, spot):
    proc, calls = run_script(
        fake, "create.sh", states=["NONE", "WAITING_FOR_RESOURCES", "ACTIVE"], SPOT=spot
    )
    assert proc.returncode == 0, proc.stderr
    creates = [c for c in calls if c[2:4] == ["queued-resources", "create"]]
    assert len(creates) == 1
    create = creates[0]
    assert create[4] == "tpu1-qr" and create[create.index("--node-id") + 1] == "tpu1"
    assert create[create.index("--accelerator-type") + 1] == "v5litepod-8"
    assert create[create.index("--runtime-version") + 1] == "v2-alpha-tpuv5-lite"
    assert ("--spot" in create) == (spot == "1")  # on-demand: no tier flag
    assert "ACTIVE" in proc.stdout


def test_create_is_idempotent_and_replaces_a_suspended_request(fake):
    _, calls = run_script(fake, "create.sh", states=["ACTIVE"])
    assert verbs(calls) == ["queued-resources describe"] * 2  # nothing created
    proc, calls = run_script(fake, "create.sh", states=["SUSPENDED", "ACTIVE"])
    assert proc.returncode == 0, proc.stderr
    assert verbs(calls)[:3] == [
        "queued-resources describe",
        "queued-resources delete",
        "queued-resources create",
    ]
    assert "--force" in calls[1]  # deletes the preempted TPU with the request


def test_setup_installs_the_tpu_extra_and_gcsfuse_from_its_repository(fake):
    proc, calls = run_script(fake, "setup.sh")
    assert proc.returncode == 0, proc.stderr
    assert verbs(calls) == ["tpu-vm scp", "tpu-vm ssh"]
    assert all("--worker=all" in c for c in calls)
    command = calls[1][calls[1].index("--command") + 1]
    # jax[tpu] at our jax pin comes with jaxrl's `tpu` extra (tests/test_install_extras.py).
    assert 'pip install -q -e "$HOME/jaxrl[tpu]"' in command
    assert "jax[tpu]" not in command.replace("jaxrl[tpu]", "")
    assert "https://packages.cloud.google.com/apt gcsfuse-" in command
    # Idempotent on rerun: each install and the mount are guarded.
    assert "command -v gcsfuse" in command and "mountpoint -q /gcs" in command
    assert "jax.__version__" in command


def test_launch_runs_detached_with_log_and_exit_status_on_disk(fake, tmp_path):
    # Run the remote command here: a stand-in python3 records its argv and exits 143.
    bin_dir = fake / "bin"
    (bin_dir / "python3").write_text(
        textwrap.dedent(f"""\
        #!/usr/bin/env bash
        printf '%s\\n' "$@" > {tmp_path}/argv
        echo training...
        exit 143
        """)
    )
    (bin_dir / "python3").chmod(0o755)
    home = tmp_path / "home"
    (home / "jaxrl").mkdir(parents=True)
    proc, calls = run_script(
        fake, "launch.sh", "--algo", "dpo", "--learning_rate", "1e-6", FAKE_RUN_SSH="1", HOME=str(home)
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert verbs(calls) == ["tpu-vm ssh"] and "--worker=all" in calls[0]
    run = home / "runs" / "run1"
    deadline = time.time() + 30
    while not (run / "exit_code").exists():  # the launch returned at once; the job runs on
        assert time.time() < deadline
        time.sleep(0.1)
    assert (run / "exit_code").read_text().strip() == "143"
    assert "training..." in (run / "train.log").read_text()
    argv = (tmp_path / "argv").read_text().split()
    assert argv == ["-m", "jaxrl.train", "--algo", "dpo", "--learning_rate", "1e-6",
                    "--output_dir", "/gcs/run1", "--run_name", "run1"]  # fmt: skip


def launches(calls):
    out = []
    for c in calls:
        if c[2:4] == ["tpu-vm", "ssh"] and "nohup" in c[c.index("--command") + 1]:
            out.append(c[c.index("--command") + 1])
    return out


def test_babysit_resumes_after_a_crash_and_stops_on_success(fake):
    proc, calls = run_script(
        fake, "babysit.sh", "--algo", "dpo", states=["ACTIVE"], codes=["", "143", "", "0"]
    )
    assert proc.returncode == 0, proc.stderr
    starts = launches(calls)
    assert len(starts) == 2
    assert "--resume_from_checkpoint" not in starts[0]
    assert "--resume_from_checkpoint true" in starts[1]


def test_babysit_stops_on_a_configuration_error(fake):
    proc, calls = run_script(fake, "babysit.sh", "--algo", "dpo", states=["ACTIVE"], codes=["2"])
    assert proc.returncode == 2
    assert len(launches(calls)) == 1 and "configuration error" in proc.stderr


def test_babysit_recreates_a_preempted_tpu_and_resumes(fake):
    # Running, then the spot TPU is preempted (SUSPENDED); create.sh deletes and re-requests it.
    states = ["ACTIVE", "ACTIVE", "SUSPENDED", "SUSPENDED", "ACTIVE", "ACTIVE", "ACTIVE"]
    proc, calls = run_script(
        fake, "babysit.sh", "--algo", "dpo", states=states, codes=["", "", "", "0"], SPOT="1"
    )
    assert proc.returncode == 0, proc.stderr
    v = verbs(calls)
    assert "queued-resources delete" in v and "queued-resources create" in v
    assert v.index("queued-resources create") < v.index("tpu-vm scp")  # set up again
    starts = launches(calls)
    assert len(starts) == 2 and "--resume_from_checkpoint true" in starts[1]


def test_babysit_gives_up_after_max_restarts(fake):
    proc, calls = run_script(fake, "babysit.sh", states=["ACTIVE"], codes=["1"], MAX_RESTARTS="2")
    assert proc.returncode == 1 and "giving up" in proc.stderr
    assert len(launches(calls)) == 3

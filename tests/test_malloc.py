"""The CLIs' huge-page malloc re-exec (`jaxrl/_malloc.py`): when it applies, what it sets, and
that the bench gives TRL's side back the environment without it."""

import sys

import pytest

from jaxrl import _malloc

CLI = [sys.executable, "-m", "jaxrl.train", "--algo", "dpo"]


@pytest.fixture
def madvise(monkeypatch):
    monkeypatch.setattr(_malloc, "_thp_mode", lambda: "madvise")
    monkeypatch.setattr(_malloc.sys, "platform", "linux")
    monkeypatch.setattr(_malloc.platform, "libc_ver", lambda: ("glibc", "2.36"))


@pytest.mark.parametrize(
    "argv, env, thp, expected",
    [
        (CLI, {}, "madvise", True),
        ([sys.executable, "-m", "jaxrl.bench", "--algo", "sft"], {}, "madvise", True),
        ([sys.executable, "script.py"], {}, "madvise", False),  # a library user's program
        ([sys.executable, "-m", "pytest"], {}, "madvise", False),
        (CLI, {"JAXRL_HUGEPAGE_MALLOC": "0"}, "madvise", False),  # opted out
        (CLI, {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, "madvise", False),  # user's choice
        (CLI, {}, "always", False),  # the kernel already gives huge pages
        (CLI, {}, "never", False),
        (CLI, {}, None, False),  # no THP control file
    ],
)
def test_wants_reexec(madvise, monkeypatch, argv, env, thp, expected):
    monkeypatch.setattr(_malloc, "_thp_mode", lambda: thp)
    assert _malloc.wants_reexec(argv, env) is expected


def test_maybe_reexec_runs_the_same_command_with_the_tunable(madvise, monkeypatch):
    calls = []
    monkeypatch.setattr(_malloc.sys, "orig_argv", ["python3", "-m", "jaxrl.train", "--x", "1"])
    monkeypatch.setattr(_malloc.os, "environ", {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    monkeypatch.setattr(_malloc.os, "execve", lambda *a: calls.append(a))
    _malloc.maybe_reexec()
    ((exe, argv, env),) = calls
    assert exe == sys.executable and argv == [sys.executable, "-m", "jaxrl.train", "--x", "1"]
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    assert not _malloc.wants_reexec(argv, env)  # the new process does not re-exec again
    # What a non-jaxrl child (TRL in the bench) gets: the user's environment, untouched.
    assert _malloc.without_reexec(env) == {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}
    assert _malloc.without_reexec(_malloc.reexec_env({})) == {}


def test_user_set_tunable_is_kept_for_children():
    env = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}  # set by the user, not by us
    assert _malloc.without_reexec(env) == env

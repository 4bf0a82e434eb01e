"""The CLIs' huge-page malloc re-exec (`jaxrl/_malloc.py`): when it applies, what it sets, and
that the bench gives TRL's side back the environment without it."""

import sys

import numpy as np
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


@pytest.fixture
def fresh_trim(monkeypatch):
    """`trim_after_compiles` as in a new process, with a recording `malloc_trim`; the listener
    it installs is removed afterwards (listeners are process-global)."""
    import jax

    calls = []
    monkeypatch.setattr(_malloc, "_trim_listener", None)
    monkeypatch.setattr(_malloc, "_libc_malloc_trim", lambda: calls.append)
    monkeypatch.delenv("JAXRL_MALLOC_TRIM", raising=False)
    yield calls
    if _malloc._trim_listener is not None:
        jax.monitoring.unregister_event_duration_listener(_malloc._trim_listener)


def test_trim_runs_after_each_real_compile(fresh_trim, monkeypatch):
    import jax
    import jax.numpy as jnp

    x = jax.device_put(np.arange(5.0))  # before the listener: a transfer, no compile
    monkeypatch.setattr(_malloc, "TRIM_MIN_COMPILE_S", 0.0)
    assert _malloc.trim_after_compiles()
    assert _malloc.trim_after_compiles()  # idempotent: one listener per process
    jax.jit(lambda x: jnp.tanh(x) * 3.0 + 1.0)(x).block_until_ready()
    assert fresh_trim == [0]  # malloc_trim(0) once, for the one compile
    jax.jit(lambda x: jnp.tanh(x) * 3.0 + 1.0)(x).block_until_ready()
    assert fresh_trim == [0, 0]  # a new function, a new compile, another trim


def test_trim_skips_short_compiles_and_other_events(fresh_trim):
    import jax

    assert _malloc.trim_after_compiles()
    record = jax.monitoring.record_event_duration_secs
    record(_malloc.COMPILE_EVENT, _malloc.TRIM_MIN_COMPILE_S / 2, fun_name="f")
    record("/jax/core/compile/jaxpr_trace_duration", 5.0, fun_name="f")
    assert fresh_trim == []
    record(_malloc.COMPILE_EVENT, _malloc.TRIM_MIN_COMPILE_S, fun_name="f")
    assert fresh_trim == [0]


def test_trim_opt_out_and_non_glibc(fresh_trim, monkeypatch):
    monkeypatch.setenv("JAXRL_MALLOC_TRIM", "0")
    assert not _malloc.trim_after_compiles()
    monkeypatch.delenv("JAXRL_MALLOC_TRIM")
    monkeypatch.setattr(_malloc, "_libc_malloc_trim", lambda: None)  # not glibc
    assert not _malloc.trim_after_compiles()
    assert _malloc._trim_listener is None


def test_import_installs_trim_listener():
    import os

    import jaxrl  # noqa: F401  (the package installs it at import)

    assert _malloc._libc_malloc_trim() is not None  # this test machine is Linux/glibc
    opted_out = os.environ.get("JAXRL_MALLOC_TRIM") == "0"  # the run's own environment
    assert (_malloc._trim_listener is None) == opted_out

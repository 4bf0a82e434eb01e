"""XLA_FLAGS for the tests' CLI subprocesses: the flags conftest set (fast CPU compiles), with the
subprocess's own fake CPU device count instead of the in-process 8."""

import os

DEVICE_COUNT = "--xla_force_host_platform_device_count"


def with_devices(n: int) -> str:
    """The current XLA_FLAGS with `n` fake CPU devices."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    return " ".join([*(f for f in flags if not f.startswith(DEVICE_COUNT)), f"{DEVICE_COUNT}={n}"])

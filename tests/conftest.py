"""Test setup: 8 fake CPU devices (must be set before JAX is imported) and f32 matmuls."""

import gc
import os
import sys
import tempfile

# Bytecode: where the environment sets PYTHONDONTWRITEBYTECODE (this sandbox does), every process
# (both xdist workers' collection, every CLI subprocess) would compile jaxrl's and the tests'
# sources again: ~2 s of a subprocess's ~7 s `import jaxrl`, ~3 s of a worker's collection. They
# go to one cache outside the checkout instead, shared like the XLA cache below (subprocesses
# inherit it; a cached file is used only while its source's mtime and size are unchanged).
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None):
    sys.pycache_prefix = os.environ.setdefault(
        "PYTHONPYCACHEPREFIX", os.path.join(tempfile.gettempdir(), "jaxrl-tests-pycache")
    )
    sys.dont_write_bytecode = False
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ["XLA_FLAGS"] = os.environ["XLA_FLAGS"]
if "--xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
# The tests' programs are tiny, so compiling them costs far more than running them: LLVM at -O0
# halves XLA's CPU compile times. Results can differ from -O2 code in the last bits (e.g. the
# order of a vectorised sum), inside every tolerance here; bit-exact checks compare two runs
# under the same flags. CLI subprocesses inherit it (`xla_flags.with_devices` keeps it).
if "--xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
# XLA:CPU's older loop-fusion code generator compiles the tests' step programs about 2x faster
# than its MLIR fusion emitters (e.g. a tiny DPO run's 12 programs: 0.8 s against 2.1 s), the
# same kind of last-bit differences as above.
if "--xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"
# XLA:CPU splits each program's LLVM module into parts to compile them on parallel threads; with
# both cores busy running the two xdist workers that buys nothing, and the split itself took
# ~15% of a tiny DPO train step's backend compile (124 of 855 ms, traced with jax.profiler).
if "--xla_cpu_parallel_codegen_split_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_cpu_parallel_codegen_split_count=1"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
# One XLA compilation cache for the whole run, shared by both xdist workers and every CLI
# subprocess (they inherit the environment): the tiny models' steps compile once, not per test.
# A max size turns on the cache's file lock, so concurrent writers cannot tear an entry.
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "jaxrl-tests-xla-cache")
)
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(4 << 30))
# Only programs that took over JAX's default 1 s to compile are written: with a max size (the
# file lock above) every write scans the whole cache directory and reads each entry's access
# time (jax._src.lru_cache `_evict_if_needed`), so writing every program made writes quadratic in
# the suite's ~5,600 programs (a cold full suite took 50 min instead of ~17).

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# Python's cyclic GC: with torch, transformers, TRL and JAX loaded, each older-generation pass walks
# millions of objects, and tracing allocates enough to trigger passes constantly (perf: ~25% of a
# tiny trainer test in `gc_collect_main`). Rarer young passes, and the imported modules frozen out
# of the walk once collection is done, cut ~12% of the tests' time.
gc.set_threshold(50_000, 20, 100)


def pytest_collection_finish(session):
    gc.collect()
    gc.freeze()


TRAINER_TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "trainers")


def pytest_collection_modifyitems(config, items):
    """The trainers' end-to-end runs (everything under tests/trainers/) count as slow, as do the
    tests marked so elsewhere: the fast tier (`-m "not slow"`) is the models, losses, core, data,
    generation and configuration checks. Slow tests run first (otherwise in collection order):
    under xdist the long end-to-end runs start early instead of leaving one worker busy with them
    after the other has finished."""
    for item in items:
        if str(item.path).startswith(TRAINER_TESTS + os.sep):
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(autouse=True)
def _empty_working_directory(tmp_path_factory, monkeypatch):
    """Every test runs in a new empty working directory (CLI subprocesses inherit it). Tests then
    never depend on where pytest was started: the embedded jobs' default `outputs/<algo>` (or
    HF's `trainer_output`) never meets a run the README's commands left in the checkout, where
    the run-directory check would refuse it, and no test writes into the checkout."""
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))

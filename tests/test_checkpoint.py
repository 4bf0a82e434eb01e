"""Checkpointer: sharded round trip, keep-N, mismatch errors, torn saves, SIGTERM flag."""

import os
import signal

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl.checkpoint import (
    CheckpointCorruptError,
    Checkpointer,
    CheckpointMismatchError,
    install_sigterm_handler,
)


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((4, 2), ("data", "fsdp"))


def _state(mesh, scale=1.0):
    w_sharding = NamedSharding(mesh, P("data", "fsdp"))
    return {
        "params": {
            "w": jax.device_put(scale * jnp.arange(64.0).reshape(8, 8), w_sharding),
            "b": jax.device_put(scale * jnp.ones(4), NamedSharding(mesh, P())),
        },
        "step": jnp.array(int(scale), jnp.int32),
    }


def _abstract(mesh, w_shape=(8, 8)):
    replicated = NamedSharding(mesh, P())
    return {
        "params": {
            "w": jax.ShapeDtypeStruct(
                w_shape, jnp.float32, sharding=NamedSharding(mesh, P(None, "data"))
            ),
            "b": jax.ShapeDtypeStruct((4,), jnp.float32, sharding=replicated),
        },
        "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated),
    }


def test_round_trip_restores_into_target_sharding(tmp_path, mesh):
    saver = Checkpointer(tmp_path / "ckpt")
    saver.save(3, _state(mesh, 3.0), {"trainer_state": {"global_step": 3}, "data_position": 24})
    saver.wait_until_finished()
    saver.close()

    # A fresh Checkpointer, as after a restart; restore into a different sharding than saved.
    loader = Checkpointer(tmp_path / "ckpt")
    abstract = _abstract(mesh)
    state, metadata = loader.restore(abstract_state=abstract)
    loader.close()

    assert metadata == {"trainer_state": {"global_step": 3}, "data_position": 24}
    np.testing.assert_array_equal(state["params"]["w"], 3.0 * np.arange(64.0).reshape(8, 8))
    np.testing.assert_array_equal(state["params"]["b"], 3.0 * np.ones(4))
    assert int(state["step"]) == 3
    for restored, target in zip(jax.tree.leaves(state), jax.tree.leaves(abstract), strict=True):
        assert restored.sharding == target.sharding


def test_keeps_newest_n_and_restores_by_step(tmp_path, mesh):
    ckpt = Checkpointer(tmp_path, save_total_limit=2)
    for step in (1, 2, 3):
        ckpt.save(step, _state(mesh, float(step)), {"step": step})
    ckpt.wait_until_finished()
    assert ckpt.all_steps() == [2, 3] and ckpt.latest_step() == 3
    state, metadata = ckpt.restore(2, abstract_state=_abstract(mesh))
    assert metadata == {"step": 2} and float(state["params"]["b"][0]) == 2.0
    with pytest.raises(FileNotFoundError, match=r"No checkpoint for step 1 .*available: \[2, 3\]"):
        ckpt.restore(1, abstract_state=_abstract(mesh))
    ckpt.close()


def test_leftover_tmp_dir_from_interrupted_save_is_ignored(tmp_path, mesh):
    ckpt = Checkpointer(tmp_path)
    ckpt.save(2, _state(mesh, 2.0), {"step": 2})
    ckpt.wait_until_finished()
    ckpt.close()
    # What a save killed mid-write leaves behind: an uncommitted temporary step directory.
    torn = tmp_path / "checkpoint-5.orbax-checkpoint-tmp-1234567"
    (torn / "state").mkdir(parents=True)
    (torn / "state" / "garbage").write_bytes(b"\x00partial")

    ckpt = Checkpointer(tmp_path)
    assert ckpt.latest_step() == 2 and ckpt.all_steps() == [2]
    _, metadata = ckpt.restore(abstract_state=_abstract(mesh))
    assert metadata == {"step": 2}
    ckpt.close()


def test_mismatch_names_key_and_both_shapes(tmp_path, mesh):
    ckpt = Checkpointer(tmp_path, async_save=False)
    ckpt.save(1, _state(mesh), {})
    with pytest.raises(CheckpointMismatchError, match=r"'params/w' has shape \(8, 8\).*\(8, 16\)"):
        ckpt.restore(abstract_state=_abstract(mesh, w_shape=(8, 16)))
    extra = _abstract(mesh)
    extra["params"]["c"] = extra["params"]["b"]
    with pytest.raises(CheckpointMismatchError, match=r"'params/c' \(shape \(4,\)\) is missing"):
        ckpt.restore(abstract_state=extra)
    fewer = _abstract(mesh)
    del fewer["step"]
    with pytest.raises(CheckpointMismatchError, match=r"'step' .* not in the target state"):
        ckpt.restore(abstract_state=fewer)
    ckpt.close()


def test_restore_without_checkpoints_is_clear(tmp_path, mesh):
    ckpt = Checkpointer(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="No checkpoint found"):
        ckpt.restore(abstract_state=_abstract(mesh))
    ckpt.close()


def test_sigterm_sets_flag_instead_of_exiting():
    previous = signal.getsignal(signal.SIGTERM)
    flag = install_sigterm_handler()
    try:
        assert flag.received is False
        os.kill(os.getpid(), signal.SIGTERM)
        assert flag.received is True
    finally:
        flag.uninstall()
    assert signal.getsignal(signal.SIGTERM) == previous


def test_saving_an_existing_step_keeps_the_committed_one(tmp_path, mesh):
    ckpt = Checkpointer(tmp_path, async_save=False)
    ckpt.save(4, _state(mesh, 4.0), {"first": True})
    ckpt.save(4, _state(mesh, 9.0), {"first": False})
    state, metadata = ckpt.restore(4, abstract_state=_abstract(mesh))
    assert metadata == {"first": True} and float(state["params"]["b"][0]) == 4.0
    ckpt.close()


def test_leaves_without_sharding_restore_as_host_arrays(tmp_path, mesh):
    ckpt = Checkpointer(tmp_path, async_save=False)
    ckpt.save(1, {"state": _state(mesh), "host": {"ema": np.arange(3, dtype=np.float32)}}, {})
    abstract = {"state": _abstract(mesh), "host": {"ema": jax.ShapeDtypeStruct((3,), np.float32)}}
    tree, _ = ckpt.restore(1, abstract)
    assert isinstance(tree["host"]["ema"], np.ndarray)
    np.testing.assert_array_equal(tree["host"]["ema"], [0.0, 1.0, 2.0])
    ckpt.close()


def _array_files(step_dir):
    # OCDBT data files (small arrays are stored inline in the B-tree nodes, also under `d/`).
    return [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]


DAMAGE = {
    "missing metadata": lambda d: (d / "metadata" / "metadata").unlink(),
    "truncated metadata JSON": lambda d: (d / "metadata" / "metadata").write_text('{"ste'),
    "missing state metadata": lambda d: (d / "state" / "_METADATA").unlink(),
    "truncated array files": lambda d: [os.truncate(p, 100) for p in _array_files(d)],
    "missing array files": lambda d: [p.unlink() for p in _array_files(d)],
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_newest_checkpoint_falls_back_to_intact_one(tmp_path, mesh, damage, caplog):
    ckpt = Checkpointer(tmp_path, async_save=False)
    for step in (1, 2):
        ckpt.save(step, _state(mesh, float(step)), {"step": step})
    ckpt.close()
    DAMAGE[damage](tmp_path / "checkpoint-2")

    ckpt = Checkpointer(tmp_path, async_save=False)
    with caplog.at_level("WARNING", logger="jaxrl.checkpoint"):
        state, metadata = ckpt.restore(abstract_state=_abstract(mesh))
    assert metadata == {"step": 1} and float(state["params"]["b"][0]) == 1.0
    assert f"{tmp_path / 'checkpoint-2'} is damaged" in caplog.text
    # The damaged step is moved aside (not deleted), so the resumed run can save step 2 again.
    assert ckpt.all_steps() == [1]
    assert [p.name.split("-")[:2] for p in tmp_path.glob("damaged-*")] == [["damaged", "2"]]
    ckpt.save(2, _state(mesh, 5.0), {"step": 2, "again": True})
    assert ckpt.restore(abstract_state=_abstract(mesh))[1] == {"step": 2, "again": True}
    ckpt.close()


def test_fall_back_from_an_explicit_newest_step(tmp_path, mesh):
    ckpt = Checkpointer(tmp_path, async_save=False)
    for step in (1, 2, 3):
        ckpt.save(step, _state(mesh, float(step)), {"step": step})
    DAMAGE["truncated array files"](tmp_path / "checkpoint-3")
    with pytest.raises(CheckpointCorruptError, match=r"/checkpoint-3 is damaged"):
        ckpt.restore(3, abstract_state=_abstract(mesh))  # an explicit step never falls back
    assert ckpt.restore(3, abstract_state=_abstract(mesh), fall_back=True)[1] == {"step": 2}
    ckpt.close()


def test_no_intact_checkpoint_names_the_directory(tmp_path, mesh):
    ckpt = Checkpointer(tmp_path, async_save=False)
    for step in (1, 2):
        ckpt.save(step, _state(mesh, float(step)), {"step": step})
    ckpt.close()
    for step in (1, 2):
        DAMAGE["truncated metadata JSON"](tmp_path / f"checkpoint-{step}")
    ckpt = Checkpointer(tmp_path, async_save=False)
    with pytest.raises(CheckpointCorruptError, match=f"No intact checkpoint in {tmp_path}"):
        ckpt.restore(abstract_state=_abstract(mesh))
    ckpt.close()


def test_resave_of_a_step_whose_save_was_interrupted(tmp_path, mesh):
    ckpt = Checkpointer(tmp_path, async_save=False)
    ckpt.save(1, _state(mesh, 1.0), {"step": 1})
    ckpt.close()
    torn = tmp_path / "checkpoint-2.orbax-checkpoint-tmp-99"
    (torn / "state").mkdir(parents=True)
    (torn / "state" / "garbage").write_bytes(b"\x00partial")
    ckpt = Checkpointer(tmp_path, async_save=False)
    ckpt.save(2, _state(mesh, 2.0), {"step": 2})
    assert ckpt.restore(abstract_state=_abstract(mesh))[1] == {"step": 2}
    ckpt.close()


def test_step_directories_are_named_like_hf(tmp_path, mesh):
    ckpt = Checkpointer(tmp_path, async_save=False)
    ckpt.save(8, _state(mesh, 8.0), {"step": 8})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-8"]
    assert ckpt.step_dir(8) == tmp_path / "checkpoint-8"
    (tmp_path / "checkpoint-x").mkdir()  # not a step: ignored, never restored
    assert ckpt.all_steps() == [8] and ckpt.metadata(8) == {"step": 8}
    ckpt.close()


def test_rotation_spares_the_protected_best_step_as_hf(tmp_path, mesh):
    ckpt = Checkpointer(tmp_path, save_total_limit=2, async_save=False)
    ckpt.protected_step = 1
    for step in (1, 2, 3, 4):
        ckpt.save(step, _state(mesh, float(step)), {"step": step})
    ckpt.wait_until_finished()
    # HF's rotate_checkpoints: the best (1) and the newest (4) stay, the oldest others go.
    assert ckpt.all_steps() == [1, 4]
    ckpt.protected_step = None
    ckpt.save(5, _state(mesh, 5.0), {"step": 5})
    ckpt.wait_until_finished()
    assert ckpt.all_steps() == [4, 5]
    ckpt.keep_only(4)
    assert ckpt.all_steps() == [4] and [p.name for p in tmp_path.iterdir()] == ["checkpoint-4"]
    ckpt.close()


def test_small_replicated_arrays_are_written_whole_large_ones_split(tmp_path, monkeypatch):
    """Orbax's replica-parallel save slices each replicated array per replica (an eager device op,
    compiled per shape: seconds for a whole state's small leaves). Under
    `MIN_REPLICA_SLICE_BYTES` per replica an array is written whole; above it, still split."""
    from jaxrl.checkpoint import MIN_REPLICA_SLICE_BYTES

    sliced = []
    slice_in_dim = jax.lax.slice_in_dim

    def spy(x, *args, **kwargs):
        sliced.append(x.shape)
        return slice_in_dim(x, *args, **kwargs)

    monkeypatch.setattr(jax.lax, "slice_in_dim", spy)
    replicated = NamedSharding(jax.make_mesh((8,), ("data",)), P())
    large = 8 * MIN_REPLICA_SLICE_BYTES // 4 + 64  # f32 elements: each replica's slice is larger
    state = {
        # Dimensions divisible by the 8 replicas: orbax would split these.
        "small": jax.device_put(jnp.arange(16.0 * 8).reshape(16, 8), replicated),
        "bias": jax.device_put(jnp.ones(24), replicated),
        "large": jax.device_put(jnp.arange(large, dtype=jnp.float32), replicated),
    }
    saver = Checkpointer(tmp_path / "ckpt")
    saver.save(1, state, {})
    saver.wait_until_finished()
    assert sliced and set(sliced) == {(large,)}, sliced
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )
    restored, _ = saver.restore(abstract_state=abstract)
    saver.close()
    chex.assert_trees_all_equal(restored, state, strict=True)

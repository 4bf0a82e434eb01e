"""Mesh construction, logical-axis rules, param and batch shardings on 8 fake CPU devices."""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxrl.parallel import (
    DEFAULT_RULES,
    MESH_AXES,
    data_parallel_size,
    logical_to_spec,
    make_mesh,
    merge_rules,
    param_shardings,
    shard_batch,
)


def test_make_mesh_sizes_and_errors():
    assert dict(make_mesh().shape) == {"data": 1, "fsdp": 8, "tensor": 1}
    assert dict(make_mesh(data=2, fsdp=-1, tensor=2).shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert dict(make_mesh(data=-1, fsdp=1, tensor=4).shape) == {"data": 2, "fsdp": 1, "tensor": 4}
    assert make_mesh(1, 1, 1, devices=jax.devices()[:1]).size == 1
    with pytest.raises(ValueError, match="2\\*2\\*1 = 4 but there are 8 devices"):
        make_mesh(2, 2, 1)
    with pytest.raises(ValueError, match="at most one"):
        make_mesh(-1, -1, 1)
    with pytest.raises(ValueError, match="not divisible"):
        make_mesh(3, -1, 1)


def test_logical_to_spec_rules_and_fallback():
    mesh = make_mesh(2, 2, 2)
    assert logical_to_spec(("embed", "mlp")) == P("fsdp", "tensor")
    assert logical_to_spec(("batch", None)) == P(("data", "fsdp"), None)
    assert logical_to_spec(("embed", "heads", "head_dim"), DEFAULT_RULES, (64, 4, 16), mesh) == P(
        "fsdp", "tensor", None
    )
    # 3 heads do not divide over tensor=2: that dim is replicated instead of failing.
    assert logical_to_spec(("embed", "heads"), DEFAULT_RULES, (64, 3), mesh) == P("fsdp", None)
    # A mesh axis is used once per spec.
    rules = merge_rules([["mlp", "fsdp"]])
    assert logical_to_spec(("embed", "mlp"), rules) == P("fsdp", None)
    # A partial rules list (as in a YAML config) keeps the defaults for the other names.
    assert logical_to_spec(("embed", "vocab"), [("embed", None)]) == P(None, "tensor")
    assert dict(rules)["mlp"] == "fsdp" and dict(rules)["heads"] == "tensor"
    assert dict(merge_rules([["embed", ["fsdp", "data"]]]))["embed"] == ("fsdp", "data")


def test_param_shardings_follow_metadata():
    mesh = make_mesh(1, 4, 2)

    class Tiny(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(
                np.zeros((8, 6)), out_sharding=("embed", "mlp"), eager_sharding=False
            )
            self.b = nnx.Param(np.zeros((6,)))

    shardings = param_shardings(nnx.state(Tiny()), mesh)
    assert shardings["w"].spec == P("fsdp", "tensor")
    assert shardings["b"].spec == P(None)


def test_shard_batch_splits_batch_dim():
    mesh = make_mesh(2, 2, 2)
    batch = {"input_ids": np.arange(8 * 5).reshape(8, 5), "mask": np.ones((8, 5), np.int32)}
    out = shard_batch(batch, mesh)
    assert data_parallel_size(mesh) == 4
    assert out["input_ids"].shape == (8, 5)
    assert out["input_ids"].sharding.spec == P(("data", "fsdp"))
    assert {s.data.shape for s in out["input_ids"].addressable_shards} == {(2, 5)}
    np.testing.assert_array_equal(np.asarray(out["input_ids"]), batch["input_ids"])
    with pytest.raises(ValueError, match="not divisible by the data-parallel size 4"):
        shard_batch({"x": np.zeros((6, 2))}, mesh)


MESHES = {
    "explicit axes (jax.make_mesh default)": lambda: jax.make_mesh((2, 2, 2), MESH_AXES),
    "fsdp only": lambda: jax.make_mesh((8,), ("fsdp",)),
    "data and tensor": lambda: jax.make_mesh((4, 2), ("data", "tensor")),
}


@pytest.mark.parametrize("make", list(MESHES.values()), ids=list(MESHES))
@pytest.mark.slow
def test_from_pretrained_accepts_any_make_mesh(make):
    from jaxrl import models
    from jaxrl.data import task

    path = task.asset_path("sft_model")
    ids = np.array([[3, 4, 5, 6, 7, 8, 9, 10]] * 8)
    want = np.asarray(models.from_pretrained(path)(ids))
    mesh = make()
    model = models.from_pretrained(path, mesh=mesh)
    np.testing.assert_allclose(np.asarray(model(ids)), want, atol=1e-5)
    embed = model.model.embed_tokens.embedding.value
    assert embed.sharding.mesh.axis_names == mesh.axis_names
    # vocab x embed is split over tensor x fsdp: never left whole on every device.
    assert embed.addressable_shards[0].data.size < embed.size


def test_mesh_with_unknown_axis_names_says_which_names_it_needs():
    from jaxrl import models
    from jaxrl.data import task

    with pytest.raises(ValueError, match=r"\['x'\].*\['data', 'fsdp', 'tensor'\]"):
        models.from_pretrained(task.asset_path("sft_model"), mesh=jax.make_mesh((8,), ("x",)))

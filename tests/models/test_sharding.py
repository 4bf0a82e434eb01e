"""Sharded loading/creation on 8 fake CPU devices: same logits on every mesh, params sharded
as the rules say, and the functional split/merge API under jit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxrl.models import from_config, from_pretrained, get_preset
from jaxrl.parallel import make_mesh
from tests.models.conftest import padded_batch


@pytest.fixture(scope="module")
def llama_dir(hf_causal):
    return hf_causal("llama").path


@pytest.fixture(scope="module")
def reference_logits(llama_dir):
    ids, right, _ = padded_batch()
    model = from_pretrained(llama_dir)
    return np.asarray(model(jnp.asarray(ids), jnp.asarray(right)))


def _jit_logits(model, ids, mask):
    graphdef, params = nnx.split(model)

    @jax.jit
    def forward(params, ids, mask):
        return nnx.merge(graphdef, params)(ids, mask)

    return np.asarray(forward(params, ids, mask))


@pytest.mark.parametrize(
    "shape,q_spec,down_spec,embed_spec",
    [
        ((1, 1, 1), P(None, None, None), P(None, None), P(None, None)),
        ((8, 1, 1), P(None, None, None), P(None, None), P(None, None)),
        ((2, 2, 2), P("fsdp", "tensor", None), P("tensor", "fsdp"), P("tensor", "fsdp")),
        ((1, 4, 2), P("fsdp", "tensor", None), P("tensor", "fsdp"), P("tensor", "fsdp")),
    ],
)
def test_same_logits_on_every_mesh(
    llama_dir, reference_logits, shape, q_spec, down_spec, embed_spec
):
    n = int(np.prod(shape))
    mesh = make_mesh(*shape, devices=jax.devices()[:n])
    model = from_pretrained(llama_dir, mesh=mesh, scan_layers=shape == (1, 4, 2))
    layer = model.model.layers if shape == (1, 4, 2) else model.model.layers[0]
    stack = (None,) if shape == (1, 4, 2) else ()
    assert layer.self_attn.q_proj.kernel[...].sharding.spec == P(*stack, *q_spec)
    assert layer.mlp.down_proj.kernel[...].sharding.spec == P(*stack, *down_spec)
    assert model.model.embed_tokens.embedding[...].sharding.spec == embed_spec
    assert model.model.embed_tokens.embedding[...].sharding.mesh.shape == mesh.shape
    ids, right, _ = padded_batch()
    # Batch of 3 is not divisible by 8 devices: inputs stay replicated, params drive the layout.
    got = _jit_logits(model, jnp.asarray(ids), jnp.asarray(right))
    np.testing.assert_allclose(got, reference_logits, atol=1e-5)


def test_from_config_is_created_sharded():
    mesh = make_mesh(1, 4, 2)
    model = from_config(get_preset("llama-tiny"), mesh=mesh, scan_layers=True)
    kernel = model.model.layers.mlp.gate_proj.kernel[...]
    assert kernel.shape == (2, 64, 128)
    assert kernel.sharding.spec == P(None, "fsdp", "tensor")
    # Each device holds only its shard.
    assert kernel.addressable_shards[0].data.shape == (2, 16, 64)
    std = float(jnp.std(kernel))
    assert 0.015 < std < 0.025  # HF-like normal(0, initializer_range=0.02) init


def test_activations_are_batch_sharded_on_the_model_mesh(llama_dir, reference_logits):
    mesh = make_mesh(2, 2, 2)
    model = from_pretrained(llama_dir, mesh=mesh)
    assert model.config.mesh == mesh
    ids, right, _ = padded_batch()
    ids4 = jnp.asarray(np.concatenate([ids, ids[:1]]))  # batch 4 divides data*fsdp = 4
    mask4 = jnp.asarray(np.concatenate([right, right[:1]]))
    graphdef, params = nnx.split(model)
    hidden = jax.jit(lambda p, i, m: nnx.merge(graphdef, p).hidden_states(i, m))(
        params, ids4, mask4
    )
    assert hidden.sharding.spec[0] == ("data", "fsdp")
    logits = _jit_logits(model, ids4, mask4)
    np.testing.assert_allclose(logits[:3], reference_logits, atol=1e-5)


def test_unrolled_from_config_is_the_scanned_model_cut_into_layers():
    """`scan_layers=False` is initialised as the scanned stack and sliced (an unrolled random init
    took XLA:GPU 200 s to compile at 24 layers): same weights, each slice sharded as its own
    layer's logical axes say."""
    mesh = make_mesh(1, 4, 2)
    scanned = nnx.to_flat_state(
        nnx.state(from_config(get_preset("llama-tiny"), seed=5, mesh=mesh, scan_layers=True))
    )
    unrolled = from_config(get_preset("llama-tiny"), seed=5, mesh=mesh, scan_layers=False)
    stacked = dict(scanned)
    flat = dict(nnx.to_flat_state(nnx.state(unrolled)))
    # Two layers; the embedding, final norm and LM head are not stacked.
    assert len(flat) == 2 * len(stacked) - 3
    for path, variable in flat.items():
        value = variable[...]
        if "layers" in path:
            i = path.index("layers") + 1
            expected = stacked[path[:i] + path[i + 1 :]][...][path[i]]
        else:
            expected = stacked[path][...]
        np.testing.assert_array_equal(value, expected)
    kernel = unrolled.model.layers[1].mlp.gate_proj.kernel[...]
    assert kernel.sharding.spec == P("fsdp", "tensor")
    assert kernel.addressable_shards[0].data.shape == (16, 64)


def test_fused_projections_on_a_tensor_mesh(hf_causal):
    """Phi-3's fused qkv_proj keeps its q/k/v axis whole (a tensor split would cut across q, k
    and v) and gate_up_proj splits its `mlp` axis; logits equal one device's on a
    2 x 2 x 2 mesh, scanned."""
    path = hf_causal("phi3").path
    ids, right, _ = padded_batch()
    want = _jit_logits(from_pretrained(path), jnp.asarray(ids), jnp.asarray(right))
    model = from_pretrained(path, mesh=make_mesh(2, 2, 2), scan_layers=True)
    layer = model.model.layers
    assert layer.self_attn.qkv_proj.kernel[...].sharding.spec == P(None, "fsdp", None, None)
    assert layer.mlp.gate_up_proj.kernel[...].sharding.spec == P(None, "fsdp", None, "tensor")
    got = _jit_logits(model, jnp.asarray(ids), jnp.asarray(right))
    np.testing.assert_allclose(got, want, atol=1e-5)

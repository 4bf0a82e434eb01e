"""Int8 reference weights and NF4 (QLoRA) bases: documented error bounds, memory vs bf16,
sharding preserved, NF4 equal to bitsandbytes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl.core.logprobs import token_logprobs
from jaxrl.core.quant import (
    NF4_LEVELS,
    NF4Array,
    QuantizedArray,
    dequantize_params,
    param_bytes,
    quantize_params,
)

D, F, V = 64, 256, 512


def tiny_params(dtype=jnp.float32):
    rng = np.random.default_rng(0)
    zero_cols = np.zeros((D, 8))
    zero_cols[:, :4] = 1.5
    tree = {
        "embed": rng.normal(0, 0.02, (V, D)),
        "mlp": {"kernel": rng.normal(0, 0.1, (D, F)), "bias": np.zeros(F)},
        "norm": {"scale": np.ones(D)},
        "unembed": rng.normal(0, 0.1, (D, V)),
        "zero_cols": zero_cols,
    }
    return {**jax.tree.map(lambda x: jnp.asarray(x, dtype), tree), "step": jnp.array(3, jnp.int32)}


def test_elementwise_error_within_half_step_of_channel_absmax():
    params = tiny_params()
    q = quantize_params(params)
    deq = dequantize_params(q)
    assert (
        isinstance(q["mlp"]["kernel"], QuantizedArray)
        and q["mlp"]["kernel"].values.dtype == jnp.int8
    )
    assert q["mlp"]["kernel"].scale.shape == (1, F)
    assert q["norm"]["scale"] is params["norm"]["scale"] and q["step"] is params["step"]
    for name in ("embed", "unembed", "zero_cols"):
        w = np.asarray(params[name])
        absmax = np.abs(w).max(axis=0, keepdims=True)
        # Documented bound: |w - deq(q(w))| <= absmax / 254 per output channel.
        assert np.all(np.abs(w - np.asarray(deq[name])) <= absmax / 254 * (1 + 1e-6) + 1e-12)
    np.testing.assert_array_equal(deq["zero_cols"], params["zero_cols"])
    w = np.asarray(params["unembed"])
    assert np.abs(w - deq["unembed"]).max() / np.abs(w).max() < 1 / 200


def test_reference_logprob_error_is_bounded():
    params = tiny_params()
    deq = dequantize_params(quantize_params(params))
    rng = np.random.default_rng(1)
    hidden = jnp.asarray(rng.normal(size=(2, 16, D)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, V, (2, 16)))
    exact = token_logprobs(hidden, params["unembed"], targets, chunk_size=8)
    approx = token_logprobs(hidden, deq["unembed"], targets, chunk_size=8)
    # |d logit_v| <= sum_d |h_d| * absmax_v / 254, and |d logp| <= 2 * max_v |d logit_v|.
    absmax_V = np.abs(np.asarray(params["unembed"])).max(axis=0)
    bound_BT = 2 * np.abs(np.asarray(hidden)).sum(-1) * absmax_V.max() / 254
    err_BT = np.abs(np.asarray(exact - approx))
    assert np.all(err_BT <= bound_BT)
    assert err_BT.max() < 0.05


def test_int8_bytes_at_most_055_of_bf16():
    params16 = tiny_params(jnp.bfloat16)
    q = quantize_params(params16)
    assert param_bytes(q) <= 0.55 * param_bytes(params16)
    assert param_bytes(params16) == 2 * (V * D + D * F + F + D + D * V + D * 8) + 4
    deq = jax.jit(lambda t: dequantize_params(t, jnp.bfloat16))(q)
    assert deq["unembed"].dtype == jnp.bfloat16
    assert dequantize_params(quantize_params(tiny_params()))["unembed"].dtype == jnp.float32


def test_stacked_layers_keep_per_layer_scales():
    scales = np.array([0.01, 1.0, 100.0])[:, None, None]
    w = jnp.asarray(np.random.default_rng(3).normal(size=(3, D, F)) * scales, jnp.float32)
    q = quantize_params(
        {"layers": w}, channel_axes=lambda path, shape: (0, -1) if len(shape) == 3 else (-1,)
    )
    assert q["layers"].scale.shape == (3, 1, F)
    rel = jnp.abs(dequantize_params(q)["layers"] - w).max(axis=(1, 2)) / jnp.abs(w).max(axis=(1, 2))
    assert bool(jnp.all(rel <= 1 / 254 + 1e-6))


def test_sharding_preserved_on_8_devices():
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("fsdp", "tensor"))
    params = {"unembed": tiny_params()["unembed"], "embed": tiny_params()["embed"]}
    specs = {"unembed": PartitionSpec("fsdp", "tensor"), "embed": PartitionSpec("tensor", "fsdp")}
    sharded = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
    q = quantize_params(sharded)
    assert q["unembed"].values.sharding == sharded["unembed"].sharding
    assert q["unembed"].scale.sharding.spec == PartitionSpec(None, "tensor")
    assert q["embed"].scale.sharding.spec == PartitionSpec(None, "fsdp")
    deq = jax.jit(dequantize_params)(q)
    assert deq["unembed"].sharding.is_equivalent_to(sharded["unembed"].sharding, 2)
    np.testing.assert_array_equal(
        deq["unembed"], dequantize_params(quantize_params(params))["unembed"]
    )


def test_nnx_metadata_picks_output_channels():
    rng = np.random.default_rng(4)

    def param(shape, axes, **meta):
        value = jnp.asarray(rng.normal(size=shape), jnp.bfloat16)
        return nnx.Param(value, out_sharding=axes, eager_sharding=False, **meta)

    state = nnx.State(
        {
            "q_proj": param((2, 64, 4, 16), ("layers", "embed", "heads", "head_dim"), n_in=1),
            "o_proj": param((2, 4, 16, 64), ("layers", "heads", "head_dim", "embed"), n_in=2),
            "embed": param((V, D), ("vocab", "embed")),
            "lm_head": param((D, V), ("embed", "vocab"), n_in=1),
            "norm": param((2, D), ("layers", "norm")),
        }
    )
    q = quantize_params(state)
    scale_shapes = {k: v.get_value().scale.shape for k, v in q.items() if k != "norm"}
    assert scale_shapes == {
        "q_proj": (2, 1, 4, 16),
        "o_proj": (2, 1, 1, 64),
        "embed": (V, 1),
        "lm_head": (1, V),
    }
    assert q["q_proj"].get_metadata()["out_sharding"] == ("layers", "embed", "heads", "head_dim")
    assert q["norm"].get_value().dtype == jnp.bfloat16  # a stacked 1-D param is not an int8 target
    deq = dequantize_params(q)
    assert isinstance(deq, nnx.State) and deq["o_proj"].get_value().dtype == jnp.bfloat16
    w = np.asarray(state["o_proj"].get_value(), np.float32)
    err = np.abs(w - np.asarray(deq["o_proj"].get_value(), np.float32))
    # bound on int8 rounding plus the final bf16 rounding of the dequantized value
    assert np.all(err <= np.abs(w).max(axis=(1, 2), keepdims=True) / 254 + np.abs(w) / 128)


# ---------------------------------------------------------------- NF4 (QLoRA base)

# bitsandbytes' NF4 table (functional.get_4bit_type("nf4"); QLoRA paper, Appendix E), copied here
# by hand so a change to jaxrl's table cannot go unnoticed.
BNB_NF4 = [
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
]  # fmt: skip


def test_nf4_levels_are_the_bitsandbytes_table():
    assert list(NF4_LEVELS) == BNB_NF4


def test_nf4_picks_the_nearest_level_of_each_block():
    rng = np.random.default_rng(5)
    # fan-in 96: one full block and one zero-padded block per output channel; stacked layers
    w = jnp.asarray(rng.normal(0, 0.05, (2, 96, 3)), jnp.float32)
    q = quantize_params({"w": w}, channel_axes=(0, 2), scheme="nf4")["w"]
    assert isinstance(q, NF4Array) and q.values.dtype == jnp.uint8
    assert q.values.shape == (2, 2, 32, 3) and q.scale.shape == (2, 2, 1, 3)
    deq = np.asarray(q.dequantize())
    assert deq.shape == w.shape
    w_np = np.asarray(w)
    for start, stop in ((0, 64), (64, 96)):
        block = w_np[:, start:stop]
        absmax = np.abs(block).max(axis=1, keepdims=True)
        normed = block / absmax
        nearest = np.asarray(BNB_NF4)[np.abs(normed[..., None] - np.asarray(BNB_NF4)).argmin(-1)]
        np.testing.assert_allclose(deq[:, start:stop], nearest * absmax, rtol=1e-6)


def test_nf4_matches_bitsandbytes():
    bnb = pytest.importorskip("bitsandbytes.functional")
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(6)
    w_oi = rng.normal(0, 0.02, (8, 128)).astype(np.float32)  # torch layout [out, in]
    packed, state = bnb.quantize_4bit(torch.from_numpy(w_oi), blocksize=64, quant_type="nf4")
    ours = quantize_params({"k": jnp.asarray(w_oi.T)}, channel_axes=(1,), scheme="nf4")["k"]
    assert param_bytes(ours) / (w_oi.size * 2) == 4.5 / 16  # 4 bits + an f32 absmax per 64
    # ours [in/64, 32, out] -> bitsandbytes' flat [out, in] order, two elements per byte
    ours_bytes = np.asarray(ours.values).transpose(2, 0, 1).reshape(-1)
    np.testing.assert_array_equal(ours_bytes, packed.numpy().reshape(-1))
    np.testing.assert_array_equal(
        np.asarray(ours.scale).transpose(2, 0, 1).reshape(-1), state.absmax.numpy()
    )
    np.testing.assert_array_equal(
        np.asarray(ours.dequantize()).T, bnb.dequantize_4bit(packed, state).numpy()
    )


def test_nf4_sharding_follows_the_kernel():
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("fsdp", "tensor"))
    w = jnp.asarray(np.random.default_rng(7).normal(size=(512, 16)), jnp.bfloat16)
    sharded = jax.device_put(w, NamedSharding(mesh, PartitionSpec("fsdp", "tensor")))
    q = quantize_params({"k": sharded}, channel_axes=(1,), scheme="nf4")["k"]
    assert q.values.sharding.spec == PartitionSpec("fsdp", None, "tensor")
    assert q.scale.sharding.spec == PartitionSpec("fsdp", None, "tensor")
    deq = jax.jit(lambda t: t.dequantize())(q)
    assert deq.dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        deq, quantize_params({"k": w}, channel_axes=(1,), scheme="nf4")["k"].dequantize()
    )


def test_unknown_scheme_is_rejected():
    with pytest.raises(ValueError, match="scheme"):
        quantize_params(tiny_params(), scheme="fp4")

"""Building blocks shared by the model families: params with logical axes, norms, dense,
per-layer flags, masked attention, and the (optionally scanned, rematerialised) layer stack
(key-visibility masks and default positions: `jaxrl.models.masks`; rotary embeddings:
`jaxrl.models.rope`).

Everything here holds only `nnx.Param` state; rotary tables and masks are computed on the fly.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding

from jaxrl.core import loops
from jaxrl.core.matmul import weight_grad
from jaxrl.core.quant import QuantizedArray
from jaxrl.models import dropout as model_dropout
from jaxrl.models import router_stats
from jaxrl.models.attention import AttentionMask, attend
from jaxrl.models.config import ModelConfig
from jaxrl.parallel import logical_to_spec


def param_value(variable: nnx.Variable, dtype: Any = None) -> jax.Array:
    """A parameter's array in `dtype`. An int8 `QuantizedArray` (the frozen DPO reference) is
    dequantized here, at its point of use: inside a scanned stack that is one layer at a time, so
    the full-precision copy of the whole reference never exists at once."""
    value = variable.get_value()
    if isinstance(value, QuantizedArray):
        return value.dequantize(dtype)
    return value if dtype is None else value.astype(dtype)


Initializer = Callable[[jax.Array, tuple[int, ...], Any], jax.Array]


def make_param(
    rngs: nnx.Rngs | None,
    init: Initializer,
    shape: Sequence[int],
    axes: Sequence[str | None],
    dtype: Any,
    **metadata: Any,
) -> nnx.Param:
    """An `nnx.Param` whose metadata `out_sharding` holds the logical axis name of every dim.

    `eager_sharding=False`: shardings are applied by `jaxrl.parallel` from rules, not at creation.
    """
    key = rngs.params() if rngs is not None else jax.random.key(0)
    return nnx.Param(
        init(key, tuple(shape), dtype), out_sharding=tuple(axes), eager_sharding=False, **metadata
    )


def normal_init(std: float) -> Initializer:
    return jax.nn.initializers.normal(stddev=std)


class Dense(nnx.Module):
    """y = x @ kernel (+ bias) over `n_in` trailing input dims; kernel shape = in_shape + out_shape.

    Kernels start normal(0, init_std or config.initializer_range), biases at zero (HF init).

    `n_in` is recorded on the kernel as metadata so checkpoint conversion knows the fan-in dims.
    """

    def __init__(
        self,
        in_shape: Sequence[int],
        out_shape: Sequence[int],
        in_axes: Sequence[str | None],
        out_axes: Sequence[str | None],
        config: ModelConfig,
        rngs: nnx.Rngs,
        *,
        use_bias: bool = False,
        init_std: float | None = None,
    ):
        self.n_in = len(in_shape)
        self.dtype = config.dtype
        self.kernel = make_param(
            rngs,
            normal_init(config.initializer_range if init_std is None else init_std),
            (*in_shape, *out_shape),
            (*in_axes, *out_axes),
            config.param_dtype,
            n_in=self.n_in,
        )
        self.bias = (
            make_param(rngs, jax.nn.initializers.zeros, out_shape, out_axes, config.param_dtype)
            if use_bias
            else None
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = param_value(self.kernel, self.dtype)
        n_batch = x.ndim - self.n_in
        x = x.astype(self.dtype)
        # With a bias, the product stays f32 until the bias is added, then is rounded once to the
        # compute dtype: torch's addmm (nn.Linear / Conv1D under autocast) rounds only its result.
        acc_dtype = self.dtype if self.bias is None else jnp.promote_types(self.dtype, jnp.float32)
        # As [M, in] @ [in, out] whose backward takes the cotangent in the compute dtype
        # (`matmul_2d`), as torch's addmm does under autocast.
        out_shape = kernel.shape[self.n_in :]
        y = matmul_2d(
            x.reshape(math.prod(x.shape[:n_batch]), -1),
            kernel.reshape(math.prod(kernel.shape[: self.n_in]), -1),
            acc_dtype,
        ).reshape(*x.shape[:n_batch], *out_shape)
        if self.bias is not None:
            y = (y + param_value(self.bias, self.dtype)).astype(self.dtype)
        return y


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def matmul_2d(x_MI: jax.Array, w_IO: jax.Array, out_dtype: Any) -> jax.Array:
    """`x @ w` (f32 accumulation, returned in `out_dtype`) with a hand-written backward.

    The backward casts the cotangent to the inputs' dtype before its two matmuls. With a bias the
    product leaves in f32 (torch's addmm rounds only after adding the bias), so autodiff would
    hand the backward an f32 cotangent and run both gradient GEMMs in f32 against a bf16 weight;
    torch's addmm gets a bf16 gradient and runs them in bf16 (on an H100 the f32 q/k/v weight
    gradient ran at ~140 TFLOP/s). The weight gradient comes from `weight_grad`, which on CPU
    avoids XLA:CPU's slow transposed-operand dot (~3x slower per FLOP than its fused matmuls).
    """
    return _matmul_2d_fwd(x_MI, w_IO, out_dtype)[0]


def _matmul_2d_fwd(x_MI, w_IO, out_dtype):
    return jnp.matmul(x_MI, w_IO, preferred_element_type=out_dtype), (x_MI, w_IO)


def _matmul_2d_bwd(out_dtype, res, dy_MO):
    x_MI, w_IO = res
    # The cotangent arrives in `out_dtype`; the input gradients are in the inputs' dtypes.
    dy_MO = dy_MO.astype(x_MI.dtype)
    return dy_MO @ w_IO.T, weight_grad(x_MI, dy_MO)


matmul_2d.defvjp(_matmul_2d_fwd, _matmul_2d_bwd)


class RMSNorm(nnx.Module):
    """Llama RMSNorm: statistics in f32, normalised back in x's dtype, then times the scale in
    the residual dtype (HF: `weight * x_hat.to(input_dtype)`; f32 under autocast).

    With a float `config.norm_offset`: `x_hat * (offset + weight)` in f32, rounded once to x's
    dtype (HF's GemmaRMSNorm with offset 1, the weight starting at 0; Olmo2RMSNorm with 0)."""

    def __init__(self, dim: int, eps: float, config: ModelConfig, axis_name: str = "norm"):
        self.eps = eps
        self.dtype = config.residual_dtype
        self.offset = config.norm_offset
        # The effective scale starts at 1 (HF's init): weight 1, or 1 - offset.
        init = jax.nn.initializers.constant(1.0 - (self.offset or 0.0))
        self.scale = make_param(None, init, (dim,), (axis_name,), config.param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.offset is not None:
            return rms_norm_f32(x, param_value(self.scale), self.eps, self.offset)
        return rms_norm(x, param_value(self.scale), self.eps, self.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def rms_norm(x: jax.Array, scale: jax.Array, eps: float, dtype: Any) -> jax.Array:
    """`x / rms(x) * scale` with f32 statistics (HF LlamaRMSNorm numerics): `x / rms(x)` is
    rounded to x's dtype, the scale cast to `dtype`; the result has the wider of the two.

    A hand-written backward: autodiff's version of the f32 round trip costs several extra
    passes over the activations (measured ~10% of a small model's backward on XLA:CPU).
    """
    return _rms_norm_fwd(x, scale, eps, dtype)[0]


def _rms_norm_fwd(x, scale, eps, dtype):
    x32 = x.astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    xhat = x32 * r
    # A 0-d array carries x's dtype to the backward (dtypes are not valid residuals).
    return xhat.astype(x.dtype) * scale.astype(dtype), (xhat, r, scale, jnp.zeros((), x.dtype))


def _rms_norm_bwd(eps, dtype, res, dy):
    xhat, r, scale, x_like = res
    g = dy.astype(jnp.float32) * scale.astype(jnp.float32)
    dx = r * (g - xhat * jnp.mean(g * xhat, axis=-1, keepdims=True))
    dscale = jnp.sum(dy.astype(jnp.float32) * xhat, axis=tuple(range(dy.ndim - 1)))
    return dx.astype(x_like.dtype), dscale.astype(scale.dtype)


rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def rms_norm_f32(x: jax.Array, weight: jax.Array, eps: float, offset: float) -> jax.Array:
    """`x / rms(x) * (offset + weight)`, all in f32, rounded once to x's dtype (Gemma: offset
    1; OLMo 2: 0); the backward is `rms_norm`'s with the scale `offset + weight`."""
    return _rms_norm_f32_fwd(x, weight, eps, offset)[0]


def _rms_norm_f32_fwd(x, weight, eps, offset):
    x32 = x.astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    xhat = x32 * r
    scale = offset + weight.astype(jnp.float32)
    return (xhat * scale).astype(x.dtype), (xhat, r, weight, jnp.zeros((), x.dtype))


def _rms_norm_f32_bwd(eps, offset, res, dy):
    xhat, r, weight, x_like = res
    scale = offset + weight.astype(jnp.float32)
    dx, dscale = _rms_norm_bwd(eps, None, (xhat, r, scale, x_like), dy)
    return dx, dscale.astype(weight.dtype)


rms_norm_f32.defvjp(_rms_norm_f32_fwd, _rms_norm_f32_bwd)


class LayerNorm(nnx.Module):
    """LayerNorm with bias (GPT-2): statistics in f32, output in the residual dtype (f32 under
    autocast, where torch's layer_norm sees the f32 residual stream)."""

    def __init__(self, dim: int, eps: float, config: ModelConfig):
        self.eps = eps
        self.dtype = config.residual_dtype
        self.scale = make_param(
            None, jax.nn.initializers.ones, (dim,), ("norm",), config.param_dtype
        )
        self.bias = make_param(
            None, jax.nn.initializers.zeros, (dim,), ("norm",), config.param_dtype
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        return y.astype(self.dtype) * param_value(self.scale, self.dtype) + param_value(
            self.bias, self.dtype
        )


# (key, alpha, lengths_B) of the NEFTune noise the token embeddings of forwards traced inside
# `embedding_noise` get; None outside (every forward but the policy's in a training step).
_EMBEDDING_NOISE: contextvars.ContextVar[tuple[jax.Array, float, jax.Array] | None] = (
    contextvars.ContextVar("embedding_noise", default=None)
)


@contextlib.contextmanager
def embedding_noise(key: jax.Array, alpha: float, lengths_B: jax.Array) -> Iterator[None]:
    """NEFTune (https://arxiv.org/abs/2310.05914) for model calls traced inside the block: the
    token embeddings `[B, T, D]` get `U(-m, m)` noise drawn from `key`, with
    `m = alpha / sqrt(lengths_B * D)` per row (transformers' hook uses the batch's padded
    length; `jaxrl.algos.neftune` passes TRL's). Read when the model is traced, so enter it
    inside the jitted function."""
    token = _EMBEDDING_NOISE.set((key, alpha, lengths_B))
    try:
        yield
    finally:
        _EMBEDDING_NOISE.reset(token)


class Embed(nnx.Module):
    """Token (or position) embedding table [num, D]; rows come out in the residual dtype. A token
    table (`axis="vocab"`) adds NEFTune noise inside `embedding_noise`, as transformers hooks
    the model's input embeddings only (not GPT-2's position table)."""

    def __init__(
        self,
        num: int,
        dim: int,
        axis: str,
        config: ModelConfig,
        rngs: nnx.Rngs,
        padding_idx: int | None = None,
    ):
        self.dtype = config.residual_dtype
        self.token_table = axis == "vocab"
        # torch's `nn.Embedding(padding_idx=...)`: lookups of that row pass no gradient to it.
        self.padding_idx = padding_idx
        # Gemma's sqrt(hidden) factor, applied in the parameter dtype (HF rounds it so: 55.5
        # for sqrt(3072) in bf16), before any NEFTune noise (HF hooks the module's output).
        self.multiplier = config.embed_multiplier if self.token_table else None
        self.embedding = make_param(
            rngs,
            normal_init(config.initializer_range),
            (num, dim),
            (axis, "embed"),
            config.param_dtype,
        )

    def __call__(self, ids: jax.Array) -> jax.Array:
        h = jnp.take(param_value(self.embedding), ids, axis=0)
        if self.padding_idx is not None:
            h = jnp.where((ids == self.padding_idx)[..., None], jax.lax.stop_gradient(h), h)
        if self.multiplier is not None:
            h = h * jnp.asarray(self.multiplier, jnp.float32).astype(h.dtype)
        h = h.astype(self.dtype)
        noise = _EMBEDDING_NOISE.get() if self.token_table else None
        if noise is None:
            return h
        key, alpha, lengths_B = noise
        scale_B = alpha / jnp.sqrt(lengths_B.astype(jnp.float32) * h.shape[-1])
        # Per-position draws: a row gets the same noise at any padded length (length buckets).
        u = model_dropout.position_uniform(key, h.shape, -1.0, 1.0)
        return h + (u * scale_B.reshape((-1,) + (1,) * (h.ndim - 1))).astype(h.dtype)


# Activations that are one torch kernel compute in f32 and round once to the input dtype, as
# torch's bf16 kernels do (XLA would otherwise round the bf16 sigmoid inside silu on its own).


def silu(x: jax.Array) -> jax.Array:
    return jax.nn.silu(x.astype(jnp.float32)).astype(x.dtype)


def gelu_exact(x: jax.Array) -> jax.Array:
    return jax.nn.gelu(x.astype(jnp.float32), approximate=False).astype(x.dtype)


def gelu_tanh(x: jax.Array) -> jax.Array:
    """HF `gelu_pytorch_tanh`: torch's tanh-approximate gelu kernel."""
    return jax.nn.gelu(x.astype(jnp.float32), approximate=True).astype(x.dtype)


def gelu_new(x: jax.Array) -> jax.Array:
    """HF `gelu_new` (GPT-2): the tanh approximation written as elementwise ops, each rounded to
    x's dtype as in HF's `NewGELUActivation` (jax's formula has the same op order)."""
    return jax.nn.gelu(x, approximate=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def gated(act: Callable[[jax.Array], jax.Array], gate: jax.Array, up: jax.Array) -> jax.Array:
    """`act(gate) * up` (the gated MLP's product) saving only `gate` and `up` for the backward,
    which recomputes the activation: autodiff would also keep `act(gate)` and the activation's
    own intermediates (silu: the sigmoid), 2-3 more [tokens, intermediate] arrays per layer,
    the largest activations of the model. Numerics equal autodiff's (same ops, recomputed)."""
    return act(gate) * up


def _gated_fwd(act, gate, up):
    return act(gate) * up, (gate, up)


def _gated_bwd(act, res, d_out):
    gate, up = res
    if jax.default_backend() == "gpu":
        # Both gradients in one kernel: XLA:GPU never fuses siblings whose shared operand comes
        # straight from a GEMM (custom) fusion, so it ran two, each reading `d_out` and `gate`.
        # The barrier's outputs are plain values (the three are GEMM outputs, materialised
        # anyway) and the two gradients become one multi-output fusion: 400 MB instead of 558 MB
        # per layer at the 0.5B shape. Elsewhere fusion is free to fold the producers in.
        gate, up, d_out = jax.lax.optimization_barrier((gate, up, d_out))
    a, act_vjp = jax.vjp(act, gate)
    return act_vjp(d_out * up)[0], (d_out * a).astype(up.dtype)


gated.defvjp(_gated_fwd, _gated_bwd)


# Module-level functions (not lambdas) keep graphdefs equal and hashable across model instances.
ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": silu,
    "swish": silu,
    "relu": jax.nn.relu,
    "gelu": gelu_exact,
    "gelu_new": gelu_new,
    "gelu_pytorch_tanh": gelu_tanh,
    "gelu_fast": gelu_new,
}


def activation(name: str) -> Callable[[jax.Array], jax.Array]:
    """HF `hidden_act` / `activation_function` name -> function."""
    if name not in ACTIVATIONS:
        raise ValueError(f"Activation {name!r} is not supported; use one of {sorted(ACTIVATIONS)}.")
    return ACTIVATIONS[name]


# ---------------------------------------------------------------- layer flags


class LayerFlags(NamedTuple):
    """What may differ between the layers of a stack, handed to each block: Python bools where
    every layer agrees (or the stack is unrolled), the scanned layer's traced bools otherwise.
    `sliding`: attention within `config.sliding_window`; `rope`: rotary embedding applied
    (SmolLM3's NoPE layers have none)."""

    sliding: bool | jax.Array
    rope: bool | jax.Array


def per_layer_flags(config: ModelConfig) -> list[LayerFlags]:
    rope = config.rope_layers or (True,) * config.num_layers
    return [LayerFlags(s, r) for s, r in zip(config.sliding_layers, rope, strict=True)]


def stack_flags(config: ModelConfig) -> tuple[LayerFlags, LayerFlags]:
    """(static, scanned) flags of a scanned stack: a field every layer agrees on is static (the
    scanned array is then ignored), else read from the scanned array."""
    per_layer = list(zip(*per_layer_flags(config), strict=True))
    static = LayerFlags(*(v[0] if len(set(v)) == 1 else None for v in per_layer))
    return static, LayerFlags(*(jnp.asarray(v) for v in per_layer))


def merge_flags(static: LayerFlags, scanned: LayerFlags) -> LayerFlags:
    return LayerFlags(*(x if s is None else s for s, x in zip(static, scanned, strict=True)))


def dot_product_attention(
    q_BTNH: jax.Array,
    k_BSKH: jax.Array,
    v_BSKH: jax.Array,
    mask_B1TS: jax.Array | AttentionMask | None,
    sliding: bool | jax.Array,
    config: ModelConfig,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Causal GQA attention (K/V heads are not repeated) with the kernel chosen by
    `config.attention_impl` and the backend (`jaxrl.models.attention`); `sinks`: GPT-OSS's
    per-head attention-sink logits.

    `sliding` is a Python bool (static window) or a traced bool (scanned stacks whose layers
    mix full and sliding attention): then the window is folded into the mask. q, k and v are
    cast to the compute dtype (as SDPA under autocast: rope/qk-norm may leave them f32).
    """
    q_BTNH, k_BSKH, v_BSKH = (x.astype(config.dtype) for x in (q_BTNH, k_BSKH, v_BSKH))
    window = config.sliding_window
    static_window = None
    if isinstance(sliding, bool):
        if sliding:
            static_window = window
    else:
        seq_len = q_BTNH.shape[1]
        idx = jnp.arange(seq_len)
        in_window_TS = idx[None, :] > idx[:, None] - window
        window_TS = in_window_TS | ~sliding
        limit_BT = None
        if isinstance(mask_B1TS, AttentionMask):  # a traced window is not a segment mask
            mask_B1TS, limit_BT = mask_B1TS.dense_B1TS, mask_B1TS.key_limit_BT
        mask_B1TS = window_TS[None, None] if mask_B1TS is None else mask_B1TS & window_TS
        if limit_BT is not None:
            mask_B1TS = AttentionMask(mask_B1TS, None, limit_BT)
    key = model_dropout.active_key()  # the layer's, in a training forward
    rate = config.attention_dropout
    dropout = None
    if key is not None and rate:
        dropout = (model_dropout.site_key(key, model_dropout.ATTENTION), rate)
    return attend(
        q_BTNH, k_BSKH, v_BSKH, mask_B1TS, static_window, config.attention_impl,
        mesh=config.mesh, rules=config.rules, scale=config.attention_scale,
        softcap=config.attn_logit_softcap, dropout=dropout, sinks=sinks,
    )  # fmt: skip


# ---------------------------------------------------------------- layer stack


def constrain_batch(x: jax.Array, config: ModelConfig) -> jax.Array:
    """Pin an activation's leading dim to the `batch` rule on the model's mesh (no-op without one,
    or when the batch does not divide over it)."""
    if config.mesh is None:
        return x
    axes = ("batch",) + (None,) * (x.ndim - 1)
    spec = logical_to_spec(axes, config.rules, x.shape, config.mesh)
    return jax.lax.with_sharding_constraint(x, NamedSharding(config.mesh, spec))


LAYER_INPUT = "layer_input"  # `checkpoint_name` of a rematerialised layer's input
OFFLOAD = ("device", "pinned_host")  # activation offloading: from device memory to the host


def _offloaded(save: Callable | None) -> Callable:
    """The checkpoint policy that saves what `save` saves (None: nothing), and the layer's
    input, but offloads all of it to host memory (`OFFLOAD`)."""
    by_name = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=[LAYER_INPUT],
        offload_src=OFFLOAD[0],
        offload_dst=OFFLOAD[1],
    )
    # jax exports no constructor for the "offload this" policy value; its dot-offloading policy
    # returns one for a plain matmul.
    offload = jax.checkpoint_policies.offload_dot_with_no_batch_dims(*OFFLOAD)(
        jax.lax.dot_general_p, dimension_numbers=(((1,), (0,)), ((), ()))
    )

    def policy(prim, *args, **params):
        named = by_name(prim, *args, **params)
        if isinstance(named, type(offload)):
            return named
        return offload if save is not None and save(prim, *args, **params) else False

    return policy


def remat_wrap(fn: Callable, policy: str, offload: bool = False) -> Callable:
    """Apply `jax.checkpoint` for a `remat_policy` name ("none" returns `fn` unchanged).

    `offload` (TRL's `activation_offloading`): the same recomputation, but what the policy saves
    for the backward pass, and the layer's input (`fn`'s first argument, saved by any policy),
    is kept in host memory from the forward to the backward; "none" then saves everything, as
    without a checkpoint."""
    if policy == "none" and not offload:
        return fn
    policies = {
        "none": jax.checkpoint_policies.everything_saveable,
        "full": None,
        "dots_saveable": jax.checkpoint_policies.dots_saveable,
        "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    }
    if not offload:
        return jax.checkpoint(fn, policy=policies[policy])

    def named(h, *args):
        return fn(checkpoint_name(h, LAYER_INPUT), *args)

    return jax.checkpoint(named, policy=_offloaded(policies[policy]))


def make_layers(
    make_block: Callable[[nnx.Rngs, int], nnx.Module], config: ModelConfig, rngs: nnx.Rngs
) -> nnx.Module:
    """`num_layers` blocks (`make_block(rngs, layer_index)`): an `nnx.List`, or one block with
    params stacked on a `layers` axis (every layer then has the same structure: layer 0's)."""
    if not config.scan_layers:
        return nnx.List([make_block(rngs, i) for i in range(config.num_layers)])

    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def stacked(layer_rngs: nnx.Rngs) -> nnx.Module:
        return make_block(layer_rngs, 0)

    return stacked(rngs.split(config.num_layers))


def apply_layers(
    layers: nnx.Module, h_BTD: jax.Array, context: tuple, config: ModelConfig
) -> jax.Array:
    """Run the block stack: `block(h, *context, layer_flags) -> h` for every layer.

    Scanned stacks run under `jax.lax.scan`, so compile time does not grow with depth. Each
    `LayerFlags` field is static when all layers agree, scanned otherwise. In a training
    forward (`jaxrl.models.dropout.model_dropout`) layer i runs with its own dropout key
    `layer_key(key, i)`, scanned or not.
    """

    collect = router_stats.collecting_router_stats()

    def block_fn(graphdef: nnx.GraphDef, static: LayerFlags) -> Callable:
        def fn(h, block_state, ctx, scanned, key):
            block = nnx.merge(graphdef, block_state)
            with model_dropout.model_dropout(key):  # the layer's key, or None: no dropout
                if not collect:
                    h = block(h, *ctx, merge_flags(static, scanned))
                    return constrain_batch(h, config), None
                # MoE routing statistics leave as outputs (of the scan body, of the checkpointed
                # function), never as tracers of an inner trace.
                with router_stats.layer_router_stats() as stats:
                    h = block(h, *ctx, merge_flags(static, scanned))
            return constrain_batch(h, config), (stats[0] if stats else None)

        return remat_wrap(fn, config.remat_policy, config.activation_offloading)

    forward_key = model_dropout.active_key()
    h_BTD = constrain_batch(h_BTD, config)
    if not config.scan_layers:
        for i, (block, flags) in enumerate(zip(layers, per_layer_flags(config), strict=True)):
            graphdef, block_state = nnx.split(block)
            key = None if forward_key is None else model_dropout.layer_key(forward_key, i)
            h_BTD, stats = block_fn(graphdef, flags)(
                h_BTD, block_state, context, LayerFlags(None, None), key
            )
            if stats is not None:
                router_stats.add_router_stats(stats)
        return h_BTD

    graphdef, stacked_state = nnx.split(layers)
    static, scanned = stack_flags(config)
    fn = block_fn(graphdef, static)
    keys = None
    if forward_key is not None:
        keys = jax.vmap(lambda i: model_dropout.layer_key(forward_key, i))(
            jnp.arange(config.num_layers)
        )

    def body(h, xs):
        block_state, flags, key = xs
        return fn(h, block_state, context, flags, key)

    h_BTD, stats = loops.scan(body, h_BTD, (stacked_state, scanned, keys))
    if stats is not None:
        router_stats.add_router_stats(stats)
    return h_BTD

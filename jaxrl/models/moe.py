"""Mixture-of-experts blocks (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE) and their load-balancing
statistics.

A block routes every token to its `num_experts_per_tok` best experts (softmax over the router
logits in f32, top-k, optionally renormalised) and sums the experts' gated-MLP outputs weighted
by those probabilities, as transformers' `XSparseMoeBlock`s do. Tokens are sorted by expert and
each expert's matmul runs over its own rows only (`jax.lax.ragged_dot`: grouped GEMMs on TPU and
GPU), so nothing is computed for experts a token is not routed to and no token is ever dropped:
the result equals HF's loop over experts, with no capacity factor.

Expert weights are stacked on an `experts` axis, `[E, in, out]`; checkpoints keep HF's
per-expert keys (`mlp.experts.{e}.gate_proj.weight`, Mixtral's `block_sparse_moe.experts.{e}.w1`),
split and stacked on load and save by `hf.py`. LoRA on the experts (`jaxrl.lora.LoraExperts`)
adds each expert's low-rank update inside the same grouped matmuls.

The load-balancing loss (Switch Transformer, transformers' `load_balancing_loss_func`) needs
per-layer routing statistics; forwards traced inside `collect_router_stats` hand them out
(`jaxrl.models.router_stats`, whose collector and loss are importable from here too), every
other forward computes none. Which family names its experts how is `jaxrl.models.families`'.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from jaxrl.models.config import ModelConfig
from jaxrl.models.families import FAMILIES, MoeTraits, family
from jaxrl.models.layers import Dense, activation, gated, make_param, normal_init, param_value
from jaxrl.models.router_stats import (
    collect_router_stats,
    collecting_router_stats,
    load_balancing_loss,
    record_router_stats,
)
from jaxrl.parallel import logical_to_spec

# The decoder layer's attribute holding the MoE block, where it is not "mlp".
MOE_ATTRIBUTE = {
    t: f.moe.attribute for t, f in FAMILIES.items() if f.moe and f.moe.attribute != "mlp"
}


def moe_traits(config: ModelConfig) -> MoeTraits:
    """The config's family's MoE traits (the defaults, Qwen-MoE's, for a family without)."""
    return family(config.model_type).moe or MoeTraits()


def expert_names(config: ModelConfig) -> tuple[str, str, str]:
    """Expert parameter names as HF's checkpoints spell them: (gate, up, down)."""
    return moe_traits(config).expert_names


def moe_attribute(config: ModelConfig) -> str:
    return moe_traits(config).attribute


# ---------------------------------------------------------------- modules


class Router(nnx.Module):
    """HF's `XTopKRouter` (`gate.weight [E, D]`): logits in the compute dtype (F.linear under
    autocast). A module of its own, not a `Dense`, as in transformers: bitsandbytes and
    `quantize_base` skip it; LoRA reaches it as PEFT's `target_parameters` do (`mlp.gate.weight`,
    `jaxrl.lora.LoraRouter`)."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        self.dtype = config.dtype
        self.kernel = make_param(
            rngs,
            normal_init(config.initializer_range),
            (config.hidden_size, config.num_experts),
            ("embed", None),
            config.param_dtype,
            n_in=1,
        )

    def weight(self) -> jax.Array:
        """The `[D, E]` kernel in the compute dtype (`jaxrl.lora`'s router folds its update in)."""
        return param_value(self.kernel, self.dtype)

    def __call__(self, x_MD: jax.Array) -> jax.Array:
        return jnp.matmul(
            x_MD.astype(self.dtype), self.weight(), preferred_element_type=jnp.float32
        ).astype(self.dtype)


class Experts(nnx.Module):
    """`num_experts` gated MLPs with weights stacked on the `experts` axis; the parameter names
    are HF's per-expert module names (`gate_proj`/`up_proj`/`down_proj`, Mixtral `w1`/`w3`/`w2`)."""

    def __init__(self, config: ModelConfig, intermediate_size: int, rngs: nnx.Rngs):
        e, d, f = config.num_experts, config.hidden_size, intermediate_size
        self.dtype = config.dtype
        self.mesh, self.rules = config.mesh, config.rules
        self.act = activation(config.hidden_act)
        self.names = expert_names(config)
        init = normal_init(config.initializer_range)

        def param(shape, axes):
            return make_param(rngs, init, shape, axes, config.param_dtype, n_in=1, per_expert=True)

        gate, up, down = self.names
        setattr(self, gate, param((e, d, f), ("experts", "embed", "mlp")))
        setattr(self, up, param((e, d, f), ("experts", "embed", "mlp")))
        setattr(self, down, param((e, f, d), ("experts", "mlp", "embed")))

    def weights(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        return tuple(param_value(getattr(self, n), self.dtype) for n in self.names)

    def low_rank(self) -> dict[str, tuple[jax.Array, jax.Array, float]]:
        """Per-expert low-rank updates `(A, B, scaling)` added inside the dispatch: "gate_up"
        (`A [E, D, r]`, `B [E, r, 2, F]`, gate then up) and/or "down" (`A [E, F, r]`,
        `B [E, r, D]`). No updates here; `jaxrl.lora.LoraExperts` supplies its adapters."""
        return {}

    def __call__(self, x_MD: jax.Array, experts_MK: jax.Array) -> jax.Array:
        """Each token's output from each of its K experts, `[M, K, D]` in the compute dtype.

        Under a mesh whose batch axes split the tokens, each device sorts and runs its own
        tokens (`shard_map`; the expert weights and adapters are gathered whole, as FSDP gathers
        a layer), so no device ever sorts, gathers or multiplies another device's tokens."""
        weights = self.weights()
        low_rank = self.low_rank()
        factors = {k: (a, b) for k, (a, b, _) in low_rank.items()}
        scalings = {k: s for k, (_, _, s) in low_rank.items()}
        dispatch = functools.partial(_dispatch, self.act, self.dtype, scalings)
        return per_device_tokens(
            dispatch, self.mesh, self.rules, x_MD, experts_MK, weights, factors
        )


def per_device_tokens(dispatch, mesh, rules, x_MD, experts_MK, weights, factors) -> jax.Array:
    """`dispatch(x_MD, experts_MK, weights, factors) -> [M, K, D]` run by each device on its own
    tokens (`shard_map` over the batch axes) with the weights and adapters whole; directly when
    there is no mesh or the tokens do not split."""
    if mesh is None or mesh.size == 1:
        return dispatch(x_MD, experts_MK, weights, factors)
    (batch,) = logical_to_spec(("batch",), rules, x_MD.shape[:1], mesh)
    if batch is None:  # the tokens do not split over the batch axes
        return dispatch(x_MD, experts_MK, weights, factors)
    rows = PartitionSpec(batch, None)
    return jax.shard_map(
        dispatch,
        mesh=mesh,
        in_specs=(rows, rows, PartitionSpec(), PartitionSpec()),
        out_specs=PartitionSpec(batch, None, None),
    )(x_MD, experts_MK, weights, factors)


def _dispatch(act, dtype, scalings, x_MD, experts_MK, weights, factors) -> jax.Array:
    """`Experts.__call__` on one device's tokens: rows sorted by expert, three grouped matmuls
    (each plus its expert's low-rank update `scaling * (rows A_e) B_e`, two thin grouped
    matmuls, where `factors` has one), rows put back in token order."""
    w_gate, w_up, w_down = weights
    num_tokens, top_k = experts_MK.shape
    num_experts = w_gate.shape[0]
    flat_N = experts_MK.reshape(-1)
    order_N = jnp.argsort(flat_N, stable=True)  # rows grouped by expert, tokens in order
    group_sizes_E = jnp.bincount(flat_N, length=num_experts).astype(jnp.int32)
    x_ND = x_MD.astype(dtype)[order_N // top_k]

    def grouped(lhs, rhs):  # f32: the low-rank updates are added before the cast
        return jax.lax.ragged_dot(
            lhs, rhs.astype(dtype), group_sizes_E, preferred_element_type=jnp.float32
        )

    gate_NF, up_NF = grouped(x_ND, w_gate), grouped(x_ND, w_up)
    if "gate_up" in factors:
        a, b = factors["gate_up"]
        u_NR = grouped(x_ND, a).astype(dtype)
        gate_NF = gate_NF + scalings["gate_up"] * grouped(u_NR, b[..., 0, :])
        up_NF = up_NF + scalings["gate_up"] * grouped(u_NR, b[..., 1, :])
    h_NF = gated(act, gate_NF.astype(dtype), up_NF.astype(dtype))
    y_ND = grouped(h_NF, w_down)
    if "down" in factors:
        a, b = factors["down"]
        y_ND = y_ND + scalings["down"] * grouped(grouped(h_NF, a).astype(dtype), b)
    inverse_N = jnp.zeros_like(order_N).at[order_N].set(jnp.arange(order_N.shape[0]))
    return y_ND.astype(dtype)[inverse_N].reshape(num_tokens, top_k, -1)


class SparseMoeBlock(nnx.Module):
    """Router + experts (+ Qwen2-MoE's sigmoid-gated shared expert). `x [B, T, D] -> [B, T, D]`
    in x's dtype (HF adds the experts' outputs into `zeros_like(hidden_states)`)."""

    def __init__(
        self,
        config: ModelConfig,
        rngs: nnx.Rngs,
        shared_expert: nnx.Module | None = None,
    ):
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        # Mixtral keeps the routing weights in f32; Qwen-MoE and OLMoE cast them to the logits'.
        self.f32_weights = moe_traits(config).f32_routing_weights
        self.gate = Router(config, rngs)
        self.experts = Experts(config, config.moe_intermediate_size, rngs)
        self.shared_expert = shared_expert
        self.shared_expert_gate = (
            None
            if shared_expert is None
            else Dense((config.hidden_size,), (1,), ("embed",), (None,), config, rngs)
        )

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        b, t, d = x_BTD.shape
        x_MD = x_BTD.reshape(b * t, d)
        logits_ME = self.gate(x_MD)
        record_router_stats(logits_ME, self.top_k)
        probs_ME = jax.nn.softmax(logits_ME.astype(jnp.float32), axis=-1)
        weights_MK, experts_MK = jax.lax.top_k(probs_ME, self.top_k)
        if self.norm_topk_prob:
            weights_MK = weights_MK / jnp.sum(weights_MK, axis=-1, keepdims=True)
        if not self.f32_weights:
            weights_MK = weights_MK.astype(logits_ME.dtype)
        y_MKD = self.experts(x_MD, experts_MK)
        # Each expert's weighted output in its own dtype, summed in x's dtype (HF's index_add_).
        out_MD = jnp.sum((y_MKD * weights_MK[..., None]).astype(x_BTD.dtype), axis=1)
        if self.shared_expert is not None:
            shared_MD = self.shared_expert(x_MD)
            out_MD = out_MD + jax.nn.sigmoid(self.shared_expert_gate(x_MD)) * shared_MD
        return out_MD.reshape(b, t, d)


__all__ = [
    "Experts",
    "Router",
    "SparseMoeBlock",
    "collect_router_stats",
    "collecting_router_stats",
    "load_balancing_loss",
]

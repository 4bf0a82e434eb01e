"""Routing statistics of mixture-of-experts layers and the load-balancing loss built from them.

The load-balancing loss (Switch Transformer, transformers' `load_balancing_loss_func`) needs
per-layer routing statistics; forwards traced inside `collect_router_stats` hand them out: each
router records its layer's (`record_router_stats`), the layer stack returns them from its scan
body or checkpointed function (`layer_router_stats`, `add_router_stats`; see
`jaxrl.models.layers.apply_layers`). Every other forward computes none.

Below both `layers.py` and `moe.py`: this module builds no module and imports no model code.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax
import jax.numpy as jnp

# (token mask [B, T], per-layer statistics collected so far) while collecting; None otherwise.
_ROUTER_STATS: contextvars.ContextVar[tuple[jax.Array | None, list] | None] = (
    contextvars.ContextVar("router_stats", default=None)
)


@contextlib.contextmanager
def collect_router_stats(token_mask_BT: jax.Array | None) -> Iterator[list[jax.Array]]:
    """Collect the routing statistics of every MoE layer of the forwards traced inside the
    block: the yielded list receives one `[..., 2, E]` array per layer or scanned stack (the
    leading axes are the stack's layers): the number of top-k assignments per expert and the
    sum of router probabilities per expert, both over the tokens where `token_mask_BT` is
    nonzero (all tokens for None). `load_balancing_loss` turns them into the auxiliary loss."""
    collected: list[jax.Array] = []
    token = _ROUTER_STATS.set((token_mask_BT, collected))
    try:
        yield collected
    finally:
        _ROUTER_STATS.reset(token)


def collecting_router_stats() -> bool:
    return _ROUTER_STATS.get() is not None


@contextlib.contextmanager
def layer_router_stats() -> Iterator[list[jax.Array]]:
    """Inside `collect_router_stats`: a fresh list for one block's statistics (the layer stack
    returns them from its scan body or checkpointed function instead of leaking tracers), with
    the outer token mask."""
    outer = _ROUTER_STATS.get()
    assert outer is not None
    collected: list[jax.Array] = []
    token = _ROUTER_STATS.set((outer[0], collected))
    try:
        yield collected
    finally:
        _ROUTER_STATS.reset(token)


def add_router_stats(stats: jax.Array) -> None:
    """Hand a layer's (or a stack's stacked) statistics to the active collector."""
    active = _ROUTER_STATS.get()
    if active is not None:
        active[1].append(stats)


def record_router_stats(router_logits_ME: jax.Array, top_k: int) -> None:
    """A router's statistics of one forward (its `[M, E]` logits, top-`top_k` routing) for the
    active collector; nothing outside `collect_router_stats`."""
    active = _ROUTER_STATS.get()
    if active is None:
        return
    mask_BT, collected = active
    num_experts = router_logits_ME.shape[-1]
    # transformers' `load_balancing_loss_func`: softmax in the logits' dtype, top-k of that.
    probs_ME = jax.nn.softmax(router_logits_ME, axis=-1)
    _, chosen_MK = jax.lax.top_k(probs_ME, top_k)
    weight_M = (
        jnp.ones(probs_ME.shape[0], jnp.float32)
        if mask_BT is None
        else mask_BT.reshape(-1).astype(jnp.float32)
    )
    one_hot_MKE = jax.nn.one_hot(chosen_MK, num_experts, dtype=jnp.float32)
    counts_E = jnp.einsum("mke,m->e", one_hot_MKE, weight_M)
    prob_sum_E = jnp.einsum("me,m->e", probs_ME.astype(jnp.float32), weight_M)
    collected.append(jnp.stack([counts_E, prob_sum_E]))


def load_balancing_loss(
    stats: list[jax.Array], token_mask_BT: jax.Array | None, num_tokens: int | None = None
) -> jax.Array:
    """transformers' `load_balancing_loss_func` from `collect_router_stats`' statistics:
    `E * sum_e f_e * P_e`, with `f_e` the share of top-k assignments and `P_e` the mean router
    probability of expert `e` over every MoE layer's valid tokens. `num_tokens` (without a
    mask) is the number of tokens of one layer's forward."""
    if not stats:
        raise ValueError("No MoE layer ran inside collect_router_stats; the model has no router.")
    per_layer = jnp.concatenate([s.reshape(-1, *s.shape[-2:]) for s in stats])  # [L, 2, E]
    counts_E, prob_sum_E = jnp.sum(per_layer, axis=0)
    valid = (
        jnp.asarray(num_tokens, jnp.float32)
        if token_mask_BT is None
        else jnp.sum(token_mask_BT.astype(jnp.float32))
    )
    rows = valid * per_layer.shape[0]
    return counts_E.shape[-1] * jnp.sum((counts_E / rows) * (prob_sum_E / rows))


__all__ = [
    "add_router_stats",
    "collect_router_stats",
    "collecting_router_stats",
    "layer_router_stats",
    "load_balancing_loss",
    "record_router_stats",
]

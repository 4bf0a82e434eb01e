"""TRL's `router_aux_loss_coef`: the mixture-of-experts load-balancing loss added to a trainer's
loss (SFT, DPO, GRPO, RLOO), as TRL 1.x adds transformers' `outputs.aux_loss`.

- The coefficient is the config's, or when that is None the model config's own
  `router_aux_loss_coef` (0.0 for a config without one); a nonzero value set on a model without
  MoE layers is an error. As TRL, the model config keeps the resolved value and
  `output_router_logits` (so a saved config.json says what was trained).
- The loss of one forward is transformers' `load_balancing_loss_func` over the policy's
  training forward only (never a reference model), with padding excluded, and the `aux_loss`
  metric is its mean over micro-batches. Each micro-batch adds `coef * aux_loss` divided by
  the number of micro-batches (TRL divides by the accumulation steps), so the optimizer step
  minimises the mean task loss plus `coef` times the micro-batches' mean `aux_loss`.
- It is computed over the whole (global) micro-batch on every mesh, i.e. TRL's value on one
  process; under DDP TRL averages the per-rank values instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl.core.step import UNITS_PER_MICRO
from jaxrl.models import moe


def resolve_coef(coef: float | None, model: Any) -> float:
    """The coefficient TRL uses for `model` (0.0: no auxiliary loss), written into the model's
    HF config as TRL does."""
    config = getattr(model, "config", None)
    hf_config = getattr(config, "hf_config", None)
    is_moe = any(getattr(config, "moe_layers", ()) or ())
    if coef and not is_moe:
        raise ValueError(
            f"`router_aux_loss_coef` is set to {coef} but the model is not a Mixture-of-Experts "
            "model (no layer has a router), so there is no auxiliary loss to weight. Remove "
            "router_aux_loss_coef (or set it to None / 0.0)."
        )
    if not is_moe:
        return 0.0
    if coef is None:
        coef = float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0)
    if hf_config is not None:
        text = hf_config.get_text_config()
        text.output_router_logits = coef != 0.0
        text.router_aux_loss_coef = coef
    return float(coef)


@contextlib.contextmanager
def collect(enabled: bool, token_weights_BT: jax.Array | None) -> Iterator[list | None]:
    """Collect the routing statistics of the forwards traced inside (when `enabled`)."""
    if not enabled:
        yield None
        return
    with moe.collect_router_stats(token_weights_BT) as stats:
        yield stats


def add_to_loss(
    coef: float,
    stats: list | None,
    token_weights_BT: jax.Array,
    mb: dict,
    loss_sum: jax.Array,
    sums: dict,
    counts: dict,
) -> jax.Array:
    """`loss_sum` plus the micro-batch's weighted aux loss, in the units the step divides by
    (`UNITS_PER_MICRO`; an eval batch, which has none, uses its own `counts["loss"]`); records
    `aux_loss` (and the new `loss`) in `sums`/`counts`."""
    if not coef:
        return loss_sum
    aux = moe.load_balancing_loss(stats, token_weights_BT)
    units = mb[UNITS_PER_MICRO] if UNITS_PER_MICRO in mb else jnp.maximum(counts["loss"], 1)
    loss_sum = loss_sum + coef * aux * units
    sums["loss"] = loss_sum
    sums["aux_loss"] = aux
    counts["aux_loss"] = jnp.ones_like(aux)
    return loss_sum

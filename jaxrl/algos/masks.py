"""Traced mask builders over collated batches (`jaxrl.data.collate`'s layouts): which mask a
model is called with, the prefix-tree visibility of prefix-shared DPO rows, and token counts
weighted by the real examples of a partial batch.

The collators build numpy batches on the host; these functions read them inside the jitted
steps (they also work on numpy arrays). Nothing here collates, tokenizes or touches the host.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp


def model_masks(batch: Mapping[str, Any]) -> tuple[Any, Any]:
    """`(attention_mask, segment_ids)` to call a model with on a collated batch: both for packed
    rows, `(None, None)` for one right-padded document per row (causal attention is exact at
    every real token there; see `jaxrl.data.collate`'s module docstring). Works on numpy and
    jax arrays."""
    if "segment_ids" in batch:
        return batch["attention_mask"], batch["segment_ids"]
    return None, None


def prefix_tree_mask(branch_ids_BT):
    """[B, T, S] bool key visibility of a prefix-shared row (causality is added by the kernel):
    real keys of the query's own branch or of the shared prompt. Works on numpy and jax arrays."""
    q_BT1, k_B1S = branch_ids_BT[:, :, None], branch_ids_BT[:, None, :]
    return (k_B1S > 0) & ((k_B1S == q_BT1) | (k_B1S == 1))


def weighted_token_count(mask: jax.Array, mb: dict) -> jax.Array:
    """`sum(mask)` over the rows of real examples: rows `[B, ...]` weighted by `example_mask`
    (`[B]`, 0 for the copies filling a partial batch); the plain sum without one."""
    if "example_mask" not in mb:
        return jnp.sum(mask)
    w = mb["example_mask"]
    return jnp.sum(mask * w.reshape(w.shape + (1,) * (mask.ndim - w.ndim)))

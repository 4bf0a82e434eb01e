"""Shape checks at the pure core's entry points (losses, RL math, log-probs), with chex.

They read static shapes only, so under `jit` they run once while tracing and cost nothing per
step. A mismatch raises chex's `AssertionError` with the function and argument names added,
where jnp would broadcast silently: `[B]` advantages against `[B, 1]` log-probs give a `[B, B]`
loss, and a `[B, T]` mask against `[B, T - 1]` log-probs only fails deep inside a fused step.
`chex.disable_asserts()` turns them off, like every chex assertion.
"""

from __future__ import annotations

from collections.abc import Sequence

import chex
import numpy as np


def _named(arrays: dict) -> dict:
    return {
        k: v if hasattr(v, "shape") else np.asarray(v) for k, v in arrays.items() if v is not None
    }


def _describe(where: str, named: dict) -> str:
    return f"{where}: " + ", ".join(f"{k} {tuple(v.shape)}" for k, v in named.items())


def same_shape(where: str, *, rank: int | None = None, **arrays) -> None:
    """All of `arrays` (None ones skipped) have one shape, of `rank` dimensions if given."""
    named = _named(arrays)
    if not named:
        return
    msg = _describe(where, named) + " must have the same shape"
    if rank is not None:
        msg += f" with {rank} dimension{'s' if rank != 1 else ''}"
        chex.assert_rank(list(named.values()), rank, custom_message=msg)
    chex.assert_equal_shape(list(named.values()), custom_message=msg)


def shape_is(where: str, expected: Sequence[int | None], **arrays) -> None:
    """Each of `arrays` (None ones skipped) has shape `expected` (None: any size there)."""
    named = _named(arrays)
    if not named:
        return
    dims = ", ".join("*" if d is None else str(d) for d in expected)
    msg = _describe(where, named) + f" must have shape ({dims})"
    chex.assert_shape(list(named.values()), tuple(expected), custom_message=msg)


def shape_in(where: str, allowed: Sequence[tuple[int, ...]], **arrays) -> None:
    """Each of `arrays` (None ones skipped) has one of the `allowed` shapes."""
    named = _named(arrays)
    allowed = [tuple(s) for s in allowed]
    for name, v in named.items():
        if tuple(v.shape) not in allowed:
            raise AssertionError(
                f"[Chex-style] {where}: {name} has shape {tuple(v.shape)}; "
                f"expected one of {allowed}"
            )


def same_tree_shapes(where: str, **trees) -> None:
    """The pytrees have one structure and equal leaf shapes (dtypes may differ)."""
    names = ", ".join(trees)
    chex.assert_trees_all_equal_shapes(
        *trees.values(),
        custom_message=f"{where}: {names} must have the same structure and leaf shapes",
    )

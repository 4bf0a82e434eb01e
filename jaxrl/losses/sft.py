"""Token-weighted SFT loss and metric pieces (TRL `SFTTrainer` semantics), as sums and counts.

Everything returns `(total, count)` so that gradient accumulation and multi-device averaging
are exact: the step sums totals and counts over micro-batches and divides once, which is what
TRL does with `num_items_in_batch` (loss) and gathered sums (metrics). `mean_of` does the
final division with TRL's convention that an empty batch gives 0.
"""

import jax
import jax.numpy as jnp

from jaxrl.core.shapes import same_shape

SFT_LOSS_TYPES = ("nll", "dft")


def sft_loss_sum(
    logps_BT: jax.Array, loss_mask_BT: jax.Array, *, loss_type: str = "nll"
) -> tuple[jax.Array, jax.Array]:
    """Summed token loss and number of loss tokens (f32 scalars).

    `nll`: `-log p(target)`. `dft` (Dynamic Fine-Tuning, Wu et al. 2025, TRL `loss_type="dft"`):
    `-log p * stop_gradient(p)`. The loss is `sum / count` over all micro-batches of a step.
    """
    if loss_type not in SFT_LOSS_TYPES:
        raise ValueError(
            f"Unknown SFT loss_type {loss_type!r}; valid values are {list(SFT_LOSS_TYPES)}."
        )
    same_shape("sft_loss_sum", logps_BT=logps_BT, loss_mask_BT=loss_mask_BT)
    mask_BT = loss_mask_BT.astype(jnp.float32)
    logps_BT = logps_BT.astype(jnp.float32)
    per_token_BT = -logps_BT
    if loss_type == "dft":
        per_token_BT = per_token_BT * jax.lax.stop_gradient(jnp.exp(logps_BT))
    return jnp.sum(per_token_BT * mask_BT), jnp.sum(mask_BT)


def mean_token_accuracy(
    argmax_correct_BT: jax.Array, mask_BT: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """`(num_correct, num_tokens)` for TRL's `mean_token_accuracy` (target is the argmax)."""
    same_shape("mean_token_accuracy", argmax_correct_BT=argmax_correct_BT, mask_BT=mask_BT)
    mask_BT = mask_BT.astype(jnp.float32)
    return jnp.sum(argmax_correct_BT.astype(jnp.float32) * mask_BT), jnp.sum(mask_BT)


def entropy(entropy_BT: jax.Array, mask_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`(entropy_sum, num_tokens)` for TRL's `entropy` metric (next-token entropy in nats)."""
    same_shape("entropy", entropy_BT=entropy_BT, mask_BT=mask_BT)
    mask_BT = mask_BT.astype(jnp.float32)
    return jnp.sum(jax.lax.stop_gradient(entropy_BT).astype(jnp.float32) * mask_BT), jnp.sum(
        mask_BT
    )


def mean_of(total: jax.Array, count: jax.Array) -> jax.Array:
    """`total / count`, or 0 when `count == 0` (TRL logs 0.0 for a batch without tokens)."""
    return jnp.where(count > 0, total / jnp.maximum(count, 1), 0.0)

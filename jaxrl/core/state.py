"""TrainState: the whole mutable state of a run as one pytree.

Everything a step changes lives here so that `train_step(state, batch) -> (state, metrics)` is
pure and a checkpoint is just this pytree. Host-only state (callbacks, data position) lives in the
trainer and is saved beside it as metadata.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: optimizer updates done
    params: Any  # trainable params (nnx.State of the policy)
    opt_state: Any
    rng: jax.Array  # base key; each step uses fold_in(rng, step)
    # Frozen reference params (DPO), possibly int8-quantized; None when unused.
    ref_params: Any = None
    # Loss-specific running state (e.g. the BCO running reward mean); a dict of arrays.
    extras: Any = None
    # Dynamic fp16 loss scale: (scale, good_steps); None unless fp16 training.
    loss_scale: Any = None

    @classmethod
    def create(
        cls,
        params: Any,
        tx: optax.GradientTransformation,
        *,
        seed: int,
        ref_params: Any = None,
        extras: Any = None,
        fp16: bool = False,
    ) -> TrainState:
        # HF's GradScaler starts at 2**16 and doubles every 2000 finite steps.
        scale = (jnp.float32(2.0**16), jnp.int32(0)) if fp16 else None
        return cls(
            step=jnp.int32(0),
            params=params,
            opt_state=tx.init(params),
            rng=jax.random.key_data(jax.random.key(seed)),
            ref_params=ref_params,
            extras=extras if extras is not None else {},
            loss_scale=scale,
        )

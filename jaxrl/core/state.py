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
    # Trainable params: one model's nnx.State, or a dict of named trainable models
    # (e.g. {"policy": ..., "value": ...}); the optimizer state covers exactly these.
    params: Any
    opt_state: Any
    rng: jax.Array  # base key; each step uses fold_in(rng, step)
    # Named frozen models, never differentiated: "ref" (DPO/PPO reference, possibly int8),
    # "reward" (a reward model scoring rollouts), "base" (a LoRA base under adapters), ...
    frozen: Any = None
    # Loss-specific running state (e.g. the BCO running reward mean); a dict of arrays.
    extras: Any = None
    # Dynamic fp16 loss scale: (scale, good_steps); None unless fp16 training.
    loss_scale: Any = None

    @property
    def ref_params(self) -> Any:
        """The frozen reference model's params, or None."""
        return (self.frozen or {}).get("ref")

    def replace_frozen(self, **models: Any) -> TrainState:
        """A copy with the named frozen models replaced (others kept)."""
        return self.replace(frozen={**(self.frozen or {}), **models})

    @classmethod
    def create(
        cls,
        params: Any,
        tx: optax.GradientTransformation,
        *,
        seed: int,
        ref_params: Any = None,
        frozen: dict[str, Any] | None = None,
        extras: Any = None,
        fp16: bool = False,
    ) -> TrainState:
        # HF's GradScaler starts at 2**16 and doubles every 2000 finite steps.
        scale = (jnp.float32(2.0**16), jnp.int32(0)) if fp16 else None
        frozen = dict(frozen or {})
        if ref_params is not None:
            frozen["ref"] = ref_params
        return cls(
            step=jnp.int32(0),
            params=params,
            opt_state=tx.init(params),
            rng=jax.random.key_data(jax.random.key(seed)),
            frozen=frozen,
            extras=extras if extras is not None else {},
            loss_scale=scale,
        )

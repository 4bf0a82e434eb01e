"""SyncRefModelCallback: TR-DPO soft reference updates, run inside the jitted train step.

Every `ref_model_sync_steps` optimizer steps, `ref <- alpha * policy + (1 - alpha) * ref` with
`alpha = ref_model_mixup_alpha` (TRL `SyncRefModelCallback`). The callback class is TRL's API; the
update itself is a pure `state -> state` function (`state_update`) that the trainer compiles into
its step as a `lax.cond` on the step count, so no host code rewrites the train state between
steps and the sharded params are mixed where they live. An int8 reference is dequantized, mixed
and re-quantized inside the same branch. The math is `jaxrl.core.averaging.sync_ref_update`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from jaxrl.callbacks.base import TrainerCallback
from jaxrl.core import averaging, quant
from jaxrl.core.state import TrainState


def make_sync_ref_update(
    alpha: float, sync_steps: int, int8: bool = False
) -> Callable[[TrainState], TrainState]:
    """Pure in-step update: soft-sync `state.frozen["ref"]` after steps divisible by
    `sync_steps` (`state.step` already counts the update just applied, HF's `global_step`)."""

    def mix(state: TrainState) -> TrainState:
        ref = state.frozen["ref"]
        if int8:
            ref = quant.dequantize_params(ref, None)
        new = averaging.sync_ref_update(ref, state.params, alpha)
        return state.replace_frozen(ref=quant.quantize_params(new) if int8 else new)

    def update(state: TrainState) -> TrainState:
        due = averaging.sync_ref_should_update(state.step, sync_steps)
        return jax.lax.cond(due, mix, lambda s: s, state)

    return update


class SyncRefModelCallback(TrainerCallback):
    """TRL's reference-sync callback. Adding it to a trainer (as `sync_ref_model=True` does)
    makes the trainer compile `state_update` into its train step."""

    def state_update(self, trainer) -> Callable[[TrainState], TrainState]:
        args = trainer.args
        state = trainer.train_state
        if state is not None and state.ref_params is None:
            raise ValueError("sync_ref_model=True but the train state holds no reference params.")
        int8 = getattr(args, "ref_model_quantization", None) == "int8"
        if state is not None and not int8:
            ref_dtypes = [x.dtype for x in jax.tree.leaves(state.ref_params)]
            if ref_dtypes != [x.dtype for x in jax.tree.leaves(state.params)]:
                raise ValueError(
                    "SyncRefModelCallback mixes the policy into the reference in the params' "
                    "dtype, but the reference holds weights in another dtype (a frozen copy "
                    "built before the callback was added keeps its matmul weights in the "
                    "compute dtype, or a ref_model of another dtype). Pass it in `callbacks=` "
                    "(or set sync_ref_model=True) when creating the trainer, and give any "
                    "ref_model in the params' dtype."
                )
        return make_sync_ref_update(
            args.ref_model_mixup_alpha,
            args.ref_model_sync_steps,
            int8=int8,
        )

"""SyncRefModelCallback: TR-DPO soft reference updates as one jitted, donated `tree_map`.

Every `ref_model_sync_steps` optimizer steps, `ref <- alpha * policy + (1 - alpha) * ref` with
`alpha = ref_model_mixup_alpha` (TRL `SyncRefModelCallback`). The update runs on the sharded
params where they live (no gather to one device); an int8 reference is dequantized, mixed and
re-quantized inside the same jitted call. The math is `jaxrl.core.averaging.sync_ref_update`.
"""

from __future__ import annotations

import jax

from jaxrl.callbacks.base import TrainerCallback
from jaxrl.core import averaging, quant


class SyncRefModelCallback(TrainerCallback):
    """Soft-syncs the reference params held in the train state (TRL semantics)."""

    def __init__(self):
        self._fn = None

    def _build(self, trainer):
        alpha = trainer.args.ref_model_mixup_alpha
        int8 = trainer.args.ref_model_quantization == "int8"

        def sync(ref, policy):
            if int8:
                ref = quant.dequantize_params(ref, None)
            new = averaging.sync_ref_update(ref, policy, alpha)
            return quant.quantize_params(new) if int8 else new

        return jax.jit(sync, donate_argnums=0)

    def on_step_end(self, args, state, control, trainer=None, **kwargs):
        if trainer is None or trainer.train_state is None:
            return control
        if not averaging.sync_ref_should_update(state.global_step, args.ref_model_sync_steps):
            return control
        ts = trainer.train_state
        if ts.ref_params is None:
            raise ValueError("sync_ref_model=True but the train state holds no reference params.")
        self._fn = self._fn or self._build(trainer)
        trainer.train_state = ts.replace(ref_params=self._fn(ts.ref_params, ts.params))
        return control

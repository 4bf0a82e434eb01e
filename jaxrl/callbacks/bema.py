"""BEMACallback: bias-corrected EMA of the weights (Block & Zhang 2025), TRL's `BEMACallback`.

The buffers (`theta0`, `ema`, `bema`) live on `device`: "cpu" (default, as TRL) keeps them in
host memory so they cost no accelerator memory; "accelerator" keeps them sharded like the params
on the mesh. Updates are the pure, jitted `jaxrl.core.averaging.bema_update`; this callback only
decides when to call it, checkpoints the buffers and exports the BEMA weights to
`output_dir/bema/` as an HF directory at the end of training.
"""

from __future__ import annotations

import os

import jax
import numpy as np
from flax import nnx

from jaxrl import models
from jaxrl.callbacks.base import TrainerCallback
from jaxrl.core import averaging

_DEVICES = ("cpu", "accelerator")


class BEMACallback(TrainerCallback):
    """Arguments and defaults as TRL's `BEMACallback`."""

    def __init__(
        self,
        update_freq: int = 400,
        ema_power: float = 0.5,
        bias_power: float = 0.2,
        lag: int = 10,
        update_after: int = 0,
        multiplier: float = 1.0,
        min_ema_multiplier: float = 0.0,
        device: str = "cpu",
    ):
        if device not in _DEVICES and device not in ("cuda", "gpu", "tpu"):
            raise ValueError(f"BEMACallback device={device!r}: use 'cpu' or 'accelerator'.")
        if update_freq < 1:
            raise ValueError(f"BEMACallback update_freq must be >= 1, got {update_freq}.")
        self.hparams = dict(
            update_freq=update_freq,
            update_after=update_after,
            ema_power=ema_power,
            bias_power=bias_power,
            lag=lag,
            multiplier=multiplier,
            min_ema_multiplier=min_ema_multiplier,
        )
        self.on_host = device == "cpu"
        self.buffers: averaging.BEMAState | None = None
        self._update = jax.jit(
            lambda s, p, step: averaging.bema_update(s, p, step, **self.hparams), donate_argnums=0
        )

    def _place(self, params):
        """Policy params where the buffers live (a host copy when device='cpu')."""
        if self.on_host:
            cpu = jax.devices("cpu")[0]
            return jax.device_put(jax.device_get(params), cpu)
        return params

    def init_state(self, trainer) -> None:
        """Create the buffers from the current params (a checkpoint restore overwrites them)."""
        if self.buffers is None:
            self.buffers = jax.jit(averaging.bema_init)(self._place(trainer.train_state.params))

    def on_train_begin(self, args, state, control, trainer=None, **kwargs):
        self.init_state(trainer)
        return control

    def on_step_end(self, args, state, control, trainer=None, **kwargs):
        step = state.global_step
        if averaging.bema_should_update(
            step, self.hparams["update_freq"], self.hparams["update_after"]
        ):
            params = self._place(trainer.train_state.params)
            self.buffers = self._update(self.buffers, params, np.int32(step))
        return control

    def on_train_end(self, args, state, control, trainer=None, **kwargs):
        out = os.path.join(args.output_dir, "bema")
        model = nnx.merge(trainer.graphdef, self.buffers.bema)
        models.save_pretrained(model, out)
        if trainer.is_world_process_zero():
            trainer.processing_class.save_pretrained(out)
        return control

    # Checkpoint hooks used by the trainer: the buffers are saved with the train state.
    def state_pytree(self):
        return None if self.buffers is None else jax.device_get(self.buffers._asdict())

    def load_state_pytree(self, tree):
        placed = {k: self._place(v) for k, v in tree.items()}
        self.buffers = averaging.BEMAState(**placed)

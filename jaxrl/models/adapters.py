"""What adapted models share below the adapter layers: the variable type of `modules_to_save`
params (`SavedParam`) and the trace-time switches, LoRA dropout's key and "base without adapter".

The switches are context variables read when a model is traced, as `jaxrl.models.dropout` is for the model's own
dropout: `dropout_rng(key)` turns LoRA dropout on for forwards traced inside it, and
`disable_adapter()` makes every adapted layer run its frozen base alone (PEFT's
`disable_adapter()`: the implicit reference of a LoRA policy, with no second copy of the
weights). They live below the adapted layers (`jaxrl.lora.layers` reads them) so that the
algorithms' traced code (`jaxrl.algos`) can enter them without importing `jaxrl.lora`. Public
through `jaxrl.lora`. Holds no layers.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import jax
from flax import nnx


class SavedParam(nnx.Param):
    """A `modules_to_save` parameter: trained in full, exported with the adapter."""


_DROPOUT_KEY: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar(
    "lora_dropout_key", default=None
)
_DISABLED: contextvars.ContextVar[bool] = contextvars.ContextVar("lora_disabled", default=False)


def adapter_disabled() -> bool:
    """Whether the forward being traced runs with every adapter branch skipped."""
    return _DISABLED.get()


def adapter_dropout_key() -> jax.Array | None:
    """The LoRA dropout key of the forward being traced (None: adapters are deterministic)."""
    return _DROPOUT_KEY.get()


@contextlib.contextmanager
def dropout_rng(key: jax.Array | None) -> Iterator[None]:
    """Apply `lora_dropout` with `key` to model calls traced inside the block (training). Without
    it (or with `key=None`) adapters are deterministic, as PEFT in eval mode. Enter it inside the
    jitted function: the key is read when the model is traced."""
    token = _DROPOUT_KEY.set(key)
    try:
        yield
    finally:
        _DROPOUT_KEY.reset(token)


@contextlib.contextmanager
def disable_adapter() -> Iterator[None]:
    """Model calls traced inside the block skip every LoRA branch (PEFT's `disable_adapter()`):
    the frozen base alone, e.g. the implicit DPO reference, with no second copy of the weights.
    `modules_to_save` params keep the values they are given; for PEFT's "original module"
    semantics merge the adapter state captured before training."""
    token = _DISABLED.set(True)
    try:
        yield
    finally:
        _DISABLED.reset(token)


@contextlib.contextmanager
def adapter_off(enabled: bool = True) -> Iterator[None]:
    """`disable_adapter()` when `enabled`, else nothing (a reference that is its own model)."""
    if not enabled:
        yield
        return
    with disable_adapter():
        yield


class _WithoutAdapter:
    """Proxy returned by `without_adapter`."""

    def __init__(self, model: nnx.Module):
        self._model = model

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with disable_adapter():
            return self._model(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._model, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            with disable_adapter():
                return attr(*args, **kwargs)

        return call


def without_adapter(model: nnx.Module) -> Any:
    """`model` seen through `disable_adapter()`: each of its method calls (`hidden_states`,
    `unembed_weight`, ...) runs the frozen base alone. For code that receives a model object and
    calls it later, e.g. a reference model handed to a shared forward function."""
    return _WithoutAdapter(model)

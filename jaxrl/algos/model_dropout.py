"""Which forwards of a trainer get the model's dropout (`jaxrl.models.dropout`), from which key.

torch applies a model's dropout modules while it is in training mode. In TRL that is the
policy's forward inside the training loss: SFT always (its config has no `disable_dropout`), DPO
and reward only with `disable_dropout=False` (default True), GRPO and RLOO unless
`disable_dropout=True` (default False). Here a trainer runs its training loss inside
`training_dropout`, and its `apply_model` passes the policy it builds for those same params
through `dropping_policy`, whose forwards run inside `jaxrl.models.dropout.model_dropout`. A
reference model (other params, or the LoRA base merged directly), evaluation and prediction
steps, generation and the on-policy scoring passes (old and reference log-probs, jitted outside
the loss) never drop.

Each forward of the policy within one loss gets its own key (the micro-batch's key folded with
the stream constant, then with the call's index), so runs and resumes are reproducible: the
micro-batch key comes from `state.rng` and the step (`jaxrl.core.step`). This file holds no model
code and no loss.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any

import jax

from jaxrl.algos.forward_view import ForwardView, view_for
from jaxrl.models.dropout import model_dropout

# Folded into a micro-batch's key for the model's dropout (NEFTune and LoRA dropout use others).
DROPOUT_STREAM = 0x44524F50


def has_dropout(config: Any) -> bool:
    """Whether a `ModelConfig` has any nonzero dropout rate."""
    return any(
        getattr(config, name, 0.0)
        for name in ("attention_dropout", "residual_dropout", "embedding_dropout")
    )


@dataclasses.dataclass
class _Request:
    params: Any  # the trained params: only a policy built from this object drops
    key: jax.Array
    calls: int = 0  # forwards so far, each with its own key


_REQUEST: contextvars.ContextVar[_Request | None] = contextvars.ContextVar(
    "model_dropout_request", default=None
)


@contextlib.contextmanager
def training_dropout(params: Any, key: jax.Array) -> Iterator[None]:
    """Inside the block (a training loss being traced), policies built by `dropping_policy`
    from `params` apply their config's dropout, drawing from `key`."""
    token = _REQUEST.set(_Request(params, key))
    try:
        yield
    finally:
        _REQUEST.reset(token)


def dropping_policy(model: Any, params: Any) -> Any:
    """`model` (built from `params`), or inside `training_dropout` for these params a view of it
    whose forwards drop."""
    return view_for(model, params, _REQUEST.get(), _DroppingForward)


class _DroppingForward(ForwardView):
    """A model whose forwards run inside `model_dropout` (see `dropping_policy`)."""

    def _forward(self, method: Any, args: tuple, kwargs: dict) -> Any:
        with model_dropout(self._next_key()):
            return method(*args, **kwargs)

"""A view of a policy model whose forwards from token ids run inside a context: how NEFTune
(`neftune.py`) and model dropout (`model_dropout.py`) reach only the trained policy's forwards
in a training loss. Each forward draws its own key (the request's key folded with the call's
index), so a loss that runs the policy twice (DPO's chosen and rejected rows) gets two draws."""

from __future__ import annotations

from typing import Any

import jax

# Model methods that run a forward from token ids `(input_ids, attention_mask, positions,
# segment_ids)`; other methods (e.g. `unembed_weight`) pass through unchanged.
FORWARDS = ("hidden_states", "token_scores")


class ForwardView:
    """`model` with its forwards routed through `_forward(method, args, kwargs)`; `request`
    holds the key and the call count (`key`, `calls`)."""

    def __init__(self, model: Any, request: Any):
        self._model = model
        self._request = request

    def _next_key(self) -> jax.Array:
        r = self._request
        key = jax.random.fold_in(r.key, r.calls)
        r.calls += 1
        return key

    def _forward(self, method: Any, args: tuple, kwargs: dict) -> Any:
        raise NotImplementedError

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward(self._model, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._model, name)
        if name not in FORWARDS:
            return attr
        return lambda *args, **kwargs: self._forward(attr, args, kwargs)


def view_for(model: Any, params: Any, request: Any, cls: type[ForwardView]) -> Any:
    """`model` (built from `params`) as is, or a `cls` view of it when `request` (the active
    one, or None) was made for these very params (a reference model built from other params
    stays untouched)."""
    if request is None or request.params is not params:
        return model
    return cls(model, request)

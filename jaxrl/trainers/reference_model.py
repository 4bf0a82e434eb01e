"""What the offline preference trainers (DPO, KTO) share about their reference model on the host:
binding the train state's reference params to a graph, and the one reference pass over a dataset
behind `precompute_ref_log_probs`.

Where the reference lives in the train state is `jaxrl.algos.reference`; the passes' traced
bodies are the algorithms' (`jaxrl.algos.dpo.make_precompute_logps`, `jaxrl.algos.kto`'s). This
module only binds, batches and gathers.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxrl import parallel
from jaxrl.algos import reference


class ReferenceModelMixin:
    """The reference model of `Trainer` subclasses with a `_ref_is_base` property (a LoRA policy
    whose base is the reference) and `_ref_graphdef` (an explicit reference model's graph, or
    None: the policy's)."""

    _ref_graphdef: Any = None
    _explicit_ref: Any = None

    def _frozen_params(self, params: Any) -> dict[str, Any]:
        """The reference's entries of the train state's frozen part (`jaxrl.algos.reference`):
        none without a reference in memory; with LoRA and no reference model, the base with the
        adapter off (no second copy of the weights); else the explicit reference model's params
        or a frozen copy of the policy (`_reference_copy`)."""
        if not self.uses_ref_params:
            return {}
        if self._ref_is_base:
            return reference.lora_base_frozen(params)
        if self._explicit_ref is not None:
            self._ref_graphdef = nnx.graphdef(self._explicit_ref)
            return {reference.REF: nnx.state(self._explicit_ref)}
        self._ref_graphdef = None
        return {reference.REF: self._reference_copy(params)}

    def _reference_copy(self, params: Any) -> Any:
        """The frozen copy of the initial policy that is the reference (DPO may quantize it)."""
        return self._frozen_copy(params)

    def ref_model_apply(self, ref_params: Any):
        # int8 leaves stay quantized here: the model dequantizes each weight where it is used
        # (per layer inside a scanned stack), so no full-precision copy of the reference exists.
        graphdef = self._ref_graphdef if self._ref_graphdef is not None else self.graphdef
        return nnx.merge(graphdef, ref_params)

    def _bind_reference(self, state) -> Any:
        """The reference model of `state` (inside jit): the LoRA policy's base (traced with the
        adapter off by the algorithm's reference pass), or the reference params."""
        if self._ref_is_base:
            adapter = reference.lora_base_adapter(state.params, state.frozen)
            return nnx.merge(self.graphdef, adapter, state.frozen["base"])
        return self.ref_model_apply(state.ref_params)

    def _run_precompute(self, ds, bs: int, params: Any, fn) -> np.ndarray:
        """`fn(params, batch)` over `ds` in global batches of `bs` rows (the last one padded with
        the final row), each host collating its share; the first `len(ds)` results, float32."""
        n = len(ds)
        out = []
        per_host = bs // jax.process_count()
        for start in range(0, n, bs):
            idx = [min(start + i, n - 1) for i in range(bs)]
            lo = jax.process_index() * per_host
            seq_len = self._batch_seq_len(ds, idx, "train")
            host = self._collate([ds[i] for i in idx[lo : lo + per_host]], seq_len)
            batch = {k: v[None] for k, v in host.items()}
            dev = {k: v[0] for k, v in self._to_device(batch).items()}
            res = parallel.to_host(fn(params, dev))
            out.append(res[: min(bs, n - start)])
        return np.concatenate(out).astype(np.float32)

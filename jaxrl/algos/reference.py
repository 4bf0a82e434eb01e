"""Where a reference policy lives in a train state, and how its forward is traced.

Three layouts (`state.frozen`), shared by DPO, GRPO/RLOO and PPO:
- `"ref"`: frozen params of the reference model (a copy of the initial policy, an explicit
  reference model's, or an int8 copy), run through its own graph;
- LoRA without a reference model: the policy's frozen base with every adapter branch skipped
  (PEFT's `disable_adapter()`, no second copy of the weights). `modules_to_save` params are
  trained in full, so their initial values are kept as `"ref_saved"` (PEFT's disabled adapter
  runs the original modules);
- `"ref_adapter"`: a model that came with a trained adapter keeps a frozen copy of it (TRL's
  "ref" adapter) over the shared base.

Pure functions of pytrees; the trainers decide which layout a run uses.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.models.adapters import SavedParam

REF, REF_SAVED, REF_ADAPTER = "ref", "ref_saved", "ref_adapter"


def lora_base_frozen(adapter: Any) -> dict[str, Any]:
    """The frozen entries a LoRA reference "base without adapter" needs: a copy of the initial
    `modules_to_save` params of the trainable `adapter` state (`{}` when there are none)."""
    saved = nnx.filter_state(adapter, SavedParam)
    if not jax.tree.leaves(saved):
        return {}
    return {REF_SAVED: jax.tree.map(jnp.copy, saved)}


def lora_base_adapter(adapter: Any, frozen: dict[str, Any]) -> Any:
    """The adapter state the "base without adapter" reference runs with: the trained one, its
    `modules_to_save` params back at their initial values."""
    if REF_SAVED in frozen:
        return nnx.merge_state(adapter, frozen[REF_SAVED])
    return adapter

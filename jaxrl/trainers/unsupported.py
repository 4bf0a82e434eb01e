"""Trainer arguments of TRL's and HF's constructors that jaxrl does not take, and what to do
instead: a TRL script that passes one gets a clear error naming the feature and its status, not
Python's "unexpected keyword argument".

Used by the constructors of `Trainer` (SFT, reward, DPO, KTO), `OnPolicyTrainer` (GRPO, RLOO) and
`DistillationTrainer`. Plain data and one check; no trainer code here.
"""

from __future__ import annotations

from typing import Any

# Argument -> why jaxrl does not take it, and the fix.
TRAINER_ARGS = {
    "data_collator": (
        "jaxrl collates every batch itself into fixed-shape arrays for the jitted step (padding, "
        "packing, padding_free and length_buckets are config fields); a torch collator has no "
        "JAX meaning. Prepare the columns in the dataset, or use those config fields"
    ),
    "compute_loss_func": (
        "each algorithm's loss is its traced module (jaxrl.algos.<algo>.make_loss); subclass "
        "the trainer and return your own loss from `_loss_fn`"
    ),
    "optimizer_cls_and_kwargs": (
        "the optimizer is an optax transformation: pass optimizers=(optax_tx, schedule), or set "
        "the config's optim / learning_rate fields"
    ),
    "model_init": "pass the model itself as model= (a path or Hub id, a config, or a model)",
    "tokenizer": "pass it as processing_class= (transformers' current name)",
}


def refuse(trainer: str, unsupported: dict[str, Any]) -> None:
    """Raise a `TypeError` naming each argument in `unsupported` and what to do instead."""
    if not unsupported:
        return
    parts = []
    for name in sorted(unsupported):
        why = TRAINER_ARGS.get(name)
        if why is None:
            parts.append(f"`{name}` is not an argument of {trainer} (TRL's or jaxrl's)")
        else:
            parts.append(f"`{name}` is not supported by jaxrl's {trainer}: {why}")
    raise TypeError("; ".join(parts) + ".")

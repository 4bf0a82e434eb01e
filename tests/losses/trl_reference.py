"""Run TRL 1.16's own GRPO/RLOO loss code on given per-token log-probs (test reference).

`GRPOTrainer._compute_loss` / `RLOOTrainer._compute_loss` are called on a trainer built with
`object.__new__` plus the attributes those methods read; the model forward is replaced by a
function returning a leaf tensor, so torch autograd gives the gradient w.r.t. the log-probs.
"""

import collections
import types

import numpy as np
import torch
from trl import GRPOTrainer, RLOOTrainer


class _OneProcess:
    """The accelerator calls the loss methods make, for a single process."""

    num_processes = 1
    sync_gradients = True

    def gather(self, x):
        return x

    def gather_for_metrics(self, x):
        return x

    def reduce(self, x, reduction="sum"):
        return x

    def pad_across_processes(self, x, dim=0, pad_index=0):
        return x


def _trainer(cls, logps, entropies, **attrs):
    trainer = object.__new__(cls)
    leaf = torch.tensor(np.asarray(logps), dtype=torch.float32, requires_grad=True)
    ent = torch.tensor(np.asarray(entropies), dtype=torch.float32)
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (leaf, ent, None)
    trainer.model = types.SimpleNamespace(training=True)
    trainer.accelerator = _OneProcess()
    trainer._metrics = {"train": collections.defaultdict(list)}
    trainer.aux_loss_enabled = False
    trainer._entropy_bonus_enabled = False
    for name, value in attrs.items():
        setattr(trainer, name, value)
    return trainer, leaf


def _ids(mask):
    ids = torch.zeros(np.asarray(mask).shape, dtype=torch.long)
    return {
        "prompt_ids": torch.zeros((ids.shape[0], 1), dtype=torch.long),
        "prompt_mask": torch.ones((ids.shape[0], 1), dtype=torch.long),
        "completion_ids": ids,
        "completion_mask": torch.tensor(np.asarray(mask), dtype=torch.long),
    }


def trl_grpo_loss(
    logps,
    advantages,
    mask,
    *,
    old_logps=None,
    ref_logps=None,
    entropies=None,
    num_items_in_batch=None,
    grad_accum=1,
    loss_type="dapo",
    importance_sampling_level="token",
    beta=0.0,
    epsilon=0.2,
    epsilon_high=None,
    delta=None,
    max_completion_length=None,
    top_entropy_quantile=1.0,
    off_policy_mask_threshold=None,
    use_bias_correction_kl=True,
):
    """TRL's loss, its gradient w.r.t. `logps` and the metrics it logged (last values)."""
    mask = np.asarray(mask)
    entropies = np.zeros_like(np.asarray(logps)) if entropies is None else entropies
    args = types.SimpleNamespace(
        delta=delta,
        use_bias_correction_kl=use_bias_correction_kl,
        steps_per_generation=grad_accum,
        sapo_temperature_neg=1.05,
        sapo_temperature_pos=1.0,
        vespo_k_pos=2.0,
        vespo_lambda_pos=3.0,
        vespo_k_neg=3.0,
        vespo_lambda_neg=2.0,
    )
    trainer, leaf = _trainer(
        GRPOTrainer,
        logps,
        entropies,
        args=args,
        loss_type=loss_type,
        importance_sampling_level=importance_sampling_level,
        beta=beta,
        epsilon_low=epsilon,
        epsilon_high=epsilon if epsilon_high is None else epsilon_high,
        max_completion_length=max_completion_length,
        top_entropy_quantile=top_entropy_quantile,
        off_policy_mask_threshold=off_policy_mask_threshold,
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        current_gradient_accumulation_steps=grad_accum,
    )
    inputs = _ids(mask)
    inputs["advantages"] = torch.tensor(np.asarray(advantages), dtype=torch.float32)
    n_items = mask.sum() if num_items_in_batch is None else num_items_in_batch
    inputs["num_items_in_batch"] = torch.tensor(float(n_items))
    if old_logps is not None:
        inputs["old_per_token_logps"] = torch.tensor(np.asarray(old_logps), dtype=torch.float32)
    if ref_logps is not None:
        inputs["ref_per_token_logps"] = torch.tensor(np.asarray(ref_logps), dtype=torch.float32)
    loss = trainer._compute_loss(None, inputs)
    loss.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return float(loss.detach()), leaf.grad.numpy(), metrics


def trl_rloo_loss(
    logps, advantages, mask, old_logps, *, epsilon=0.2, epsilon_high=None, entropies=None
):
    """TRL's RLOO loss, its gradient w.r.t. `logps` and the metrics it logged."""
    entropies = np.zeros_like(np.asarray(logps)) if entropies is None else entropies
    trainer, leaf = _trainer(
        RLOOTrainer,
        logps,
        entropies,
        epsilon_low=epsilon,
        epsilon_high=epsilon if epsilon_high is None else epsilon_high,
    )
    inputs = _ids(mask)
    inputs["advantages"] = torch.tensor(np.asarray(advantages), dtype=torch.float32)
    inputs["old_logps"] = torch.tensor(np.asarray(old_logps), dtype=torch.float32)
    loss = trainer._compute_loss(None, inputs)
    loss.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return float(loss.detach()), leaf.grad.numpy(), metrics

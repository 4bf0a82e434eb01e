"""RLOOTrainer: REINFORCE leave-one-out with TRL 1.16 `RLOOTrainer` semantics.

The online shell is `OnPolicyTrainer`; this file supplies RLOO's advantages (reward minus
`beta` times the sequence-level k1 KL `sum_t log pi_old - log pi_ref`, optionally clipped to
`reward_clip_range`, minus the leave-one-out baseline, optionally normalised;
`jaxrl.losses.rloo.rloo_advantages`) and wires in its traced update, `jaxrl.algos.rloo` (a
PPO-clipped surrogate on the *sequence* log-prob ratio; with a mixture-of-experts policy
(`router_aux_loss_coef`) each micro-batch's loss adds `coef x aux_loss`, which HF's Trainer then
divides by the accumulation steps as it does RLOO's loss, see `OnPolicyTrainer`'s module doc).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.algos import rloo
from jaxrl.algos.rollout import loss_mask
from jaxrl.losses.rloo import rloo_advantages, rloo_sequence_kl
from jaxrl.rewards import group_reward_metrics
from jaxrl.trainers.onpolicy import OnPolicyTrainer
from jaxrl.trainers.rloo_config import RLOOConfig


class RLOOTrainer(OnPolicyTrainer):
    """TRL `RLOOTrainer` API: `RLOOTrainer(model, reward_funcs, args=RLOOConfig(...), ...)`."""

    config_class = RLOOConfig

    def _kl_in_reward(self) -> bool:
        return self.args.beta != 0.0

    def _needs_old_logps(self) -> bool:
        # TRL's RLOO always takes the ratio against the sampling policy's log-probs.
        return True

    def _advantages(
        self,
        rewards_NK: np.ndarray,
        rollout: dict[str, jax.Array],
        num_generations: int | None = None,
    ) -> tuple[jax.Array, dict[str, float]]:
        a = self.args
        metrics: dict[str, float] = {}
        kl_N = None
        if a.beta != 0.0:
            # Tool-result tokens (`tool_mask`) are out of the KL as out of the loss.
            kl_N, kl_aux = rloo_sequence_kl(
                rollout["old_logps"], rollout["ref_logps"], loss_mask(rollout)
            )
            metrics["kl"] = float(kl_aux["sum"]["kl"] / jnp.maximum(kl_aux["count"]["kl"], 1.0))
        advantages_N, is_std_zero_P = rloo_advantages(
            rewards_NK,
            self.reward_weights,
            num_generations=num_generations or a.num_generations,
            beta=a.beta,
            kl_N=kl_N,
            reward_clip_range=a.reward_clip_range,
            normalize_advantages=a.normalize_advantages,
        )
        metrics.update(
            group_reward_metrics(
                rewards_NK, self.reward_weights, self.reward_func_names, np.asarray(is_std_zero_P)
            )
        )
        return advantages_N, metrics

    def _loss_units(self):
        return rloo.loss_units

    def _loss_fn(self):
        return rloo.make_loss(
            self.args, self.apply_model, router_aux_loss_coef=self.router_aux_loss_coef
        )

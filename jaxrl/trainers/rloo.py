"""RLOOTrainer: REINFORCE leave-one-out with TRL 1.16 `RLOOTrainer` semantics.

The online shell is `OnPolicyTrainer`; this file supplies RLOO's advantages (reward minus
`beta` times the sequence-level k1 KL `sum_t log pi_old - log pi_ref`, optionally clipped to
`reward_clip_range`, minus the leave-one-out baseline, optionally normalised;
`jaxrl.losses.rloo.rloo_advantages`) and its loss (a PPO-clipped surrogate on the *sequence*
log-prob ratio, `rloo_loss`). With a mixture-of-experts policy (`router_aux_loss_coef`) each
micro-batch's loss adds `coef x aux_loss`, which HF's Trainer then divides by the accumulation
steps as it does RLOO's loss (see `OnPolicyTrainer`'s module doc).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.algos import router_aux
from jaxrl.losses.rloo import rloo_advantages, rloo_loss, rloo_sequence_kl
from jaxrl.rewards import group_reward_metrics
from jaxrl.trainers.onpolicy import OnPolicyTrainer, completion_logprobs, rollout_token_weights
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
            kl_N, kl_aux = rloo_sequence_kl(
                rollout["old_logps"], rollout["ref_logps"], rollout["completion_mask"]
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
        # `rloo_loss` counts sequences: the step's rows.
        return lambda batch_A: jnp.asarray(batch_A["advantages"].size, jnp.float32)

    def _loss_fn(self):
        a = self.args
        chunk = a.logprob_chunk_size
        aux_coef = self.router_aux_loss_coef

        def loss_fn(params, state, mb, rng, extras) -> tuple[jax.Array, Any]:
            model = self.apply_model(params, state)
            tokens_BT = rollout_token_weights(mb)
            # TRL: the policy's loss forward returns the MoE load-balancing loss (no other one).
            with router_aux.collect(bool(aux_coef), tokens_BT) as router_stats:
                logps_BC, stats = completion_logprobs(
                    model, mb, temperature=a.temperature, chunk_size=chunk, with_stats=True
                )
            mask_BC = mb["completion_mask"]
            # An eval batch carries none: TRL's eval takes its old log-probs from the policy being
            # evaluated, so the ratio is 1.
            old_B = jnp.sum(mb["old_logps"] * mask_BC, axis=-1) if "old_logps" in mb else None
            loss_sum, aux = rloo_loss(
                logps_BC,
                mb["advantages"],
                mask_BC,
                old_logps_B=old_B,
                epsilon=a.epsilon,
                epsilon_high=a.epsilon_high,
                entropies_BT=stats["entropy"],
            )
            # TRL adds `coef x aux_loss` to the micro-batch's sequence mean, which HF's Trainer
            # then divides by the accumulation steps (eval: by nothing).
            loss_sum = router_aux.add_to_loss(
                aux_coef, router_stats, tokens_BT, mb, loss_sum, aux["sum"], aux["count"]
            )
            return loss_sum, (aux, extras)

        return loss_fn

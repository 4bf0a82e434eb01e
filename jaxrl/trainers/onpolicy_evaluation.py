"""The online trainers' (GRPO, RLOO) `evaluate()`: TRL 1.16's evaluation of sampled eval
batches through the training loss, with greedy-decoding reward metrics and HF's speed metrics.

`OnPolicyEvaluationMixin` is one of the pieces `jaxrl.trainers.onpolicy.OnPolicyTrainer` is
composed of; it drives the trainer's own sampling, scoring and jitted eval step
(`_sample`, `_rollout_rows`, `_advantages`, `_jit_eval_step`) and holds no math of its own: no
traced code here; it does not import `jaxrl.trainers.onpolicy`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import defaultdict
from typing import Any

import jax
import numpy as np

from jaxrl.core.step import reduce_aux
from jaxrl.trainers.evaluation import hf_eval_loss, speed_metrics


class OnPolicyEvaluationMixin:
    """`OnPolicyTrainer`'s `evaluate()` and its per-batch loss `_eval_batch`."""

    # ----------------------------------------------------------------- eval
    def evaluate(self, eval_dataset: Any = None, metric_key_prefix: str = "eval") -> dict:
        """TRL 1.16's GRPO/RLOO evaluation, with HF's `eval_loss` and speed metrics.

        The eval prompts go in batches of `per_device_eval_batch_size` x data-parallel devices
        completions (`num_generations_eval` per prompt, default `num_generations`), each batch
        sampled, scored and given its advantages (groups of `num_generations_eval`) as TRL's
        `prediction_step` does, then run through the training loss: `<prefix>_loss` is HF's mean
        of the batch losses. As in TRL's eval the old log-probs are the evaluated policy's own
        (ratio 1: no clipping, no off-policy masking), the reference KL enters when `beta > 0`
        (GRPO: `beta x k3` in the loss; RLOO: in the reward, hence the advantages), and the loss
        is aggregated as `loss_type` does in training, a token-normalised type (`dapo`, `cispo`,
        `vespo`) over the eval batch's own active tokens (over several data-parallel devices the
        loss is the global batch's, which TRL's per-process losses average to, `bnpo` aside: TRL
        averages the processes' token means). HF weights each batch by the eval batch size, the
        last by `len(eval_dataset) % batch size` when non-zero (accelerate's remainder, counted
        in prompts under TRL's repeat sampler), and leaves out non-finite batch losses when some
        are finite. Besides: the reward and completion metrics of the
        sampled completions, greedy decoding (`<prefix>_greedy/...`: one completion per prompt,
        e.g. exact-match accuracy for a correctness reward; jaxrl's, not TRL's), and HF's
        `<prefix>_runtime`, `_samples_per_second`, `_steps_per_second` (samples are eval
        prompts, steps `ceil(prompts / batch size)` as HF counts them; the greedy pass is timed
        too)."""
        self._prepare_for_evaluation()
        a = self.args
        ds = (
            self.eval_dataset
            if eval_dataset is None
            else self._prepare_dataset(eval_dataset, "eval")
        )
        if ds is None:
            raise ValueError("evaluate() needs an eval_dataset.")
        G = a.num_generations_eval or a.num_generations
        batch_size = a.per_device_eval_batch_size * self.dp  # completions, as TRL's eval batch
        per_batch = max(1, batch_size // G)
        start_time = time.time()
        sampling = self.rollout_generation_config
        greedy = dataclasses.replace(sampling, do_sample=False)
        sampled: list[dict] = []
        greedy_rewards = []
        user_metrics: dict[str, list[float]] = defaultdict(list)
        batch_losses: list[float] = []
        batch_metrics: dict[str, list[float]] = defaultdict(list)
        rows = [ds[i] for i in range(len(ds))]
        policy = self.current_params()
        for b, start in enumerate(range(0, len(rows), per_batch)):
            examples = rows[start : start + per_batch]
            seed = jax.random.fold_in(jax.random.key(a.seed + 1), b)
            s = self._sample(policy, examples, G, sampling, seed)
            sampled.append(s)
            loss, values = self._eval_batch(policy, s, G)
            batch_losses.append(loss)
            values.update(self._completion_metrics(s["lengths_N"], s["truncated_N"]))
            values.update(s["tool_metrics"])  # TRL's `tools/*` of the eval batch
            for name, value in values.items():
                batch_metrics[name].append(value)
            g = self._sample(policy, examples, 1, greedy, seed)
            greedy_rewards.append(g["rewards_NK"])
            for prefix, call in (("", s), ("greedy/", g)):
                for name, value in call["user_metrics"].items():
                    user_metrics[prefix + name].append(value)
        metrics = {"loss": hf_eval_loss(batch_losses, len(rows), batch_size)}
        # TRL's `log()`: each metric's mean over the eval batches' values, NaN ones left out.
        for name, values in batch_metrics.items():
            values = [v for v in values if not math.isnan(v)]
            metrics[name] = float(np.mean(values)) if values else math.nan
        metrics["num_tokens"] = float(getattr(self, "_tokens_seen", 0))  # TRL: training's so far
        greedy_NK = np.concatenate(greedy_rewards)
        weighted = np.nansum(greedy_NK * self.reward_weights[None], axis=1)
        metrics["greedy/reward"] = float(np.mean(weighted))
        for i, name in enumerate(self.reward_func_names):
            column = greedy_NK[:, i]
            scored = column[~np.isnan(column)]
            metrics[f"greedy/rewards/{name}/mean"] = (
                float(scored.mean()) if scored.size else math.nan
            )
        for name, values in user_metrics.items():
            # TRL: each eval batch's mean, averaged over the batches (NaN ones left out).
            values = [v for v in values if not math.isnan(v)]
            metrics[name] = float(np.mean(values)) if values else math.nan
        metrics = {f"{metric_key_prefix}_{k}": v for k, v in metrics.items()}
        prep = getattr(self, "model_preparation_time", None)
        metrics.update(speed_metrics(metric_key_prefix, start_time, len(rows), batch_size, prep))
        # TRL's `log()` logs None for a metric with no non-NaN value (e.g. a reward function that
        # returned None for every eval completion); the returned metrics keep the NaN.
        self.log({k: None if math.isnan(v) else v for k, v in metrics.items()})
        self._event("on_evaluate", metrics=metrics)
        return metrics

    def _eval_batch(self, policy: Any, s: dict, group_size: int) -> tuple[float, dict]:
        """TRL's `compute_loss` on one eval batch (a `_sample` call with `group_size`
        completions per prompt): advantages of the batch alone, the evaluated policy's log-probs
        as the old ones, the training loss function forward only. Returns the batch's loss and
        its metrics: the scoring ones (`reward`, `reward_std`, `rewards/<name>/*`,
        `frac_reward_zero_std`, RLOO's `kl`) and the loss's (`entropy`, GRPO's `kl`,
        `clip_ratio/*`, ...), as TRL appends them per eval batch."""
        rollout = self._rollout_rows(s)
        if self._kl_in_reward():  # RLOO's KL reward: TRL recomputes the policy's log-probs
            rollout["old_logps"] = self._jit_logps(policy, rollout)
        if self._needs_ref():
            rollout["ref_logps"] = self._jit_ref_logps(self.train_state, rollout)
        rollout["advantages"], metrics = self._advantages(s["rewards_NK"], rollout, group_size)
        self._record_completions(s, rollout["advantages"])  # TRL's eval batches log theirs too
        # No `old_logps` (ratio 1) and no `num_items_in_batch` (the loss normalises a
        # token-normalised type by the batch's own tokens, TRL's eval normaliser).
        rollout.pop("old_logps", None)
        batch_A = jax.tree.map(lambda x: x[None], rollout)  # one micro-batch
        aux = jax.device_get(self._jit_eval_step(self.train_state, batch_A))
        # The step's reductions (`reduce_aux`); the loss over its units as `loss_type` counts
        # them (at least 1).
        values = {k: float(v) for k, v in jax.device_get(reduce_aux(aux)).items()}
        loss = values.pop("loss")
        metrics.update(values)
        return loss, metrics

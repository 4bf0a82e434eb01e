"""`PPOTrainer.train()` (jaxrl; TRL v0.7.2 has no `train()`): the common PPO loop of TRL's examples
(for each batch of prompts: generate, score, `step()`) as the iteration of the online shell
(`jaxrl.trainers.online.OnlineLoop`), and the sampling-correction stats of its rollouts: TRL's
`sampling/sampling_logp_difference/*` and `sampling/importance_sampling_ratio/*` of the
sampler's log-prob of each response token against `step()`'s rollout forward (`old_logprobs`),
over the response tokens.

`PPOTrainLoopMixin` is one of the pieces `jaxrl.trainers.ppo.PPOTrainer` is composed of (it
comes before `OnlineLoop` in the bases, whose hooks it fills); it does not import `ppo.py`.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import numpy as np

from jaxrl.trainers import ppo_generation, ppo_inputs, ppo_stats


class PPOTrainLoopMixin:
    """`train()`'s hooks of `OnlineLoop` for `PPOTrainer`: every step generates, scores, then
    runs `step()` (with the sampler's log-probs, for the `sampling/*` stats)."""

    def _check_can_train(self) -> None:
        if self.dataset is None:
            raise ValueError(
                "train() needs a dataset of prompts (a `query` or `prompt` text column, or "
                "`input_ids`)."
            )
        if self.reward is None:
            raise ValueError("train() needs reward= (a callable or a reward model path).")

    def _has_train_data(self) -> bool:
        return self.dataset is not None

    def _ensure_state(self) -> None:
        """The state is built in __init__ (step() works without train())."""

    @property
    def train_batch_size(self) -> int:
        return self.config.batch_size * jax.process_count()

    @property
    def steps_per_epoch(self) -> int:
        steps = len(self.dataset) // self.train_batch_size
        if steps == 0:
            raise ValueError(
                f"The dataset has {len(self.dataset)} prompts, fewer than one batch of "
                f"{self.train_batch_size}."
            )
        return steps

    @property
    def max_steps(self) -> int:
        c = self.config
        return c.max_steps if c.max_steps > 0 else c.total_ppo_epochs

    def _train_iterator(self):
        return ppo_inputs.prompt_batches(self.dataset, self.config.batch_size, self.config.seed)

    # The online iteration (`OnlineLoop`): every step generates, scores, then runs `step()`.
    def _sampling_params(self) -> Any:
        # With LoRA: base + adapter through the adapter forward (no merged copy).
        return self._policy_params()["pretrained_model"]

    def _rollout(self, batch: dict) -> None:
        """Sample responses to the batch's queries (key fixed by the step), decode and score."""
        c = self.config
        t = time.time()
        queries, prompts = ppo_inputs.batch_queries(batch, self.tokenizer)
        ppo_inputs.check_rollout_lengths(queries, c.response_length, self._positions)
        gen = ppo_generation.rollout_generation_config(c, self.tokenizer)
        key = jax.random.fold_in(jax.random.key(c.seed + 1), self.state.global_step)
        g = self._generate(queries, gen, key)
        t_gen, t = time.time() - t, time.time()
        scores = [0.0 if s is None else float(s) for s in self.reward(prompts, g.texts)]
        responses = [np.asarray(ids, np.int64) for ids in g.ids]
        logprobs_BN = np.asarray(g.out.logprobs_BN)
        sampled = [logprobs_BN[i, : len(ids)] for i, ids in enumerate(g.ids)]
        self._rollout_data = (queries, responses, scores, sampled, t_gen, time.time() - t)

    def _update(self, batch: dict, generated: bool) -> dict:
        """TRL's `step()` on the rollout, with `train()`'s metrics (and the sampling-correction
        stats of the sampler's log-probs)."""
        queries, responses, scores, sampled, t_gen, t_score = self._rollout_data
        stats = self._step(
            queries, responses, [np.float32(s) for s in scores], sampling_logprobs=sampled
        )
        metrics = ppo_stats.train_metrics(stats, scores)
        metrics["time/ppo/generate"], metrics["time/ppo/score"] = t_gen, t_score
        # The minibatch permutations of later steps come from NumPy's global generator. Placed
        # as the state's copy was (the train state's sharding): a plain `jnp.asarray` (one
        # device, no mesh) changed the optimise step's input type, so every run traced and
        # compiled that step a second time at step 2.
        rng = self.train_state.extras["numpy_rng"]
        self.train_state = self.train_state.replace(
            extras={
                **self.train_state.extras,
                "numpy_rng": jax.device_put(ppo_stats.numpy_rng_state(), rng.sharding),
            }
        )
        return metrics

    def _restore(self, step: int):
        super()._restore(step)
        ppo_stats.set_numpy_rng_state(self.train_state.extras["numpy_rng"])

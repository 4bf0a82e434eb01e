"""The one online shell (GRPO, RLOO, PPO, and DDPO for images): rollout -> score -> update.

An online iteration asks the policy's sampler for completions of a batch of prompts (the
policy's own params, never a copy; a LoRA policy through its adapter forward), decodes them,
scores them on the host, and runs the algorithm's jitted update (`jaxrl.algos.<algo>`).
`OnlineLoop` writes that order, and the generation and decoding every online trainer shares,
once; the loop around it (when to log, evaluate, save, stop, resume) is `TrainLoop`'s, and where
the reference policy lives in the train state is `jaxrl.algos.reference`'s.

A trainer supplies:
- for language models, `rollout_sampler` (a `jaxrl.generation.Sampler`, built with the
  trainer's mesh and prompt buckets) and `_sampling_params()`, the params it samples from
  (DDPO samples images with its own jitted DDIM program and uses the iteration alone);
- `_needs_rollout(item)`: whether this iteration generates. PPO generates at every step; GRPO and
  RLOO reuse one generation batch for `steps_per_generation x num_iterations` steps;
- `_rollout(item)`: generate (`_generate`), score with its reward functions, and keep what the
  update needs (the rollout buffer);
- `_update(item, generated) -> metrics`: the jitted update over the rollout and its metrics.

No algorithm math, no reward semantics and no config fields here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxrl.generation import GenerationConfig, Sampler
from jaxrl.trainers.loop import TrainLoop


@dataclasses.dataclass
class Generation:
    """Completions of one sampler call: `out` (the sampler's device arrays: prompt and completion
    ids and masks, the sampling log-probs), each row's completion `ids` up to its `lengths`
    (EOS kept), and the `texts` decoded without special tokens (None when not decoded)."""

    out: Any
    ids: list[list[int]]
    lengths: np.ndarray
    texts: list[str] | None


class OnlineLoop(TrainLoop):
    """rollout -> score -> update as one loop iteration (see the module docstring)."""

    rollout_sampler: Sampler | None = None

    # ----------------------------------------------------------------- subclass hooks
    def _sampling_params(self) -> Any:
        """The params `rollout_sampler` samples the policy from (with LoRA: base + adapter)."""
        raise NotImplementedError

    def _needs_rollout(self, item: Any) -> bool:
        """Whether this iteration generates a new rollout (default: every iteration)."""
        return True

    def _rollout(self, item: Any) -> None:
        """Generate and score the rollout of `item`; keep what `_update` needs."""
        raise NotImplementedError

    def _update(self, item: Any, generated: bool) -> dict:
        """The jitted update of this iteration over the current rollout; returns its metrics
        (device arrays allowed: the loop reads them one iteration late)."""
        raise NotImplementedError

    # ----------------------------------------------------------------- shared
    def _generate(
        self,
        prompt_ids: list,
        config: GenerationConfig,
        seed: Any,
        *,
        group_size: int = 1,
        params: Any = None,
        pixel_values: Any = None,
        decode: bool = True,
    ) -> Generation:
        """`group_size` completions of each prompt (one prefill per prompt) from the policy
        (`params`, default `_sampling_params()`), cut at each row's length and decoded."""
        params = self._sampling_params() if params is None else params
        out = self.rollout_sampler(
            params, prompt_ids, config, seed=seed, group_size=group_size,
            pixel_values=pixel_values, tokenizer=self.tokenizer,
        )  # fmt: skip
        ids_NC = np.asarray(out.completion_ids_BN)
        lengths_N = np.asarray(out.completion_mask_BN).sum(axis=1)
        ids = [row[:n].tolist() for row, n in zip(ids_NC, lengths_N, strict=True)]
        texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True) if decode else None
        return Generation(out, ids, lengths_N, texts)

    def _train_iteration(self, item: Any) -> dict:
        generated = self._needs_rollout(item)
        if generated:
            self._rollout(item)
        return self._update(item, generated)

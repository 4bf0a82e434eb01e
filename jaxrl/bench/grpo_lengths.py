"""`python -m jaxrl.bench --algo grpo --lengths longtail`: every completion's length forced on
both sides, drawn once from the long tail of `--algo generate --lengths longtail` (row i of each
generation batch ends after lengths[i] tokens with EOS, never before), so jaxrl's engine and
TRL's `generate` do the same useful work whatever the model would have sampled.

jaxrl: the rollout sampler gets each row's `max_new_tokens` and never picks EOS before it
(`suppress_token_ids`); the row's last token is then EOS. TRL: the model's `generate` gets a
logits processor forcing EOS at the row's length and banning it before.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxrl.bench.generate import _eos_at
from jaxrl.generation import Sampler


def force_jaxrl(trainer: Any, lengths: np.ndarray, eos: int) -> None:
    """Make `trainer`'s rollouts end row i after lengths[i] tokens, with EOS."""
    config = trainer.rollout_generation_config
    trainer.rollout_generation_config = dataclasses.replace(
        config, suppress_token_ids=(*config.suppress_token_ids, eos)
    )
    sampler = trainer.rollout_sampler

    class Forced(type(sampler)):
        def __call__(self, params: Any, prompts: Any, *args: Any, **kwargs: Any) -> Any:
            rows = np.resize(lengths, len(prompts) * kwargs.get("group_size", 1))
            kwargs["max_new_tokens"] = rows
            out = Sampler.__call__(self, params, prompts, *args, **kwargs)
            ids = out.completion_ids_BN.at[np.arange(len(rows)), rows - 1].set(eos)
            return out._replace(completion_ids_BN=ids)

    sampler.__class__ = Forced


def force_trl(trainer: Any, lengths: np.ndarray, eos: int) -> None:
    """Make TRL's `GRPOTrainer` generations end row i after lengths[i] tokens, with EOS."""
    model = trainer.model
    generate = model.generate

    def forced(*args: Any, **kwargs: Any) -> Any:
        width = kwargs["input_ids"].shape[1]
        rows = np.resize(lengths, kwargs["input_ids"].shape[0])
        kwargs["logits_processor"] = _eos_at(rows, width, eos)
        return generate(*args, **kwargs)

    model.generate = forced

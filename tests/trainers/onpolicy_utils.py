"""Helpers shared by the GRPO/RLOO trainer tests: prompt data, a recording reward function and a
hand recomputation of the rollout log-probs with a freshly loaded model."""

from __future__ import annotations

import functools

import datasets
import jax
import numpy as np
from flax import nnx

from jaxrl import models
from jaxrl.algos.rollout import completion_logprobs
from jaxrl.callbacks.base import TrainerCallback
from jaxrl.data import task


def prompt_rows(n: int, split: str = "train") -> datasets.Dataset:
    ds = datasets.load_dataset(
        "json", data_files=str(task.asset_path(f"sft_{split}.jsonl")), split="train"
    )
    return ds.select(range(n))


class RecordingReward:
    """A deterministic reward with TRL's signature that records every call: the number of
    '1' characters in the completion, None for empty completions."""

    __name__ = "ones"

    def __init__(self):
        self.calls: list[dict] = []

    def __call__(self, prompts, completions, completion_ids, **kwargs):
        self.calls.append(
            dict(prompts=prompts, completions=completions, ids=completion_ids, kwargs=kwargs)
        )
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
        return [float(t.count("1")) if t else None for t in texts]


@functools.partial(jax.jit, static_argnums=(0, 3))
def split_model_logps(graphdef, params, batch: dict, temperature: float = 1.0) -> jax.Array:
    """Completion log-probs (f32) of a model split as `(graphdef, params)`: the weights are an
    argument, so one program per batch shape serves every model of the same config (a policy,
    its reference, a reloaded export) instead of one program per model with its weights baked
    in."""
    model = nnx.merge(graphdef, params)
    return completion_logprobs(model, batch, temperature=temperature, chunk_size=128)


def recompute_logps(model_dir: str, rollout: dict, temperature: float = 1.0) -> np.ndarray:
    """Completion log-probs of the rollout rows under the model saved at `model_dir` (f32)."""
    graphdef, params = nnx.split(models.from_pretrained(model_dir))
    batch = {k: rollout[k] for k in ("input_ids", "attention_mask", "completion_mask")}
    return np.asarray(split_model_logps(graphdef, params, batch, temperature))


class StopAt(TrainerCallback):
    """Stops the run after optimizer step `step` (a kill right after a checkpoint)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.step:
            control.should_training_stop = True

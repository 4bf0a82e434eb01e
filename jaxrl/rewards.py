"""Host-side reward plumbing for the online trainers (GRPO, RLOO), with TRL 1.16's conventions.

A reward function is a Python callable `f(prompts, completions, completion_ids=..., **columns)`
returning one `float` or `None` (unscorable, stored as NaN) per completion; `columns` are the
dataset's other columns, one value per completion, plus whatever extra keyword arguments the
trainer passes (TRL passes `trainer_state`, `log_extra`, `log_metric`). Async callables run
concurrently. A reward *model* enters through `RewardModelFunc`, a callable with the same
signature around a text scorer. This module runs on the host, never inside jit; advantages are
computed from its `[N, K]` output by `jaxrl.losses.grpo` / `jaxrl.losses.rloo`.
"""

import asyncio
import functools
import importlib
import importlib.util
import inspect
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxrl.config import ConfigError
from jaxrl.data import task
from jaxrl.data.formats import is_conversational
from jaxrl.losses.grpo import nanstd, weighted_rewards

logger = logging.getLogger(__name__)

RewardFunc = Callable[..., Sequence[float | None]]
# Passed as named arguments, so never forwarded again as dataset columns (as TRL).
_RESERVED_COLUMNS = ("prompt", "completion", "completion_ids")


class RewardModelFunc:
    """A reward model used as a reward function (TRL passes reward models in `reward_funcs`).

    `score_texts` maps full texts (prompt + completion) to one scalar each; the trainer builds
    it from a jaxrl reward model (tokenize without special tokens, right-pad, score). Texts are
    built as TRL does: `prompt + completion` for standard data; for conversational data the
    chat template of `prompt + completion` messages, rendered with `tokenizer`. `name` is what
    the metrics show (TRL: the last path component of the model id).
    """

    def __init__(
        self,
        score_texts: Callable[[list[str]], Sequence[float]],
        *,
        name: str,
        tokenizer: Any = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ):
        self.score_texts = score_texts
        self.name = name
        self.tokenizer = tokenizer
        self.chat_template_kwargs = dict(chat_template_kwargs or {})

    def __call__(self, prompts: list, completions: list, **_: Any) -> list[float]:
        texts = reward_model_texts(
            prompts, completions, self.tokenizer, **self.chat_template_kwargs
        )
        return [float(x) for x in self.score_texts(texts)]


def reward_model_texts(
    prompts: list, completions: list, tokenizer: Any = None, **chat_template_kwargs: Any
) -> list[str]:
    """The texts TRL feeds a reward model: `p + c`, or the chat template of `p + c` messages."""
    if is_conversational({"prompt": prompts[0]}):
        if tokenizer is None:
            raise ValueError(
                "Conversational prompts need the reward model's tokenizer to apply its chat "
                "template; pass tokenizer= to RewardModelFunc."
            )
        return [
            tokenizer.apply_chat_template(p + c, tokenize=False, **chat_template_kwargs)
            for p, c in zip(prompts, completions, strict=True)
        ]
    return [p + c for p, c in zip(prompts, completions, strict=True)]


def reward_func_name(func: RewardFunc) -> str:
    """The name in `rewards/<name>/mean`: a `RewardModelFunc`'s `name`, else the callable's
    `__name__` (through `functools.partial`), else its class name (TRL `get_callable_name`)."""
    if isinstance(func, RewardModelFunc):
        return func.name
    while isinstance(func, functools.partial):
        func = func.func
    return getattr(func, "__name__", type(func).__name__)


def resolve_reward_weights(reward_weights: Sequence[float] | None, num_funcs: int) -> np.ndarray:
    """`[K]` float32 weights: `GRPOConfig.reward_weights`, or ones when None."""
    if reward_weights is None:
        return np.ones(num_funcs, np.float32)
    if len(reward_weights) != num_funcs:
        raise ValueError(
            f"Number of reward weights ({len(reward_weights)}) must match number of reward "
            f"functions ({num_funcs}); give one weight per reward function."
        )
    return np.asarray(reward_weights, np.float32)


def completions_from_texts(prompts: list, completion_texts: list[str]) -> list:
    """Completions in the dataset's format: decoded strings for standard prompts, a one-message
    assistant turn `[{"role": "assistant", "content": text}]` for conversational ones."""
    if is_conversational({"prompt": prompts[0]}):
        return [[{"role": "assistant", "content": text}] for text in completion_texts]
    return list(completion_texts)


def _is_async(func: Callable) -> bool:
    while isinstance(func, functools.partial):
        func = func.func
    # A callable instance carries `async` on its `__call__`, not on itself.
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(type(func).__call__)


def _to_column(output: Sequence[float | None], name: str, n: int) -> np.ndarray:
    values = [np.nan if r is None else r for r in output]
    if len(values) != n:
        raise ValueError(
            f"The reward function '{name}' returned {len(values)} rewards, but {n} were expected "
            "(one per prompt-completion pair). Make sure it returns exactly one reward per "
            "completion."
        )
    return np.asarray(values, np.float32)


def compute_rewards(
    reward_funcs: Sequence[RewardFunc],
    prompts: list,
    completions: list,
    *,
    completion_ids: list[list[int]] | None = None,
    columns: Mapping[str, list] | None = None,
    **extra_kwargs: Any,
) -> np.ndarray:
    """`[N, K]` float32 rewards of `N` completions under `K` functions, NaN where one returned None.

    Every function gets `prompts=`, `completions=`, `completion_ids=`, the dataset `columns`
    (each a list of N values; not `prompt`/`completion`/`completion_ids`) and `extra_kwargs`.
    """
    n = len(prompts)
    if len(completions) != n:
        raise ValueError(f"Got {n} prompts but {len(completions)} completions.")
    kwargs = {k: v for k, v in (columns or {}).items() if k not in _RESERVED_COLUMNS}
    kwargs.update(extra_kwargs)
    call = dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs)
    rewards_NK = np.zeros((n, len(reward_funcs)), np.float32)
    pending = []
    for i, func in enumerate(reward_funcs):
        if _is_async(func):
            pending.append(i)
        else:
            rewards_NK[:, i] = _to_column(func(**call), reward_func_name(func), n)
    if pending:

        async def run_all():
            return await asyncio.gather(*(reward_funcs[i](**call) for i in pending))

        for i, output in zip(pending, asyncio.run(run_all()), strict=True):
            rewards_NK[:, i] = _to_column(output, reward_func_name(reward_funcs[i]), n)
    unscorable = np.isnan(rewards_NK).all(axis=1)
    if reward_funcs and unscorable.any():
        row = int(np.flatnonzero(unscorable)[0])
        logger.warning(
            "All reward functions returned None for prompt %r, completion %r. Make sure at least "
            "one reward function returns a valid reward.",
            prompts[row],
            completions[row],
        )
    return rewards_NK


def group_reward_metrics(
    rewards_per_func_NK: np.ndarray,
    reward_weights_K: np.ndarray,
    names: Sequence[str],
    is_std_zero: np.ndarray,
) -> dict[str, float]:
    """TRL's reward metrics of one generation batch: `rewards/<name>/mean|std` per function
    (over the completions it scored), `reward` and `reward_std` of the weighted sum (over
    scorable completions), `frac_reward_zero_std` (mean of the advantage functions' flags)."""
    rewards_per_func_NK = jnp.asarray(rewards_per_func_NK, jnp.float32)
    out = {}
    for i, name in enumerate(names):
        column = rewards_per_func_NK[:, i]
        out[f"rewards/{name}/mean"] = float(jnp.nanmean(column))
        out[f"rewards/{name}/std"] = float(nanstd(column))
    rewards_N = weighted_rewards(rewards_per_func_NK, reward_weights_K)
    out["reward"] = float(jnp.nanmean(rewards_N))
    out["reward_std"] = float(nanstd(rewards_N))
    out["frac_reward_zero_std"] = float(np.mean(np.asarray(is_std_zero, np.float32)))
    return out


def arith_correct(prompts: list, completions: list, **_: Any) -> list[float | None]:
    """Correctness reward of the embedded arithmetic task (`jaxrl.data.task`): 1.0 for the right
    sum, 0.0 otherwise, None for a prompt that is not an `a+b=` task. Standard or conversational
    (last user message / assistant content)."""
    out: list[float | None] = []
    for prompt, completion in zip(prompts, completions, strict=True):
        if isinstance(prompt, list):
            prompt = next(m["content"] for m in reversed(prompt) if m["role"] == "user")
        if isinstance(completion, list):
            completion = completion[-1]["content"]
        try:
            out.append(float(task.is_correct(prompt, completion)))
        except ValueError:
            out.append(None)
    return out


_THINK_FORMAT = re.compile(r"^<think>(?!.*<think>)(.*?)</think>.*$", re.DOTALL | re.MULTILINE)


def think_format_reward(completions: list, **_: Any) -> list[float]:
    """TRL's `think_format_reward`: 1.0 when the completion opens with one `<think>...</think>`
    block (no second `<think>`), else 0.0. Conversational completions are scored on their first
    message's content, as TRL; standard (string) completions as they are (TRL expects messages)."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [1.0 if _THINK_FORMAT.match(text) else 0.0 for text in texts]


class SoftOverlongPunishment:
    """TRL's `get_soft_overlong_punishment` (DAPO's Eq. 13) on completion token counts: 0 up to
    `max_completion_len - soft_punish_cache` tokens, then falling linearly to -1 at
    `max_completion_len`, -1 beyond. A class (not a closure) with TRL's `__name__`, so the
    metric is `rewards/soft_overlong_punishment_reward/mean` as in TRL."""

    __name__ = "soft_overlong_punishment_reward"

    def __init__(self, max_completion_len: int, soft_punish_cache: int):
        if soft_punish_cache <= 0 or soft_punish_cache > max_completion_len:
            raise ValueError(
                f"soft_punish_cache must be in (0, max_completion_len={max_completion_len}]; "
                f"got {soft_punish_cache}."
            )
        self.max_completion_len = max_completion_len
        self.soft_punish_cache = soft_punish_cache

    def __call__(self, completion_ids: list[list[int]], **_: Any) -> list[float]:
        free = self.max_completion_len - self.soft_punish_cache
        out = []
        for ids in completion_ids:
            n = len(ids)
            if n <= free:
                out.append(0.0)
            elif n <= self.max_completion_len:
                out.append((free - n) / self.soft_punish_cache)
            else:
                out.append(-1.0)
        return out


def get_soft_overlong_punishment(max_completion_len: int, soft_punish_cache: int) -> Callable:
    """TRL's `trl.rewards.get_soft_overlong_punishment`."""
    return SoftOverlongPunishment(max_completion_len, soft_punish_cache)


def _trl_math_reward(name: str) -> RewardFunc:
    """TRL's math-verify checkers (`accuracy_reward`, `reasoning_accuracy_reward`): TRL's own
    functions where TRL and `math_verify` are installed (jaxrl needs neither otherwise)."""
    if importlib.util.find_spec("math_verify") is None or importlib.util.find_spec("trl") is None:
        raise ConfigError(
            f"--reward_funcs {name}: TRL's {name} checks answers with the math_verify package; "
            "install both (`pip install trl math-verify`), or pass a dotted path to your own "
            "reward function (--reward_funcs my_module.my_reward)."
        )
    return getattr(importlib.import_module("trl.rewards"), name)


# `--reward_funcs` names of `python -m jaxrl.train --algo grpo|rloo`: TRL's GRPO script's registry
# (its soft overlong punishment with the script's max_completion_len=1280, soft_punish_cache=256)
# and the embedded task's `arith_correct`.
SCRIPT_REWARD_FUNCS: dict[str, Callable[[], RewardFunc]] = {
    "accuracy_reward": functools.partial(_trl_math_reward, "accuracy_reward"),
    "reasoning_accuracy_reward": functools.partial(_trl_math_reward, "reasoning_accuracy_reward"),
    "think_format_reward": lambda: think_format_reward,
    "get_soft_overlong_punishment": lambda: get_soft_overlong_punishment(1280, 256),
    "arith_correct": lambda: arith_correct,
}


def script_reward_funcs(
    reward_funcs: Sequence[str] | None, reward_model_name_or_path: str | None = None
) -> list[RewardFunc | str]:
    """The reward functions of TRL's GRPO script flags, in TRL's order: the reward model (a
    path, loaded by the trainer) first, then each `reward_funcs` entry, a registry name
    (`SCRIPT_REWARD_FUNCS`) or a dotted import path (`package.module.function`)."""
    funcs: list[RewardFunc | str] = []
    if reward_model_name_or_path:
        funcs.append(reward_model_name_or_path)
    for name in [reward_funcs] if isinstance(reward_funcs, str) else reward_funcs or ():
        if name in SCRIPT_REWARD_FUNCS:
            funcs.append(SCRIPT_REWARD_FUNCS[name]())
            continue
        module, _, attr = name.rpartition(".")
        if not module:
            raise ConfigError(
                f"--reward_funcs {name!r} is not one of {sorted(SCRIPT_REWARD_FUNCS)} and not a "
                "dotted import path (e.g. my_lib.rewards.custom_reward)."
            )
        try:
            func = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"--reward_funcs {name!r}: cannot import it ({e}).") from e
        if not callable(func):
            raise ConfigError(
                f"--reward_funcs {name!r} is a {type(func).__name__}, not a function."
            )
        funcs.append(func)
    return funcs

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
import math
import re
import reprlib
import traceback
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


class RewardFunctionError(ValueError):
    """A reward function raised, or returned something that is not one number (or None) per
    completion. The message names the function, the step and the fix; `user_traceback` is the
    traceback of the user's code alone (from the reward function's frame on), for a command line
    to show above the message (empty when the function returned a bad value)."""

    def __init__(self, message: str, user_traceback: str = ""):
        super().__init__(message)
        self.user_traceback = user_traceback


def _shown(value: Any) -> str:
    return f"{reprlib.repr(value)} ({type(value).__name__})"


def _where(extra_kwargs: Mapping[str, Any]) -> str:
    """` at global step N` from the trainer's `trainer_state` (TRL passes it), else ``."""
    step = getattr(extra_kwargs.get("trainer_state"), "global_step", None)
    return "" if step is None else f" at global step {step}"


_CALL_FRAMES: set = set()  # code objects of the callers, cut from user tracebacks


def _user_traceback(err: BaseException) -> str:
    """`err`'s traceback from the first frame that is neither `compute_rewards` nor asyncio's
    machinery: the user's reward function and what it called."""
    tb = err.__traceback__
    asyncio_dir = str(asyncio.__file__).rsplit("/", 1)[0]
    while tb is not None and (
        tb.tb_frame.f_code in _CALL_FRAMES or tb.tb_frame.f_code.co_filename.startswith(asyncio_dir)
    ):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(err), err, tb))


def _raised(name: str, err: Exception, columns: Sequence[str], where: str) -> RewardFunctionError:
    hint = ""
    if isinstance(err, KeyError):
        given = f"the dataset columns {sorted(columns)}" if columns else "no other dataset column"
        hint = (
            " A KeyError often means the function reads a dataset column the dataset lacks; "
            f"reward functions get prompts, completions, completion_ids and {given} as keyword "
            "arguments."
        )
    return RewardFunctionError(
        f"Reward function {name!r} raised {type(err).__name__}: {err}{where} (its traceback is "
        f"above).{hint} Fix the function or the dataset and rerun; checkpoints already saved are "
        "kept (continue with --resume_from_checkpoint true).",
        _user_traceback(err),
    )


def _to_column(output: Any, name: str, n: int, where: str = "", prompts: list = ()) -> np.ndarray:
    """One reward function's output -> `[n]` float32 (None -> NaN, as TRL), or a
    RewardFunctionError naming the function and what it returned."""
    expected = (
        f"return a list of {n} rewards, one per completion: a number, or None for a completion "
        "it cannot score (TRL's NaN)"
    )
    if output is None or isinstance(output, (str, bytes, Mapping)):
        raise RewardFunctionError(
            f"Reward function {name!r} returned {_shown(output)}{where}, not a list; {expected}."
        )
    try:
        values = list(output)
    except TypeError:  # a bare number (or a 0-d array)
        raise RewardFunctionError(
            f"Reward function {name!r} returned {_shown(output)}{where}, not a list; {expected}."
        ) from None
    if len(values) != n:
        raise RewardFunctionError(
            f"Reward function {name!r} returned {len(values)} rewards{where}, but {n} were "
            f"expected (one per prompt-completion pair): {reprlib.repr(values)}. Make sure it "
            "returns exactly one reward per completion."
        )
    out = np.empty(n, np.float32)
    for i, r in enumerate(values):
        bad = isinstance(r, (str, bytes))
        if not bad:
            try:
                out[i] = np.nan if r is None else float(r)
            except (TypeError, ValueError):
                bad = True
        if bad:
            raise RewardFunctionError(
                f"Reward function {name!r} returned {_shown(r)} for completion {i}{where}; "
                "rewards must be numbers or None (TRL refuses anything else). Convert them with "
                "float(...) in the function."
            )
        if math.isinf(out[i]):
            prompt = f" (prompt {reprlib.repr(prompts[i])})" if i < len(prompts) else ""
            raise RewardFunctionError(
                f"Reward function {name!r} returned {float(out[i])} for completion {i}{prompt}"
                f"{where}; rewards must be finite: one infinite reward makes its group's "
                "advantages, and so the loss, NaN. Clip it to a finite value, or return None "
                "for a completion the function cannot score (TRL's NaN)."
            )
    return out


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
    A function that raises, or returns anything but one finite number or None per completion,
    raises RewardFunctionError naming it (and the step, from `trainer_state`).
    """
    n = len(prompts)
    if len(completions) != n:
        raise ValueError(f"Got {n} prompts but {len(completions)} completions.")
    kwargs = {k: v for k, v in (columns or {}).items() if k not in _RESERVED_COLUMNS}
    column_names = list(kwargs)
    kwargs.update(extra_kwargs)
    call = dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs)
    where = _where(extra_kwargs)
    rewards_NK = np.zeros((n, len(reward_funcs)), np.float32)
    pending = []
    for i, func in enumerate(reward_funcs):
        if _is_async(func):
            pending.append(i)
            continue
        name = reward_func_name(func)
        try:
            output = func(**call)
        except Exception as err:
            raise _raised(name, err, column_names, where) from err
        rewards_NK[:, i] = _to_column(output, name, n, where, prompts)
    if pending:

        async def run_all():
            return await asyncio.gather(
                *(reward_funcs[i](**call) for i in pending), return_exceptions=True
            )

        for i, output in zip(pending, asyncio.run(run_all()), strict=True):
            name = reward_func_name(reward_funcs[i])
            if isinstance(output, Exception):
                raise _raised(name, output, column_names, where) from output
            if isinstance(output, BaseException):  # KeyboardInterrupt, SystemExit: as they are
                raise output
            rewards_NK[:, i] = _to_column(output, name, n, where, prompts)
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


_CALL_FRAMES.add(compute_rewards.__code__)


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

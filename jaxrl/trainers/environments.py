"""Environments for the online trainers (TRL 1.16's `GRPOTrainer(environment_factory=...)`).

`environment_factory` is a callable returning an environment instance, or a dict of them chosen
per example by its `environment` column. An environment defines `reset(**example)` (called once
per rollout before generation; a string it returns is appended to the last user message), its
public methods (the model's tools, besides the trainer's `tools`), and optionally
`get_reward()`: the environment owns a reward, an extra reward function (weight 1) named after
its class, scoring the rollouts of that exact class (others: None).

Without a `train_dataset` (the environment owns the data: `reset()` returns each prompt), the
run trains on placeholder rows of empty prompts (`placeholder_dataset`), `max_steps` long.

Instances are pooled: the pool of each environment grows only when a batch needs more
concurrent instances than exist; each batch hands out one instance per rollout and resets it.
Host code only, no sampling or scoring here.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import datasets

from jaxrl.config import ConfigError

# TRL's placeholder prompt of a run whose environment owns the data.
EMPTY_PROMPT = [{"role": "user", "content": ""}]
_CONTROL = ("reset", "get_reward")


def tool_methods(instance: Any) -> list[Callable]:
    """The bound public methods of an environment (its tools), read from the class so that no
    property is evaluated."""
    return [
        getattr(instance, name)
        for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
        if name not in _CONTROL and not name.startswith("_")
    ]


def _reward_func(env_type: type) -> Callable:
    """A reward function `f(prompts, completions, environments, **kw)` scoring the rollouts
    whose environment is exactly `env_type` with their `get_reward()`; None elsewhere."""
    if inspect.iscoroutinefunction(env_type.get_reward):

        async def get_reward(prompts=None, completions=None, environments=(), **kwargs):
            return [await e.get_reward() if type(e) is env_type else None for e in environments]

    else:

        def get_reward(prompts=None, completions=None, environments=(), **kwargs):
            return [e.get_reward() if type(e) is env_type else None for e in environments]

    get_reward.__name__ = env_type.__name__
    return get_reward


class EnvironmentPool:
    """The environments of a run: probed at construction (each factory called once, checked for
    `reset`, its tools listed), then pooled and handed out per batch (see the module doc)."""

    def __init__(self, environment_factory: Callable | dict[str, Callable]):
        self.multi = isinstance(environment_factory, dict)
        factories = environment_factory if self.multi else {None: environment_factory}
        if self.multi and not factories:
            raise ConfigError("environment_factory is an empty dict; give at least one factory.")
        for name, factory in factories.items():
            if not callable(factory):
                raise ConfigError(
                    f"environment_factory[{name!r}] must be a callable returning an "
                    f"environment; got {factory!r}."
                )
        self.factories: dict[Any, Callable] = dict(factories)
        self.pool: dict[Any, list[Any]] = {}
        self.env_tools: dict[Any, list[Callable]] = {}
        self.reward_funcs: list[Callable] = []
        reward_types: list[type] = []
        for name, factory in self.factories.items():
            instance = factory()
            if not callable(getattr(instance, "reset", None)):
                raise ConfigError(
                    "Each environment instance returned by `environment_factory` must define a "
                    f"callable `reset` ({type(instance).__name__} has none)."
                )
            self.pool[name] = [instance]
            self.env_tools[name] = tool_methods(instance)
            has_reward = callable(getattr(type(instance), "get_reward", None))
            if has_reward and type(instance) not in reward_types:
                reward_types.append(type(instance))
                self.reward_funcs.append(_reward_func(type(instance)))

    def example_environment(self, example: dict) -> Any:
        """The environment name an example selects (None with a single factory)."""
        if not self.multi:
            return None
        name = example.get("environment")
        if name not in self.factories:
            raise ValueError(
                f"Example has `environment={name!r}`, which is not among the environments passed "
                f"to `environment_factory`. Expected one of: {list(self.factories)}."
            )
        return name

    def take(self, names: list[Any]) -> list[Any]:
        """One instance per rollout (`names`: each rollout's environment), reusing the pool and
        creating an instance only when this batch needs more of one environment than exist."""
        cursor: dict[Any, int] = {}
        out = []
        for name in names:
            pool = self.pool[name]
            i = cursor.get(name, 0)
            if i == len(pool):
                pool.append(self.factories[name]())
            cursor[name] = i + 1
            out.append(pool[i])
        return out

    def reset(self, environment: Any, example: dict, prompt: list[dict]) -> list[dict]:
        """`environment.reset(**example)` (without the `environment` column in multi mode);
        its observation appended to the prompt's last message (a new list, `prompt` kept)."""
        kwargs = {k: v for k, v in example.items() if k != "environment"} if self.multi else example
        observation = environment.reset(**kwargs)
        if observation is None:
            return prompt
        content = prompt[-1]["content"]
        if isinstance(observation, list) and isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if isinstance(observation, str) and isinstance(content, list):
            observation = [{"type": "text", "text": observation}]
        return [*prompt[:-1], {**prompt[-1], "content": content + observation}]

    def all_tools(self, standalone: list[Callable]) -> list[Callable]:
        """The union of every environment's tools and the standalone ones (the probe instances'
        bound methods; what the template checks and tool metrics need)."""
        tools = list(standalone)
        for methods in self.env_tools.values():
            tools += [m for m in methods if m not in tools]
        return tools


def placeholder_dataset(environment_factory: Any, args: Any, n_devices: int) -> Any:
    """TRL's dataset of a run without `train_dataset`: one generation batch of empty prompts
    (over `n_devices`, all devices: the mesh is not built yet; every row is the same), cycled
    for `max_steps` steps; each rollout's `reset()` supplies its prompt."""
    if isinstance(environment_factory, dict):
        raise ConfigError(
            "A `dict` `environment_factory` (multiple environments) requires a `train_dataset` "
            "with an `environment` column to route each example to its environment. Provide a "
            "dataset, or pass a single environment factory."
        )
    if args.max_steps <= 0:
        raise ConfigError(
            "When training without a `train_dataset` (the environment owns the data and returns "
            "the prompt from `reset()`), `max_steps` must be set to a positive value to define "
            "the training length. Set it via `GRPOConfig(max_steps=...)`."
        )
    generation_batch_size, _ = args.resolve_generation_batch(n_devices)
    n = generation_batch_size // args.num_generations
    return datasets.Dataset.from_dict({"prompt": [EMPTY_PROMPT] * n})

"""Agentic rollouts of the online trainers (GRPO, RLOO), with TRL 1.16's `GRPOTrainer` surface:
`tools=` (`jaxrl.trainers.tools`), `environment_factory=` (`jaxrl.trainers.environments`) and
`rollout_func=` (the user's own rollout).

A batch's generation with any of them: the prompts (each rollout's environment reset and its
observation appended, then the chat template with the rollout's tools), the first turn from the
policy, then the tool loop; or `rollout_func(prompts, trainer)`, whose `prompt_ids`,
`completion_ids` (and `env_mask`, TRL's tool mask) are taken as given and whose other returned
fields reach the reward functions. The result is the rows `OnPolicyTrainer` trains on: the
completion holds every turn, `tool_mask` keeps the tool results out of the loss, and the
sampling policy's log-probs are recomputed by a forward (a tool turn's sampler log-probs do not
cover the tool tokens), as TRL computes its old log-probs.

Each tool turn continues the rows from the KV caches the previous turn left
(`jaxrl.generation.turns`): only the tool result's tokens are run through the model. `OnPolicyAgenticMixin` is one of the pieces
`jaxrl.trainers.onpolicy.OnPolicyTrainer` is composed of; it does not import that module.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.config import ConfigError
from jaxrl.data.formats import is_conversational
from jaxrl.generation import GenerationConfig, SampleOutput, Sampler, left_pad
from jaxrl.generation.turns import TurnSession, continued_rows
from jaxrl.trainers.environments import EnvironmentPool, tool_methods
from jaxrl.trainers.tools import (
    DEFAULT_TOOL_TIMEOUT_S,
    ToolExecutor,
    check_tool_tokenizer,
    check_tools,
    parse_completion,
    tool_call_loop,
)

_ROLLOUT_KEYS = ("prompt_ids", "completion_ids", "logprobs")


class OnPolicyAgenticMixin:
    """`OnPolicyTrainer`'s tools, environments and custom rollouts (see the module doc)."""

    # Seconds a tool call may run before it fails (`jaxrl.trainers.tools`).
    tool_timeout_s: float = DEFAULT_TOOL_TIMEOUT_S
    # Wall seconds spent running tool calls so far (read by `python -m jaxrl.bench --tools`).
    tool_time_s: float = 0.0

    def _init_agentic(self, tools, rollout_func, environment_factory) -> None:
        """Before `Trainer.__init__` (the prompts are tokenized with the tools)."""
        tools = list(tools or [])
        check_tools(tools)
        if rollout_func is not None and not callable(rollout_func):
            raise ConfigError(f"rollout_func must be callable; got {rollout_func!r}.")
        self.rollout_func = rollout_func
        self.environment_pool = (
            EnvironmentPool(environment_factory) if environment_factory is not None else None
        )
        self._standalone_tools = tools
        pool = self.environment_pool
        self.tools = pool.all_tools(tools) if pool is not None else tools
        if pool is not None:
            for methods in pool.env_tools.values():
                check_tools(methods)
        self._tool_executor: ToolExecutor | None = None
        self._turn_sampler: Sampler | None = None
        self._turn_session: TurnSession | None = None

    def _check_agentic(self) -> None:
        """After `Trainer.__init__`: the tokenizer can run tool calls."""
        if not self._agentic:
            return
        if self.vision:
            raise ConfigError(
                "tools, environment_factory and rollout_func are not supported with image "
                "prompts in jaxrl; drop the image column or the agentic arguments."
            )
        if self.tools:
            check_tool_tokenizer(self.tokenizer)
        max_iterations = getattr(self.args, "max_tool_calling_iterations", None)
        self.max_tool_calling_iterations = 2**62 if max_iterations is None else max_iterations

    def train(self, *args, **kwargs):
        """`Trainer.train`, then the tool executor closed (its event loop stopped; a hung sync
        tool is left on its daemon thread), also when training fails."""
        try:
            return super().train(*args, **kwargs)
        finally:
            self.close_tools()

    def close_tools(self) -> None:
        """Close the tool executor (a later generation, e.g. `evaluate()`, opens a new one)."""
        if self._tool_executor is not None:
            self._tool_executor.close()
            self._tool_executor = None

    @property
    def _agentic(self) -> bool:
        return (
            bool(self.tools) or self.rollout_func is not None or self.environment_pool is not None
        )

    # ----------------------------------------------------------------- generation
    def _sample_turn(
        self, params: Any, prompts: list[list[int]], config: GenerationConfig, seed: Any,
        group_size: int = 1, pad_rows_to: int | None = None,
    ) -> list[list[int]]:  # fmt: skip
        """`group_size` completions (ids, EOS kept) of each prompt from the policy `params`.

        A batch's first turn starts a `TurnSession` (its KV caches kept); a later turn whose
        rows each extend a distinct row of it (the tool loop's `prompt + completion + tool
        result`) continues those rows from their caches, running only the new tokens. Other
        calls (a tool turn after `rollout_func`'s first turn) sample afresh, rows padded to
        `pad_rows_to` (copies of the first, outputs dropped) so every turn of a batch runs one
        compiled program."""
        if self._turn_sampler is None:
            a = self.args
            self._turn_sampler = Sampler(
                self.graphdef, mesh=self.mesh, rules=self.rules, engine=a.generation_engine,
                num_slots=a.generation_num_slots,
            )  # fmt: skip
        session = self._turn_session
        if pad_rows_to is None:  # a batch's first turn
            session = TurnSession(self._turn_sampler, params, config, self.tokenizer)
            self._turn_session = session
            return session.first(prompts, seed, group_size)
        rows = continued_rows(session, prompts) if session is not None else None
        if rows is not None and group_size == 1:
            return session.next(rows, prompts, seed)
        n = len(prompts)
        padded = list(prompts)
        if pad_rows_to > n:
            padded += [padded[0]] * (pad_rows_to - n)
        out = self._turn_sampler(
            params, padded, config, seed=seed, group_size=group_size, tokenizer=self.tokenizer
        )
        ids_NC = np.asarray(out.completion_ids_BN)[: n * group_size]
        lengths_N = np.asarray(out.completion_mask_BN).sum(axis=1)[: n * group_size]
        return [row[:k].tolist() for row, k in zip(ids_NC, lengths_N, strict=True)]

    def _agentic_prompts(self, examples: list[dict], group_size: int) -> tuple[list, list, list]:
        """Each rollout's prompt (environment reset applied), its tools and its environment."""
        rows = [ex for ex in examples for _ in range(group_size)]
        pool = self.environment_pool
        if pool is None:
            prompts = [ex["prompt"] for ex in rows]
            return prompts, [self.tools] * len(rows), [None] * len(rows)
        names = [pool.example_environment(ex) for ex in rows]
        environments = pool.take(names)
        prompts, tools = [], []
        for ex, env in zip(rows, environments, strict=True):
            prompt = ex.get("prompt", [{"role": "user", "content": ""}])
            example = {k: v for k, v in ex.items() if k != "prompt_ids"}
            prompts.append(pool.reset(env, example, prompt))
            tools.append(self._standalone_tools + tool_methods(env))
        return prompts, tools, environments

    def _tokenize_agentic(self, prompt: Any, tools: list[Callable]) -> list[int]:
        if not is_conversational({"prompt": prompt}):
            return self.tokenizer(text=prompt)["input_ids"]
        return self.processing_class.apply_chat_template(
            prompt, tools=tools or None, add_generation_prompt=True, tokenize=True,
            return_dict=True, **(self.args.chat_template_kwargs or {}),
        )["input_ids"]  # fmt: skip

    def _agentic_generate(
        self, params: Any, examples: list[dict], group_size: int, config: GenerationConfig,
        seed: Any,
    ) -> dict:  # fmt: skip
        """One batch's agentic generation (see the module doc): a dict with `out` (the rows as
        a `SampleOutput`: left-padded prompts, completions right-padded to the completion
        width), `ids` (completion ids), `lengths_N` (model tokens, TRL's lengths), `prompts`,
        `completions` (conversations), `tool_mask_NC` (or None), `extra` (rollout_func's other
        fields), `environments` and `tool_metrics`."""
        prompts, tools_per_row, environments = self._agentic_prompts(examples, group_size)
        self._turn_session = None
        extra: dict[str, Any] = {}
        tool_mask = None
        if self.rollout_func is not None:
            # TRL: a copy of each rollout's prompt (environment observations applied; a group's
            # rollouts do not share one).
            output = self.rollout_func([copy.deepcopy(p) for p in prompts], self)
            missing = sorted(set(_ROLLOUT_KEYS) - set(output))
            if missing:
                raise ValueError(f"rollout_func must return keys {missing} in its output dict.")
            for key in ("prompt_ids", "completion_ids"):
                if len(output[key]) != len(prompts):
                    raise ValueError(
                        f"rollout_func returned {len(output[key])} {key} for {len(prompts)} "
                        "prompts; it gets one prompt per rollout (each prompt repeated "
                        "num_generations times) and must return one row per prompt."
                    )
            extra = {k: v for k, v in output.items() if k not in _ROLLOUT_KEYS}
            prompt_ids = [list(p) for p in output["prompt_ids"]]
            completion_ids = [list(c) for c in output["completion_ids"]]
        elif self.environment_pool is not None:
            prompt_ids = [
                self._tokenize_agentic(p, t) for p, t in zip(prompts, tools_per_row, strict=True)
            ]
            completion_ids = self._sample_turn(params, prompt_ids, config, seed)
        else:
            unique = [ex["prompt_ids"] for ex in examples]
            completion_ids = self._sample_turn(params, unique, config, seed, group_size)
            prompt_ids = [list(p) for p in unique for _ in range(group_size)]
        conversational = is_conversational({"prompt": prompts[0]})
        if self.tools and not conversational:
            raise ValueError(
                "Tool calling needs conversational prompts (a list of chat messages in the "
                "'prompt' column): the model's tool calls are read from assistant turns."
            )
        completions = self._parse_completions(prompt_ids, completion_ids, tools_per_row)
        metrics: dict[str, float] = {}
        if self.tools:
            turn = [0]

            def generate(rows: list[list[int]]) -> list[list[int]]:
                turn[0] += 1
                return self._sample_turn(
                    params, rows, config, jax.random.fold_in(seed, turn[0]),
                    pad_rows_to=len(prompt_ids),
                )  # fmt: skip

            if self._tool_executor is None:
                self._tool_executor = ToolExecutor(self.tool_timeout_s)
            self._tool_executor.timeout_s = self.tool_timeout_s
            result = tool_call_loop(
                tokenizer=self.tokenizer,
                prompt_ids=prompt_ids,
                completion_ids=completion_ids,
                completions=completions,
                tools_per_row=tools_per_row,
                generate=generate,
                executor=self._tool_executor,
                max_iterations=self.max_tool_calling_iterations,
                max_completion_length=self.args.max_completion_length,
                max_model_len=getattr(self.model.config, "max_position_embeddings", None),
                chat_template_kwargs=self.args.chat_template_kwargs,
            )
            completion_ids, tool_mask = result.completion_ids, result.tool_mask
            self.tool_time_s += result.tool_s
            completions = result.completions
            metrics = result.metrics()
        elif "env_mask" in extra:  # rollout_func's mask of the tokens the model sampled
            tool_mask = [list(m) for m in extra.pop("env_mask")]
        # TRL's completion lengths count the tokens the model sampled (tool_mask 1).
        lengths_N = np.array(
            [sum(m) for m in tool_mask] if tool_mask is not None else list(map(len, completion_ids))
        )
        out, tool_mask_NC = self._agentic_rows(prompt_ids, completion_ids, tool_mask, config)
        return dict(
            out=out, ids=completion_ids, lengths_N=lengths_N, prompts=prompts,
            completions=completions, tool_mask_NC=tool_mask_NC, extra=extra,
            environments=environments if self.environment_pool is not None else None,
            tool_metrics=metrics,
        )  # fmt: skip

    def _parse_completions(self, prompt_ids, completion_ids, tools_per_row) -> list:
        """TRL's decoding: conversational prompts with a response parser -> one parsed
        assistant message; without one -> the decoded text as the assistant's content."""
        tok = self.tokenizer
        has_parser = (
            getattr(tok, "response_template", None) is not None
            or getattr(tok, "response_schema", None) is not None
        )
        if has_parser:
            return [
                [parse_completion(tok, ids, prefix=p, tools=t)]
                for p, ids, t in zip(prompt_ids, completion_ids, tools_per_row, strict=True)
            ]
        texts = tok.batch_decode(completion_ids, skip_special_tokens=True)
        return [[{"role": "assistant", "content": t}] for t in texts]

    def _agentic_rows(self, prompt_ids, completion_ids, tool_mask, config):
        """The rows as device arrays: prompts left-padded to a power-of-two bucket, completions
        right-padded (pad id; `tool_mask` with 1, as TRL) to `max_new_tokens` or the longest."""
        pad = config.pad_id
        ids_BP, mask_BP = left_pad(prompt_ids, None, None, pad)
        width = max(config.max_new_tokens, max((len(c) for c in completion_ids), default=1), 1)
        n = len(completion_ids)
        ids_BC = np.full((n, width), pad, np.int32)
        mask_BC = np.zeros((n, width), np.int32)
        tool_BC = np.ones((n, width), np.int32) if tool_mask is not None else None
        for i, ids in enumerate(completion_ids):
            ids_BC[i, : len(ids)] = ids
            mask_BC[i, : len(ids)] = 1
            if tool_BC is not None:
                tool_BC[i, : len(tool_mask[i])] = tool_mask[i]
        out = SampleOutput(
            jnp.asarray(ids_BP), jnp.asarray(mask_BP), jnp.asarray(ids_BC), jnp.asarray(mask_BC),
            jnp.zeros((n, width), jnp.float32),
        )  # fmt: skip
        return out, tool_BC

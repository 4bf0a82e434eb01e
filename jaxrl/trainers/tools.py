"""Tool calling in the online trainers (TRL 1.16's `GRPOTrainer(tools=...)`), on the host.

A tool is a plain Python function (sync or `async`) with type hints and a Google-style
docstring; transformers turns it into the JSON schema the chat template renders
(`apply_chat_template(..., tools=[fn, ...])`). After each turn the model's tool calls are parsed
from its completion with the tokenizer's response parser (`tokenizer.response_template` or the
legacy `response_schema`, TRL's `parse_response` semantics: a malformed call falls back to plain
text), each call runs (async tools on one event loop thread, sync tools each on a daemon thread, every
call under a timeout so that a hanging tool fails instead of hanging the run), its result
(`str(result)`, or TRL's `{"error": ...}` text) is appended as a `tool` message, and the model
continues from `prompt + completion + tool suffix` until no call is left,
`max_tool_calling_iterations` is reached or the completion budget `max_completion_length` is
spent. A tool result that would overflow the budget is rolled back (TRL): the rollout ends with
its completion as it was. `tool_mask` marks the completion tokens the model sampled (1) and the
tool-result tokens (0), which stay in the completion but out of the loss.

What this module does not do: sample (the trainer passes `generate`, which re-prefills each
turn's `prompt + completion + tool suffix` with the rollout sampler), score, or trace anything.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import dataclasses
import inspect
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from jaxrl.config import ConfigError

# TRL's refusal of a chat template that cannot render a tool-calling conversation.
TOOL_TEMPLATE_ERROR = (
    "The provided chat template does not support tool calling. The template must be able to "
    "render a full tool-calling conversation (user -> assistant with tool_calls -> tool)."
)
# Seconds a tool call may run before it counts as a failure (TRL has no timeout; a hanging
# tool would hang its run). A trainer attribute overrides it (`tool_timeout_s`).
DEFAULT_TOOL_TIMEOUT_S = 60.0


def is_async_tool(tool: Callable) -> bool:
    return inspect.iscoroutinefunction(tool)


# ----------------------------------------------------------------- chat template checks
def supports_tool_calling(tokenizer: Any) -> bool:
    """Whether the chat template renders `user -> assistant with tool_calls -> tool` with the
    call's name, argument and the tool's content all visible (TRL's check, with sentinels)."""
    from jinja2 import TemplateError

    if getattr(tokenizer, "chat_template", None) is None:
        return False
    name, key, value, content = "tn_a8f3e2b1", "tk_b9d4f5c2", "tv_d6e7a9f3", "tc_c4f9a8e2"
    calls = [{"type": "function", "function": {"name": name, "arguments": {key: value}}}]
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "name": name, "content": content},
    ]
    try:
        rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    except TemplateError:
        return False
    except TypeError:  # templates that want the arguments as a JSON string
        calls[0]["function"]["arguments"] = f'{{"{key}": "{value}"}}'
        try:
            rendered = tokenizer.apply_chat_template(messages, tokenize=False)
        except TemplateError:
            return False
    return all(s in rendered for s in (name, key, value, content))


def _dummy_exchange(name: str) -> list[dict]:
    calls = [{"type": "function", "function": {"name": name, "arguments": {}}}]
    return [
        {"role": "user", "content": "dummy"},
        {"role": "assistant", "content": "", "tool_calls": calls},
    ]


def is_prefix_preserving(tokenizer: Any) -> bool:
    """Whether rendering `user -> assistant call` is a prefix of rendering it followed by a tool
    message (what `tool_suffix_ids` relies on; TRL's `is_chat_template_prefix_preserving`)."""
    messages = _dummy_exchange("dummy")
    tool = {"role": "tool", "name": "dummy", "content": "dummy"}
    ids1 = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    ids2 = tokenizer.apply_chat_template(
        [*messages, tool], tokenize=True, return_dict=False, add_generation_prompt=True
    )
    return list(ids2[: len(ids1)]) == list(ids1)


def check_tools(tools: Sequence[Callable]) -> None:
    """Each tool must be a function transformers can describe (type hints and a Google-style
    docstring with every argument): refused here rather than at the first prompt."""
    from transformers.utils import get_json_schema

    for tool in tools:
        if not callable(tool) or not hasattr(tool, "__name__"):
            raise ConfigError(f"tools must be functions; got {tool!r}.")
        try:
            get_json_schema(tool)
        except Exception as e:
            raise ConfigError(
                f"Tool {tool.__name__!r} cannot be described to the chat template: {e}. A tool "
                "needs type hints on every argument and a Google-style docstring with a "
                "description and an `Args:` entry per argument (transformers' "
                "`get_json_schema`)."
            ) from e


def check_tool_tokenizer(tokenizer: Any) -> None:
    """Refuse a tokenizer that cannot run tool calls: a template that cannot render them
    (TRL's message), no response parser, or a template that is not prefix-preserving."""
    if not supports_tool_calling(tokenizer):
        raise ConfigError(TOOL_TEMPLATE_ERROR)
    if (
        getattr(tokenizer, "response_template", None) is None
        and getattr(tokenizer, "response_schema", None) is None
    ):
        raise ConfigError(
            "Tool calling needs the tokenizer's response parser to read the model's tool calls, "
            "but the tokenizer has neither `response_template` nor `response_schema`. Set one "
            "(transformers' response-parsing docs; TRL's `trl.chat_template_utils."
            "add_response_schema(tokenizer)` sets it for the chat templates it knows)."
        )
    if not is_prefix_preserving(tokenizer):
        raise ConfigError(
            "Tool calling needs a prefix-preserving chat template (rendering a conversation "
            "must not change how its earlier messages render), and this one is not. Use a "
            "training chat template (TRL ships `*_training.jinja` versions of the templates it "
            "knows: set `tokenizer.chat_template` to it)."
        )


# ----------------------------------------------------------------- parsing and suffixes
def _validate_tool_calls(tool_calls: Any) -> None:
    """TRL's shape checks of parsed tool calls (ValueError -> the completion is plain text);
    missing arguments become `{}`."""
    if tool_calls is None:
        return
    if not isinstance(tool_calls, list):
        raise ValueError("tool_calls must be a list or None.")
    for i, call in enumerate(tool_calls):
        if not isinstance(call, dict):
            raise ValueError(f"tool_calls[{i}] must be a dict.")
        fn = call.get("function", call)
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"tool_calls[{i}] needs a string name.")
        if fn.get("arguments") is None:
            fn["arguments"] = {}


def parse_completion(
    tokenizer: Any, ids: list[int], prefix: list[int] | None = None, tools: Any = None
) -> dict:
    """One assistant message from completion `ids` (TRL's `parse_response`): the tokenizer's
    response parser (given the prompt `prefix` and `tools` with a `response_template`); the
    EOS token stripped from the content; a parse failure or malformed tool call decodes the
    ids as plain text."""
    try:
        if prefix is not None and getattr(tokenizer, "response_template", None) is not None:
            kwargs: dict[str, Any] = {"prefix": prefix}
            if "tools" in inspect.signature(tokenizer.parse_response).parameters:
                kwargs["tools"] = tools
            parsed = tokenizer.parse_response(ids, **kwargs)
        else:
            parsed = tokenizer.parse_response(ids)
        if parsed is None:
            raise ValueError("nothing parsed")
        if isinstance(parsed.get("content"), str) and tokenizer.eos_token:
            parsed["content"] = parsed["content"].removesuffix(tokenizer.eos_token)
        if not parsed.get("content"):
            parsed["content"] = ""
        if "tool_calls" in parsed:
            _validate_tool_calls(parsed["tool_calls"])
    except (ValueError, TypeError):
        parsed = {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}
    return parsed


def tool_suffix_ids(tokenizer: Any, tool_messages: list[dict], **chat_template_kwargs) -> list[int]:
    """The tokens the chat template puts after an assistant turn that called tools: the tool
    messages and the next generation prompt (TRL's `_get_tool_suffix_ids`: the difference of
    rendering a dummy exchange with and without them, cut at the last EOS of the first)."""
    messages = _dummy_exchange(tool_messages[0]["name"])
    prefix = tokenizer.apply_chat_template(
        messages, add_generation_prompt=False, tokenize=True, return_dict=False,
        **chat_template_kwargs,
    )  # fmt: skip
    full = tokenizer.apply_chat_template(
        messages + tool_messages, add_generation_prompt=True, tokenize=True, return_dict=False,
        **chat_template_kwargs,
    )  # fmt: skip
    prefix, full = list(prefix), list(full)
    eos = [i for i, t in enumerate(prefix) if t == tokenizer.eos_token_id]
    if eos:
        prefix = prefix[: eos[-1] + 1]
    if full[: len(prefix)] != prefix:
        raise ValueError("The chat template's tool suffix does not follow its assistant turn.")
    return full[len(prefix) :]


# ----------------------------------------------------------------- running calls
def _run_sync(tool: Callable, args: Any) -> concurrent.futures.Future:
    """`tool(**args)` on its own daemon thread (not a pool's: the interpreter joins a pool's
    threads at exit, so one hung tool would hang the exit); its outcome on the future. Calling
    `tool(**args)` there, not here, gives arguments that are not a mapping the error text of
    TRL's call."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(tool(**args))
        except BaseException as e:
            future.set_exception(e)

    threading.Thread(target=run, name="jaxrl-tool", daemon=True).start()
    return future


class ToolExecutor:
    """Runs a turn's tool calls: async tools concurrently on one event loop, sync tools each on
    a thread, all daemon threads, each call under `timeout_s` (a call past it fails and is left
    behind: nothing waits for it, not even the interpreter's exit). Results keep TRL's order:
    the sync calls' results (and errors) in call order, then the async calls' in call order.
    `close()` (the trainer's, when `train()` ends) stops the event loop."""

    def __init__(self, timeout_s: float = DEFAULT_TOOL_TIMEOUT_S):
        self.timeout_s = timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self.closed = False

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        if self.closed:
            raise RuntimeError("This ToolExecutor is closed.")
        if self._loop is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="jaxrl-tool-loop", daemon=True).start()
            self._loop = loop
        return self._loop

    def run_rows(
        self, rows: list[tuple[list[dict], dict[str, Callable]]]
    ) -> tuple[list[list[tuple[str, Any]]], int, int]:
        """`rows`: each rollout's tool calls with its tools by name. Returns each row's
        `(name, result)` list (a failure's result is TRL's `{"error": text}`), the number of
        calls and of failures. All rows' calls run concurrently."""
        if self.closed:
            raise RuntimeError("This ToolExecutor is closed.")
        n_calls = n_failures = 0
        pending: list[list[tuple[str, Any, str]]] = []  # (name, future | result, kind)
        for calls, tools in rows:
            row = []
            for call in calls:
                n_calls += 1
                if call.get("type", "function") != "function":
                    n_failures += 1
                    row.append((call.get("name", "unknown"), {"error": (
                        f"Unsupported tool call type: {call.get('type')}")}, "sync"))  # fmt: skip
                    continue
                fn = call.get("function", call)
                name = fn["name"]
                tool = tools.get(name)
                args = fn.get("arguments")
                if tool is None:
                    n_failures += 1
                    row.append((name, {"error": f"Tool {name} not found."}, "sync"))
                elif is_async_tool(tool):
                    try:
                        coro = tool(**args)
                    except Exception as e:  # bad arguments fail at the call, as TRL's
                        n_failures += 1
                        row.append((name, {"error": str(e)}, "sync"))
                        continue
                    future = asyncio.run_coroutine_threadsafe(
                        asyncio.wait_for(coro, self.timeout_s), self._event_loop()
                    )
                    row.append((name, future, "async"))
                else:
                    row.append((name, _run_sync(tool, args), "future"))
            pending.append(row)
        results = []
        for row in pending:
            sync_part, async_part = [], []
            for name, value, kind in row:
                if kind == "sync":
                    sync_part.append((name, value))
                    continue
                try:
                    result = value.result(timeout=self.timeout_s + 1.0)
                except (TimeoutError, concurrent.futures.TimeoutError):
                    value.cancel()
                    n_failures += 1
                    result = {"error": f"Tool {name} timed out after {self.timeout_s:g} s."}
                except Exception as e:
                    n_failures += 1
                    result = {"error": str(e)}
                (async_part if kind == "async" else sync_part).append((name, result))
            results.append(sync_part + async_part)
        return results, n_calls, n_failures

    def close(self) -> None:
        """Stop the event loop (pending async calls are dropped); sync calls still running
        are left to their daemon threads."""
        self.closed = True
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop = None


# ----------------------------------------------------------------- the multi-turn loop
@dataclasses.dataclass
class ToolRollout:
    """The rollouts after the tool loop: each row's completion ids (all turns, tool results
    included), its `tool_mask` (0 on tool-result tokens), its conversation (the assistant and
    tool messages), the batch's call and failure counts, and the wall seconds its tool calls took
    (`tool_s`, read by `python -m jaxrl.bench --algo grpo --tools`)."""

    completion_ids: list[list[int]]
    tool_mask: list[list[int]]
    completions: list[list[dict]]
    n_calls: int
    n_failures: int
    tool_s: float = 0.0

    def metrics(self) -> dict[str, float]:
        """TRL's `tools/call_frequency` (calls per rollout) and `tools/failure_frequency`
        (failed calls per call, 0 without calls)."""
        n = len(self.completion_ids)
        return {
            "tools/call_frequency": self.n_calls / n,
            "tools/failure_frequency": self.n_failures / self.n_calls if self.n_calls else 0.0,
        }


def tool_call_loop(
    *,
    tokenizer: Any,
    prompt_ids: list[list[int]],
    completion_ids: list[list[int]],
    completions: list[list[dict]],
    tools_per_row: list[list[Callable]],
    generate: Callable[[list[list[int]]], list[list[int]]],
    executor: ToolExecutor,
    max_iterations: int,
    max_completion_length: int,
    max_model_len: int | None = None,
    chat_template_kwargs: dict | None = None,
) -> ToolRollout:
    """Run the tool calls of each rollout and let the model continue (see the module doc).

    `completions[i]` is row i's conversation so far (one parsed assistant message);
    `generate(ids_rows)` samples one continuation per row of `prompt + completion + suffix`
    ids. Inputs are not modified."""
    kwargs = dict(chat_template_kwargs or {})
    completion_ids = [list(ids) for ids in completion_ids]
    completions = copy.deepcopy(completions)
    tool_mask = [[1] * len(ids) for ids in completion_ids]
    by_name = [{t.__name__: t for t in tools} for tools in tools_per_row]
    active = [i for i, c in enumerate(completions) if c[0].get("tool_calls")]
    calls = {i: completions[i][0]["tool_calls"] for i in active}
    n_calls = n_failures = 0
    iteration = 0
    tool_s = 0.0
    while active and iteration < max_iterations:
        before = {i: len(completions[i]) for i in active}
        t0 = time.perf_counter()
        results, c, f = executor.run_rows([(calls[i], by_name[i]) for i in active])
        tool_s += time.perf_counter() - t0
        n_calls, n_failures = n_calls + c, n_failures + f
        for i, row in zip(active, results, strict=True):
            for name, result in row:
                content = result if isinstance(result, list) else str(result)
                completions[i].append({"role": "tool", "name": name, "content": content})
        turn_ids = []
        for i in active:
            tools_msgs = []
            for message in reversed(completions[i]):
                if message["role"] != "tool":
                    break
                tools_msgs.insert(0, message)
            suffix = tool_suffix_ids(tokenizer, tools_msgs, **kwargs)
            turn_ids.append(prompt_ids[i] + completion_ids[i] + suffix)
        # TRL: a tool result that pushes the completion past its budget (or the sequence past
        # the model's context) is rolled back, and the rollout ends as it was.
        overlong = [
            len(ids) - len(prompt_ids[i]) > max_completion_length
            or (max_model_len is not None and len(ids) >= max_model_len)
            for i, ids in zip(active, turn_ids, strict=True)
        ]
        for i, over in zip(active, overlong, strict=True):
            if over:
                del completions[i][before[i] :]
        turn_ids = [ids for ids, over in zip(turn_ids, overlong, strict=True) if not over]
        active = [i for i, over in zip(active, overlong, strict=True) if not over]
        if not active:
            break
        new_ids = generate(turn_ids)
        next_active = []
        for i, ids, new in zip(active, turn_ids, new_ids, strict=True):
            budget = max_completion_length - (len(ids) - len(prompt_ids[i]))
            new = list(new)[: max(budget, 0)]
            tool_len = len(ids) - len(prompt_ids[i]) - len(completion_ids[i])
            tool_mask[i] += [0] * tool_len + [1] * len(new)
            completion_ids[i] = ids[len(prompt_ids[i]) :] + new
            message = parse_completion(tokenizer, new, prefix=ids, tools=tools_per_row[i])
            if message:
                completions[i].append(message)
            if message.get("tool_calls"):
                calls[i] = message["tool_calls"]
                next_active.append(i)
        active = next_active
        iteration += 1
    return ToolRollout(completion_ids, tool_mask, completions, n_calls, n_failures, tool_s)

"""The embedded tool-use task: sums too long to do in the head, with a `calculator` tool.

Prompts are single user messages such as `"48213+90517="` (5-digit operands from 50000 to 99999,
so every sum has 6 digits); the answer is the sum's digits as the final assistant message. A tiny model cannot add such numbers
itself, but it can copy the operands into a `calculator` call and the tool's result into its
answer; `python -m jaxrl.train --algo grpo --config arith_tools` trains it to do so (TRL 1.16's
`GRPOTrainer(tools=[calculator])`), rewarded by `jaxrl.rewards.arith_correct`.

This module holds the task's pieces, all host-only: the tool, the tool-capable chat template with
its response template (how transformers reads tool calls back), the character-level tokenizer
that knows the template's markers, the train/test prompts and the demonstrations the shipped
model is fine-tuned on. `examples/make_tools_model.py` writes the shipped files under
`jaxrl/assets/arith/` from these functions; this module only reads them.
"""

from __future__ import annotations

import ast
import operator
import string
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from jaxrl.data.char_tokenizer import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, SPECIAL_TOKENS, UNK_TOKEN
from jaxrl.data.task import ASSETS_DIR

TOOLS_MODEL_DIR = ASSETS_DIR / "tools_model"  # the shipped SFT model (weights and config)
# Its tokenizer, in a directory of its own: beside the model's config.json, AutoTokenizer would
# load it as Qwen2's tokenizer class, which drops the spaces of the tool-call JSON.
TOOLS_TOKENIZER_DIR = ASSETS_DIR / "tools_tokenizer"
TOOLS_DATA_DIR = ASSETS_DIR / "tools_task"  # train.jsonl / test.jsonl prompts

# Operand range: a 5-digit sum needs carries across 5 places, which a 0.2M parameter model
# cannot do in the head, while copying digits (into a call, out of a result) is easy for
# attention. Fixed widths put each copied digit at a fixed distance from its source (variable
# widths, 4 to 6 digits, were measured to need several times more SFT steps to copy at all).
OPERAND_MIN, OPERAND_MAX = 50_000, 99_999
TRAIN_SEED, TEST_SEED = 7, 8  # fixed: changing them changes the shipped prompts

# Chat markers, one token each; the rest of the vocabulary is printable ASCII, one token per
# character, so tool-call JSON, schemas and error texts encode without `<unk>`.
USER, ASSISTANT, TOOL, SYSTEM = "<|user|>", "<|assistant|>", "<|tool|>", "<|system|>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
MARKERS = (SYSTEM, USER, ASSISTANT, TOOL, CALL_OPEN, CALL_CLOSE)

# Renders `<|system|>tools: calculator(expression)<eos>` when tools are given (names and
# parameter names only: the schema's prose would be hundreds of character tokens), each message
# as `<|role|>content<eos>`, an assistant's tool calls as Qwen-style
# `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` after its content. Prefix-preserving
# (rendering more messages never changes earlier ones), and the assistant turns, their EOS
# included, are inside `{% generation %}` so that `assistant_only_loss` trains exactly them.
CHAT_TEMPLATE = (
    "{%- if tools -%}" + SYSTEM + "tools:"
    "{%- for t in tools %}{% set f = t.function if t.function is defined else t %}"
    " {{ f.name }}({{ (f.parameters.properties if f.parameters is defined else {}) | list"
    " | join(',') }})"
    "{%- endfor %}" + EOS_TOKEN + "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' or m.role == 'system' -%}" + USER + "{{ m.content }}" + EOS_TOKEN +
    "{%- elif m.role == 'assistant' -%}" + ASSISTANT + "{% generation %}"
    "{{ m.content if m.content is string else '' }}"
    "{%- for c in m.tool_calls or [] -%}{% set f = c.function if c.function is defined else c %}"
    + CALL_OPEN + '{"name": "{{ f.name }}", "arguments": '
    "{{ f.arguments if f.arguments is string else f.arguments | tojson }}}" + CALL_CLOSE +
    "{%- endfor -%}" + EOS_TOKEN + "{% endgeneration %}"
    "{%- elif m.role == 'tool' -%}" + TOOL + "{{ m.content }}" + EOS_TOKEN +
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}" + ASSISTANT + "{%- endif -%}"
)  # fmt: skip

# transformers' response template for `tokenizer.parse_response` (what TRL's tool loop reads
# calls with): the text after the last `<|assistant|>`, tool calls as JSON between the call
# markers, the rest up to EOS as content.
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": ASSISTANT,
    "fields": {
        "tool_calls": {
            "open": CALL_OPEN,
            "close": CALL_CLOSE,
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<eos>|$", "content": "text"},
    },
}


def build_tool_tokenizer() -> PreTrainedTokenizerFast:
    """The task's tokenizer: `<pad>`=0, `<eos>`=1, `<bos>`=2, `<unk>`=3, the chat markers, then
    one id per printable ASCII character; with `CHAT_TEMPLATE` and `RESPONSE_TEMPLATE` set."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + MARKERS)}
    for c in string.digits + "+=" + string.printable:
        if c not in "\t\n\r\x0b\x0c":
            vocab.setdefault(c, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_TOKENS + MARKERS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        bos_token=BOS_TOKEN,
        unk_token=UNK_TOKEN,
        chat_template=CHAT_TEMPLATE,
    )
    fast.response_template = RESPONSE_TEMPLATE
    return fast


def load_tool_tokenizer(path: str | Path = TOOLS_TOKENIZER_DIR) -> Any:
    """The shipped tokenizer (chat and response templates included), loaded offline."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


# ----------------------------------------------------------------- the tool
_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_MAX_DIGITS_IN = 30  # numbers longer than this are refused (no big-number work on the host)


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        if len(str(node.value)) > _MAX_DIGITS_IN:
            raise ValueError(f"number too long (more than {_MAX_DIGITS_IN} digits)")
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod) and right == 0:
            raise ValueError("division by zero")
        return _OPS[type(node.op)](left, right)
    raise ValueError("only numbers, + - * / // % and parentheses are allowed")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: Numbers combined with +, -, *, /, //, % and parentheses, e.g. "48213+90517".

    Returns:
        The value, e.g. "953330" (an integer without a decimal point when it is whole).
    """
    if not isinstance(expression, str):
        raise TypeError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > 200:
        raise ValueError("expression too long (more than 200 characters)")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse expression {expression!r}") from None
    value = _evaluate(tree)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def calculator_schema() -> dict[str, Any]:
    """`calculator`'s JSON schema as transformers describes it to a chat template."""
    from transformers.utils import get_json_schema

    return get_json_schema(calculator)


# ----------------------------------------------------------------- prompts and demonstrations
def operand_pairs(n: int, seed: int | list[int]) -> list[tuple[int, int]]:
    """`n` operand pairs drawn uniformly from [OPERAND_MIN, OPERAND_MAX]."""
    values = np.random.default_rng(seed).integers(OPERAND_MIN, OPERAND_MAX + 1, size=(n, 2))
    return [(int(a), int(b)) for a, b in values]


def prompt_messages(a: int, b: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{a}+{b}="}]


def prompts(split: str, n: int) -> list[dict[str, Any]]:
    """`n` conversational prompt rows `{"prompt": [user message]}` of `split` ("train": pairs of
    seed TRAIN_SEED, "test": of TEST_SEED; among 2.5e9 pairs a held-out pair that was also
    trained on is a rare event, checked in the tests)."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}.")
    seed = TRAIN_SEED if split == "train" else TEST_SEED
    return [{"prompt": prompt_messages(a, b)} for a, b in operand_pairs(n, seed)]


def demonstration(a: int, b: int, call: bool) -> dict[str, Any]:
    """One SFT example: the prompt, and either a calculator call, its result and the answer
    (`call`), or the answer written directly."""
    answer = str(a + b)
    if not call:
        completion = [{"role": "assistant", "content": answer}]
    else:
        expression = f"{a}+{b}"
        call_msg = {
            "type": "function",
            "function": {"name": "calculator", "arguments": {"expression": expression}},
        }
        completion = [
            {"role": "assistant", "content": "", "tool_calls": [call_msg]},
            {"role": "tool", "name": "calculator", "content": calculator(expression)},
            {"role": "assistant", "content": answer},
        ]
    return {"prompt": prompt_messages(a, b), "completion": completion}


def demonstrations(n: int, call_fraction: float, seed: int) -> list[dict[str, Any]]:
    """`n` demonstrations on train operands, a `call_fraction` of them calling the tool."""
    rng = np.random.default_rng([seed, 1])
    calls = rng.random(n) < call_fraction
    pairs = operand_pairs(n, [seed, 2])
    return [demonstration(a, b, bool(c)) for (a, b), c in zip(pairs, calls, strict=True)]

"""A tool-capable tiny setup for the agentic GRPO/RLOO tests: a character tokenizer with Qwen2.5's
special tokens, TRL's Qwen2.5 chat template (tool calls in `<tool_call>` JSON) and TRL's Qwen3
response template (the parser TRL sets for it), a tiny Qwen2 saved by transformers, and scripted
completions that both trainers' generation is patched with (as TRL's own tests do)."""

from __future__ import annotations

import pathlib
import re
import string

import datasets

SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]


def tool_tokenizer():
    """Every printable ASCII character one token, Qwen2.5's markers special tokens."""
    import trl
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from trl.chat_template_utils import qwen3_template

    chars = sorted(set(string.printable))
    vocab = {tok: i for i, tok in enumerate(SPECIALS + ["<unk>"] + chars)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        additional_special_tokens=SPECIALS[1:2],
    )
    tok.add_tokens([t for t in SPECIALS[3:]], special_tokens=False)
    template = pathlib.Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja"
    tok.chat_template = template.read_text()
    tok.response_template = qwen3_template
    return tok


def tool_model_dir(path, tokenizer) -> str:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    Qwen2ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def prompts(n: int) -> datasets.Dataset:
    return datasets.Dataset.from_list(
        [{"prompt": [{"role": "user", "content": f"Q{i}"}]} for i in range(n)]
    )


def call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call><|im_end|>'


# First turn of (prompt, generation): what the model "says".
FIRST = {
    ("Q0", 0): call("add", '{"a": 2, "b": 3}'),
    ("Q0", 1): "seven<|im_end|>",
    ("Q1", 0): call("mul", '{"a": 2}'),  # unknown tool
    ("Q1", 1): '<tool_call>\n{"name": "add", "arguments": \n</tool_call><|im_end|>',  # malformed
    ("Q2", 0): call("long", "{}"),  # a result overflowing the completion budget
    ("Q2", 1): call("slow_add", '{"a": 40, "b": 2}'),  # async
}
# Later turns: the answer to the last tool response.
AFTER = {
    "5": "five<|im_end|>",
    "Tool mul not found.": call("boom", "{}"),
    "boom!": call("add", '{"a": 1, "b": 1}'),  # past max_tool_calling_iterations: not run
    "42": "forty-two<|im_end|>",
}


def script(text: str, g: int | None) -> str:
    responses = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text, re.S)
    if responses:
        content = responses[-1]
        if content.startswith("{'error'"):
            content = re.sub(r"^\{'error': '(.*)'\}$", r"\1", content)
        return AFTER[content]
    (prompt,) = re.findall(r"<\|im_start\|>user\n(Q\d)", text)
    return FIRST[(prompt, g)]


# ----------------------------------------------------------------- the tools
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b  # not a string: the trainer turns it into one


async def slow_add(a: int, b: int) -> str:
    """Add two integers, asynchronously.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return str(a + b)


def boom() -> str:
    """A tool that always fails."""
    raise RuntimeError("boom!")


def long() -> str:
    """A tool with a long answer."""
    return "x" * 600


TOOLS = [add, slow_add, boom, long]

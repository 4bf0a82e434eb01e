"""The setup of `python -m jaxrl.bench --algo grpo --tools calculator`: GRPO with a `calculator`
tool on 4-6 digit arithmetic, the same for jaxrl and TRL's `GRPOTrainer` (the runner is
`jaxrl.bench.grpo`).

No shipped model calls tools (the arithmetic SFT model's character tokenizer has no chat
template), so the bench uses a **scripted policy on real decoding**: a tiny random Qwen2 (saved
by transformers, loaded by both sides) with a character tokenizer carrying Qwen2.5's chat
template (TRL's `qwen2_5.jinja`, tool calls in `<tool_call>` JSON) and TRL's Qwen3 response
parser. Every turn the model really decodes (KV-cache sampler / transformers `generate`, up to
`max_completion_length` tokens), then the decoded text is replaced by the script's: on the
first turn even generations call `calculator` with the question's expression and odd ones
answer from the head (wrong); after a tool response the model states the tool's result. So
each step has real decode cost on both sides, real tool calls (half the rollouts, one each),
a second turn for those, and a non-zero advantage.

Host setup only: nothing here times or trains.
"""

from __future__ import annotations

import functools
import pathlib
import random
import re
import string
import time
from collections.abc import Callable

# Qwen2.5's markers: the first three special, the tool markers plain added tokens (as the tests'
# tool-capable tokenizer).
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
TOOL_NAMES = ("calculator",)
_QUESTION = re.compile(r"What is (\d+) ([*+]) (\d+)\?")
_RESPONSE = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.S)


def tool_tokenizer():
    """Every printable ASCII character one token, Qwen2.5's markers, TRL's Qwen2.5 chat template
    and Qwen3 response parser. Needs `trl` (the test extra) for the template files: the bench
    compares against TRL anyway."""
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
    tok.add_tokens(SPECIALS[3:], special_tokens=False)
    template = pathlib.Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja"
    tok.chat_template = template.read_text()
    tok.response_template = qwen3_template
    return tok


def save_model(path: str, tokenizer) -> str:
    """A tiny random Qwen2 (2 layers, hidden 64, 4 heads / 2 KV heads, MLP 256) with the
    tokenizer, saved by transformers to `path`."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=256,
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
    return path


def questions(n: int, seed: int = 0) -> list[dict]:
    """`n` conversational prompts "What is A op B?" with 4-6 digit operands."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(1000, 999999), rng.randint(1000, 999999)
        op = rng.choice("+*")
        rows.append({"prompt": [{"role": "user", "content": f"What is {a} {op} {b}?"}]})
    return rows


def _evaluate(a: str, op: str, b: str) -> int:
    return int(a) + int(b) if op == "+" else int(a) * int(b)


def make_calculator(latency_s: float = 0.0, spent: list[float] | None = None) -> Callable:
    """The `calculator` tool; it sleeps `latency_s` (a remote call's latency, 0 by default) and
    adds each call's seconds to `spent` (TRL's side of the bench: its sync tools run one after
    another, so their sum is its tool wall time)."""

    def calculator(expression: str) -> str:
        """Evaluate the sum or product of two integers.

        Args:
            expression: Two integers joined by `+` or `*`, e.g. "123 * 456".
        """
        t0 = time.perf_counter()
        if latency_s:
            time.sleep(latency_s)
        match = re.fullmatch(r"\s*(\d+)\s*([*+])\s*(\d+)\s*", expression)
        if match is None:
            raise ValueError(f"Cannot evaluate {expression!r}: expected 'A + B' or 'A * B'.")
        result = str(_evaluate(*match.groups()))
        if spent is not None:
            spent.append(time.perf_counter() - t0)
        return result

    return calculator


def script(text: str, generation: int) -> str:
    """The scripted policy's reply to a conversation `text` (see the module doc)."""
    responses = _RESPONSE.findall(text)
    if responses:
        return f"The answer is {responses[-1]}.<|im_end|>"
    a, op, b = _QUESTION.findall(text)[-1]
    if generation % 2 == 0:
        arguments = f'{{"expression": "{a} {op} {b}"}}'
        return (
            f'<tool_call>\n{{"name": "calculator", "arguments": {arguments}}}\n'
            "</tool_call><|im_end|>"
        )
    return f"The answer is {int(a) + 1}.<|im_end|>"


def calculator_correct(prompts, completions, **kwargs) -> list[float]:
    """1 when the conversation's last message states the question's answer, else 0."""
    out = []
    for prompt, completion in zip(prompts, completions, strict=True):
        a, op, b = _QUESTION.findall(prompt[-1]["content"])[-1]
        last = str(completion[-1].get("content", ""))
        out.append(1.0 if f"answer is {_evaluate(a, op, b)}." in last else 0.0)
    return out


def script_ours(trainer, tokenizer, decoded: list[int]) -> None:
    """jaxrl's turns: the real sampler decodes, then the script's text replaces its output;
    `decoded` collects the real tokens per call."""
    real = trainer._sample_turn

    @functools.wraps(real)
    def sample_turn(params, rows, config, seed, group_size=1, pad_rows_to=None):
        ids = real(params, rows, config, seed, group_size, pad_rows_to)
        decoded.append(sum(map(len, ids)))
        texts = [tokenizer.decode(r) for r in rows]
        return [tokenizer(script(t, g))["input_ids"] for t in texts for g in range(group_size)]

    trainer._sample_turn = sample_turn


def script_trl(trainer, tokenizer, group_size: int, decoded: list[int]) -> None:
    """TRL's turns (`_generate_single_turn`, its prompts already one per rollout): the same."""
    real = trainer._generate_single_turn

    def generate(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        ids, _ = real(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        decoded.append(sum(map(len, ids)))
        texts = [tokenizer.decode(p) for p in prompt_ids]
        out = [tokenizer(script(t, i % group_size))["input_ids"] for i, t in enumerate(texts)]
        return out, None

    trainer._generate_single_turn = generate

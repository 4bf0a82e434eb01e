"""Shared fixtures for the data tests: an offline character tokenizer with a chat template."""

import string

import datasets
import pytest

from jaxrl.data.char_tokenizer import build_char_tokenizer

datasets.disable_progress_bars()

# Renders "U:<user text>\n" and "A:<assistant text><eos>", marking assistant text + EOS as
# generated so `return_assistant_tokens_mask` works.
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}A:{% generation %}{{ m['content'] }}"
    "<eos>{% endgeneration %}{% else %}U:{{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}A:{% endif %}"
)
PLAIN_CHAT_TEMPLATE = CHAT_TEMPLATE.replace("{% generation %}", "").replace(
    "{% endgeneration %}", ""
)


@pytest.fixture(scope="session")
def tok():
    return build_char_tokenizer(string.printable, chat_template=CHAT_TEMPLATE)


@pytest.fixture(scope="session")
def tok_plain_template():
    return build_char_tokenizer(string.printable, chat_template=PLAIN_CHAT_TEMPLATE)

"""The embedded tool-use task (`jaxrl.data.tool_task`): the `calculator` tool (its schema as the
chat template gets it, its values and errors as the tool loop reports them), the shipped
tokenizer's tool-capable chat template and response template (a call rendered, parsed back and
followed by the tool suffix TRL's loop builds), and the prompts and demonstrations."""

import json

import pytest
from transformers.utils import get_json_schema

from jaxrl.data import task, tool_task
from jaxrl.rewards import arith_correct
from jaxrl.trainers.tools import (
    ToolExecutor,
    check_tool_tokenizer,
    parse_completion,
    tool_suffix_ids,
)


@pytest.fixture(scope="module")
def tok():
    return tool_task.load_tool_tokenizer()


def test_calculator_schema_is_what_the_template_gets():
    schema = get_json_schema(tool_task.calculator)
    fn = schema["function"]
    assert schema["type"] == "function" and fn["name"] == "calculator"
    assert fn["parameters"]["properties"]["expression"]["type"] == "string"
    assert fn["parameters"]["required"] == ["expression"]
    assert "+" in fn["parameters"]["properties"]["expression"]["description"]
    assert tool_task.calculator_schema() == schema


@pytest.mark.parametrize(
    "expression, value",
    [("48213+905117", "953330"), ("2*(3+4)", "14"), (" 7/2 ", "3.5"), ("6/3", "2"),
     ("-5+2", "-3"), ("17//5", "3"), ("17%5", "2"), ("1.5*2", "3")],
)  # fmt: skip
def test_calculator_values(expression, value):
    assert tool_task.calculator(expression) == value


@pytest.mark.parametrize(
    "expression, error",
    [("1/0", "division by zero"), ("2**10", "only numbers"), ("__import__('os')", "only numbers"),
     ("1+", "cannot parse"), ("x+1", "only numbers"), ("1" * 31, "number too long"),
     ("1+" * 101 + "1", "expression too long")],
)  # fmt: skip
def test_calculator_errors_reach_the_model_as_trl_error_results(expression, error):
    with pytest.raises(ValueError, match=error):
        tool_task.calculator(expression)
    executor = ToolExecutor(timeout_s=5.0)
    try:
        call = {"type": "function", "function": {"name": "calculator",
                                                 "arguments": {"expression": expression}}}  # fmt: skip
        results, n_calls, n_failures = executor.run_rows(
            [([call], {"calculator": tool_task.calculator})]
        )
    finally:
        executor.close()
    assert (n_calls, n_failures) == (1, 1)
    assert error in results[0][0][1]["error"]


def test_calculator_refuses_a_non_string():
    with pytest.raises(TypeError, match="expression must be a string"):
        tool_task.calculator(12)


def test_shipped_tokenizer_is_the_one_the_code_builds(tok):
    built = tool_task.build_tool_tokenizer()
    assert tok.get_vocab() == built.get_vocab() and len(tok) == 105
    assert tok.chat_template == tool_task.CHAT_TEMPLATE
    assert tok.response_template == tool_task.RESPONSE_TEMPLATE
    # The other recipes' tokenizer is untouched: no chat template, 16 tokens.
    plain = task.load_tokenizer()
    assert plain.chat_template is None and len(plain) == 16


def test_shipped_tokenizer_renders_a_tool_conversation_and_parses_the_call_back(tok):
    check_tool_tokenizer(tok)  # TRL's template check, a response parser, prefix-preserving
    demo = tool_task.demonstration(48213, 905117, call=True)
    text = tok.apply_chat_template(
        demo["prompt"] + demo["completion"], tools=[tool_task.calculator], tokenize=False
    )
    assert text == (
        "<|system|>tools: calculator(expression)<eos><|user|>48213+905117=<eos><|assistant|>"
        '<tool_call>{"name": "calculator", "arguments": {"expression": "48213+905117"}}'
        "</tool_call><eos><|tool|>953330<eos><|assistant|>953330<eos>"
    )
    ids = tok(text)["input_ids"]
    assert tok.unk_token_id not in ids and tok.decode(ids) == text
    prompt = tok.apply_chat_template(
        demo["prompt"], tools=[tool_task.calculator], add_generation_prompt=True,
        tokenize=True, return_dict=True,
    )["input_ids"]  # fmt: skip
    assert ids[: len(prompt)] == list(prompt)
    call_ids = tok('<tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}'
                   "</tool_call><eos>")["input_ids"]  # fmt: skip
    message = parse_completion(tok, call_ids, prefix=prompt, tools=[tool_task.calculator])
    assert message == {
        "role": "assistant", "content": "",
        "tool_calls": [{"type": "function", "function": {
            "name": "calculator", "arguments": {"expression": "1+2"}}}],
    }  # fmt: skip
    suffix = tool_suffix_ids(tok, [{"role": "tool", "name": "calculator", "content": "3"}])
    assert tok.decode(suffix) == "<|tool|>3<eos><|assistant|>"
    answer = parse_completion(tok, tok("3<eos>")["input_ids"], prefix=prompt + call_ids + suffix)
    assert answer == {"role": "assistant", "content": "3"}
    # A call cut off mid-JSON is plain text (TRL's fallback), not a call.
    cut = parse_completion(tok, call_ids[:20], prefix=prompt, tools=[tool_task.calculator])
    assert "tool_calls" not in cut


def test_assistant_only_loss_trains_the_assistant_turns_and_their_eos(tok):
    demo = tool_task.demonstration(1234, 5678, call=True)
    out = tok.apply_chat_template(
        demo["prompt"] + demo["completion"], tools=[tool_task.calculator], tokenize=True,
        return_dict=True, return_assistant_tokens_mask=True,
    )  # fmt: skip
    trained = [i for i, m in zip(out["input_ids"], out["assistant_masks"], strict=True) if m]
    assert tok.decode(trained) == (
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1234+5678"}}'
        "</tool_call><eos>6912<eos>"
    )


def test_prompts_and_demonstrations():
    train, test = tool_task.prompts("train", 4000), tool_task.prompts("test", 128)
    assert train == tool_task.prompts("train", 4000)  # deterministic
    contents = lambda rows: {r["prompt"][0]["content"] for r in rows}  # noqa: E731
    demos = tool_task.demonstrations(800, 0.4, seed=0)
    assert not contents(test) & (contents(train) | contents(demos))
    for row in test + train[:200]:
        a, b = row["prompt"][0]["content"].rstrip("=").split("+")
        assert 50_000 <= int(a) <= 99_999 and 50_000 <= int(b) <= 99_999
        assert len(str(int(a) + int(b))) == 6  # every sum has 6 digits
    n_calls = sum(len(d["completion"]) == 3 for d in demos)
    assert 0.35 < n_calls / 800 < 0.45
    prompts = [d["prompt"] for d in demos]
    assert arith_correct(prompts, [d["completion"] for d in demos]) == [1.0] * 800
    assert json.loads(json.dumps(demos)) == demos  # JSON-serialisable rows
    with pytest.raises(ValueError, match="split must be"):
        tool_task.prompts("dev", 1)


def test_shipped_prompt_files_match_the_code():
    rows = [json.loads(line) for line in (tool_task.TOOLS_DATA_DIR / "test.jsonl").open()]
    assert rows == tool_task.prompts("test", len(rows)) and len(rows) == 128

"""`python -m jaxrl.bench --algo grpo --tools calculator`'s pieces, without the (minutes-long)
bench itself: the scripted policy's tool call parses as a `calculator` call with the question's
expression, the tool answers it, the policy's next turn states the answer and the reward scores
it; the tool loop times its tool calls (`tool_s`, what the bench reads as the trainer's
`tool_time_s`); a tool the bench does not know is refused with exit status 2."""

from __future__ import annotations

import time

import pytest
from tool_utils import tool_tokenizer

from jaxrl.bench import cli, grpo_tools
from jaxrl.trainers.tools import ToolExecutor, parse_completion, tool_call_loop

QUESTION = [{"role": "user", "content": "What is 123456 * 789?"}]


def test_scripted_policy_calls_the_calculator_and_is_scored():
    tok = grpo_tools.tool_tokenizer()
    spent: list[float] = []
    calculator = grpo_tools.make_calculator(0.0, spent)
    prompt_ids = tok.apply_chat_template(
        QUESTION, tools=[calculator], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    text = tok.decode(prompt_ids)
    call_ids = tok(grpo_tools.script(text, 0))["input_ids"]
    message = parse_completion(tok, call_ids, prefix=list(prompt_ids), tools=[calculator])
    (call,) = message["tool_calls"]
    assert call["function"] == {"name": "calculator", "arguments": {"expression": "123456 * 789"}}
    assert calculator(**call["function"]["arguments"]) == str(123456 * 789)
    assert len(spent) == 1
    answer = grpo_tools.script(text + "<tool_response>\n97406784\n</tool_response>", 0)
    assert answer == "The answer is 97406784.<|im_end|>"
    guess = grpo_tools.script(text, 1)  # odd generations answer from the head
    completions = [
        [{"role": "assistant", "content": answer.removesuffix("<|im_end|>")}],
        [{"role": "assistant", "content": guess.removesuffix("<|im_end|>")}],
    ]
    assert grpo_tools.calculator_correct([QUESTION] * 2, completions) == [1.0, 0.0]
    with pytest.raises(ValueError, match="Cannot evaluate"):
        calculator("2 ** 8")


def test_the_tool_loop_times_its_tool_calls():
    tok = tool_tokenizer()

    def slow(x: int) -> str:
        """Answer slowly.

        Args:
            x: A number.
        """
        time.sleep(0.2)
        return str(x)

    call = {"type": "function", "function": {"name": "slow", "arguments": {"x": 1}}}
    completions = [[{"role": "assistant", "content": "", "tool_calls": [call]}]] * 3
    executor = ToolExecutor(timeout_s=5.0)
    result = tool_call_loop(
        tokenizer=tok, prompt_ids=[[1, 2]] * 3, completion_ids=[[3]] * 3,
        completions=completions, tools_per_row=[[slow]] * 3,
        generate=lambda rows: [tok("ok<|im_end|>")["input_ids"] for _ in rows],
        executor=executor, max_iterations=4, max_completion_length=200,
    )  # fmt: skip
    executor.close()
    assert result.n_calls == 3
    # The three rows' calls run concurrently: about one call's time, not three.
    assert 0.2 <= result.tool_s < 0.5


def test_an_unknown_bench_tool_exits_2(capsys):
    assert cli.main(["--algo", "grpo", "--tools", "search"]) == 2
    err = capsys.readouterr().err
    assert "--tools search" in err and "--tools calculator" in err

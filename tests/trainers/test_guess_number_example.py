"""examples/guess_number.py, the environment_factory example: the game's rules and reward, and
one batch of it through the trainers' environment pool and tool loop (scripted binary search
as the model, the tiny tool-capable tokenizer of `tool_utils`), host only."""

import json
import re
import sys
from pathlib import Path

import pytest
from tool_utils import call, tool_tokenizer

from jaxrl.train import import_path
from jaxrl.trainers.environments import EnvironmentPool
from jaxrl.trainers.tools import ToolExecutor, check_tools, parse_completion, tool_call_loop

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import guess_number  # noqa: E402


def test_rules_and_reward():
    game = guess_number.GuessNumber()
    assert "guess" in game.reset(target=37, prompt=[])
    assert [game.guess(50), game.guess(25), game.guess(37)] == ["lower", "higher", "correct"]
    assert game.get_reward() == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="between 1 and 100"):
        game.guess(0)
    game.reset(target=5)
    assert (game.guesses, game.solved, game.get_reward()) == (0, False, 0.0)


def test_binary_search_through_the_tool_loop():
    tok = tool_tokenizer()
    pool = EnvironmentPool(guess_number.GuessNumber)
    assert [m.__name__ for m in pool.env_tools[None]] == ["guess"]
    check_tools(pool.env_tools[None])
    assert import_path("--environment_factory", "guess_number:GuessNumber", "class") is (
        guess_number.GuessNumber
    )
    data = guess_number.dataset(3, seed=1)
    examples = list(data)
    envs = pool.take([None] * len(examples))
    prompts = [pool.reset(e, ex, ex["prompt"]) for e, ex in zip(envs, examples, strict=True)]
    assert prompts[0][0]["content"].startswith("Let's play. A number between 1 and 100")

    def move(text):  # the model: a binary search replayed from the answers so far
        lo, hi = 1, 100
        for answer in re.findall(r"<tool_response>\n(\w+)\n</tool_response>", text):
            if answer == "correct":
                return "found<|im_end|>"
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if answer == "higher" else (lo, mid - 1)
        return call("guess", json.dumps({"number": (lo + hi) // 2}))

    prompt_ids = [
        tok.apply_chat_template(p, tools=pool.env_tools[None], add_generation_prompt=True,
                                tokenize=True, return_dict=False)
        for p in prompts
    ]  # fmt: skip
    first = [tok(move(""))["input_ids"] for _ in examples]
    completions = [
        [parse_completion(tok, ids, prefix=p)] for p, ids in zip(prompt_ids, first, strict=True)
    ]

    def generate(rows):
        return [tok(move(tok.decode(r)))["input_ids"] for r in rows]

    executor = ToolExecutor(timeout_s=5.0)
    result = tool_call_loop(
        tokenizer=tok, prompt_ids=prompt_ids, completion_ids=first, completions=completions,
        tools_per_row=[[guess_number.GuessNumber.guess.__get__(e)] for e in envs],
        generate=generate, executor=executor, max_iterations=10, max_completion_length=4000,
    )  # fmt: skip
    executor.close()
    assert all(e.solved for e in envs)
    assert [e.guesses for e in envs] == [
        sum(m["role"] == "tool" for m in c) for c in result.completions
    ]
    assert all(e.guesses <= 7 for e in envs)  # binary search over 100 numbers
    rewards = pool.reward_funcs[0](environments=envs)
    assert rewards == [pytest.approx(1 / e.guesses) for e in envs]
    assert pool.reward_funcs[0].__name__ == "GuessNumber"

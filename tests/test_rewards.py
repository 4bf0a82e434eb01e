"""Reward plumbing: TRL's calling convention, names, text formats and reward metrics."""

import functools
import logging
import types

import numpy as np
import pytest
import torch
from trl import GRPOTrainer
from trl.data_utils import apply_chat_template as trl_apply_chat_template
from trl.trainer.utils import get_callable_name
from trl.trainer.utils import nanstd as trl_nanstd

from jaxrl.data.char_tokenizer import build_char_tokenizer
from jaxrl.losses.grpo import grpo_advantages
from jaxrl.rewards import (
    RewardFunctionError,
    RewardModelFunc,
    arith_correct,
    completions_from_texts,
    compute_rewards,
    group_reward_metrics,
    resolve_reward_weights,
    reward_func_name,
    reward_model_texts,
)

PROMPTS = ["12+35=", "12+35=", "40+2=", "40+2="]
COMPLETIONS = ["47", "46", "42", "x"]


def length_reward(prompts, completions, completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


def scaled(prompts, completions, scale, **kwargs):
    return [scale * len(c) for c in completions]


class SkipOdd:
    """A callable class: scores even rows only, echoes a dataset column."""

    def __call__(self, prompts, completions, difficulty, **kwargs):
        return [None if i % 2 else d for i, d in enumerate(difficulty)]


async def async_reward(prompts, completions, **kwargs):
    return [1.0] * len(prompts)


def test_compute_rewards_calls_every_kind_of_function_like_trl():
    seen = {}

    def spy(prompts, completions, **kwargs):
        seen.update(kwargs)
        return [0.0] * len(prompts)

    funcs = [length_reward, functools.partial(scaled, scale=2.0), SkipOdd(), async_reward, spy]
    rewards = compute_rewards(
        funcs,
        PROMPTS,
        COMPLETIONS,
        completion_ids=[[1, 2], [3], [4, 5, 6], []],
        columns={"difficulty": [0.5, 0.6, 0.7, 0.8], "prompt": PROMPTS},
        trainer_state="state",
    )
    assert rewards.dtype == np.float32 and rewards.shape == (4, 5)
    np.testing.assert_array_equal(rewards[:, 0], [2, 1, 3, 0])
    np.testing.assert_array_equal(rewards[:, 1], [4, 4, 4, 2])
    np.testing.assert_array_equal(rewards[:, 2], np.array([0.5, np.nan, 0.7, np.nan], np.float32))
    np.testing.assert_array_equal(rewards[:, 3], [1, 1, 1, 1])
    assert seen["difficulty"] == [0.5, 0.6, 0.7, 0.8] and seen["trainer_state"] == "state"
    assert "prompt" not in seen  # passed as `prompts=`, not again as a column


def test_rewards_match_trl_calculate_rewards():
    """Same functions, same rows: TRL's own `GRPOTrainer._calculate_rewards` gives the same
    `[N, K]` array and passes the functions the same keyword arguments."""
    seen = {"ours": {}, "trl": {}}

    def spy(prompts, completions, completion_ids, **kwargs):
        seen[kwargs["who"][0]] = kwargs
        return [float(len(p)) for p in prompts]

    funcs = [length_reward, functools.partial(scaled, scale=2.0), SkipOdd(), spy]
    ids = [[1, 2], [3], [4, 5, 6], []]
    difficulty = [0.5, 0.6, 0.7, 0.8]
    rows = [
        {"prompt": p, "difficulty": d, "who": "trl"}
        for p, d in zip(PROMPTS, difficulty, strict=True)
    ]
    trainer = object.__new__(GRPOTrainer)
    trainer.reward_funcs = funcs
    trainer.reward_processing_classes = [None] * len(funcs)
    trainer.reward_func_names = [reward_func_name(f) for f in funcs]
    trainer.state = types.SimpleNamespace(global_step=0)
    trainer.args = types.SimpleNamespace(report_to=[])
    trainer.accelerator = types.SimpleNamespace(device=torch.device("cpu"), is_main_process=True)
    trainer.environments = None
    want = trainer._calculate_rewards(rows, PROMPTS, COMPLETIONS, ids).numpy()
    got = compute_rewards(
        funcs,
        PROMPTS,
        COMPLETIONS,
        completion_ids=ids,
        columns={"prompt": PROMPTS, "difficulty": difficulty, "who": ["ours"] * 4},
        trainer_state=trainer.state,
        log_extra=trainer._log_completion_extra,
        log_metric=trainer._log_metric,
    )
    np.testing.assert_array_equal(got, want)
    assert np.isnan(got).any()
    assert (
        set(seen["ours"])
        == set(seen["trl"])
        == {
            "difficulty",
            "who",
            "trainer_state",
            "log_extra",
            "log_metric",
        }
    )


def test_names_match_trl():
    funcs = [length_reward, functools.partial(scaled, scale=2.0), SkipOdd(), lambda p, c, **k: []]
    assert [reward_func_name(f) for f in funcs] == [get_callable_name(f) for f in funcs]
    assert [reward_func_name(f) for f in funcs] == [
        "length_reward",
        "scaled",
        "SkipOdd",
        "<lambda>",
    ]
    rm = RewardModelFunc(lambda texts: [0.0] * len(texts), name="tiny-rm")
    assert reward_func_name(rm) == "tiny-rm"


def test_wrong_length_and_weights_are_rejected():
    with pytest.raises(ValueError, match="'short' returned 1 rewards, but 4"):

        def short(prompts, completions, **kwargs):
            return [1.0]

        compute_rewards([short], PROMPTS, COMPLETIONS)
    with pytest.raises(ValueError, match="Number of reward weights"):
        resolve_reward_weights([1.0], 2)
    np.testing.assert_array_equal(resolve_reward_weights(None, 3), [1, 1, 1])


def _returning(value):
    def bad_reward(prompts, completions, **kwargs):
        return value

    return bad_reward


@pytest.mark.parametrize(
    "value,words",
    [
        (None, ["returned None (NoneType)", "not a list", "4 rewards"]),
        (0.5, ["returned 0.5 (float)", "not a list"]),
        ("1.0", ["returned '1.0' (str)", "not a list"]),
        (["1.0", 1.0, 1.0, 1.0], ["returned '1.0' (str) for completion 0", "numbers or None"]),
        ([1.0, [2.0], 1.0, 1.0], ["returned [2.0] (list) for completion 1"]),
        ([1.0, 2.0], ["returned 2 rewards", "4 were expected", "[1.0, 2.0]"]),
        ([1.0, float("inf"), 1.0, 1.0], ["returned inf for completion 1", "'12+35='", "finite"]),
        ([1.0, 1.0, -np.inf, 1.0], ["returned -inf for completion 2", "'40+2='"]),
    ],
    ids=["None", "float", "string", "string element", "list element", "short", "inf", "-inf"],
)
def test_bad_reward_outputs_name_the_function_and_the_value(value, words):
    state = types.SimpleNamespace(global_step=7)
    with pytest.raises(RewardFunctionError) as err:
        compute_rewards([_returning(value)], PROMPTS, COMPLETIONS, trainer_state=state)
    message = str(err.value)
    for word in ["'bad_reward'", "at global step 7", *words]:
        assert word in message, message
    assert err.value.user_traceback == ""


def test_numbers_of_any_kind_and_nan_are_accepted_like_trl():
    out = [np.float64(0.5), True, torch.tensor(2.0), float("nan")]
    rewards = compute_rewards([_returning(out)], PROMPTS, COMPLETIONS)
    np.testing.assert_array_equal(rewards[:, 0], [0.5, 1.0, 2.0, np.nan])
    np.testing.assert_array_equal(
        compute_rewards([_returning(np.arange(4))], PROMPTS, COMPLETIONS)[:, 0], [0, 1, 2, 3]
    )


def wants_answer(prompts, completions, answer, **kwargs):
    return [float(c == a) for c, a in zip(completions, answer, strict=True)]


async def async_boom(prompts, completions, **kwargs):
    raise RuntimeError("scorer offline")


def test_a_raising_reward_function_is_named_with_its_traceback():
    state = types.SimpleNamespace(global_step=3)
    columns = {"difficulty": [1, 2, 3, 4]}
    with pytest.raises(RewardFunctionError) as err:
        compute_rewards([wants_answer], PROMPTS, COMPLETIONS, columns=columns, trainer_state=state)
    message = str(err.value)
    assert "'wants_answer' raised TypeError" in message and "at global step 3" in message
    assert "answer" in message  # Python's own words: the missing keyword argument
    assert isinstance(err.value.__cause__, TypeError)

    def reads_column(prompts, completions, **kwargs):
        return kwargs["answer"]

    with pytest.raises(RewardFunctionError) as err:
        compute_rewards([reads_column], PROMPTS, COMPLETIONS, columns=columns, trainer_state=state)
    assert "raised KeyError: 'answer'" in str(err.value)
    assert "dataset columns ['difficulty']" in str(err.value)  # the columns it does get
    # The user's frames only: the function's own line, not the caller's plumbing.
    tb = err.value.user_traceback
    assert tb.startswith("Traceback") and 'return kwargs["answer"]' in tb
    assert "in reads_column" in tb and "compute_rewards" not in tb

    with pytest.raises(RewardFunctionError) as err:
        compute_rewards([async_boom], PROMPTS, COMPLETIONS, trainer_state=state)
    assert "'async_boom' raised RuntimeError: scorer offline at global step 3" in str(err.value)
    assert "in async_boom" in err.value.user_traceback


def test_all_none_row_warns(caplog):
    def nothing(prompts, completions, **kwargs):
        return [None, 1.0, 1.0, 1.0]

    with caplog.at_level(logging.WARNING, logger="jaxrl.rewards"):
        rewards = compute_rewards([nothing], PROMPTS, COMPLETIONS)
    assert np.isnan(rewards[0, 0]) and "All reward functions returned None" in caplog.text


def test_reward_metrics_match_trl():
    r = np.array([[1.0, np.nan], [0.0, 2.0], [np.nan, np.nan], [1.0, 1.0]], np.float32)
    w = np.array([1.0, 0.5], np.float32)
    _, zero = grpo_advantages(r, w, num_generations=2)
    got = group_reward_metrics(r, w, ["a", "b"], zero)
    rpf = torch.tensor(r)
    want = {}
    for i, name in enumerate(["a", "b"]):
        want[f"rewards/{name}/mean"] = torch.nanmean(rpf[:, i]).item()
        want[f"rewards/{name}/std"] = trl_nanstd(rpf[:, i]).item()
    rewards = (rpf * torch.tensor(w).unsqueeze(0)).nansum(dim=1)
    rewards[torch.isnan(rpf).all(dim=1)] = torch.nan
    want["reward"] = torch.nanmean(rewards).item()
    want["reward_std"] = trl_nanstd(rewards).item()
    # Rows 0, 1 both reward 1.0 (std 0); rows 2, 3 have one scorable reward (std NaN, not zero).
    std = trl_nanstd(rewards.view(-1, 2), dim=1).repeat_interleave(2)
    want["frac_reward_zero_std"] = torch.isclose(std, torch.zeros_like(std)).float().mean().item()
    assert want["frac_reward_zero_std"] == 0.5
    assert set(got) == set(want)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-6, err_msg=name)
    _, zero = grpo_advantages(np.ones((4, 1), np.float32), w[:1], num_generations=2)
    assert group_reward_metrics(np.ones((4, 1)), w[:1], ["a"], zero)["frac_reward_zero_std"] == 1.0


TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


def test_conversational_formats_match_trl():
    tok = build_char_tokenizer("0123456789+=", chat_template=TEMPLATE)
    prompts = [[{"role": "user", "content": "1+2="}], [{"role": "user", "content": "3+4="}]]
    completions = completions_from_texts(prompts, ["3", "8"])
    assert completions == [
        [{"role": "assistant", "content": "3"}],
        [{"role": "assistant", "content": "8"}],
    ]
    texts = reward_model_texts(prompts, completions, tok)
    want = [
        trl_apply_chat_template({"messages": p + c}, tok)["text"]
        for p, c in zip(prompts, completions, strict=True)
    ]
    assert texts == want == ["<user>1+2=<assistant>3", "<user>3+4=<assistant>8"]
    assert completions_from_texts(["1+2="], ["3"]) == ["3"]
    assert reward_model_texts(["1+2="], ["3"]) == ["1+2=3"]
    with pytest.raises(ValueError, match="tokenizer"):
        reward_model_texts(prompts, completions)


def test_reward_model_hook_scores_built_texts():
    rm = RewardModelFunc(lambda texts: [len(t) for t in texts], name="rm")
    rewards = compute_rewards([rm, arith_correct], PROMPTS, COMPLETIONS)
    np.testing.assert_array_equal(rewards[:, 0], [8, 8, 7, 6])
    np.testing.assert_array_equal(rewards[:, 1], [1, 0, 1, 0])


def test_arith_correct():
    conv_prompts = [[{"role": "system", "content": "add"}, {"role": "user", "content": "10+5="}]]
    assert arith_correct(conv_prompts, [[{"role": "assistant", "content": "15"}]]) == [1.0]
    assert arith_correct(["10+5=", "10+5=", "hello"], ["15", "16", "15"]) == [1.0, 0.0, None]


def test_script_rewards_equal_trls():
    """`think_format_reward` and the soft overlong punishment equal `trl.rewards`' on the cases
    around every boundary; TRL's math-verify rewards need math_verify (a clear error without)."""
    import importlib.util

    from trl.rewards import get_soft_overlong_punishment as trl_overlong
    from trl.rewards import think_format_reward as trl_think

    from jaxrl.config import ConfigError
    from jaxrl.rewards import get_soft_overlong_punishment, script_reward_funcs, think_format_reward

    texts = ["<think>\na\n</think>\nb", "<think>a", "x<think>a</think>", "<think>a</think><think>",
             "<think></think>", "<think>a\n</think>"]  # fmt: skip
    messages = [[{"role": "assistant", "content": t}] for t in texts]
    want = trl_think(messages)
    assert want == [1.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    assert think_format_reward(messages) == want == think_format_reward(texts)
    ids = [[1] * n for n in (0, 79, 80, 81, 90, 99, 100, 101, 150)]
    assert get_soft_overlong_punishment(100, 20)(ids) == trl_overlong(100, 20)(ids)
    assert get_soft_overlong_punishment(100, 20)(ids)[4] == -0.5
    with pytest.raises(ValueError, match="soft_punish_cache"):
        get_soft_overlong_punishment(100, 0)
    if importlib.util.find_spec("math_verify") is None:
        with pytest.raises(ConfigError, match="pip install trl math-verify"):
            script_reward_funcs(["accuracy_reward"])
    assert script_reward_funcs(None, "rm_dir") == ["rm_dir"]

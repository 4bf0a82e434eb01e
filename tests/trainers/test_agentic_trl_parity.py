"""GRPO with `environment_factory=` and with `rollout_func=` against TRL 1.16's GRPOTrainer, side
by side on the tiny tool-capable setup of `tool_utils`, generation scripted on both sides (as
TRL's own tests patch it), two optimizer steps each:

- environment_factory (a dict of two environments selected by an `environment` column: a
  counter that owns its reward, an echo without one): the same prompt ids (`reset()`'s
  observation appended, each rollout rendered with its own environment's tools), completion ids,
  tool_mask, rewards (`get_reward()` logged under the class name, None -> NaN for the other
  environment's rollouts), advantages, loss, entropy, `tools/*` and every other logged metric
  per step; the completions table (parquet and the printed rich table) shows the whole
  conversation, tool calls and tool results, as TRL's does.
- environment_factory without a `train_dataset` (the environment owns the data: `reset()`
  returns the prompt): the same placeholder prompts and everything above; a dict factory
  without a dataset refused as TRL does.
- rollout_func: the same ids, `env_mask` as the tool mask, the extra returned fields (one per
  rollout, or one for all) at the reward functions, the same rewards, advantages, loss and
  metrics per step; with `tools=` too, the tool loop continues rollout_func's first turns.
"""

from __future__ import annotations

import re

import datasets
import numpy as np
import pandas as pd
import pytest
from tool_utils import add, call, tool_model_dir, tool_tokenizer
from trainer_utils import base_args, train_logs

from jaxrl.callbacks.completions import print_completions
from jaxrl.config import ConfigError
from jaxrl.trainers.grpo import GRPOTrainer
from jaxrl.trainers.grpo_config import GRPOConfig

# Two trainers (jaxrl compiling, TRL) per scenario: 20-40 s each on this machine.
pytestmark = pytest.mark.slow

G = 2
STEPS = 2
SETTINGS = dict(
    per_device_train_batch_size=4,
    num_generations=G,
    max_completion_length=200,
    max_steps=STEPS,
    shuffle_dataset=False,
    learning_rate=1e-3,
)
# Logged by one side only, or wall-clock.
NOT_COMPARED = {"epoch", "step", "learning_rate", "step_time", "num_input_tokens_seen"}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tok = tool_tokenizer()
    return tok, tool_model_dir(tmp_path_factory.mktemp("tool_qwen2"), tok)


def rows_of(ids_BT, mask_BT) -> list[list[int]]:
    return [row[m.astype(bool)].tolist() for row, m in zip(ids_BT, mask_BT, strict=True)]


# ----------------------------------------------------------------- environments
class Counter:
    """A counter the model increments; its final value is the reward."""

    def reset(self, **example) -> str:
        self.example = example
        self.value = example.get("start", 0)
        return f" Start at {self.value}."

    def increment(self, step: int) -> int:
        """Add to the counter.

        Args:
            step: How much to add.
        """
        self.value += step
        return self.value

    def get_reward(self) -> float:
        return float(self.value)


class Echo:
    """No reward of its own; `reset` returns nothing."""

    def reset(self, **example) -> None:
        self.calls = 0

    def shout(self, text: str) -> str:
        """Shout some text.

        Args:
            text: The text.
        """
        self.calls += 1
        return text.upper()


ENV_DATA = [
    {"prompt": [{"role": "user", "content": "Q0"}], "start": 0, "environment": "counter"},
    {"prompt": [{"role": "user", "content": "Hi"}], "start": 0, "environment": "echo"},
    {"prompt": [{"role": "user", "content": "Q2"}], "start": 10, "environment": "counter"},
    {"prompt": [{"role": "user", "content": "Ho"}], "start": 0, "environment": "echo"},
]


def env_script(text: str, i: int) -> str:
    """What the model says: rollout i of a batch's first turn by its environment and parity;
    after a tool response, by the response (the counter is incremented until it reaches 3)."""
    responses = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text, re.S)
    if responses:
        last = responses[-1]
        if last.isdigit() and int(last) < 3:
            return call("increment", '{"step": 2}')
        return f"done {last[:8]}<|im_end|>"
    if "Start at" in text:
        return call("increment", '{"step": 1}') if i % 2 == 0 else "no<|im_end|>"
    # The echo environment: a call of its tool, or of the counter's (not its tool: a failure).
    return call("shout", '{"text": "hey"}') if i % 2 == 0 else call("increment", '{"step": 1}')


def length_reward(prompts, completions, **kw):
    """Depends on the whole conversation: its messages and the last message's length."""
    return [float(len(c)) + 0.01 * len(str(c[-1]["content"])) for c in completions]


# ----------------------------------------------------------------- rollout_func
def make_rollout_func(tok):
    """Row i: the model says "ab" * (i + 1), the environment answers "XYZ" (env_mask 0), the
    model ends with "c<|im_end|>" (or is cut, unterminated, for i == 3); extra fields `hint` (one
    per rollout) and `level` (one for all)."""

    def rollout_func(prompts, trainer):
        prompt_ids, completion_ids, env_mask = [], [], []
        for i, prompt in enumerate(prompts):
            ids = tok.apply_chat_template(
                prompt, add_generation_prompt=True, tokenize=True, return_dict=False
            )
            model = tok("ab" * (i + 1))["input_ids"]
            env = tok("XYZ")["input_ids"]
            end = tok("c" if i == 3 else "c<|im_end|>")["input_ids"]
            prompt_ids.append(list(ids))
            completion_ids.append(model + env + end)
            env_mask.append([1] * len(model) + [0] * len(env) + [1] * len(end))
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": completion_ids,
            "logprobs": [[0.0] * len(c) for c in completion_ids],
            "env_mask": env_mask,
            "hint": [f"h{i}{p[-1]['content']}" for i, p in enumerate(prompts)],
            "level": 7,
        }

    return rollout_func


def hint_reward(prompts, completions, completion_ids, hint, level, **kw):
    """Uses rollout_func's extra fields, the completion ids and the parsed completion."""
    return [
        float(h[1]) * lv + 0.1 * len(ids) + 0.01 * len(c[-1]["content"])
        for h, lv, ids, c in zip(hint, level, completion_ids, completions, strict=True)
    ]


ROLLOUT_DATA = [{"prompt": [{"role": "user", "content": f"Q{i}"}]} for i in range(4)]


# ----------------------------------------------------------------- the two runs
def trl_run(tok, model_dir, out, data, reward_funcs, **kwargs):
    """TRL's GRPOTrainer, its single-turn generation scripted with `env_script`; each step's
    `_generate_and_score_completions` output captured."""
    import torch
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer as TRLTrainer

    torch.manual_seed(0)
    trainer = TRLTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        reward_funcs=reward_funcs,
        args=TRLConfig(
            output_dir=str(out), use_cpu=True, logging_steps=1, report_to="none", bf16=False,
            seed=0, lr_scheduler_type="constant", log_completions=True, **SETTINGS,
        ),
        train_dataset=None if data is None else datasets.Dataset.from_list(data),
        processing_class=tok,
        **kwargs,
    )  # fmt: skip

    def generate(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        ids = [tok(env_script(tok.decode(p), i))["input_ids"] for i, p in enumerate(prompt_ids)]
        # Sampling log-probs as a vLLM backend gives them (TRL's tool loop extends
        # rollout_func's; unused without vLLM's importance sampling).
        return ids, [[0.0] * len(c) for c in ids]

    trainer._generate_single_turn = generate
    batches = []
    original = trainer._generate_and_score_completions

    def capture(inputs):
        output = original(inputs)
        batches.append(output)
        return output

    trainer._generate_and_score_completions = capture
    trainer.train()
    return trainer, batches


def ours_run(tok, model_dir, out, data, reward_funcs, **kwargs):
    trainer = GRPOTrainer(
        model_dir,
        reward_funcs=reward_funcs,
        args=GRPOConfig(**base_args(out, log_completions=True, **SETTINGS)),
        train_dataset=None if data is None else datasets.Dataset.from_list(data),
        processing_class=tok,
        **kwargs,
    )

    def sample_turn(params, rows, config, seed, group_size=1, pad_rows_to=None):
        texts = [env_script(tok.decode(ids), i) for i, ids in enumerate(rows)]
        return [tok(t)["input_ids"] for t in texts for _ in range(group_size)]

    trainer._sample_turn = sample_turn
    samples = []
    original = trainer._sample

    def capture(*args, **kw):
        s = original(*args, **kw)
        samples.append(s)
        return s

    trainer._sample = capture
    trainer.train()
    return trainer, samples


def assert_batches_match(samples, batches):
    """Per generation batch: prompt and completion ids, the tool mask."""
    assert len(samples) == len(batches) == STEPS
    for s, b in zip(samples, batches, strict=True):
        out = s["out"]
        their_prompts = rows_of(b["prompt_ids"].numpy(), b["prompt_mask"].numpy())
        assert rows_of(np.asarray(out.prompt_ids_BP), np.asarray(out.prompt_mask_BP)) == (
            their_prompts
        )
        their_mask = b["completion_mask"].numpy()
        assert s["completion_ids"] == rows_of(b["completion_ids"].numpy(), their_mask)
        ours_tool = rows_of(s["tool_mask_NC"], np.asarray(out.completion_mask_BN))
        assert ours_tool == rows_of(b["tool_mask"].numpy(), their_mask)


def assert_logs_match(ours, theirs):
    """Every metric both sides log, step by step; each side's advantages and rewards."""
    logs, their_logs = train_logs(ours), train_logs(theirs)
    assert len(logs) == len(their_logs) == STEPS
    for step, (log, their_log) in enumerate(zip(logs, their_logs, strict=True)):
        keys = (set(log) & set(their_log)) - NOT_COMPARED
        assert {"loss", "reward", "entropy", "grad_norm"} <= keys
        for key in sorted(keys):
            if their_log[key] is None:  # TRL: a metric with only NaN values
                assert log[key] is None or np.isnan(log[key]), key
                continue
            np.testing.assert_allclose(
                log[key], their_log[key], rtol=2e-3 if key == "grad_norm" else 2e-4,
                atol=2e-5, err_msg=f"{key} at step {step + 1}",
            )  # fmt: skip
    ours_logs, their_tables = ours.completion_logs, theirs._logs
    np.testing.assert_allclose(
        list(ours_logs["advantages"]), list(their_tables["advantages"]), rtol=1e-5, atol=1e-6
    )
    assert list(ours_logs["rewards"]) == list(their_tables["rewards"])
    for name, values in their_tables["rewards"].items():
        np.testing.assert_allclose(list(ours_logs["rewards"][name]), list(values), rtol=1e-6)
    return logs, their_logs


def table(out_dir, step: int) -> pd.DataFrame:
    return pd.read_parquet(out_dir / "completions" / f"completions_{step:05d}.parquet")


def plain(value):
    """A parquet cell as plain Python (arrays -> lists, recursively), for comparison."""
    if isinstance(value, np.ndarray):
        return [plain(v) for v in value.tolist()]
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


# ----------------------------------------------------------------- environment_factory
@pytest.fixture(scope="module")
def env_runs(setup, tmp_path_factory):
    tok, model_dir = setup
    kwargs = dict(environment_factory={"counter": Counter, "echo": Echo})
    their_out, our_out = tmp_path_factory.mktemp("trl_env"), tmp_path_factory.mktemp("ours_env")
    theirs, batches = trl_run(tok, model_dir, their_out, ENV_DATA, [length_reward], **kwargs)
    ours, samples = ours_run(tok, model_dir, our_out, ENV_DATA, [length_reward], **kwargs)
    return ours, samples, our_out, theirs, batches, their_out


def test_environment_rollouts_match_trl(env_runs):
    ours, samples, _, _, batches, _ = env_runs
    assert_batches_match(samples, batches)
    s = samples[0]
    # The premises: reset()'s observation in the counter prompts, each environment's own tools.
    assert [p[-1]["content"] for p in s["prompts"]] == [
        "Q0 Start at 0.", "Q0 Start at 0.", "Hi", "Hi"
    ]  # fmt: skip
    assert [m["content"] for m in s["completions"][0] if m["role"] == "tool"] == ["1", "3"]
    assert s["completions"][3][1] == {
        "role": "tool", "name": "increment", "content": "{'error': 'Tool increment not found.'}"
    }  # fmt: skip
    assert s["completions"][2][1] == {"role": "tool", "name": "shout", "content": "HEY"}


def test_environment_rewards_advantages_loss_and_metrics_match_trl(env_runs):
    ours, samples, _, theirs, _, _ = env_runs
    logs, their_logs = assert_logs_match(ours, theirs)
    assert ours.reward_func_names == ["length_reward", "Counter"]
    rewards = np.asarray(samples[0]["rewards_NK"])
    np.testing.assert_allclose(rewards[:2, 1], [3.0, 0.0])  # the counters' final values
    assert np.isnan(rewards[2:, 1]).all()  # the echo rollouts: not the Counter's to score
    # Step 1: 4 calls over 4 rollouts (increment twice, shout, the echo's unknown increment).
    assert their_logs[0]["tools/call_frequency"] == pytest.approx(1.0)
    assert their_logs[0]["tools/failure_frequency"] == pytest.approx(0.25)
    assert {"rewards/Counter/mean", "tools/call_frequency"} <= set(logs[0])


def test_completions_table_shows_tool_calls_and_results_as_trl(env_runs, capsys, monkeypatch):
    ours, _, our_out, theirs, _, their_out = env_runs
    for step in range(1, STEPS + 1):
        mine, their = table(our_out, step), table(their_out, step)
        assert list(mine.columns) == list(their.columns)
        for column in ("prompt", "completion"):
            assert [plain(v) for v in mine[column]] == [plain(v) for v in their[column]], column
        np.testing.assert_allclose(mine["advantage"], their["advantage"], rtol=1e-5, atol=1e-6)
    conversation = plain(table(our_out, 1)["completion"][0])
    calls = [m["tool_calls"] for m in conversation if m.get("tool_calls") is not None]
    assert [c[0]["function"]["name"] for c in calls] == ["increment", "increment"]
    assert [m["content"] for m in conversation if m["role"] == "tool"] == ["1", "3"]
    # The printed table (TRL's `print_prompt_completions_sample`): the same text.
    from trl.trainer.utils import print_prompt_completions_sample

    monkeypatch.setenv("COLUMNS", "300")  # rich's width: no wrapped cells
    logs = ours._completion_logs_copy()
    capsys.readouterr()
    print_completions(logs, 2, None)
    mine_printed = capsys.readouterr().out
    t = theirs._logs
    print_prompt_completions_sample(
        t["prompt"], t["completion"], t["rewards"], t["advantages"], 2, None, extra=t["extra"]
    )
    their_printed = capsys.readouterr().out
    assert "increment(step=1)" in mine_printed and "TOOL" in mine_printed
    assert mine_printed == their_printed


def test_environment_without_a_dataset_matches_trl(setup, tmp_path):
    """TRL: the environment owns the data; placeholder rows of empty prompts drive the loop."""
    tok, model_dir = setup
    theirs, batches = trl_run(
        tok, model_dir, tmp_path / "trl", None, None, environment_factory=Counter
    )
    ours, samples = ours_run(
        tok, model_dir, tmp_path / "ours", None, None, environment_factory=Counter
    )
    assert_batches_match(samples, batches)
    assert [p[-1]["content"] for p in samples[0]["prompts"]] == [" Start at 0."] * 4
    counter = ours.environment_pool.pool[None][0]
    assert counter.example == {"prompt": [{"role": "user", "content": ""}]}
    assert ours.reward_func_names == ["Counter"]
    assert_logs_match(ours, theirs)
    with pytest.raises(ConfigError, match="requires a `train_dataset` with an `environment`"):
        GRPOTrainer(
            model_dir, reward_funcs=None, args=GRPOConfig(**base_args(tmp_path, **SETTINGS)),
            processing_class=tok, environment_factory={"counter": Counter},
        )  # fmt: skip


# ----------------------------------------------------------------- rollout_func
@pytest.fixture(scope="module")
def rollout_runs(setup, tmp_path_factory):
    tok, model_dir = setup
    seen = {"ours": [], "theirs": []}

    def recording(who):
        def reward(prompts, completions, completion_ids, hint, level, **kw):
            seen[who].append({"hint": list(hint), "level": list(level)})
            return hint_reward(prompts, completions, completion_ids, hint, level, **kw)

        reward.__name__ = "hint_reward"
        return reward

    func = make_rollout_func(tok)
    theirs, batches = trl_run(
        tok, model_dir, tmp_path_factory.mktemp("trl_rollout"), ROLLOUT_DATA,
        [recording("theirs")], rollout_func=func,
    )  # fmt: skip
    ours, samples = ours_run(
        tok, model_dir, tmp_path_factory.mktemp("ours_rollout"), ROLLOUT_DATA,
        [recording("ours")], rollout_func=func,
    )  # fmt: skip
    return ours, samples, theirs, batches, seen


def test_rollout_func_rollouts_match_trl(rollout_runs):
    _, samples, _, batches, seen = rollout_runs
    assert_batches_match(samples, batches)
    # The extra fields reached both sides' reward functions alike: one value per rollout, and
    # the one-for-all `level` repeated.
    assert seen["ours"] == seen["theirs"]
    assert seen["ours"][0] == {"hint": ["h0Q0", "h1Q0", "h2Q1", "h3Q1"], "level": [7] * 4}


def test_rollout_func_rewards_advantages_loss_and_metrics_match_trl(rollout_runs):
    ours, _, theirs, _, _ = rollout_runs
    logs, _ = assert_logs_match(ours, theirs)
    # The premise: the fourth rollout is cut (no EOS), its lengths count the model's tokens.
    assert logs[0]["completions/clipped_ratio"] == pytest.approx(0.25)
    assert logs[0]["completions/max_length"] == 2 * 4 + 1


def test_rollout_func_with_tools_matches_trl(setup, tmp_path):
    """TRL runs the tool loop on rollout_func's completions (later turns from the trainer's own
    generation)."""
    tok, model_dir = setup

    def rollout_func(prompts, trainer):
        prompt_ids = [
            tok.apply_chat_template(
                p, tools=[add], add_generation_prompt=True, tokenize=True, return_dict=False
            )
            for p in prompts
        ]
        texts = [
            call("add", f'{{"a": {i}, "b": 3}}') if i % 2 == 0 else "no<|im_end|>"
            for i in range(len(prompts))
        ]
        completion_ids = [tok(t)["input_ids"] for t in texts]
        return {
            "prompt_ids": [list(p) for p in prompt_ids],
            "completion_ids": completion_ids,
            "logprobs": [[0.0] * len(c) for c in completion_ids],
        }

    kwargs = dict(rollout_func=rollout_func, tools=[add])
    theirs, batches = trl_run(
        tok, model_dir, tmp_path / "trl", ROLLOUT_DATA, [length_reward], **kwargs
    )
    ours, samples = ours_run(
        tok, model_dir, tmp_path / "ours", ROLLOUT_DATA, [length_reward], **kwargs
    )
    assert_batches_match(samples, batches)
    # The premise: rollout 2 called add(2, 3) and the trainer's own turn answered the result.
    assert [m.get("content") for m in samples[0]["completions"][2][1:]] == ["5", "done 5"]
    logs, _ = assert_logs_match(ours, theirs)
    assert logs[0]["tools/call_frequency"] == pytest.approx(0.5)

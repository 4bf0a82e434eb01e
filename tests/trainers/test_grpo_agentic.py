"""GRPO/RLOO `rollout_func=` and `environment_factory=` (TRL 1.16's GRPOTrainer surface), asserted
by hand on the tiny tool-capable setup of `tool_utils` with scripted generation:

- rollout_func: TRL's signature (one deep-copied prompt per rollout), its required keys, its
  `env_mask` as the tool mask (model tokens counted, the rest out of the loss), its other fields
  at the reward functions;
- environment_factory: one instance per rollout, pooled and `reset()` before every batch, public
  methods as tools (in the rendered prompt and callable), `reset()`'s string appended to the last
  user message, `get_reward()` an extra reward logged under the class name; a dict selects by an
  `environment` column, only the selected environment's tools rendered; no `reset` refused;
- RLOO with a tool mask: the loss and the KL-in-reward equal those with the tool tokens masked
  by hand (and differ from those with the tool tokens in);
- the tool executor is closed when `train()` ends.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import time

import datasets
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tool_utils import call, tool_model_dir, tool_tokenizer
from trainer_utils import base_args, train_logs

from jaxrl.config import ConfigError
from jaxrl.trainers.environments import EnvironmentPool
from jaxrl.trainers.grpo import GRPOTrainer
from jaxrl.trainers.grpo_config import GRPOConfig
from jaxrl.trainers.rloo import RLOOTrainer
from jaxrl.trainers.rloo_config import RLOOConfig

G = 2
SETTINGS = dict(
    per_device_train_batch_size=4,
    num_generations=G,
    max_completion_length=64,
    max_steps=1,
    shuffle_dataset=False,
)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tok = tool_tokenizer()
    return tok, tool_model_dir(tmp_path_factory.mktemp("tool_qwen2"), tok)


def data(rows: list[dict]) -> datasets.Dataset:
    return datasets.Dataset.from_list(rows)


def capture_samples(trainer) -> list[dict]:
    samples = []
    original = trainer._sample

    def capture(*args, **kwargs):
        s = original(*args, **kwargs)
        samples.append(s)
        return s

    trainer._sample = capture
    return samples


# ----------------------------------------------------------------- rollout_func
# Each rollout: the model says "ab", the environment answers "XYZ" (env_mask 0), the model
# ends with "c<|im_end|>"; row i's model part repeated i + 1 times (distinct lengths).
def rollout_rows(tok, prompts):
    prompt_ids, completion_ids, env_mask = [], [], []
    for i, prompt in enumerate(prompts):
        ids = tok.apply_chat_template(
            prompt, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        model = tok("ab" * (i + 1))["input_ids"]
        env = tok("XYZ")["input_ids"]
        end = tok("c<|im_end|>")["input_ids"]
        prompt_ids.append(list(ids))
        completion_ids.append(model + env + end)
        env_mask.append([1] * len(model) + [0] * len(env) + [1] * len(end))
    return prompt_ids, completion_ids, env_mask


def test_rollout_func(setup, tmp_path):
    tok, model_dir = setup
    seen, kwargs_seen = [], []

    def rollout_func(prompts, trainer):
        assert isinstance(trainer, GRPOTrainer)
        seen.append(prompts)
        prompts[0][0]["content"] = "mutated"  # a copy: the dataset's prompts stay as they are
        prompt_ids, completion_ids, env_mask = rollout_rows(tok, prompts)
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": completion_ids,
            "logprobs": [[0.0] * len(c) for c in completion_ids],
            "env_mask": env_mask,
            "hint": [f"h{i}" for i in range(len(prompts))],  # one per rollout
            "level": 7,  # one for all
        }

    def reward(prompts, completions, completion_ids, hint, level, **kw):
        kwargs_seen.append(dict(kw, hint=hint, level=level, completions=completions))
        return [float(h[1:]) + lv for h, lv in zip(hint, level, strict=True)]

    ds = data([{"prompt": [{"role": "user", "content": f"Q{i}"}]} for i in range(2)])
    trainer = GRPOTrainer(
        model_dir, reward_funcs=reward, args=GRPOConfig(**base_args(tmp_path, **SETTINGS)),
        train_dataset=ds, processing_class=tok, rollout_func=rollout_func,
    )  # fmt: skip
    samples = capture_samples(trainer)
    trainer.train()
    (prompts,) = seen
    # TRL: one prompt per rollout (the RepeatSampler's repeats), messages as in the dataset.
    assert [p[0]["content"] for p in prompts] == ["mutated", "Q0", "Q1", "Q1"]
    assert ds[0]["prompt"][0]["content"] == "Q0"
    (s,) = samples
    expected_prompts, completion_ids, env_mask = rollout_rows(
        tok, [[{"role": "user", "content": q}] for q in ("mutated", "Q0", "Q1", "Q1")]
    )
    assert s["completion_ids"] == completion_ids
    mask = np.asarray(s["out"].completion_mask_BN).astype(bool)
    assert [row[m].tolist() for row, m in zip(s["tool_mask_NC"], mask, strict=True)] == env_mask
    # The extra fields reach the rewards (env_mask and logprobs do not).
    (kw,) = kwargs_seen
    assert kw["hint"] == ["h0", "h1", "h2", "h3"] and kw["level"] == [7] * 4
    assert "env_mask" not in kw and "logprobs" not in kw
    assert kw["completions"][1] == [{"role": "assistant", "content": "ababXYZc"}]
    np.testing.assert_allclose(np.asarray(s["rewards_NK"])[:, 0], [7, 8, 9, 10])
    (log,) = train_logs(trainer)
    # TRL's lengths count the model's tokens (env_mask 1): 2i + 2 + 1 + 1 (EOS).
    assert log["completions/mean_length"] == pytest.approx(np.mean([4, 6, 8, 10]))
    assert log["completions/max_length"] == 10


def test_rollout_func_missing_keys_refused(setup, tmp_path):
    tok, model_dir = setup

    def rollout_func(prompts, trainer):
        prompt_ids, completion_ids, _ = rollout_rows(tok, prompts)
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids}

    trainer = GRPOTrainer(
        model_dir, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=GRPOConfig(**base_args(tmp_path, **SETTINGS)),
        train_dataset=data([{"prompt": [{"role": "user", "content": "Q0"}]}] * 2),
        processing_class=tok, rollout_func=rollout_func,
    )  # fmt: skip
    with pytest.raises(ValueError, match=re.escape("rollout_func must return keys ['logprobs']")):
        trainer.train()


# ----------------------------------------------------------------- environment_factory
class Counter:
    """A counter the model increments; its value is the reward."""

    made = 0

    def __init__(self):
        type(self).made += 1
        self.resets = 0
        self.value = 0

    def reset(self, **example) -> str:
        self.resets += 1
        self.example = example
        self.value = example["start"]
        return f" Start at {self.value}."

    def increment(self, step: int) -> int:
        """Add to the counter.

        Args:
            step: How much to add.
        """
        self.value += step
        return self.value

    def _hidden(self) -> None:
        raise AssertionError("not a tool")

    def get_reward(self) -> float:
        return float(self.value)


class Echo:
    """An environment without a reward: `reset` returns nothing."""

    def reset(self, **example) -> None:
        self.example = example

    def shout(self, text: str) -> str:
        """Shout some text.

        Args:
            text: The text.
        """
        return text.upper()


# Room for a call, its result and an answer (one token a character).
ENV_SETTINGS = {**SETTINGS, "max_completion_length": 200}


def scripted_env_turns(tok):
    """The model increments by 2 (first generation of each prompt) or answers at once; after a
    tool response it says "done"."""

    def sample_turn(params, rows, config, seed, group_size=1, pad_rows_to=None):
        out = []
        for i, ids in enumerate(rows):
            text = tok.decode(ids)
            for _g in range(group_size):
                if "<tool_response>" in text:
                    reply = "done<|im_end|>"
                elif "Start at" in text and i % 2 == 0:
                    reply = call("increment", '{"step": 2}')
                elif "Hi" in text and i % 2 == 0:
                    reply = call("shout", '{"text": "hey"}')
                else:
                    reply = "no<|im_end|>"
                out.append(tok(reply)["input_ids"])
        return out

    return sample_turn


def prompt_texts(tok, s) -> list[str]:
    out = s["out"]
    ids, mask = np.asarray(out.prompt_ids_BP), np.asarray(out.prompt_mask_BP).astype(bool)
    return [tok.decode(row[m]) for row, m in zip(ids, mask, strict=True)]


def test_environment_factory(setup, tmp_path):
    tok, model_dir = setup
    Counter.made = 0
    ds = data([{"prompt": [{"role": "user", "content": f"Q{i}"}], "start": 10 * i} for i in (0, 1)])
    trainer = GRPOTrainer(
        model_dir, reward_funcs=None,
        args=GRPOConfig(**base_args(tmp_path, **{**ENV_SETTINGS, "max_steps": 2})),
        train_dataset=ds, processing_class=tok, environment_factory=Counter,
    )  # fmt: skip
    assert Counter.made == 1  # the probe
    assert [t.__name__ for t in trainer.tools] == ["increment"]
    assert trainer.reward_func_names == ["Counter"]
    trainer._sample_turn = scripted_env_turns(tok)
    samples = capture_samples(trainer)
    trainer.train()
    # One instance per rollout: the probe and three more, reused (and reset) by the 2nd batch.
    assert Counter.made == 4
    pool = trainer.environment_pool.pool[None]
    assert [e.resets for e in pool] == [2, 2, 2, 2]
    assert [e.example["start"] for e in pool] == [0, 0, 10, 10]
    assert pool[0].example["prompt"] == [{"role": "user", "content": "Q0"}]  # the whole example
    s = samples[0]
    # reset()'s string appended to the last user message; the tools rendered, not the rest.
    assert [p[-1]["content"] for p in s["prompts"]] == [
        "Q0 Start at 0.", "Q0 Start at 0.", "Q1 Start at 10.", "Q1 Start at 10."
    ]  # fmt: skip
    for text in prompt_texts(tok, s):
        assert '"name": "increment"' in text
        assert "get_reward" not in text and "_hidden" not in text and '"reset"' not in text
    assert s["completions"][2][1] == {"role": "tool", "name": "increment", "content": "12"}
    # get_reward after the rollout: the counter's final value, logged under "Counter".
    np.testing.assert_allclose(np.asarray(s["rewards_NK"])[:, 0], [2.0, 0.0, 12.0, 10.0])
    logs = train_logs(trainer)
    assert logs[0]["rewards/Counter/mean"] == pytest.approx(6.0)
    assert logs[0]["tools/call_frequency"] == pytest.approx(0.5)
    assert list(trainer.completion_logs["rewards"]) == ["Counter"]
    # Training ended: the tool executor is closed.
    assert trainer._tool_executor is None


def test_environment_dict_selects_by_column(setup, tmp_path):
    tok, model_dir = setup
    ds = data([
        {"prompt": [{"role": "user", "content": "Q0"}], "start": 5, "environment": "counter"},
        {"prompt": [{"role": "user", "content": "Hi"}], "start": 0, "environment": "echo"},
    ])  # fmt: skip

    def length(completions, **kw):
        return [float(len(c)) for c in completions]

    trainer = GRPOTrainer(
        model_dir, reward_funcs=length, args=GRPOConfig(**base_args(tmp_path, **ENV_SETTINGS)),
        train_dataset=ds, processing_class=tok,
        environment_factory={"counter": Counter, "echo": Echo},
    )  # fmt: skip
    assert trainer.reward_func_names == ["length", "Counter"]
    trainer._sample_turn = scripted_env_turns(tok)
    samples = capture_samples(trainer)
    trainer.train()
    (s,) = samples
    texts = prompt_texts(tok, s)
    # Each rollout renders its own environment's tools only.
    assert all('"name": "increment"' in t and "shout" not in t for t in texts[:2])
    assert all('"name": "shout"' in t and "increment" not in t for t in texts[2:])
    assert s["prompts"][2] == [{"role": "user", "content": "Hi"}]  # reset returned None
    echo = trainer.environment_pool.pool["echo"][0]
    assert "environment" not in echo.example and echo.example["start"] == 0
    assert s["completions"][2][1]["content"] == "HEY"
    rewards = np.asarray(s["rewards_NK"])
    np.testing.assert_allclose(rewards[:2, 1], [7.0, 5.0])
    assert np.isnan(rewards[2:, 1]).all()  # Counter's reward: None for Echo's rollouts
    np.testing.assert_allclose(rewards[:, 0], [3, 1, 3, 1])  # call, result, answer / answer
    pool = trainer.environment_pool
    with pytest.raises(ValueError, match=re.escape("`environment='chess'`, which is not among")):
        pool.example_environment({"environment": "chess"})


def test_environment_without_reset_refused(setup, tmp_path):
    tok, model_dir = setup

    class NoReset:
        def act(self, x: int) -> int:
            """Act.

            Args:
                x: A number.
            """
            return x

    with pytest.raises(ConfigError, match="must define a callable `reset`"):
        GRPOTrainer(
            model_dir, reward_funcs=None, args=GRPOConfig(**base_args(tmp_path, **SETTINGS)),
            train_dataset=data([{"prompt": [{"role": "user", "content": "Q0"}]}] * 2),
            processing_class=tok, environment_factory=NoReset,
        )  # fmt: skip
    with pytest.raises(ConfigError, match="empty dict"):
        EnvironmentPool({})


# ----------------------------------------------------------------- RLOO with a tool mask
@pytest.mark.slow
def test_rloo_tool_tokens_carry_no_loss(setup, tmp_path):
    tok, model_dir = setup

    def rollout_func(prompts, trainer):
        prompt_ids, completion_ids, env_mask = rollout_rows(tok, prompts)
        return {
            "prompt_ids": prompt_ids, "completion_ids": completion_ids,
            "logprobs": [[0.0] * len(c) for c in completion_ids], "env_mask": env_mask,
        }  # fmt: skip

    def reward(completions, **kw):
        return [float(len(c[0]["content"])) for c in completions]

    trainer = RLOOTrainer(
        model_dir, reward_funcs=reward,
        args=RLOOConfig(**base_args(tmp_path, **SETTINGS, beta=0.5, learning_rate=1e-3)),
        train_dataset=data([{"prompt": [{"role": "user", "content": f"Q{i}"}]} for i in (0, 1)]),
        processing_class=tok, rollout_func=rollout_func,
    )  # fmt: skip
    seen = {}
    advantages = trainer._advantages

    def capture_advantages(rewards_NK, rollout, *args):
        seen["rewards_NK"], seen["rollout"] = rewards_NK, dict(rollout)
        return advantages(rewards_NK, rollout, *args)

    generate = trainer._generate_and_score

    def capture_buffer(plan):
        # The params the first step's loss is taken at (a copy: the step donates them).
        seen["state"] = jax.tree.map(
            lambda x: jnp.copy(x) if isinstance(x, jax.Array) else x, trainer.train_state
        )
        generate(plan)
        seen["buffer"] = dict(trainer.rollout)

    trainer._advantages = capture_advantages
    trainer._generate_and_score = capture_buffer
    trainer.train()
    (log,) = train_logs(trainer)

    def by_hand(rows):  # the tool tokens out of completion_mask, no tool_mask
        rows = dict(rows)
        rows["completion_mask"] = rows["completion_mask"] * rows.pop("tool_mask")
        return rows

    def with_tool_tokens(rows):  # the tool tokens in the loss
        rows = dict(rows)
        rows.pop("tool_mask")
        return rows

    # The KL in the reward (beta): the tool tokens' log-ratios left out.
    rollout = seen["rollout"]
    assert float(jnp.sum(rollout["tool_mask"] == 0)) == 4 * 3  # "XYZ" in each rollout
    # At the first step the policy is the reference (KL 0): move the reference on the tool
    # tokens only; the KL stays as it was, unless the tool tokens are in it.
    rollout = dict(rollout, ref_logps=rollout["ref_logps"] - 0.3 * (1 - rollout["tool_mask"]))
    rewards_NK = seen["rewards_NK"]
    adv, metrics = advantages(rewards_NK, rollout)
    np.testing.assert_allclose(adv, advantages(rewards_NK, seen["rollout"])[0], rtol=1e-6)
    adv_hand, metrics_hand = advantages(rewards_NK, by_hand(rollout))
    np.testing.assert_allclose(adv, adv_hand, rtol=1e-6)
    assert metrics["kl"] == pytest.approx(metrics_hand["kl"], abs=1e-7)
    _, metrics_in = advantages(rewards_NK, with_tool_tokens(rollout))
    assert abs(metrics["kl"]) < 1e-6 and metrics_in["kl"] > 0.05
    # The loss of the first step's batch at the first step's params.
    loss_fn = trainer._loss_fn()
    state, buffer = seen["state"], seen["buffer"]
    rng = jax.random.key(0)

    def loss(rows):
        return float(loss_fn(state.params, state, rows, rng, state.extras)[0])

    ours = loss(buffer)
    assert ours == pytest.approx(loss(by_hand(buffer)), rel=1e-6)
    # At the first step the ratio is 1 whatever the mask; old log-probs moved on the tool tokens
    # only leave the loss as it is, unless the tool tokens are in it.
    moved = dict(buffer, old_logps=buffer["old_logps"] - 0.05 * (1 - buffer["tool_mask"]))
    assert loss(moved) == pytest.approx(ours, rel=1e-6)
    assert loss(by_hand(moved)) == pytest.approx(ours, rel=1e-6)
    assert loss(with_tool_tokens(moved)) != pytest.approx(ours, rel=1e-3)
    # RLOO's loss is the sequence mean: the step's logged loss (one micro-step).
    assert log["loss"] == pytest.approx(ours / 4, rel=1e-4)


# ----------------------------------------------------------------- the tool executor
HUNG_SYNC_TOOL = textwrap.dedent("""
    import threading, time
    from jaxrl.trainers.tools import ToolExecutor

    def stuck() -> str:
        threading.Event().wait()  # never returns

    executor = ToolExecutor(timeout_s=0.2)
    calls = [{"type": "function", "function": {"name": "stuck", "arguments": {}}}]
    print(executor.run_rows([(calls, {"stuck": stuck})]), flush=True)
    {close}
""")


@pytest.mark.parametrize("close", ["executor.close()", "pass"])
def test_a_hung_sync_tool_times_out_and_does_not_block_exit(close):
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", HUNG_SYNC_TOOL.replace("{close}", close)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (
        "([[('stuck', {'error': 'Tool stuck timed out after 0.2 s.'})]], 1, 1)"
    )
    assert time.monotonic() - start < 60


def test_a_closed_executor_refuses_calls():
    from jaxrl.trainers.tools import ToolExecutor

    executor = ToolExecutor(timeout_s=1.0)
    executor.close()
    with pytest.raises(RuntimeError, match="closed"):
        executor.run_rows([([], {})])

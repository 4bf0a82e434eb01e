"""GRPO with `tools=` against TRL 1.16's GRPOTrainer: scripted completions (both trainers'
generation patched, as TRL's tests do) through a sync tool returning an int, an async tool, an
unknown tool, a tool that raises, a malformed call, a result overflowing the completion budget
(rolled back) and `max_tool_calling_iterations`; the same prompt/completion ids, tool_mask,
rewards, advantages, loss, entropy and `tools/*` metrics. Then bad input: a hanging async tool
times out (counted as a failure), a template that cannot render tool calls and a tool without a
docstring are refused at construction."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from tool_utils import TOOLS, prompts, script, tool_model_dir, tool_tokenizer
from trainer_utils import base_args, train_logs

from jaxrl.config import ConfigError
from jaxrl.trainers.grpo import GRPOTrainer
from jaxrl.trainers.grpo_config import GRPOConfig
from jaxrl.trainers.tools import TOOL_TEMPLATE_ERROR

G = 2
SETTINGS = dict(
    per_device_train_batch_size=6,
    num_generations=G,
    max_completion_length=400,
    max_tool_calling_iterations=2,
    max_steps=1,
    shuffle_dataset=False,
    learning_rate=1e-3,
)


def reward(prompts, completions, **kw):
    """Depends on the whole conversation: its messages and the last message's length."""
    return [float(len(c)) + 0.01 * len(str(c[-1]["content"])) for c in completions]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tok = tool_tokenizer()
    return tok, tool_model_dir(tmp_path_factory.mktemp("tool_qwen2"), tok)


def our_fake(tok):
    def sample_turn(params, rows, config, seed, group_size=1, pad_rows_to=None):
        out = []
        for ids in rows:
            text = tok.decode(ids)
            for g in range(group_size):
                out.append(tok(script(text, g))["input_ids"])
        return out

    return sample_turn


def trl_run(tok, model_dir, out):
    import torch
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer as TRLTrainer

    torch.manual_seed(0)
    trainer = TRLTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        reward_funcs=reward,
        args=TRLConfig(
            output_dir=str(out), use_cpu=True, logging_steps=1, report_to="none", bf16=False,
            seed=0, lr_scheduler_type="constant", **SETTINGS,
        ),
        train_dataset=prompts(3),
        processing_class=tok,
        tools=TOOLS,
    )  # fmt: skip
    calls = [0]

    def generate(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        first = calls[0] == 0
        calls[0] += 1
        ids = [
            tok(script(tok.decode(p), i % G if first else None))["input_ids"]
            for i, p in enumerate(prompt_ids)
        ]
        return ids, None

    trainer._generate_single_turn = generate
    batches = []
    original = trainer._generate_and_score_completions

    def capture(inputs):
        output = original(inputs)
        batches.append(output)
        return output

    trainer._generate_and_score_completions = capture
    trainer.train()
    return trainer, batches[0]


@pytest.fixture(scope="module")
def runs(setup, tmp_path_factory):
    tok, model_dir = setup
    theirs, batch = trl_run(tok, model_dir, tmp_path_factory.mktemp("trl"))
    ours = GRPOTrainer(
        model_dir,
        reward_funcs=reward,
        args=GRPOConfig(**base_args(tmp_path_factory.mktemp("ours"), **SETTINGS)),
        train_dataset=prompts(3),
        processing_class=tok,
        tools=TOOLS,
    )
    ours._sample_turn = our_fake(tok)
    samples = []
    original = ours._sample

    def capture(*args, **kwargs):
        s = original(*args, **kwargs)
        samples.append(s)
        return s

    ours._sample = capture
    ours.train()
    return ours, samples[0], theirs, batch


def rows_of(ids_BT, mask_BT):
    return [row[m.astype(bool)].tolist() for row, m in zip(ids_BT, mask_BT, strict=True)]


@pytest.mark.slow
def test_rollouts_match_trl(runs):
    ours, s, _, batch = runs
    out = s["out"]
    their_prompts = rows_of(batch["prompt_ids"].numpy(), batch["prompt_mask"].numpy())
    assert rows_of(np.asarray(out.prompt_ids_BP), np.asarray(out.prompt_mask_BP)) == their_prompts
    their_mask = batch["completion_mask"].numpy()
    their_ids = rows_of(batch["completion_ids"].numpy(), their_mask)
    assert s["completion_ids"] == their_ids
    their_tool = rows_of(batch["tool_mask"].numpy(), their_mask)
    assert rows_of(s["tool_mask_NC"], np.asarray(out.completion_mask_BN)) == their_tool
    # The premises: tool results masked; Q2's long result rolled back (the completion is the
    # call alone); Q1's third call past max_tool_calling_iterations left unrun.
    assert 0 in their_tool[0] and all(their_tool[1])
    assert their_ids[4] == ours.tokenizer(script("<|im_start|>user\nQ2", 0))["input_ids"]
    assert len(s["completions"][2]) == 5  # call, error, call, error, unrun call
    assert s["completions"][2][1]["content"] == "{'error': 'Tool mul not found.'}"
    assert s["completions"][0][1]["content"] == "5"  # an int result, as a string


@pytest.mark.slow
def test_rewards_advantages_loss_and_tool_metrics_match_trl(runs):
    ours, s, theirs, batch = runs
    (log,) = train_logs(ours)
    (their_log,) = train_logs(theirs)
    # 5 calls over 6 rollouts (add, mul, boom, long, slow_add); mul and boom failed.
    assert their_log["tools/call_frequency"] == pytest.approx(5 / 6)
    assert their_log["tools/failure_frequency"] == pytest.approx(2 / 5)
    for key in (
        "tools/call_frequency", "tools/failure_frequency", "reward", "reward_std",
        "completions/mean_length", "completions/max_length", "completions/clipped_ratio",
        "loss", "entropy", "num_tokens",
    ):  # fmt: skip
        np.testing.assert_allclose(log[key], their_log[key], rtol=2e-4, atol=2e-5, err_msg=key)
    rewards = np.asarray(s["rewards_NK"])[:, 0]
    np.testing.assert_allclose(rewards, theirs._logs["rewards"]["reward"], rtol=1e-6)
    np.testing.assert_allclose(
        list(ours.completion_logs["advantages"]), batch["advantages"].numpy(), rtol=1e-5
    )
    assert list(ours.completion_logs["completion"]) == list(theirs._logs["completion"])


async def hang() -> str:
    """A tool that never answers."""
    await asyncio.sleep(3600)
    return "never"


def make(setup, tmp_path, tools, **kw):
    tok, model_dir = setup
    return GRPOTrainer(
        model_dir,
        reward_funcs=reward,
        args=GRPOConfig(**base_args(tmp_path, **{**SETTINGS, **kw})),
        train_dataset=prompts(3),
        processing_class=tok,
        tools=tools,
    )


def test_a_hanging_tool_times_out_as_a_failure(setup, tmp_path):
    from jaxrl.trainers.tools import ToolExecutor

    executor = ToolExecutor(timeout_s=0.2)
    calls = [{"type": "function", "function": {"name": "hang", "arguments": {}}}]
    results, n_calls, n_failures = executor.run_rows([(calls, {"hang": hang})])
    executor.close()
    assert (n_calls, n_failures) == (1, 1)
    assert results == [[("hang", {"error": "Tool hang timed out after 0.2 s."})]]


def test_bad_tools_and_templates_are_refused(setup, tmp_path):
    def undocumented(a: int) -> int:
        return a

    with pytest.raises(ConfigError, match="undocumented"):
        make(setup, tmp_path, [undocumented])
    tok, model_dir = setup
    plain = tool_tokenizer()
    plain.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    with pytest.raises(ConfigError, match="does not support tool calling") as e:
        GRPOTrainer(
            model_dir, reward_funcs=reward,
            args=GRPOConfig(**base_args(tmp_path, **SETTINGS)),
            train_dataset=prompts(3), processing_class=plain, tools=TOOLS,
        )  # fmt: skip
    assert str(e.value) == TOOL_TEMPLATE_ERROR

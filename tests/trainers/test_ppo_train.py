"""PPOTrainer.generate (TRL v0.7.2 semantics, checked against transformers' greedy `generate`)
and the jaxrl `train()` loop: callable and reward-model rewards, metrics.jsonl with TRL's stat
names, exact kill-and-resume, and the `--algo ppo` CLI."""

from __future__ import annotations

import json
import os

import chex
import datasets
import numpy as np
import pytest
import torch
from safetensors import safe_open
from trainer_utils import killed_after_checkpoint, tiny_config
from transformers import AutoModelForCausalLM

from jaxrl.callbacks.base import TrainerCallback
from jaxrl.data import task
from jaxrl.train import main as train_main
from jaxrl.trainers.ppo import PPOTrainer
from jaxrl.trainers.ppo_config import PPOConfig

PROMPTS = ["12+34=", "5+6=", "77+8=", "1+2=", "90+19="]
# TRL's stat names train() logs (scalars of step() plus log_stats' env/*).
TRL_KEYS = {
    "objective/kl", "objective/kl_coef", "objective/entropy", "ppo/mean_non_score_reward",
    "ppo/mean_scores", "ppo/std_scores", "tokens/queries_len_mean", "tokens/responses_len_mean",
    "ppo/loss/policy", "ppo/loss/value", "ppo/loss/total", "ppo/policy/entropy",
    "ppo/policy/approxkl", "ppo/policy/policykl", "ppo/policy/clipfrac",
    "ppo/policy/advantages_mean", "ppo/returns/mean", "ppo/returns/var", "ppo/val/vpred",
    "ppo/val/error", "ppo/val/clipfrac", "ppo/val/mean", "ppo/val/var", "ppo/val/var_explained",
    "ppo/learning_rate", "time/ppo/forward_pass", "time/ppo/optimize_step", "time/ppo/total",
    "env/reward_mean", "env/reward_std",
}  # fmt: skip


def _config(tmp_path, **kw) -> PPOConfig:
    base = dict(
        batch_size=4, mini_batch_size=2, ppo_epochs=2, learning_rate=1e-3, seed=0,
        output_dir=str(tmp_path), disable_tqdm=True, response_length=4, max_steps=3,
        save_strategy="no",
    )  # fmt: skip
    return PPOConfig(**{**base, **kw})


def _queries(tokenizer) -> list[np.ndarray]:
    return [np.asarray(tokenizer(p)["input_ids"]) for p in PROMPTS]


@pytest.fixture(scope="module")
def trainer(hf_model_dir, tmp_path_factory):
    return PPOTrainer(_config(tmp_path_factory.mktemp("gen")), hf_model_dir)


def test_generate_greedy_equals_transformers(trainer, hf_model_dir, tokenizer):
    hf = AutoModelForCausalLM.from_pretrained(hf_model_dir).eval()
    queries = _queries(tokenizer)
    got = trainer.generate(queries, batch_size=2, do_sample=False, max_new_tokens=6)
    got_np = trainer.generate(
        queries, batch_size=3, return_prompt=False, do_sample=False, max_new_tokens=6
    )
    single = trainer.generate(queries[0], do_sample=False, max_new_tokens=6)
    for q, g, g_np in zip(queries, got, got_np, strict=True):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor(q)[None], max_new_tokens=6, do_sample=False, pad_token_id=0,
                eos_token_id=1,
            )[0].numpy()  # fmt: skip
        np.testing.assert_array_equal(g, ref)
        np.testing.assert_array_equal(g_np, ref[len(q) :])
    assert single.shape[0] == 1
    np.testing.assert_array_equal(single[0], got[0])


@pytest.mark.slow
def test_generate_length_sampler_per_chunk_and_eos(trainer, tokenizer):
    draws = iter([2, 3, 5])
    calls = []

    def length_sampler():
        calls.append(next(draws))
        return calls[-1]

    queries = _queries(tokenizer)
    kwargs = {"min_length": -1, "top_k": 0.0, "top_p": 1.0, "do_sample": True}  # TRL examples
    out = trainer.generate(
        queries, length_sampler=length_sampler, batch_size=2, return_prompt=False, **kwargs
    )
    assert calls == [2, 3, 5]  # one draw per chunk of 2 (5 queries: 2 + 2 + 1)
    for resp, limit in zip(out, [2, 2, 3, 3, 5], strict=True):
        eos = np.flatnonzero(resp == tokenizer.eos_token_id)
        if eos.size:  # cut right after the first EOS
            assert eos[0] == len(resp) - 1 and len(resp) <= limit
        else:
            assert len(resp) == limit
    # TRL strips after the first EOS anywhere in the output, the prompt included.
    with_eos = np.array([5, 6, tokenizer.eos_token_id, 7])
    (cut,) = trainer.generate([with_eos], do_sample=False, max_new_tokens=3)
    np.testing.assert_array_equal(cut, with_eos[:3])
    # The reference is the initial policy: same keys, same samples.
    resp, ref = trainer.generate(queries, generate_ref_response=True, **kwargs)
    chex.assert_trees_all_equal(resp, ref, strict=True)


def test_generate_rejects_unsupported(trainer, tokenizer):
    q = _queries(tokenizer)[0]
    with pytest.raises(ValueError, match="1-D"):
        trainer.generate(np.stack([q, q]))
    with pytest.raises(ValueError, match="max_length"):
        trainer.generate(q, max_length=10)
    with pytest.raises(ValueError, match="min_new_tokens"):
        trainer.generate(q, min_length=3)
    with pytest.raises(ValueError, match="Unsupported"):
        trainer.generate(q, no_repeat_ngram_size=2)
    # transformers' repetition penalty and min-p are the sampler's (HF's order and semantics).
    with pytest.raises(ValueError, match="repetition_penalty must be > 0"):
        trainer.generate(q, repetition_penalty=0.0)
    greedy = dict(do_sample=False, max_new_tokens=6)
    plain = trainer.generate(q, **greedy)
    assert not np.array_equal(trainer.generate(q, repetition_penalty=50.0, **greedy), plain)
    np.testing.assert_array_equal(trainer.generate(q, min_p=0.5, **greedy), plain)  # greedy


def _ones_reward(prompts, completions):
    return [float(c.count("1")) for c in completions]


def _prompt_ds(n: int = 8) -> datasets.Dataset:
    rows = task.sft_examples("train", n, seed=0)
    return datasets.Dataset.from_list([{"query": r["prompt"]} for r in rows])


def _metrics(path) -> list[dict]:
    with open(os.path.join(path, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


class _KillAfter(TrainerCallback):
    """Stops the run after `step` (after that step's checkpoint), like a killed job."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True
        return control


def _train(hf_model_dir, out, resume=None, callbacks=None, **kw):
    cfg = _config(out, resume_from_checkpoint=resume, **kw)
    trainer = PPOTrainer(
        cfg, hf_model_dir, dataset=_prompt_ds(), reward=_ones_reward, callbacks=callbacks
    )
    trainer.output = trainer.train()  # TrainOutput, checked where the test needs it
    return trainer


def _step_logs(path) -> dict[int, dict]:
    return {
        m["step"]: {k: v for k, v in m.items() if not k.startswith("time/")}
        for m in _metrics(path)
        if "ppo/loss/total" in m
    }


@pytest.mark.slow  # end to end: full training runs
def test_train_callable_reward_and_exact_resume(hf_model_dir, tmp_path):
    """A 5-step run killed after step 4 (checkpoints at steps 2 and 4): the stop is honoured
    (metrics.jsonl ends at step 4), TrainOutput and the logs are those of 4 steps; resumed from
    its step-2 checkpoint (what a run killed right after saving it leaves, copied instead of
    run: one trainer fewer), the same killed run's steps 3-4 are exactly the uninterrupted
    run's."""
    full = tmp_path / "full"
    save = dict(max_steps=5, save_strategy="steps", save_steps=2)
    trainer = _train(hf_model_dir, full, callbacks=[_KillAfter(4)], **save)
    logs = _step_logs(full)
    assert sorted(logs) == [1, 2, 3, 4]
    # TrainOutput.training_loss: the mean of PPO's per-step total loss (HF's training loss).
    want = np.mean([logs[s]["ppo/loss/total"] for s in logs])
    assert trainer.output.global_step == 4
    assert trainer.output.training_loss == pytest.approx(want, rel=1e-5)
    first = next(m for m in _metrics(full) if m["step"] == 1)
    assert TRL_KEYS <= set(first), TRL_KEYS - set(first)
    assert int(trainer.train_state.extras["ppo_step"]) == 4
    # One optimise program for the whole run: the state's inputs keep their types and
    # placements from step to step (a host-refreshed RNG state once changed them at step 2).
    assert trainer._jit_optimise._cache_size() == 1
    assert trainer.save_model() == str(full)  # HF's default: args.output_dir itself
    assert {"model.safetensors", "config.json"} <= set(os.listdir(full))

    # Killed after step 2 (checkpoint at 2), then resumed to step 4.
    part = tmp_path / "part"
    killed_after_checkpoint(full, 2, part)
    _train(hf_model_dir, part, resume=True, callbacks=[_KillAfter(4)], **save)
    resumed = _step_logs(part)
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):
        assert resumed[step] == logs[step]
    assert logs[3] != logs[4]  # the stats move from step to step


def test_reward_model_path_equals_direct_forward(hf_model_dir, tokenizer, tmp_path):
    from transformers import Qwen2ForSequenceClassification

    torch.manual_seed(1)
    cfg = tiny_config()
    cfg.num_labels = 1
    rm = Qwen2ForSequenceClassification(cfg).eval()
    rm.save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    trainer = PPOTrainer(_config(tmp_path), hf_model_dir, reward=str(tmp_path / "rm"))
    completions = ["46", "11", "", "3"]
    got = trainer.reward(PROMPTS[:4], completions)
    for p, c, g in zip(PROMPTS[:4], completions, got, strict=True):
        ids = tokenizer(p + c + tokenizer.eos_token)["input_ids"]
        with torch.no_grad():
            want = rm(torch.tensor(ids)[None]).logits[0, 0].item()
        assert g == pytest.approx(want, abs=1e-4)


@pytest.mark.slow
def test_cli_ppo_smoke(tmp_path, capsys):
    """`--algo ppo` through the CLI's entry point, in this process: nothing here needs a fresh
    interpreter (no signal, no exit status beyond main's return value; `python -m jaxrl.train`
    as a subprocess is tests/test_train_cli.py's), which saved the subprocess's ~6 s of imports."""
    out = tmp_path / "cli"
    # No checkpoint (the recipe saves one at the last step): the exact resume test checks
    # saving, and a save costs more than the two steps.
    argv = ["--algo", "ppo", "--max_steps", "2", "--output_dir", str(out),
            "--disable_tqdm", "true", "--save_strategy", "no"]  # fmt: skip
    assert train_main(argv) == 0, capsys.readouterr().err[-2000:]
    logs = _step_logs(out)
    assert sorted(logs) == [1, 2] and TRL_KEYS <= set(_metrics(out)[1])
    with safe_open(str(out / "final" / "model.safetensors"), "np") as f:
        assert {"v_head.summary.weight", "v_head.summary.bias"} <= set(f.keys())

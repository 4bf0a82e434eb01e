"""PPOTrainer against TRL v0.7.2 golden runs (examples/golden_ppo_trl072.py): every stat of three
`step()` calls and the weights after them, plus config validation, input checks, shared
layers, the lr scheduler and saving."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from safetensors import safe_open
from transformers import AutoTokenizer

from jaxrl import AutoModelForCausalLMWithValueHead
from jaxrl.trainers.ppo import PPOTrainer
from jaxrl.trainers.ppo_config import PPOConfig

GOLDEN = Path(__file__).resolve().parent.parent / "golden"
FAST = {("gpt2", "base")}
CASES = [
    ("gpt2", c)
    for c in (
        "base", "ga2", "mb2", "kl_abs", "kl_mse", "kl_full", "score_scaling",
        "score_scaling_no_norm", "fixed_kl_gamma", "clip_grad", "early_stop", "ratio_skip",
        "response_masks",
    )
] + [("llama", "base"), ("llama", "ga2")]  # fmt: skip
# Arrays whose entries at padded positions depend on pad-token positions (transformers 4.36
# used arange positions there); compared on the loss mask only.
MASKED_ARRAYS = ("objective/logprobs", "objective/ref_logprobs", "ppo/policy/ratio")


def _golden(family: str, case: str) -> tuple[dict, Path]:
    d = GOLDEN / f"ppo_trl072_{family}"
    return json.loads((d / f"{case}.json").read_text()), d


def _masks(g: dict) -> np.ndarray:
    """TRL's [B, T] loss mask for the golden right-padded batch."""
    lens = [len(q) + len(r) for q, r in zip(g["queries"], g["responses"], strict=True)]
    mask = np.zeros((len(lens), max(lens) - 1))
    for j, (q, r) in enumerate(zip(g["queries"], g["responses"], strict=True)):
        rm = g["response_masks"][j] if g["response_masks"] else [1] * len(r)
        mask[j, len(q) - 1 : len(q) - 1 + len(r)] = rm
    return mask


def _run(family: str, case: str, **trainer_kwargs):
    g, d = _golden(family, case)
    trainer = PPOTrainer(
        PPOConfig(**g["config"]),
        str(d / "init"),
        tokenizer=AutoTokenizer.from_pretrained(d / "init"),
        **trainer_kwargs,
    )
    rm = g["response_masks"]
    all_stats = []
    for step in range(3):
        all_stats.append(
            trainer.step(
                [np.array(q) for q in g["queries"]],
                [np.array(r) for r in g["responses"]],
                [np.float32(s) for s in g["scores"][step]],
                response_masks=None if rm is None else [np.array(m) for m in rm],
            )
        )
    return trainer, all_stats, g


@pytest.mark.parametrize(
    "family,case",
    [pytest.param(*c, marks=() if c in FAST else pytest.mark.slow) for c in CASES],
)
def test_step_stats_match_trl_v072(family, case):
    trainer, all_stats, g = _run(family, case)
    mask_BT = _masks(g)
    B, T = mask_BT.shape
    perm_cursor = 0
    for step, (got, want) in enumerate(zip(all_stats, g["steps"], strict=True)):
        assert set(got) == set(want), set(got) ^ set(want)
        n_mb_rows = len(want["ppo/policy/ratio"]) // T  # rows over all epochs run
        epochs = n_mb_rows // B
        perms = g["permutations"][perm_cursor : perm_cursor + epochs]
        perm_cursor += epochs
        mask_flat = np.concatenate([mask_BT[p].ravel() for p in perms]) > 0
        # Wall-clock timings (TRL's layout): each phase took time, and the phases are disjoint
        # intervals of the step, so the total covers their sum.
        timings = {k: got[k] for k in want if k.startswith("time/")}
        parts = [v for k, v in timings.items() if k != "time/ppo/total"]
        assert len(parts) == 5 and all(v > 0 for v in parts), timings
        assert timings["time/ppo/total"] >= sum(parts) - 1e-6, timings
        for key, w in want.items():
            if key.startswith("time/"):
                continue
            gv, wv = np.asarray(got[key], np.float64), np.asarray(w, np.float64)
            assert gv.shape == wv.shape, (key, gv.shape, wv.shape)
            if key in MASKED_ARRAYS:
                keep = mask_flat if key == "ppo/policy/ratio" else mask_BT > 0
                gv, wv = gv[keep], wv[keep]
            np.testing.assert_allclose(
                gv, wv, rtol=1e-4, atol=5e-6, err_msg=f"{family}/{case} step {step}: {key}"
            )
    assert perm_cursor == len(g["permutations"])  # same NumPy draws as TRL (early stop too)
    if case == "base":
        _check_final_weights(trainer, family)


def _check_final_weights(trainer: PPOTrainer, family: str) -> None:
    final = GOLDEN / f"ppo_trl072_{family}" / "base_final" / "model.safetensors"
    with tempfile.TemporaryDirectory() as tmpdir:
        trainer.save_pretrained(tmpdir)  # TRL's layout: LM keys + v_head.summary.*
        assert (Path(tmpdir) / "README.md").exists()
        assert (Path(tmpdir) / "tokenizer.json").exists()
        with safe_open(str(Path(tmpdir) / "model.safetensors"), "np") as f:
            ours = {k: f.get_tensor(k) for k in f.keys()}
    with safe_open(str(final), "np") as f:
        assert set(f.keys()) == set(ours)
        for k in f.keys():
            np.testing.assert_allclose(ours[k], f.get_tensor(k), atol=2e-4, err_msg=k)


def test_config_defaults_and_validation():
    c = PPOConfig()
    assert (c.steps, c.learning_rate, c.batch_size, c.mini_batch_size, c.ppo_epochs) == (
        20000,
        1e-5,
        256,
        1,
        4,
    )
    assert (c.init_kl_coef, c.target, c.horizon, c.gamma, c.lam, c.vf_coef) == (
        0.2,
        6,
        10000,
        1,
        0.95,
        0.1,
    )
    assert c.backward_batch_size == 1 and c.total_ppo_epochs == 79
    assert c.to_dict()["cliprange"] == 0.2
    with pytest.raises(ValueError, match="multiple of"):
        PPOConfig(batch_size=6, mini_batch_size=2, gradient_accumulation_steps=2)
    with pytest.raises(ValueError, match="kl_penalty"):
        PPOConfig(kl_penalty="js")
    with pytest.raises(ValueError, match="accelerator_kwargs"):
        PPOConfig(accelerator_kwargs={"mixed_precision": "bf16"})
    with pytest.raises(ValueError, match="push_to_hub_if_best_kwargs"):
        PPOConfig(push_to_hub_if_best_kwargs={"repo_id": "x"})
    with pytest.raises(ValueError, match="tensorboard"):
        PPOConfig(log_with="tensorboard")
    with pytest.warns(FutureWarning, match="forward_batch_size"):
        assert PPOConfig(batch_size=8, forward_batch_size=4).mini_batch_size == 4
    with pytest.warns(UserWarning, match="no effect"):
        PPOConfig(optimize_cuda_cache=True)


@pytest.fixture(scope="module")
def gpt2_dir():
    return GOLDEN / "ppo_trl072_gpt2" / "init"


def test_public_api_input_checks_and_dataloader(gpt2_dir):
    """One trainer (the golden base config, with a dataset) for three checks that each built
    their own before (two trainers fewer):

    - TRL's helper methods: batched_forward_pass (logits only on request), compute_rewards,
      compute_advantages and loss reproduce the first golden step's rollout statistics;
    - step()'s input checks, and the refusals of a model that is no value-head LM, of a config
      that is no PPOConfig and of num_shared_layers beyond the model;
    - the dataloader (batches of batch_size without unknown columns, the last partial one
      dropped) and log_stats (reward mean and std, the log history)."""
    import datasets

    g, _ = _golden("gpt2", "base")
    want = g["steps"][0]
    ds = datasets.Dataset.from_dict(
        {"query": [f"q{i}" for i in range(10)], "input_ids": [[i, i + 1] for i in range(10)],
         "extra": list(range(10))}
    )  # fmt: skip
    tok = AutoTokenizer.from_pretrained(gpt2_dir)
    config = PPOConfig(**g["config"])
    assert (config.batch_size, config.mini_batch_size) == (4, 4)
    trainer = PPOTrainer(config, str(gpt2_dir), tokenizer=tok, dataset=ds)

    # The helper methods, at the initial weights.
    q = [np.array(x) for x in g["queries"]]
    r = [np.array(x) for x in g["responses"]]
    inputs = trainer.prepare_model_inputs(q, r)
    logps, logits, values, masks = trainer.batched_forward_pass(trainer.model, q, r, inputs)
    assert logits is None
    np.testing.assert_array_equal(masks, _masks(g))
    keep = _masks(g) > 0
    np.testing.assert_allclose(
        np.asarray(logps)[keep], np.asarray(want["objective/logprobs"])[keep], rtol=1e-5
    )
    ref_logps, ref_logits, ref_values, _ = trainer.batched_forward_pass(
        trainer.ref_model, q, r, inputs, return_logits=True
    )
    assert ref_values is None and ref_logits.shape == (*logps.shape, 64)
    # Called again on the same shapes, it runs the program it compiled (it used to build and
    # compile a new one on every call).
    from jaxrl.algos import ppo

    compiled = ppo.batched_forward._cache_size()
    again = trainer.batched_forward_pass(trainer.model, q, r, inputs)[0]
    assert ppo.batched_forward._cache_size() == compiled
    np.testing.assert_array_equal(np.asarray(again), np.asarray(logps))
    scores = np.asarray(g["scores"][0], np.float32)
    # compute_rewards and loss run eagerly, one compiled program per operation: under jit they
    # compile once (the same methods, the same values up to float rounding).
    rewards, non_score = jax.jit(trainer.compute_rewards)(scores, logps, ref_logps, masks)
    non_score_np, masks_np = np.asarray(non_score), np.asarray(masks)
    np.testing.assert_allclose(
        float((non_score_np * masks_np).sum() / masks_np.sum()),
        want["ppo/mean_non_score_reward"],
        atol=1e-6,
    )
    values, adv, returns = trainer.compute_advantages(values, rewards, masks)
    pg, vf, stats = jax.jit(trainer.loss)(
        logps, values, ref_logits, values, logps, masks, adv, returns
    )
    assert float(stats["policy/approxkl"]) == 0.0 and float(stats["val/clipfrac"]) == 0.0
    np.testing.assert_allclose(float(vf), 0.1 * float(stats["loss/value"]), rtol=1e-6)
    np.testing.assert_allclose(stats["returns/mean"], want["ppo/returns/mean"], rtol=1e-4)
    np.testing.assert_allclose(stats["val/mean"], want["ppo/val/mean"], rtol=1e-4)

    # step()'s input checks (batch_size 4) and the constructor's refusals.
    q = [np.array([3, 4]), np.array([5]), np.array([3]), np.array([4, 5])]
    r = [np.array([6]), np.array([7, 8]), np.array([9]), np.array([10])]
    with pytest.raises(ValueError, match="Batch size"):
        trainer.step(q[:1], r[:1], [np.float32(1.0)])
    with pytest.raises(ValueError, match="must be a list"):
        trainer.step(tuple(q), r, [1.0, 2.0, 3.0, 4.0])
    with pytest.raises(ValueError, match="1-dimensional"):
        trainer.step(q, r, [np.ones((1, 1))] * 4)
    with pytest.raises(ValueError, match="response mask"):
        trainer.step(q, r, [1.0, 2.0, 3.0, 4.0], response_masks=[np.array([1, 1])] * 4)
    with pytest.raises(ValueError, match="CausalLMWithValueHead"):
        PPOTrainer(PPOConfig(batch_size=2, mini_batch_size=2), object(), tokenizer=tok)
    with pytest.raises(ValueError, match="PPOConfig"):
        PPOTrainer({"batch_size": 2}, str(gpt2_dir), tokenizer=tok)
    with pytest.raises(ValueError, match="num_shared_layers"):
        PPOTrainer(PPOConfig(batch_size=2, mini_batch_size=2), str(gpt2_dir), tokenizer=tok,
                   num_shared_layers=2)  # fmt: skip

    # The dataloader and log_stats.
    batches = list(trainer.dataloader)
    assert len(trainer.dataloader) == 2 and len(batches) == 2
    assert set(batches[0]) == {"query", "input_ids"}  # "extra" removed
    assert len(batches[0]["query"]) == 4
    seen = [q for b in batches for q in b["query"]]
    assert len(set(seen)) == 8
    logs = trainer.log_stats({"objective/kl": 0.5}, batches[0], [1.0, 2.0, 3.0, 4.0])
    assert logs["env/reward_mean"] == pytest.approx(2.5)
    assert logs["env/reward_std"] == pytest.approx(np.std([1, 2, 3, 4], ddof=1))
    assert trainer.log_history[-1]["objective/kl"] == 0.5
    assert jax.process_index() == 0


@pytest.mark.slow
def test_shared_layers_frozen_and_lr_scheduler(gpt2_dir):
    """num_shared_layers=1: embeddings and layer 0 never move, layer 1 and the value head do;
    the scheduler sets each step's learning rate (reported as ppo/learning_rate)."""
    g, _ = _golden("gpt2", "base")
    tok = AutoTokenizer.from_pretrained(gpt2_dir)
    config = PPOConfig(batch_size=4, mini_batch_size=2, ppo_epochs=1, learning_rate=1e-2)
    before = AutoModelForCausalLMWithValueHead.from_pretrained(gpt2_dir)
    trainer = PPOTrainer(
        config, str(gpt2_dir), tokenizer=tok, num_shared_layers=1,
        lr_scheduler=lambda step: 1e-2 * 0.5**step,
    )  # fmt: skip
    lrs = []
    for step in range(2):
        stats = trainer.step(
            [np.array(q) for q in g["queries"]],
            [np.array(r) for r in g["responses"]],
            [np.float32(s) for s in g["scores"][step]],
        )
        lrs.append(stats["ppo/learning_rate"])
    assert lrs == pytest.approx([1e-2, 5e-3])
    after = trainer.model.pretrained_model.transformer
    old = before.pretrained_model.transformer
    for name in ("wte", "wpe"):
        np.testing.assert_array_equal(getattr(after, name).embedding[...],
                                      getattr(old, name).embedding[...])  # fmt: skip
    np.testing.assert_array_equal(after.h[0].mlp.c_fc.kernel[...], old.h[0].mlp.c_fc.kernel[...])
    assert not np.allclose(after.h[1].mlp.c_fc.kernel[...], old.h[1].mlp.c_fc.kernel[...])
    assert not np.allclose(
        trainer.model.v_head.summary.kernel[...], before.v_head.summary.kernel[...]
    )
    # The reference is the initial policy, untouched.
    np.testing.assert_array_equal(
        trainer.ref_model.transformer.h[1].mlp.c_fc.kernel[...], old.h[1].mlp.c_fc.kernel[...]
    )
    with pytest.raises(ValueError, match="inject_hyperparams"):
        PPOTrainer(config, str(gpt2_dir), tokenizer=tok, optimizer=optax.sgd(0.1),
                   lr_scheduler=lambda step: 0.1)  # fmt: skip

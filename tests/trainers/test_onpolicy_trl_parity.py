"""GRPO/RLOO behaviours that follow TRL 1.16 exactly: metrics TRL may leave NaN are logged as TRL
logs them (NaN dropped from the window mean, None when nothing is left) while a NaN loss still
stops the run; reward functions get `log_extra` and `log_metric` (every value averaged); the
stop ids are the tokenizer's EOS plus the model's generation-config EOS ids, and a completion
ending with the pad token is not truncated; `generate_completions` and
`LogCompletionsCallback` work; config spellings (`pad_to_multiple_of="auto"`,
`max_completion_length=None`, the global eval batch check); DAPO's token-count normaliser
(the run with a generation spanning several optimizer steps is in test_grpo_trainer.py)."""

from __future__ import annotations

import json
import math
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from onpolicy_utils import prompt_rows
from trainer_utils import base_args, tiny_config, train_logs

from jaxrl.config import ConfigError
from jaxrl.core.step import make_train_step
from jaxrl.generation import GenerationConfig
from jaxrl.losses.grpo import grpo_aggregate, grpo_loss
from jaxrl.losses.rloo import rloo_loss
from jaxrl.trainers.grpo import GRPOTrainer
from jaxrl.trainers.grpo_config import GRPOConfig
from jaxrl.trainers.loop import TrainLoop
from jaxrl.trainers.rloo_config import RLOOConfig

SETTINGS = dict(per_device_train_batch_size=8, num_generations=4, max_completion_length=4)


def make(model, tokenizer, tmp_path, reward, trainer_cls=GRPOTrainer, **kw):
    config_cls = GRPOConfig if trainer_cls is GRPOTrainer else RLOOConfig
    args = config_cls(**base_args(tmp_path, **{**SETTINGS, "max_steps": 1, **kw}))
    return trainer_cls(
        model,
        reward_funcs=reward,
        args=args,
        train_dataset=prompt_rows(16),
        eval_dataset=prompt_rows(4, "test"),
        processing_class=tokenizer,
    )


def always(prompts, completions, **kw):
    return [1.0 for _ in completions]


def never(prompts, completions, **kw):
    return [None for _ in completions]  # e.g. a math-only reward on a code batch


class Hooks:
    """A TRL-style reward function that needs `log_extra` and `log_metric` (required
    keyword-only, as TRL always passes them), returns None on its first call only, logs one
    metric value per completion and a NaN metric."""

    __name__ = "hooks"

    def __init__(self):
        self.calls = []

    def __call__(self, prompts, completions, *, log_extra, log_metric, **kw):
        first = not self.calls
        values = [float(len(c)) for c in completions]
        self.calls.append(values)
        log_extra("length", [len(c) for c in completions])
        for i, _ in enumerate(completions):
            log_metric("custom/index", float(i))
        log_metric("custom/nan", math.nan)
        return [None] * len(completions) if first else values


@pytest.fixture(scope="module")
def hooked_run(hf_model_dir, tokenizer, tmp_path_factory):
    """Two steps logged as one window: `never` is None on both, `hooks` on the first only."""
    hooks = Hooks()
    out = tmp_path_factory.mktemp("hooked")
    trainer = make(
        hf_model_dir, tokenizer, out, [always, never, hooks], max_steps=2, logging_steps=2
    )
    trainer.train()
    return trainer, hooks, out


def test_hooked_run(hooked_run):
    """The hooked run's five checks, in one test so that the run is built once (as a module
    fixture of five tests, xdist built it on both workers when they were split), in the order
    they ran as tests: NaN reward metrics dropped from the log, log_metric's mean of every
    value, log_extra's columns, eval's NaN reward metrics as None (runs evaluate()), and a NaN
    loss or undeclared metric still stopping the run."""
    check_nan_reward_metrics_are_dropped_from_the_log_not_raised(hooked_run)
    check_log_metric_logs_the_mean_of_every_value(hooked_run)
    check_log_extra_columns_are_kept_like_trls_completion_logs(hooked_run)
    check_eval_logs_nan_reward_metrics_as_none(hooked_run)
    check_nan_loss_and_undeclared_metrics_still_stop_the_run(hooked_run)


def check_nan_reward_metrics_are_dropped_from_the_log_not_raised(hooked_run):
    trainer, hooks, out = hooked_run
    (log,) = train_logs(trainer)
    assert log["step"] == 2
    # TRL's log(): no non-NaN value in the window -> None; else the mean of the non-NaN ones.
    assert log["rewards/never/mean"] is None and log["rewards/never/std"] is None
    assert log["rewards/hooks/mean"] == pytest.approx(np.mean(hooks.calls[1]))
    assert log["rewards/always/mean"] == 1.0 and math.isfinite(log["loss"])
    lines = (out / "metrics.jsonl").read_text().splitlines()
    (record,) = [r for r in map(json.loads, lines) if "loss" in r]
    assert record["rewards/never/mean"] is None  # JSON null, as TRL's loggers get


def check_log_metric_logs_the_mean_of_every_value(hooked_run):
    trainer, _, _ = hooked_run
    (log,) = train_logs(trainer)
    assert log["custom/index"] == pytest.approx(np.mean(range(8)))  # not the last value (7)
    assert log["custom/nan"] is None  # a user metric may be NaN too (TRL drops it)


def check_log_extra_columns_are_kept_like_trls_completion_logs(hooked_run):
    trainer, hooks, _ = hooked_run
    # TRL's `_logs["extra"]`: the latest generation_batch_size values of each column.
    assert list(trainer.completion_extras) == ["length"]
    assert list(trainer.completion_extras["length"]) == [int(v) for v in hooks.calls[-1]]


def check_eval_logs_nan_reward_metrics_as_none(hooked_run):
    trainer, _, _ = hooked_run
    metrics = trainer.evaluate()
    assert math.isnan(metrics["eval_rewards/never/mean"])
    logged = trainer.state.log_history[-1]
    assert logged["eval_rewards/never/mean"] is None
    # 2 prompts x 4 generations per eval batch: each batch's mean of 0..7, then their mean;
    # the greedy calls (one completion per prompt) under greedy/.
    assert logged["eval_custom/index"] == pytest.approx(3.5)
    assert logged["eval_greedy/custom/index"] == pytest.approx(0.5)


def check_nan_loss_and_undeclared_metrics_still_stop_the_run(hooked_run):
    trainer, _, _ = hooked_run
    values = {
        "loss": math.nan,
        "grad_norm": math.inf,
        "reward": math.nan,
        "reward_std": math.inf,  # allowed to be NaN, not infinite
        "rewards/never/mean": math.nan,
        "rewards/unknown/mean": math.nan,
        "clip_ratio/low_min": math.nan,
        "custom/index": math.nan,
        "entropy": math.nan,
    }
    assert trainer._non_finite(values) == [
        "entropy",
        "grad_norm",
        "loss",
        "reward_std",
        "rewards/unknown/mean",
    ]

    class Declares(TrainLoop):
        _nan_allowed_metrics = ("loss", "grad_norm", "x")

    # The loss and grad_norm are never allowed NaN, whatever a trainer declares.
    assert Declares()._non_finite({"loss": math.nan, "grad_norm": math.nan, "x": math.nan}) == [
        "grad_norm",
        "loss",
    ]
    assert TrainLoop()._non_finite({"x": math.nan, "y": 1.0}) == ["x"]  # other trainers: as before


@pytest.mark.slow
def test_every_completion_masked_logs_no_clip_extrema(hf_model_dir, tokenizer, tmp_path):
    """mask_truncated_completions with every completion truncated: TRL's nanmin/nanmax of no
    sequence are NaN, dropped by its log(); the run goes on."""

    def r(prompts, completions, **kw):
        return [float(len(c)) + 0.1 * i for i, c in enumerate(completions)]

    trainer = make(
        hf_model_dir, tokenizer, tmp_path, r, mask_truncated_completions=True,
        max_completion_length=2, per_device_train_batch_size=4, num_generations=2, seed=1,
    )  # fmt: skip
    trainer.train()
    assert np.asarray(trainer.rollout["completion_mask"]).sum() == 0  # the premise
    (log,) = train_logs(trainer)
    assert log["clip_ratio/low_min"] is None and log["clip_ratio/high_max"] is None
    assert log["loss"] == 0.0


# RLOO's NaN reward metrics (a reward that is None for every completion) are checked on the
# RLOO run of test_onpolicy_moe.py::test_coefficient_follows_trl.


def test_clip_extrema_are_nan_when_every_row_is_masked():
    B, T = 4, 3
    logps = jnp.log(jnp.full((B, T), 0.5))
    adv = jnp.array([1.0, -1.0, 1.0, -1.0])
    # Jitted: called eagerly, each of the losses' operations compiled a program of its own.
    grpo = jax.jit(lambda mask: grpo_loss(logps, adv, mask, loss_type="dapo"))
    _, aux = grpo(jnp.zeros((B, T)))
    assert jnp.isnan(aux["min"]["clip_ratio/low_min"])
    assert jnp.isnan(aux["max"]["clip_ratio/high_max"])
    _, aux = grpo(jnp.ones((B, T)).at[0].set(0))
    assert aux["min"]["clip_ratio/low_min"] == 0.0
    _, aux = jax.jit(rloo_loss)(logps, adv, jnp.ones((B, T)), example_mask_B=jnp.zeros(B))
    assert jnp.isnan(aux["min"]["clip_ratio/low_min"])
    assert jnp.isnan(aux["max"]["clip_ratio/high_max"])


def test_step_min_max_ignore_nan_micro_batches():
    """Over accumulation micro-batches a NaN min (an all-masked micro-batch) is ignored, as
    TRL's log() ignores it; NaN only when every micro-batch had none."""

    def loss_fn(params, state, mb, rng, extras):
        loss = jnp.sum(params["w"] * mb["x"])
        aux = {
            "sum": {"loss": loss},
            "count": {"loss": jnp.ones(())},
            "min": {"m": mb["m"][0]},
            "max": {"M": mb["m"][0]},
        }
        return loss, (aux, extras)

    from jaxrl.core.state import TrainState

    tx = optax.sgd(0.1)
    step = jax.jit(make_train_step(loss_fn, tx))
    params = {"w": jnp.ones(2)}
    state = TrainState.create(params, tx, seed=0)
    x = jnp.ones((2, 2))
    _, m = step(state, {"x": x, "m": jnp.array([[jnp.nan], [0.25]])})
    assert m["m"] == 0.25 and m["M"] == 0.25
    _, m = step(state, {"x": x, "m": jnp.full((2, 1), jnp.nan)})
    assert jnp.isnan(m["m"]) and jnp.isnan(m["M"])


def test_stop_ids_include_the_model_generation_config_eos(
    hf_model_dir, tokenizer, tmp_path, monkeypatch
):
    model_dir = tmp_path / "model"
    shutil.copytree(hf_model_dir, model_dir)
    gen_path = model_dir / "generation_config.json"
    gen = json.loads(gen_path.read_text())
    gen["eos_token_id"] = [7, 1]  # e.g. an end-of-turn token besides the tokenizer's EOS
    gen_path.write_text(json.dumps(gen))
    trainer = make(str(model_dir), tokenizer, tmp_path / "out", always, max_completion_length=8)
    assert trainer.eos_token_ids == [7, 1]  # TRL keeps the model's order when it holds EOS
    assert trainer.rollout_generation_config.stop_ids == (7, 1)
    trainer._ensure_state()
    config = trainer.rollout_generation_config
    s = trainer._sample(
        trainer.current_params(), list(trainer.train_dataset)[:4], 4, config, jax.random.key(0)
    )
    ids = np.asarray(s["out"].completion_ids_BN)
    lengths = s["lengths_N"]
    stopped_at_7 = [row[n - 1] == 7 for row, n in zip(ids, lengths, strict=True)]
    assert any(stopped_at_7)  # the premise: the random model samples token 7
    for row, n in zip(ids, lengths, strict=True):
        assert 7 not in row[: n - 1].tolist()  # 7 ends a completion
    assert not s["truncated_N"][np.array(stopped_at_7)].any()  # ... properly

    # A completion ending with the pad token ended properly (TRL's truncation test).
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    assert pad != eos
    np.testing.assert_array_equal(
        trainer._truncated([[5, pad], [5, eos], [5, 7], [5, 6], [5]], config),
        [False, False, False, True, True],
    )

    # No generation_config.json: transformers derives it from the model config (as a model
    # built from a config object).
    gen_path.unlink()
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["eos_token_id"] = [1, 9]
    (model_dir / "config.json").write_text(json.dumps(cfg))
    trainer = make(str(model_dir), tokenizer, tmp_path / "out2", always)
    assert trainer.eos_token_ids == [1, 9]
    config = tiny_config()
    config.eos_token_id = [3, 5]
    trainer = make(config, tokenizer, tmp_path / "out3", always)
    assert trainer.eos_token_ids == [1, 3, 5]  # the tokenizer's EOS first, as TRL


def test_generate_completions_and_log_completions_callback(hf_model_dir, tokenizer, tmp_path):
    """Greedy completions (3 new tokens) equal a transformers greedy decode of the same model,
    decoded with special tokens skipped; the callback logs the eval set's first prompts with
    those completions at the current step."""
    import torch
    from transformers import AutoModelForCausalLM

    from jaxrl.callbacks.completions import LogCompletionsCallback

    model = AutoModelForCausalLM.from_pretrained(hf_model_dir, dtype=torch.float32).eval()

    def greedy(prompt: str) -> str:
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        n = ids.shape[1]
        with torch.no_grad():
            for _ in range(3):  # no EOS in this config: always 3 new tokens
                ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], dim=1)
        return tokenizer.decode(ids[0, n:].tolist(), skip_special_tokens=True)

    trainer = make(hf_model_dir, tokenizer, tmp_path, always)
    gen = GenerationConfig(max_new_tokens=3)
    (completion,) = trainer.generate_completions(["12+3="], generation_config=gen)
    assert completion == greedy("12+3=")
    callback = LogCompletionsCallback(trainer, generation_config=gen, num_prompts=2, freq=1)
    callback.on_step_end(trainer.args, trainer.state, trainer.control)
    rows = [json.loads(x) for x in (tmp_path / "completions.jsonl").read_text().splitlines()]
    prompts = prompt_rows(2, "test")["prompt"]
    assert rows == [{"step": 0, "prompt": p, "completion": greedy(p)} for p in prompts]


def test_config_spellings_like_trl():
    # TRL's default "auto" pads only on Neuron: None here; "none"/"null" and int strings too.
    assert GRPOConfig().pad_to_multiple_of is None
    assert RLOOConfig(pad_to_multiple_of="auto").pad_to_multiple_of is None
    assert GRPOConfig(pad_to_multiple_of="None").pad_to_multiple_of is None
    assert GRPOConfig(pad_to_multiple_of="64").pad_to_multiple_of == 64
    assert GRPOConfig(pad_to_multiple_of=64).pad_to_multiple_of == 64
    with pytest.raises(ConfigError, match="pad_to_multiple_of"):
        GRPOConfig(pad_to_multiple_of="big")
    with pytest.raises(ConfigError, match="pad_to_multiple_of"):
        GRPOConfig(pad_to_multiple_of=0)
    with pytest.raises(ConfigError, match="max_completion_length=None"):
        GRPOConfig(max_completion_length=None)
    with pytest.raises(ConfigError, match="max_completion_length=None"):
        RLOOConfig(max_completion_length=None)
    # cast_lm_head_to_fp32 is a TRL GRPOConfig field, not an RLOOConfig one.
    assert GRPOConfig(cast_lm_head_to_fp32=True).cast_lm_head_to_fp32
    with pytest.raises(TypeError, match="cast_lm_head_to_fp32"):
        RLOOConfig(cast_lm_head_to_fp32=True)
    # TRL checks the *global* eval batch (per device x processes) against num_generations_eval.
    c = GRPOConfig(eval_strategy="steps", per_device_eval_batch_size=2, num_generations=4)
    c.check_eval_batch(2)
    with pytest.raises(ConfigError, match="global eval batch size"):
        c.check_eval_batch(1)
    GRPOConfig(per_device_eval_batch_size=2, num_generations=4).check_eval_batch(1)  # no eval


def test_eval_batch_checked_over_devices_at_init(hf_model_dir, tokenizer, tmp_path):
    with pytest.raises(ConfigError, match="global eval batch size"):
        make(
            hf_model_dir, tokenizer, tmp_path, always, eval_strategy="steps",
            per_device_eval_batch_size=2,
        )  # fmt: skip


def test_token_count_replaces_the_dapo_normaliser():
    loss = jnp.arange(6.0).reshape(2, 3)
    mask = jnp.array([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    for loss_type in ("dapo", "cispo", "vespo"):
        s, n = grpo_aggregate(loss, mask, loss_type=loss_type)
        assert (float(s), float(n)) == (4.0, 3.0)
        s, n = grpo_aggregate(loss, mask, loss_type=loss_type, token_count=5.0)
        assert (float(s), float(n)) == (4.0, 5.0)
    _, n = grpo_aggregate(loss, mask, loss_type="grpo", token_count=5.0)
    assert float(n) == 2.0  # sequence-normalised types ignore it


# DAPO's generation-batch normaliser on a run (steps_per_generation=2) is checked with the
# sampler log-probs on one run: test_grpo_trainer.py::
# test_sampler_logps_are_old_logps_and_dapo_normalises_by_the_generation_batch_tokens.

"""GRPO and RLOO on a mixture-of-experts model (Qwen3-MoE: 4 experts, 2 per token, renormalised
routing) equal TRL 1.16's own trainers step for step with the load-balancing loss
(`router_aux_loss_coef`): loss, `aux_loss`, entropy and grad norm over two optimizer steps of two
micro-batches each, from one generation batch (`steps_per_generation` 4, so the second step is
off-policy and `dapo` normalises by the generation batch's tokens); the eval loss adds the aux
loss undivided; the coefficient is resolved (and refused) as TRL does.

TRL's trainer replays jaxrl's rollouts: its `_prepare_inputs` hands each micro-step the
micro-batch jaxrl used (same rows, advantages, sampling log-probs), so everything after
generation is TRL's own code: the loss forward with `output_router_logits`, GRPO's
`coef x aux_loss / accumulation steps` (RLOO adds `coef x aux_loss` and HF's Trainer divides),
the backward pass, clipping, AdamW and the logs."""

from __future__ import annotations

import numpy as np
import pytest
from onpolicy_utils import prompt_rows
from trainer_utils import (
    assert_logs_match,
    base_args,
    tiny_qwen3_moe,
    train_logs,
    trl_train_logs,
)

from jaxrl.trainers.grpo import GRPOTrainer
from jaxrl.trainers.grpo_config import GRPOConfig
from jaxrl.trainers.rloo import RLOOTrainer
from jaxrl.trainers.rloo_config import RLOOConfig

COEF = 0.5  # large, so that the aux loss moves the loss and the gradients visibly
SETTINGS = dict(
    per_device_train_batch_size=4,
    gradient_accumulation_steps=2,
    steps_per_generation=4,  # one generation batch of 16 (4 prompts x 4) for both steps
    num_generations=4,
    max_completion_length=6,
    max_steps=2,
    learning_rate=1e-2,
    router_aux_loss_coef=COEF,
)
METRICS = ("loss", "aux_loss", "entropy")


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory, tokenizer):
    return tiny_qwen3_moe(tmp_path_factory.mktemp("tiny_qwen3_moe_onpolicy"), tokenizer)


def digits(prompts, completions, **kw):
    """A reward that differs within groups: the completion's digit sum and length."""
    return [sum(int(c) for c in s if c.isdigit()) + 0.1 * len(s) for s in completions]


def always(prompts, completions, **kw):
    return [1.0 for _ in completions]


def never(prompts, completions, **kw):
    return [None for _ in completions]  # e.g. a math-only reward on a code batch


def _ours(trainer_cls, config_cls, model_dir, tokenizer, out, **kw):
    args = config_cls(**base_args(out, **{**SETTINGS, **kw}))
    trainer = trainer_cls(
        model_dir,
        reward_funcs=digits,
        args=args,
        train_dataset=prompt_rows(8),
        processing_class=tokenizer,
    )
    trainer.train()
    return trainer


def _trl_inputs(rows: dict, algorithm: str, *, old_logps: bool = True) -> dict:
    """Rollout rows (numpy) as TRL's `_compute_loss` inputs."""
    import torch

    mask = rows["completion_mask"]
    C = mask.shape[1]
    P = rows["input_ids"].shape[1] - C
    inputs = {
        "prompt_ids": torch.tensor(rows["input_ids"][:, :P]),
        "prompt_mask": torch.tensor(rows["attention_mask"][:, :P]),
        "completion_ids": torch.tensor(rows["input_ids"][:, P:]),
        "completion_mask": torch.tensor(mask),
        "advantages": torch.tensor(rows["advantages"], dtype=torch.float32),
    }
    if algorithm == "grpo":
        inputs["num_items_in_batch"] = torch.tensor(float(rows["num_items_in_batch"][0]))
    if old_logps:
        old = np.where(mask > 0, rows["old_logps"], 0.0)
        if algorithm == "grpo":
            inputs["old_per_token_logps"] = torch.tensor(old, dtype=torch.float32)
        else:  # RLOO's sequence log-probs of the sampling policy
            inputs["old_logps"] = torch.tensor((old * mask).sum(1), dtype=torch.float32)
    return inputs


def _micro_batches(trainer) -> list[dict]:
    """jaxrl's generation batch in the order its micro-steps used it (micro-step m takes buffer
    slice m of `steps_per_generation`)."""
    buf = {k: np.asarray(v) for k, v in trainer.rollout.items()}
    assert trainer._buffer_generation == 0  # one generation served both steps
    b = trainer.args.per_device_train_batch_size
    return [
        {k: v[m * b : (m + 1) * b] for k, v in buf.items()}
        for m in range(trainer.steps_per_generation)
    ]


def _theirs(trl_trainer_cls, trl_config_cls, model_dir, tokenizer, out, inputs, **kw):
    """TRL's trainer with its `_prepare_inputs` replaying `inputs`, one per micro-step."""

    class Replay(trl_trainer_cls):
        def _prepare_inputs(self, generation_batch):
            assert self.model.training
            return inputs[self._step]

    return trl_train_logs(
        Replay, trl_config_cls, model_dir, tokenizer, prompt_rows(8), out,
        trainer_kwargs={"reward_funcs": digits}, save_strategy="no", **{**SETTINGS, **kw},
    )  # fmt: skip


def _eval_matches(ours, theirs, rows: dict, algorithm: str) -> None:
    """One eval batch through both losses (TRL: `model.eval()`, the policy's own log-probs as
    the old ones, no accumulation): loss and aux_loss agree and the aux loss enters undivided."""
    import torch

    keep = ("input_ids", "attention_mask", "completion_mask", "advantages")
    batch = {k: rows[k][None] for k in keep}  # jaxrl's `_eval_batch`: one micro-batch
    aux = ours._jit_eval_step(ours.train_state, batch)
    got = {k: float(np.sum(aux["sum"][k]) / np.sum(aux["count"][k])) for k in ("loss", "aux_loss")}
    rows = {**rows, "num_items_in_batch": rows["completion_mask"].sum()[None]}
    inputs = _trl_inputs(rows, algorithm, old_logps=False)
    model = theirs.model
    model.eval()
    with torch.no_grad():
        if algorithm == "rloo":  # TRL's eval scores the batch with the evaluated policy
            ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
            am = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
            C = inputs["completion_ids"].shape[1]
            logps = theirs._get_per_token_logps_and_entropies(model, ids, am, C)[0]
            inputs["old_logps"] = (logps * inputs["completion_mask"]).sum(1)
        want = float(theirs._compute_loss(model, inputs))
    want_aux = theirs._metrics["eval"]["aux_loss"][-1]
    np.testing.assert_allclose(got["aux_loss"], want_aux, rtol=2e-4)
    np.testing.assert_allclose(got["loss"], want, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize(
    ("loss_type", "mask_truncated"),
    # dapo: per micro-batch the generation batch's tokens / steps_per_generation; bnpo: 1 per
    # micro-batch, with truncated completions out of the loss and so out of the aux loss.
    [("dapo", False), ("bnpo", True)],
)
def test_grpo_matches_trl_with_aux_loss(tmp_path, tokenizer, moe_dir, loss_type, mask_truncated):
    import trl

    kw = dict(loss_type=loss_type, mask_truncated_completions=mask_truncated)
    ours = _ours(GRPOTrainer, GRPOConfig, moe_dir, tokenizer, tmp_path / "ours", **kw)
    micro = _micro_batches(ours)
    if mask_truncated:  # the premise: some completions are out, some in
        assert 0 < sum(m["completion_mask"].any(1).sum() for m in micro) < 16
    inputs = [_trl_inputs(m, "grpo") for m in micro]
    theirs, logs = _theirs(
        trl.GRPOTrainer, trl.GRPOConfig, moe_dir, tokenizer, tmp_path / "trl", inputs, **kw
    )
    # TRL's `entropy` is the mean of its micro-batches' (0 for one with every completion
    # masked), jaxrl's a token mean over the step: equal only when no micro-batch is empty.
    metrics = METRICS if not mask_truncated else ("loss", "aux_loss")
    assert_logs_match(train_logs(ours), logs, metrics, steps=2)
    _eval_matches(ours, theirs, micro[0], "grpo")


def test_rloo_matches_trl_with_aux_loss(tmp_path, tokenizer, moe_dir):
    import trl

    ours = _ours(RLOOTrainer, RLOOConfig, moe_dir, tokenizer, tmp_path / "ours")
    micro = _micro_batches(ours)
    inputs = [_trl_inputs(m, "rloo") for m in micro]
    # TRL's beta only shapes the rewards (replayed here); 0 spares it a reference model.
    theirs, logs = _theirs(
        trl.RLOOTrainer, trl.RLOOConfig, moe_dir, tokenizer, tmp_path / "trl", inputs, beta=0.0
    )
    assert_logs_match(train_logs(ours), logs, METRICS, steps=2)
    _eval_matches(ours, theirs, micro[0], "rloo")


def test_coefficient_follows_trl(tmp_path, tokenizer, moe_dir, hf_model_dir):
    """None takes the model config's coefficient (Qwen3-MoE's default 0.001), 0.0 turns the loss
    off (no `aux_loss` metric), a nonzero one on a dense model is an error, as in TRL."""

    def make(trainer_cls, model, name, reward_funcs=digits, **kw):
        config_cls = GRPOConfig if trainer_cls is GRPOTrainer else RLOOConfig
        args = config_cls(**base_args(tmp_path / name, **{**SETTINGS, "max_steps": 1, **kw}))
        return trainer_cls(
            model,
            reward_funcs=reward_funcs,
            args=args,
            train_dataset=prompt_rows(8),
            processing_class=tokenizer,
        )

    for trainer_cls in (GRPOTrainer, RLOOTrainer):
        assert "router_aux_loss_coef" not in trainer_cls.config_class.unsupported_fields()
        assert trainer_cls.config_class().router_aux_loss_coef is None  # TRL's default
        default = make(trainer_cls, moe_dir, "default", router_aux_loss_coef=None)
        assert default.router_aux_loss_coef == 0.001
        assert default.model.config.hf_config.output_router_logits is True
        assert default.model.config.hf_config.router_aux_loss_coef == 0.001
        # The trained (RLOO) one also carries test_onpolicy_trl_parity.py's RLOO NaN reward
        # metrics check (was test_rloo_nan_reward_metrics, a dense RLOO run of its own): a
        # reward that is None for every completion is logged as None, not raised on.
        rewards = [digits, always, never]
        off = make(trainer_cls, moe_dir, "off", reward_funcs=rewards, router_aux_loss_coef=0.0)
        assert off.router_aux_loss_coef == 0.0
        assert off.model.config.hf_config.output_router_logits is False
        dense = make(trainer_cls, hf_model_dir, "dense", router_aux_loss_coef=None)
        assert dense.router_aux_loss_coef == 0.0
        with pytest.raises(ValueError, match="not a Mixture-of-Experts model"):
            make(trainer_cls, hf_model_dir, "dense", router_aux_loss_coef=0.01)
    off.train()  # RLOO's
    (log,) = train_logs(off)
    assert "aux_loss" not in log and np.isfinite(log["loss"])
    assert log["rewards/never/mean"] is None and log["rewards/always/mean"] == 1.0

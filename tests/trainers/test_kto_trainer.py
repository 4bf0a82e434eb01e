"""KTOTrainer end to end: parity with TRL's KTOTrainer per step (losses, rewards, KL, log-probs,
logits, entropy) with and without gradient accumulation, for both loss types and for paired data
unpaired as TRL does; precomputed and LoRA references; TRL's refusals."""

import datasets
import numpy as np
import pytest
from trainer_utils import base_args, train_logs, trl_train_logs

from jaxrl import KTOConfig, KTOTrainer
from jaxrl.config import ConfigError

TRL_METRICS = (
    "loss",
    "kl",
    "entropy",
    "num_tokens",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "logits/chosen",
    "logits/rejected",
)


def unpaired(pref_data, n: int = 16) -> datasets.Dataset:
    """`n` unpaired rows from the task's pairs, two in three desirable (so that micro-batches
    differ in their label counts)."""
    rows = pref_data[0].select(range(n))
    return datasets.Dataset.from_list(
        [
            {"prompt": r["prompt"], "completion": r["chosen"] if i % 3 else r["rejected"],
             "label": bool(i % 3)}
            for i, r in enumerate(rows)
        ]
    )  # fmt: skip


def kto(tmp_path, model, tokenizer, data, eval_data=None, **kw):
    trainer = KTOTrainer(
        model,
        args=KTOConfig(**base_args(tmp_path, **kw)),
        train_dataset=data,
        eval_dataset=eval_data,
        processing_class=tokenizer,
    )
    trainer.train()
    return trainer, train_logs(trainer)


def assert_same_logs(ours, theirs, where: str) -> None:
    assert len(ours) == len(theirs) == 3
    for step, (o, t) in enumerate(zip(ours, theirs, strict=True)):
        for key in TRL_METRICS:
            if key not in t:  # TRL logs a label's metrics only when the step has such rows
                assert o.get(key) is None, f"{key} at step {step + 1}, {where}"
                continue
            np.testing.assert_allclose(
                o[key], t[key], rtol=1e-5, atol=1e-5, err_msg=f"{key} at step {step + 1}, {where}"
            )
        np.testing.assert_allclose(o["grad_norm"], t["grad_norm"], rtol=1e-4, err_msg=where)


CASES = {
    # the KL batch of mismatched pairs, 4 rows per batch
    "kto": dict(per_device_train_batch_size=4),
    # 2 micro-batches of 4, each with its own KL estimate, TRL's weights
    "accumulation": dict(
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        desirable_weight=1.3,
        undesirable_weight=0.7,
    ),
    "apo_zero_unpaired": dict(per_device_train_batch_size=4, loss_type="apo_zero_unpaired"),
    # paired rows, unpaired as TRL does: every step's rows are desirable
    "paired": dict(per_device_train_batch_size=4),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_matches_trl_kto_trainer(tmp_path, tokenizer, hf_model_dir, pref_data, case):
    import trl

    data = pref_data[0].select(range(16)) if case == "paired" else unpaired(pref_data)
    common = dict(max_steps=3, learning_rate=1e-3, beta=0.1, max_length=64, **CASES[case])
    _, theirs = trl_train_logs(
        trl.KTOTrainer, trl.KTOConfig, hf_model_dir, tokenizer, data, tmp_path / "trl", **common
    )
    _, ours = kto(tmp_path / "ours", hf_model_dir, tokenizer, data, **common)
    assert_same_logs(ours, theirs, case)
    if case != "apo_zero_unpaired":
        assert max(o["kl"] for o in ours) > 0  # the KL estimate is exercised


@pytest.mark.slow
def test_precomputed_reference_and_eval(tmp_path, tokenizer, hf_model_dir, pref_data):
    """Precomputed reference log-probs give the live reference's numbers; eval logs TRL's
    metric names with the `eval_` prefix."""
    data = unpaired(pref_data)
    kw = dict(max_steps=2, per_device_train_batch_size=4, per_device_eval_batch_size=4)
    kw.update(eval_strategy="steps", eval_steps=2, learning_rate=1e-3)
    live, live_logs = kto(tmp_path / "live", hf_model_dir, tokenizer, data, data, **kw)
    pre, pre_logs = kto(
        tmp_path / "pre", hf_model_dir, tokenizer, data, data, precompute_ref_log_probs=True, **kw
    )
    assert "ref_logps" in pre.train_dataset.column_names
    for a, b in zip(live_logs, pre_logs, strict=True):
        for key in ("loss", "kl", "rewards/chosen", "rewards/margins"):
            np.testing.assert_allclose(b[key], a[key], rtol=1e-5, atol=1e-7, err_msg=key)
    evals = [h for h in live.state.log_history if "eval_loss" in h]
    pre_evals = [h for h in pre.state.log_history if "eval_loss" in h]
    for key in ("eval_loss", "eval_kl", "eval_rewards/chosen", "eval_logps/rejected"):
        assert np.isfinite(evals[-1][key]), key
        np.testing.assert_allclose(pre_evals[-1][key], evals[-1][key], rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_lora_reference_is_the_base_without_adapter(tmp_path, tokenizer, hf_model_dir, pref_data):
    """With LoRA, step 1's rewards are 0 (the adapter starts at zero, the reference is the base
    with the adapter off) and training moves them."""
    from jaxrl.lora import LoraConfig

    trainer = KTOTrainer(
        hf_model_dir,
        args=KTOConfig(**base_args(tmp_path, max_steps=3, per_device_train_batch_size=4)),
        train_dataset=unpaired(pref_data),
        processing_class=tokenizer,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    trainer.train()
    logs = train_logs(trainer)
    assert logs[0]["rewards/chosen"] == pytest.approx(0.0, abs=1e-6)
    assert abs(logs[-1]["rewards/chosen"]) > 1e-5
    assert "ref" not in trainer.train_state.frozen  # no second copy of the weights


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(train_sampling_strategy="random"), "train_sampling_strategy='sequential'"),
        (dict(per_device_train_batch_size=1), "must be > 1"),
        (dict(loss_type="sigmoid"), "`loss_type='sigmoid'` is not valid"),
        (dict(sync_ref_model=True, precompute_ref_log_probs=True), "go stale"),
        (dict(reference_free=True), "reference_free"),
    ],
)
def test_config_refuses_what_trl_refuses(tmp_path, fields, message):
    with pytest.raises((ConfigError, TypeError), match=message):
        KTOConfig(**base_args(tmp_path, **fields))


def test_apo_zero_unpaired_allows_any_order_and_batch_size(tmp_path):
    config = KTOConfig(
        **base_args(
            tmp_path,
            loss_type="apo_zero_unpaired",
            train_sampling_strategy="random",
            per_device_train_batch_size=1,
        )
    )
    assert config.train_sampling_strategy == "random"


def test_missing_label_is_a_clear_error(tmp_path, tokenizer, hf_model_dir):
    bad = datasets.Dataset.from_list([{"prompt": "1+1=", "completion": "2"}] * 8)
    with pytest.raises(ValueError, match="boolean 'label'"):
        KTOTrainer(
            hf_model_dir,
            args=KTOConfig(**base_args(tmp_path)),
            train_dataset=bad,
            processing_class=tokenizer,
        )


@pytest.mark.slow
def test_eval_batches_without_a_label_add_nothing_to_its_metrics(
    tmp_path, tokenizer, hf_model_dir, pref_data
):
    """TRL appends a label's metrics only for eval batches that have rows of that label: the
    second batch (desirable rows only) must not pull `eval_rewards/rejected` toward 0."""
    rows = unpaired(pref_data, 8).to_list()
    first = [dict(r, label=i % 2 == 0) for i, r in enumerate(rows[:4])]
    second = [dict(r, label=True) for r in rows[4:]]
    trainer = KTOTrainer(
        hf_model_dir,
        args=KTOConfig(**base_args(tmp_path, max_steps=1, per_device_eval_batch_size=4)),
        train_dataset=unpaired(pref_data, 8),
        processing_class=tokenizer,
    )
    both = trainer.evaluate(datasets.Dataset.from_list(first + second))
    alone = trainer.evaluate(datasets.Dataset.from_list(first))
    # (Untrained: policy == reference, so every reward is 0; the log-probs tell the batches apart.)
    assert alone["eval_logps/rejected"] < -1.0
    for key in ("eval_rewards/rejected", "eval_logps/rejected", "eval_logits/rejected"):
        np.testing.assert_allclose(both[key], alone[key], rtol=1e-6, err_msg=key)
    # The desirable rows' metrics average over both batches.
    assert abs(both["eval_logps/chosen"] - alone["eval_logps/chosen"]) > 1e-3

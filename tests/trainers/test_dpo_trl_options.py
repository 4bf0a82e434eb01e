"""DPO's LD-DPO (`ld_alpha`), f-DPO (`f_divergence_type`) and WPO (`use_weighting`) options,
step for step against TRL 1.16's own `DPOTrainer` on the same model and pairs."""

import datasets
import numpy as np
import pytest
from trainer_utils import assert_logs_match, jaxrl_trainer, train_logs, trl_train_logs

from jaxrl import DPOConfig, DPOTrainer
from jaxrl.config import ConfigError

METRICS = (
    "loss",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "logits/chosen",
    "mean_token_accuracy",
)


def _pairs() -> datasets.Dataset:
    """Eight pairs whose completions differ in length both ways, so LD-DPO's shared prefix
    and tail both matter, and WPO's per-token means differ between the sides."""
    rows = [
        ("12+30=", "42", "42 or 43 or maybe 44"),
        ("7+8=", "15, since 7+8 is 15", "14"),
        ("20+21=", "41", "40 and a bit"),
        ("3+3=", "6 exactly", "5"),
        ("9+1=", "10", "11 or 12"),
        ("5+5=", "10 for sure, ten", "9 or so"),
        ("2+2=", "4", "22"),
        ("6+7=", "13 is it", "67"),
    ]
    return datasets.Dataset.from_list(
        [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in rows]
    )


CASES = {
    # LD-DPO with an `sft` term (which uses the plain NLL), weighted as MPO does.
    "ld_sft": dict(ld_alpha=0.5, loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5]),
    # LD-DPO and WPO together.
    "ld_wpo": dict(ld_alpha=0.7, use_weighting=True),
    # f-DPO's alpha divergence on LD-weighted log-probs, with the reference precomputed, and
    # jaxrl's prefix-shared layout.
    "alpha_div_precompute": dict(
        f_divergence_type="alpha_divergence",
        f_alpha_divergence_coef=0.3,
        ld_alpha=0.2,
        precompute_ref_log_probs=True,
        jaxrl=dict(prefix_sharing=True),
    ),
    # JS divergence on a length-normalised loss, with WPO.
    "js_ipo_wpo": dict(f_divergence_type="js_divergence", loss_type=["ipo"], use_weighting=True),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_matches_trl(case, tmp_path, tokenizer, hf_model_dir):
    import trl

    options = dict(CASES[case])
    jaxrl_only = options.pop("jaxrl", {})
    data = _pairs()
    common = dict(
        per_device_train_batch_size=8,
        max_steps=3,
        learning_rate=1e-3,
        beta=0.1,
        max_length=64,
        **options,
    )
    _, theirs = trl_train_logs(
        trl.DPOTrainer, trl.DPOConfig, hf_model_dir, tokenizer, data, tmp_path / "trl", **common
    )
    trainer = jaxrl_trainer(
        DPOTrainer, DPOConfig, hf_model_dir, tokenizer, data, tmp_path / "ours", **common,
        **jaxrl_only,
    )  # fmt: skip
    trainer.train()
    assert_logs_match(train_logs(trainer), theirs, METRICS, steps=3)


def test_ld_alpha_one_is_plain_dpo_and_zero_drops_the_tail(monkeypatch):
    """`pair_logps`' LD weighting on hand-made per-token log-probs: alpha 1 gives the plain
    sums; alpha 0 keeps only the first min(len_c, len_r) tokens of each completion."""
    import jax.numpy as jnp

    from jaxrl.algos import dpo as dpo_mod

    logps = jnp.array([[-1.0, -2.0, -3.0, -4.0], [-0.5, -0.25, -0.125, -1.0]])
    masks = jnp.array([[0, 1, 1, 1], [0, 1, 0, 0]], jnp.float32)  # chosen 3 tokens, rejected 1

    class Head:  # stands in for the model: `lm_forward` is replaced below
        pass

    def fake_forward(model, rows, chunk, with_stats, score_span):
        del model, rows, chunk, with_stats, score_span
        return logps

    mb = {"loss_mask": masks.reshape(2, 1, 4).swapaxes(0, 1)}
    monkeypatch.setattr(dpo_mod, "lm_forward", fake_forward)
    plain = dpo_mod.pair_logps(Head(), mb, 4, False)
    one = dpo_mod.pair_logps(Head(), mb, 4, False, ld_alpha=1.0)
    zero = dpo_mod.pair_logps(Head(), mb, 4, False, ld_alpha=0.0)
    half = dpo_mod.pair_logps(Head(), mb, 4, False, ld_alpha=0.5)
    np.testing.assert_allclose(plain["chosen"], [-9.0])
    np.testing.assert_allclose(one["chosen"], plain["chosen"])
    np.testing.assert_allclose(zero["chosen"], [-2.0])  # shared length 1
    np.testing.assert_allclose(half["chosen"], [-2.0 - 0.5 * 7.0])
    np.testing.assert_allclose(half["rejected"], [-0.25])  # the shorter side is all shared
    np.testing.assert_allclose(half["nll/chosen"], [-9.0])


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(ld_alpha=1.5), "ld_alpha"),
        (dict(f_divergence_type="kl"), "f_divergence_type"),
        (dict(f_divergence_type="forward_kl", loss_type=["nca_pair"]), "nca_pair"),
        (dict(use_weighting=True, loss_type=["aot"]), "aot"),
        (dict(use_weighting=True, loss_type=["sigmoid", "sft"]), "sft"),
    ],
)
def test_invalid_options_are_clear_errors(tmp_path, options, message):
    with pytest.raises(ConfigError, match=message):
        DPOConfig(output_dir=str(tmp_path), **options)

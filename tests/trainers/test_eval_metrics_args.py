"""HF's evaluation arguments `include_for_metrics`, `batch_eval_metrics` and
`eval_accumulation_steps` on the SFT, reward and DPO trainers, checked against TRL 1.16's own
trainers on the same tiny model and eval rows (7 rows in eval batches of 3: a short last batch).

HF pads each eval batch's `inputs` with the pad token to the batch's longest row and the
concatenation with -100; jaxrl's rows all have the run's one static length, padded with the pad
token. The comparisons below read HF's arrays through that difference (`_assert_same_ids`).
"""

import dataclasses

import numpy as np
import pytest
from trainer_utils import base_args

from jaxrl import DPOConfig, DPOTrainer, RewardConfig, RewardTrainer, SFTConfig, SFTTrainer
from jaxrl.config import ConfigError
from jaxrl.trainers.evaluation import EvalPrediction

N_EVAL, BATCH = 7, 3  # eval batches of 3, 3 and 1 rows
PAD = 0  # the task tokenizer's pad id (tiny_config's pad_token_id)


@dataclasses.dataclass
class Call:
    """One compute_metrics call, in numpy: what jaxrl or HF handed it."""

    predictions: np.ndarray
    label_ids: np.ndarray | None
    inputs: object
    losses: np.ndarray | None
    compute_result: bool | None


def _numpy(x):
    if x is None:
        return None
    if isinstance(x, dict):  # HF's batch_eval_metrics hands the collated batch
        return {k: _numpy(v) for k, v in x.items()}
    if isinstance(x, tuple):
        return tuple(_numpy(v) for v in x)
    if isinstance(x, list):  # eval_do_concat_batches=False: one entry per batch
        return [_numpy(v) for v in x]
    return x.numpy() if hasattr(x, "numpy") else np.asarray(x)


def _recorder(calls: list[Call]):
    def compute_metrics(pred, compute_result=None):
        fields = ("predictions", "label_ids", "inputs", "losses")
        calls.append(Call(*(_numpy(getattr(pred, k)) for k in fields), compute_result))
        # Which call's value becomes the metrics: HF keeps the last one's.
        return {"calls": len(calls), "last": float(bool(compute_result))}

    return compute_metrics


def _trl_calls(algo, model_dir, ds, out, **args) -> tuple[list[Call], dict]:
    import trl

    config_cls, trainer_cls = {
        "sft": (trl.SFTConfig, trl.SFTTrainer),
        "reward": (trl.RewardConfig, trl.RewardTrainer),
        "dpo": (trl.DPOConfig, trl.DPOTrainer),
    }[algo]
    calls: list[Call] = []
    trainer = trainer_cls(
        model=model_dir,
        args=config_cls(
            output_dir=str(out),
            report_to="none",
            use_cpu=True,
            bf16=False,
            per_device_eval_batch_size=BATCH,
            **args,
        ),
        train_dataset=ds,
        eval_dataset=ds,
        compute_metrics=_recorder(calls),
    )
    return calls, trainer.evaluate()


def _jaxrl_trainer(algo, model_dir, tokenizer, ds, out, calls, **args):
    config_cls, trainer_cls = {
        "sft": (SFTConfig, SFTTrainer),
        "reward": (RewardConfig, RewardTrainer),
        "dpo": (DPOConfig, DPOTrainer),
    }[algo]
    return trainer_cls(
        model_dir,
        args=config_cls(**base_args(out, max_steps=1, per_device_eval_batch_size=BATCH, **args)),
        eval_dataset=ds,
        processing_class=tokenizer,
        compute_metrics=_recorder(calls),
    )


def _assert_same_ids(ours: np.ndarray, theirs: np.ndarray):
    """HF's input ids `[n, L]` (pad within a batch, -100 across batches) and jaxrl's: the same
    array (each batch as wide as its longest row, whatever jaxrl padded it to)."""
    assert ours.shape == theirs.shape
    np.testing.assert_array_equal(ours, theirs)


@pytest.fixture(scope="module")
def sft_rows(sft_data):
    return sft_data[1].select(range(N_EVAL))


@pytest.fixture(scope="module")
def pair_rows(pref_data):
    return pref_data[1].select(range(N_EVAL))


def test_eval_prediction_unpacks_like_hf():
    from transformers.trainer_utils import EvalPrediction as HFEvalPrediction

    p, y, x, loss = (np.full(2, v) for v in range(4))
    for kwargs in ({}, {"inputs": x}, {"losses": loss}, {"inputs": x, "losses": loss}):
        ours, theirs = EvalPrediction(p, y, **kwargs), HFEvalPrediction(p, y, **kwargs)
        assert [a is b for a, b in zip(ours, theirs, strict=True)] == [True] * len(tuple(theirs))
        assert ours.inputs is theirs.inputs and ours.losses is theirs.losses
        n = len(tuple(theirs))
        assert all(ours[i] is theirs[i] for i in range(n))
        for bad in (-1, n):
            with pytest.raises(IndexError):
                ours[bad]
    preds, labels = EvalPrediction(p, y)  # the two-field form existing code unpacks
    assert preds is p and labels is y


def test_sft_inputs_and_losses_match_trl(tmp_path, tokenizer, hf_model_dir, sft_rows):
    """`include_for_metrics=["inputs", "loss"]`: the input ids and per-example batch losses TRL's
    SFTTrainer hands compute_metrics. jaxrl runs with `eval_accumulation_steps=2`, which HF
    only uses to move predictions off the accelerator earlier: the results must not change."""
    include = ["inputs", "loss"]
    (theirs,), trl_metrics = _trl_calls(
        "sft", hf_model_dir, sft_rows, tmp_path / "trl", include_for_metrics=include
    )
    calls = []
    trainer = _jaxrl_trainer(
        "sft", hf_model_dir, tokenizer, sft_rows, tmp_path / "ours", calls,
        include_for_metrics=include, eval_accumulation_steps=2,
    )  # fmt: skip
    metrics = trainer.evaluate()
    (ours,) = calls
    assert ours.compute_result is None and theirs.compute_result is None
    _assert_same_ids(ours.inputs, theirs.inputs)
    for row, ids in zip(ours.inputs, trainer.eval_dataset["input_ids"], strict=True):
        np.testing.assert_array_equal(row[: len(ids)], ids)
    # HF repeats each batch's loss once per example it holds: 3 x batch 1, 3 x batch 2, 1 x 3.
    assert ours.losses.dtype == theirs.losses.dtype == np.float32
    assert ours.losses.shape == theirs.losses.shape == (N_EVAL,)
    np.testing.assert_allclose(ours.losses, theirs.losses, rtol=1e-5)
    assert len(set(ours.losses[:3])) == 1 and ours.losses[2] != ours.losses[3]
    assert metrics["eval_loss"] == pytest.approx(trl_metrics["eval_loss"], abs=2e-6)
    assert metrics["eval_loss"] == pytest.approx(float(np.mean(ours.losses)), abs=1e-6)
    # The predictions and labels are those of a run without the new arguments.
    plain = []
    _jaxrl_trainer("sft", hf_model_dir, tokenizer, sft_rows, tmp_path / "p", plain).evaluate()
    assert plain[0].inputs is None and plain[0].losses is None
    np.testing.assert_array_equal(plain[0].predictions, ours.predictions)
    np.testing.assert_array_equal(plain[0].label_ids, ours.label_ids)


def test_sft_batch_eval_metrics_calls_match_trl(tmp_path, tokenizer, hf_model_dir, sft_rows):
    """HF's protocol: one call per eval batch with that batch's rows, compute_result=True only
    on the last, whose return value is the metrics (earlier calls' are dropped)."""
    include = ["inputs", "loss"]
    theirs, trl_metrics = _trl_calls(
        "sft", hf_model_dir, sft_rows, tmp_path / "trl",
        include_for_metrics=include, batch_eval_metrics=True,
    )  # fmt: skip
    calls = []
    trainer = _jaxrl_trainer(
        "sft", hf_model_dir, tokenizer, sft_rows, tmp_path / "ours", calls,
        include_for_metrics=include, batch_eval_metrics=True,
    )  # fmt: skip
    metrics = trainer.evaluate()
    assert [c.compute_result for c in calls] == [c.compute_result for c in theirs]
    assert [c.compute_result for c in calls] == [False, False, True]
    assert [len(c.label_ids) for c in calls] == [len(c.label_ids) for c in theirs] == [3, 3, 1]
    for ours_call, their_call in zip(calls, theirs, strict=True):
        assert ours_call.predictions.shape[::2] == their_call.predictions.shape[::2]  # (b, V)
        np.testing.assert_allclose(ours_call.losses, their_call.losses, rtol=1e-5)
        # HF hands the collated batch dict here (transformers issue #37683); jaxrl the batch's
        # input ids, laid out as the concatenated `inputs` are.
        _assert_same_ids(ours_call.inputs, their_call.inputs["input_ids"])
    assert metrics["eval_calls"] == trl_metrics["eval_calls"] == 3
    assert metrics["eval_last"] == trl_metrics["eval_last"] == 1.0
    assert metrics["eval_loss"] == pytest.approx(trl_metrics["eval_loss"], abs=2e-6)


def test_batch_eval_metrics_predict_and_loss_only(tmp_path, tokenizer, hf_model_dir, sft_rows):
    """predict() calls compute_metrics per batch too and still returns every prediction (HF's
    "Prediction" loop); without predictions (prediction_loss_only) there is no call."""
    calls = []
    trainer = _jaxrl_trainer(
        "sft", hf_model_dir, tokenizer, sft_rows, tmp_path / "a", calls, batch_eval_metrics=True
    )
    out = trainer.predict(sft_rows)
    assert [c.compute_result for c in calls] == [False, False, True]
    assert out.metrics["test_calls"] == 3 and out.label_ids.shape[0] == N_EVAL
    # Each call gets its batch as wide as its longest row; the returned labels are padded to
    # the widest with -100 (HF's nested_concat).
    width = out.label_ids.shape[1]
    assert width == max(c.label_ids.shape[1] for c in calls) > calls[1].label_ids.shape[1]
    padded = [np.pad(c.label_ids, ((0, 0), (0, width - c.label_ids.shape[1])), constant_values=-100)
              for c in calls]  # fmt: skip
    np.testing.assert_array_equal(out.label_ids, np.concatenate(padded, axis=0))
    calls.clear()
    loss_only = _jaxrl_trainer(
        "sft", hf_model_dir, tokenizer, sft_rows, tmp_path / "b", calls,
        batch_eval_metrics=True, prediction_loss_only=True,
    )  # fmt: skip
    metrics = loss_only.evaluate()
    assert calls == [] and "eval_calls" not in metrics and "eval_loss" in metrics


def test_unconcatenated_batches_match_trl(tmp_path, tokenizer, hf_model_dir, sft_rows):
    """`eval_do_concat_batches=False`: compute_metrics gets one array per eval batch (each as
    wide as its own rows) for predictions, labels, inputs and losses, as TRL's SFTTrainer hands
    them; predict() returns the same lists."""
    args = dict(eval_do_concat_batches=False, include_for_metrics=["inputs", "loss"])
    (theirs,), _ = _trl_calls("sft", hf_model_dir, sft_rows, tmp_path / "trl", **args)
    calls = []
    trainer = _jaxrl_trainer(
        "sft", hf_model_dir, tokenizer, sft_rows, tmp_path / "ours", calls, **args
    )
    trainer.evaluate()
    (ours,) = calls
    rows = trainer.eval_dataset["input_ids"]
    for name in ("predictions", "label_ids", "inputs", "losses"):
        got, want = getattr(ours, name), getattr(theirs, name)
        assert isinstance(got, list) and len(got) == len(want) == 3, name
        for b, (o, w) in enumerate(zip(got, want, strict=True)):
            assert o.shape == w.shape, name
            if name != "predictions":
                np.testing.assert_allclose(o, w, atol=1e-6, err_msg=name)
                continue
            # Logits at each row's own tokens (a padding position's logits are arbitrary).
            for i, ids in enumerate(rows[b * BATCH : (b + 1) * BATCH]):
                np.testing.assert_allclose(o[i, : len(ids)], w[i, : len(ids)], atol=1e-4)
    # Batches of different widths: not padded to a common one.
    assert len({b.shape[1] for b in ours.label_ids}) > 1
    out = trainer.predict(sft_rows)
    assert isinstance(out.predictions, list) and len(out.label_ids) == 3
    for o, w in zip(out.label_ids, ours.label_ids, strict=True):
        np.testing.assert_array_equal(o, w)


def test_batch_eval_metrics_needs_compute_result(tmp_path, tokenizer, hf_model_dir, sft_rows):
    import trl

    def compute_metrics(pred):
        return {}

    with pytest.raises(ValueError, match="compute_result"):
        SFTTrainer(
            hf_model_dir,
            args=SFTConfig(**base_args(tmp_path, batch_eval_metrics=True)),
            processing_class=tokenizer,
            compute_metrics=compute_metrics,
        )
    SFTTrainer(  # HF checks only when there is a compute_metrics
        hf_model_dir,
        args=SFTConfig(**base_args(tmp_path / "none", batch_eval_metrics=True)),
        processing_class=tokenizer,
    )
    with pytest.raises(ValueError, match="compute_result"):  # as HF's Trainer
        trl.SFTTrainer(
            model=hf_model_dir,
            args=trl.SFTConfig(str(tmp_path / "trl"), batch_eval_metrics=True, use_cpu=True),
            train_dataset=sft_rows,
            compute_metrics=compute_metrics,
        )


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory, hf_model_dir, tokenizer):
    """The tiny model with a seeded score head, so TRL and jaxrl score with the same weights."""
    import torch
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(hf_model_dir, num_labels=1)
    out = tmp_path_factory.mktemp("tiny_rm")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


@pytest.mark.parametrize("algo", ["reward", "dpo", "dpo_shared"])
def test_pair_inputs_and_losses_match_trl(
    algo, tmp_path, tokenizer, hf_model_dir, reward_model_dir, pair_rows
):
    """Reward and DPO: each eval batch's `prompt + chosen` and `prompt + rejected` rows as TRL
    collates them and one loss per pair. jaxrl lays them out as its predictions: reward
    `[N, 2, T]` beside the `[N, 2]` scores; DPO `[2N, T]`, every chosen row, then every rejected
    row (also when it runs each pair as one prefix-shared row). TRL's rows go chosen/rejected
    batch by batch, and a short last batch keeps only its first rows there (accelerate cuts it to
    the pair count), so its chosen row is compared."""
    trl_algo = "dpo" if algo.startswith("dpo") else algo
    model_dir = reward_model_dir if algo == "reward" else hf_model_dir
    include = ["inputs", "loss"]
    (theirs,), _ = _trl_calls(
        trl_algo, model_dir, pair_rows, tmp_path / "trl", include_for_metrics=include
    )
    calls = []
    extra = {"prefix_sharing": True} if algo == "dpo_shared" else {}
    trainer = _jaxrl_trainer(
        trl_algo, model_dir, tokenizer, pair_rows, tmp_path / "ours", calls,
        include_for_metrics=include, **extra,
    )  # fmt: skip
    trainer.evaluate()
    (ours,) = calls
    np.testing.assert_allclose(ours.losses, theirs.losses, rtol=1e-5)
    assert ours.losses.shape == (N_EVAL,)
    if algo == "reward":
        assert ours.inputs.shape[:2] == (N_EVAL, 2) and ours.predictions.shape == (N_EVAL, 2)
        chosen, rejected = ours.inputs[:, 0], ours.inputs[:, 1]
    else:
        assert ours.inputs.shape[0] == 2 * N_EVAL == ours.label_ids.shape[0]
        chosen, rejected = ours.inputs[:N_EVAL], ours.inputs[N_EVAL:]
        # Each row's completion tokens are its labels (jaxrl's DPO labels).
        trained = ours.label_ids != -100
        np.testing.assert_array_equal(ours.inputs[trained], ours.label_ids[trained])
    rows = theirs.inputs  # [3 chosen, 3 rejected, 3 chosen, 3 rejected, 1 chosen]
    _assert_same_ids(chosen[:6], np.concatenate([rows[0:3], rows[6:9]]))
    _assert_same_ids(rejected[:6], np.concatenate([rows[3:6], rows[9:12]]))
    _assert_same_ids(chosen[6:], rows[12:])


def test_config_validation():
    assert SFTConfig(include_for_metrics="loss").include_for_metrics == ["loss"]
    with pytest.raises(ConfigError, match="`include_for_metrics="):
        SFTConfig(include_for_metrics=["losses"])  # HF's name is "loss"
    for steps in (0, -1, 1.5):
        with pytest.raises(ConfigError, match="`eval_accumulation_steps="):
            SFTConfig(eval_accumulation_steps=steps)
    assert RewardConfig(eval_accumulation_steps=4).eval_accumulation_steps == 4

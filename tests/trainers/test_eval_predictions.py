"""compute_metrics, preprocess_logits_for_metrics and predict() in HF's layout for the SFT, DPO and
reward trainers: logits aligned to the inputs (checked against PyTorch), unshifted labels with
-100, on-device preprocessing, PredictionOutput and the on_predict event."""

import jax
import numpy as np
import pytest
from trainer_utils import base_args, per_batch_mean

from jaxrl import DPOConfig, DPOTrainer, RewardConfig, RewardTrainer, SFTConfig, SFTTrainer
from jaxrl.callbacks.base import TrainerCallback
from jaxrl.trainers.evaluation import PredictionOutput


def _eval_args(tmp_path, **kw):
    # Eval batch 8 over 12 rows: the second batch is padded, its copies must not come back.
    return base_args(tmp_path, max_steps=1, per_device_eval_batch_size=8, **kw)


def test_sft_predictions_and_prediction_loss_only(tmp_path, tokenizer, hf_model_dir, sft_data):
    """The full evaluation's predictions are HF's logits and labels; then HF's
    `prediction_loss_only` (once its own test, which built a second trainer of this same config
    for its full evaluation): evaluate() skips `compute_metrics` (the loss and the trainer's own
    metrics stay, equal to the full evaluation's) and predict() returns no predictions."""
    import torch
    from transformers import AutoModelForCausalLM

    seen = []

    def sft_trainer(**kw):
        return SFTTrainer(
            hf_model_dir,
            args=SFTConfig(**_eval_args(tmp_path / str(kw), **kw)),
            eval_dataset=sft_data[1].select(range(12)),
            processing_class=tokenizer,
            compute_metrics=lambda pred: seen.append(pred) or {"n": len(pred.label_ids)},
        )

    trainer = sft_trainer()
    metrics = trainer.evaluate()
    assert len(seen) == 1 and metrics["eval_n"] == 12
    logits, labels = seen[0]
    n, t = labels.shape
    assert logits.shape == (n, t, 16) and logits.dtype == np.float32
    hf = AutoModelForCausalLM.from_pretrained(hf_model_dir, dtype=torch.float32).eval()
    ds = trainer.eval_dataset
    for i, (ids, trained) in enumerate(zip(ds["input_ids"], ds["loss_mask"], strict=True)):
        with torch.no_grad():
            theirs = hf(input_ids=torch.tensor([ids])).logits[0].numpy()
        # Prediction t is the model output at input position t (HF's layout).
        np.testing.assert_allclose(logits[i, : len(ids)], theirs, atol=1e-4)
        # Labels: the input tokens where loss is taken (the completion), -100 elsewhere.
        want = [
            tok if m and j else -100 for j, (tok, m) in enumerate(zip(ids, trained, strict=True))
        ]
        want += [-100] * (t - len(ids))
        np.testing.assert_array_equal(labels[i], want)
    # HF's recipe on these gives the logged token accuracy, taken per eval batch (8 rows, then
    # 4) and averaged over the batches as TRL does.
    pred_ids, targets = logits.argmax(-1)[:, :-1], labels[:, 1:]
    per_batch = []
    for lo in (0, 8):
        scored = targets[lo : lo + 8] != -100
        per_batch.append(np.mean(pred_ids[lo : lo + 8][scored] == targets[lo : lo + 8][scored]))
    assert metrics["eval_mean_token_accuracy"] == pytest.approx(np.mean(per_batch), abs=1e-6)

    # prediction_loss_only: no compute_metrics call, the same loss and trainer metrics.
    full = metrics
    loss_only = sft_trainer(prediction_loss_only=True)
    loss_only_metrics = loss_only.evaluate()
    assert len(seen) == 1 and "eval_n" not in loss_only_metrics
    for key in ("eval_loss", "eval_mean_token_accuracy", "eval_entropy"):
        assert loss_only_metrics[key] == pytest.approx(full[key], abs=1e-7)
    out = loss_only.predict(sft_data[1].select(range(12)))
    assert out.predictions is None and out.label_ids is None
    assert out.metrics["test_loss"] == pytest.approx(full["eval_loss"], abs=1e-7)


@pytest.mark.slow
def test_preprocess_runs_on_device_and_predict(tmp_path, tokenizer, hf_model_dir, sft_data):
    calls = []

    def preprocess(logits, labels):
        # Traced inside the jitted predict step: jax values of one batch, never host arrays.
        calls.append((type(logits), logits.shape, labels.shape))
        return logits.argmax(-1), (labels != -100).sum(-1)

    predicted = []

    class OnPredict(TrainerCallback):
        def on_predict(self, args, state, control, metrics=None, **kwargs):
            predicted.append(metrics)

    trainer = SFTTrainer(
        hf_model_dir,
        args=SFTConfig(**_eval_args(tmp_path)),
        processing_class=tokenizer,
        compute_metrics=lambda pred: {"rows": len(pred.predictions[0])},
        preprocess_logits_for_metrics=preprocess,
        callbacks=[OnPredict()],
    )
    rows = sft_data[1].select(range(12))
    out = trainer.predict(rows)
    assert isinstance(out, PredictionOutput)
    (kind, logits_shape, labels_shape), *_ = calls
    assert issubclass(kind, jax.core.Tracer)
    assert logits_shape == (8, labels_shape[1], 16)  # one eval batch, full vocab, on device
    ids, n_trained = out.predictions
    # HF's width: the longest row (of the widest eval batch), not the padded length on device.
    longest = max(map(len, trainer._prepare_dataset(rows, "test")["input_ids"]))
    assert ids.shape == out.label_ids.shape == (12, longest) and longest < labels_shape[1]
    np.testing.assert_array_equal(n_trained, (out.label_ids != -100).sum(-1))
    # predict() reports the eval metrics under its prefix and is not logged.
    assert out.metrics["test_rows"] == 12 and "test_loss" in out.metrics
    assert predicted == [out.metrics]
    assert not any("test_loss" in h for h in trainer.state.log_history)
    evaluated = trainer.evaluate(rows, metric_key_prefix="heldout")
    assert evaluated["heldout_loss"] == pytest.approx(out.metrics["test_loss"], rel=1e-6)
    # HF drops model outputs named in ignore_keys: without logits there are no predictions.
    bare = trainer.predict(rows, ignore_keys=["logits"])
    assert bare.predictions is None and "test_rows" not in bare.metrics


@pytest.mark.slow
def test_dpo_predictions_rows_and_prefix_sharing(tmp_path, tokenizer, hf_model_dir, pref_data):
    rows = pref_data[1].select(range(12))
    outs = {}
    for name, extra in {"rows": {}, "shared": {"prefix_sharing": True}}.items():
        trainer = DPOTrainer(
            hf_model_dir,
            args=DPOConfig(**_eval_args(tmp_path / name, **extra)),
            processing_class=tokenizer,
        )
        outs[name] = (trainer, trainer.predict(rows))
    trainer, out = outs["rows"]
    logits, labels = out.predictions, out.label_ids
    assert logits.shape[:2] == labels.shape and labels.shape[0] == 24
    ds = trainer._prepare_dataset(rows, "test")
    # Rows 0..N-1 are prompt + chosen, N..2N-1 prompt + rejected; labels are the completions.
    for i, ex in enumerate(ds):
        for row, key in ((i, "chosen_input_ids"), (12 + i, "rejected_input_ids")):
            p, c = len(ex["prompt_input_ids"]), len(ex[key])
            np.testing.assert_array_equal(labels[row, p : p + c], ex[key])
            assert (labels[row, :p] == -100).all() and (labels[row, p + c :] == -100).all()
    # Prefix-shared rows are unpacked into the same rows: equal labels and, where scored, equal
    # logits (the shared layout's static length differs, so compare the common prefix).
    _, shared = outs["shared"]
    t = min(labels.shape[1], shared.label_ids.shape[1])
    assert (labels[:, t:] == -100).all() and (shared.label_ids[:, t:] == -100).all()
    np.testing.assert_array_equal(shared.label_ids[:, :t], labels[:, :t])
    scored = labels[:, :t] != -100
    np.testing.assert_allclose(
        shared.predictions[:, :t][scored], logits[:, :t][scored], rtol=1e-4, atol=1e-4
    )
    assert out.metrics["test_rewards/accuracies"] == shared.metrics["test_rewards/accuracies"]


def test_reward_compute_metrics_gets_pair_scores(tmp_path, tokenizer, hf_model_dir, pref_data):
    seen = []

    def compute_metrics(pred):
        seen.append(pred)
        scores, labels = pred
        return {"pair_accuracy": float(np.mean(scores.argmax(1) == labels))}

    trainer = RewardTrainer(
        hf_model_dir,
        args=RewardConfig(**_eval_args(tmp_path)),
        eval_dataset=pref_data[1].select(range(12)),
        processing_class=tokenizer,
        compute_metrics=compute_metrics,
    )
    metrics = trainer.evaluate()
    scores, labels = seen[0]
    assert scores.shape == (12, 2) and labels.shape == (12,)
    np.testing.assert_array_equal(labels, 0)
    # The (chosen, rejected) columns are the scores the trainer's own metrics are made of.
    # compute_metrics sees all 12 pairs at once; the trainer's metrics are TRL's per-batch
    # values (8 pairs, then 4) averaged over the batches.
    wins = scores.argmax(1) == labels
    assert metrics["eval_pair_accuracy"] == pytest.approx(np.mean(wins), abs=1e-6)
    assert metrics["eval_accuracy"] == pytest.approx(per_batch_mean(wins, 8), abs=1e-6)
    assert per_batch_mean(scores, 8) == pytest.approx(metrics["eval_mean_reward"], rel=1e-5)
    margins = scores[:, 0] - scores[:, 1]
    assert per_batch_mean(margins, 8) == pytest.approx(metrics["eval_margin"], rel=1e-5)
    min_reward = per_batch_mean(scores, 8, reduce=np.min)
    assert min_reward == pytest.approx(metrics["eval_min_reward"], rel=1e-6)
    out = trainer.predict(pref_data[1].select(range(3)))
    np.testing.assert_allclose(out.predictions, scores[:3], rtol=1e-6)

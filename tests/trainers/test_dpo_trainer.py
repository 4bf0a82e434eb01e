"""DPOTrainer end to end: parity with TRL's DPOTrainer, reference-model variants (frozen copy,
int8, precomputed cache, sync), multi-loss, BEMA, and TRL metric names."""

import math
import os

import chex
import datasets
import jax
import numpy as np
import pytest
from trainer_utils import base_args, tiny_config, train_logs, trl_train_logs

from jaxrl import BEMACallback, DPOConfig, DPOTrainer, SyncRefModelCallback
from jaxrl.core import averaging, quant

TRL_METRICS = (
    "loss",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "logits/chosen",
    "logits/rejected",
)


def dpo(tmp_path, model, tokenizer, data, eval_data=None, callbacks=None, **kw):
    trainer = DPOTrainer(
        model,
        args=DPOConfig(**base_args(tmp_path, **kw)),
        train_dataset=data,
        eval_dataset=eval_data,
        processing_class=tokenizer,
        callbacks=callbacks,
    )
    trainer.train()
    return trainer, train_logs(trainer)


@pytest.mark.slow
def test_matches_trl_dpo_trainer(tmp_path, tokenizer, hf_model_dir, pref_data):
    """A few full-batch f32 steps: same losses, rewards and log-probs as TRL, for jaxrl's two-row
    layout and when jaxrl runs each pair as one prefix-shared row. (Formerly parametrized over
    `prefix_sharing`; merged so TRL's run, which does not depend on jaxrl's layout, runs once:
    each layout's run is still compared with it on every metric at every step.)"""
    import trl

    data = pref_data[0].select(range(8))
    common = dict(
        per_device_train_batch_size=8, max_steps=3, learning_rate=1e-3, beta=0.1, max_length=64
    )
    _, theirs = trl_train_logs(
        trl.DPOTrainer, trl.DPOConfig, hf_model_dir, tokenizer, data, tmp_path / "trl", **common
    )
    for prefix_sharing in (False, True):
        _, ours = dpo(
            tmp_path / f"ours_{prefix_sharing}",
            hf_model_dir,
            tokenizer,
            data,
            **common,
            max_prompt_length=32,
            prefix_sharing=prefix_sharing,
        )
        assert len(ours) == len(theirs) == 3
        for step, (o, t) in enumerate(zip(ours, theirs, strict=True)):
            where = f"at step {step + 1}, prefix_sharing={prefix_sharing}"
            for key in TRL_METRICS:
                if step == 0 and key == "rewards/accuracies":
                    continue  # rewards are 0 up to float noise at step 1: the sign is arbitrary
                np.testing.assert_allclose(
                    o[key], t[key], rtol=2e-4, atol=2e-5, err_msg=f"{key} {where}"
                )
            np.testing.assert_allclose(o["grad_norm"], t["grad_norm"], rtol=2e-3, err_msg=where)


@pytest.fixture(scope="module")
def default_run(tmp_path_factory, tokenizer, hf_model_dir, pref_data):
    """`dpo(...)` with the defaults and `max_steps=2` on `pref_data[0]`: the full-precision,
    live-reference, two-row, unaccumulated single-device baseline that the int8, precomputed
    and accumulation/mesh tests each compare against (the same config in each; built once)."""
    out = tmp_path_factory.mktemp("dpo_default")
    return dpo(out, hf_model_dir, tokenizer, pref_data[0], max_steps=2)


@pytest.mark.slow
def test_metric_names_eval_prefix_and_learning(tmp_path, tokenizer, hf_model_dir, pref_data):
    trainer, logs = dpo(
        tmp_path,
        hf_model_dir,
        tokenizer,
        pref_data[0],
        pref_data[1],
        max_steps=8,
        learning_rate=5e-3,
    )
    for key in (*TRL_METRICS, "grad_norm", "learning_rate", "num_tokens", "entropy"):
        assert key in logs[0], key
    # The first step starts from policy == reference: zero rewards and loss log(2).
    assert logs[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert logs[0]["rewards/chosen"] == pytest.approx(0.0, abs=1e-6)
    assert logs[-1]["rewards/margins"] > logs[0]["rewards/margins"]
    metrics = trainer.evaluate()
    assert {f"eval_{k}" for k in TRL_METRICS} <= set(metrics)


@pytest.mark.slow
def test_int8_reference_close_to_full_precision(
    tmp_path, tokenizer, hf_model_dir, pref_data, default_run
):
    _, full_logs = default_run
    q, q_logs = dpo(
        tmp_path / "b",
        hf_model_dir,
        tokenizer,
        pref_data[0],
        max_steps=2,
        ref_model_quantization="int8",
    )
    ref_bytes = quant.param_bytes(q.train_state.ref_params)
    policy_bytes = quant.param_bytes(q.train_state.params)  # f32 policy
    assert ref_bytes <= 0.3 * policy_bytes  # int8 + scales vs f32 (<= 0.55x of bf16)
    # Quantisation error shows up as small nonzero first-step rewards.
    assert abs(q_logs[0]["rewards/chosen"]) < 5e-3
    np.testing.assert_allclose(q_logs[0]["loss"], full_logs[0]["loss"], atol=5e-3)


def _check_precomputed(pre, pre_logs, live, out) -> None:
    """A `precompute_ref_log_probs=True` run `pre` (its output dir `out`): no reference weights
    held during training, one cache file, and the live-reference run's metrics."""
    assert pre.train_state.ref_params is None  # no reference weights held during training
    cache = os.listdir(out / "ref_logps_cache")
    assert len(cache) == 1
    assert len(live) == len(pre_logs)
    for a, b in zip(live, pre_logs, strict=True):
        for key in ("loss", "rewards/chosen", "rewards/margins"):
            np.testing.assert_allclose(b[key], a[key], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_precomputed_reference_equals_live_reference(
    tmp_path, tokenizer, hf_model_dir, pref_data, default_run
):
    """The two-row layout against `default_run` (the live two-row run); the prefix-shared layout
    is checked in test_prefix_sharing_same_metrics_as_two_rows against its live run there (one
    trainer fewer than a live prefix-shared run of its own)."""
    _, live = default_run
    pre, pre_logs = dpo(
        tmp_path / "pre",
        hf_model_dir,
        tokenizer,
        pref_data[0],
        max_steps=2,
        precompute_ref_log_probs=True,
    )
    _check_precomputed(pre, pre_logs, live, tmp_path / "pre")


class _Record(BEMACallback.__mro__[1]):  # TrainerCallback
    """Host copies of the policy params at the start of training and after every step."""

    def __init__(self):
        self.initial, self.seen = None, []

    def on_train_begin(self, args, state, control, trainer=None, **kw):
        self.initial = jax.device_get(trainer.train_state.params)

    def on_step_end(self, args, state, control, trainer=None, **kw):
        self.seen.append(jax.device_get(trainer.train_state.params))


@pytest.mark.slow
def test_sync_ref_model_soft_update(tmp_path, tokenizer, hf_model_dir, pref_data):
    alpha = 0.6
    record = _Record()  # policy_0: the params at the start of training (no second trainer)
    trainer, _ = dpo(
        tmp_path,
        hf_model_dir,
        tokenizer,
        pref_data[0],
        callbacks=[record],
        max_steps=2,
        sync_ref_model=True,
        ref_model_sync_steps=2,
        ref_model_mixup_alpha=alpha,
    )
    # After 2 steps with sync at step 2: ref = alpha * policy_2 + (1 - alpha) * policy_0.
    p0 = jax.tree.leaves(record.initial)
    ref = jax.tree.leaves(trainer.train_state.ref_params)
    pol = jax.tree.leaves(trainer.train_state.params)
    for r, p, i in zip(ref, pol, p0, strict=True):
        np.testing.assert_allclose(
            np.asarray(r), alpha * np.asarray(p) + (1 - alpha) * np.asarray(i), rtol=1e-5, atol=1e-7
        )


@pytest.mark.slow
def test_bema_callback_matches_reference_exports_and_survives_resume(
    tmp_path, tokenizer, hf_model_dir, pref_data
):
    """One 4-step run (one trainer fewer for each of three checks that each ran their own):

    - BEMA: the callback's buffers equal `averaging`'s reference applied to the params recorded
      after every step (from the params at the start of training), and the exported BEMA
      weights load in transformers;
    - resume: a run killed after step 2 leaves what the uninterrupted run saved then (its
      step-2 checkpoint, BEMA buffers included): resumed from it, steps 3-4 rebuild the
      uninterrupted run's buffers exactly;
    - explicit reference: the policy's own directory passed as `ref_model` gives zero rewards at
      step 1 (test_explicit_ref_model checks a different reference)."""
    from transformers import AutoModelForCausalLM

    kw = dict(max_steps=4, learning_rate=1e-2, save_strategy="steps", save_steps=2)
    bema_kw = dict(update_freq=2, lag=1, update_after=0)
    record, bema = _Record(), BEMACallback(**bema_kw)
    trainer = DPOTrainer(
        hf_model_dir,
        ref_model=hf_model_dir,
        args=DPOConfig(**base_args(tmp_path / "full", **kw)),
        train_dataset=pref_data[0],
        processing_class=tokenizer,
        callbacks=[record, bema],
    )
    trainer.train()
    assert train_logs(trainer)[0]["rewards/chosen"] == pytest.approx(0.0, abs=1e-5)

    # One compiled update for the four steps (eagerly, every op compiled a program of its own).
    update = jax.jit(averaging.bema_update, static_argnames=("update_freq", "lag"))
    state = jax.jit(averaging.bema_init)(record.initial)
    for step, params in enumerate(record.seen, start=1):
        state = update(state, params, np.int32(step), update_freq=2, lag=1)
    chex.assert_trees_all_close(bema.buffers.bema, state.bema, rtol=1e-6, atol=1e-7)
    # Exported BEMA weights load in transformers.
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "full" / "bema")
    assert model.config.vocab_size == 16

    resumed = BEMACallback(**bema_kw)
    trainer = DPOTrainer(
        hf_model_dir,
        ref_model=hf_model_dir,
        args=DPOConfig(
            **base_args(
                tmp_path / "resumed",
                resume_from_checkpoint=str(tmp_path / "full" / "checkpoints" / "checkpoint-2"),
                **kw,
            )
        ),
        train_dataset=pref_data[0],
        processing_class=tokenizer,
        callbacks=[resumed],
    )
    trainer.train()
    chex.assert_trees_all_equal(resumed.buffers, bema.buffers, strict=True)


def test_dataset_missing_columns_is_a_clear_error(tmp_path, tokenizer, hf_model_dir):
    bad = datasets.Dataset.from_list([{"question": "1+1=", "answer": "2"}] * 8)
    with pytest.raises(ValueError, match="chosen"):
        DPOTrainer(
            hf_model_dir,
            args=DPOConfig(**base_args(tmp_path)),
            train_dataset=bad,
            processing_class=tokenizer,
        )


@pytest.mark.slow
def test_explicit_ref_model(tmp_path, tokenizer, hf_model_dir, pref_data):
    """An explicit reference different from the policy gives nonzero step-1 rewards, equal to
    beta * (policy - ref) log-probs, each side's summed completion log-probs computed by a
    transformers forward of its own model. (The same directory as reference gives zero:
    checked on the BEMA run of test_bema_callback_matches_reference_exports_and_survives_resume.)"""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2ForCausalLM

    from jaxrl.data.preference import prepare_preference_dataset

    torch.manual_seed(1)
    other = tmp_path / "other_ref"
    Qwen2ForCausalLM(tiny_config()).save_pretrained(other)
    data = pref_data[0].select(range(8))  # step 1's batch (8 rows) is the whole dataset
    trainer = DPOTrainer(
        hf_model_dir,
        ref_model=str(other),
        args=DPOConfig(**base_args(tmp_path / "a", max_steps=1)),
        train_dataset=data,
        processing_class=tokenizer,
    )
    trainer.train()
    first = train_logs(trainer)[0]

    rows = prepare_preference_dataset(data, tokenizer)

    def completion_logps(model_dir, side: str) -> np.ndarray:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        out = []
        for row in rows:
            prompt, completion = row["prompt_input_ids"], row[f"{side}_input_ids"]
            ids = torch.tensor([prompt + completion])
            with torch.no_grad():
                logps = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)
            scored = logps[len(prompt) - 1 :].gather(-1, ids[0, len(prompt) :, None])
            out.append(float(scored.sum()))
        return np.array(out)

    beta = trainer.args.beta
    for side in ("chosen", "rejected"):
        policy = completion_logps(hf_model_dir, side)
        ref = completion_logps(str(other), side)
        assert np.abs(policy - ref).min() > 1e-3  # a different reference: nonzero rewards
        want = float(np.mean(beta * (policy - ref)))
        assert first[f"rewards/{side}"] == pytest.approx(want, rel=1e-4, abs=1e-6), side
        assert first[f"logps/{side}"] == pytest.approx(np.mean(policy), rel=1e-5), side


@pytest.mark.slow
def test_same_metrics_with_accumulation_and_on_a_2x2x2_mesh(
    tmp_path, tokenizer, hf_model_dir, pref_data, default_run
):
    keys = ("loss", "grad_norm", "rewards/margins", "logps/chosen", "logits/chosen")
    _, base = default_run
    _, accum = dpo(
        tmp_path / "b",
        hf_model_dir,
        tokenizer,
        pref_data[0],
        max_steps=2,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=8,
    )
    _, mesh = dpo(
        tmp_path / "c",
        hf_model_dir,
        tokenizer,
        pref_data[0],
        max_steps=2,
        per_device_train_batch_size=2,
        mesh_data=2,
        mesh_fsdp=2,
        mesh_tensor=2,
    )
    for other in (accum, mesh):
        for b, o in zip(base, other, strict=True):
            for key in keys:
                np.testing.assert_allclose(o[key], b[key], rtol=5e-5, atol=1e-7, err_msg=key)


@pytest.mark.slow  # end to end: full training runs
def test_prefix_sharing_same_metrics_as_two_rows(tmp_path, tokenizer, hf_model_dir, pref_data):
    """One prefix-shared row per pair gives the two-row layout's train and eval metrics and
    compute_metrics predictions, also on a 2x2x2 mesh; rows are shorter. (RPO's `sft` term is
    a batch token mean, so it is compared without gradient accumulation.)

    The same runs serve two more checks (one trainer fewer than runs of their own for each):
    a precomputed reference gives the live prefix-shared run's metrics (the two-row layout:
    test_precomputed_reference_equals_live_reference), and the multi-loss weights: at step 1
    (policy == reference) loss = w_sigmoid * log 2 + w_sft * sft, linear in each weight, read
    off the two-row run's weights [0.5, 1] and a one-step run with [1, 3]."""
    from jaxrl.train import argmax_logits, chosen_task_compute_metrics

    loss = dict(loss_type=["sigmoid", "sft"], loss_weights=[0.5, 1.0])
    runs = {}
    for name, extra in {
        "rows": {},
        "shared": {"prefix_sharing": True},
        "shared_mesh": dict(
            prefix_sharing=True,
            per_device_train_batch_size=2,
            per_device_eval_batch_size=2,
            mesh_data=2,
            mesh_fsdp=2,
            mesh_tensor=2,
        ),
    }.items():
        args = DPOConfig(**base_args(tmp_path / name, max_steps=2, **loss, **extra))
        trainer = DPOTrainer(
            hf_model_dir,
            args=args,
            train_dataset=pref_data[0],
            eval_dataset=pref_data[1],
            processing_class=tokenizer,
            compute_metrics=chosen_task_compute_metrics,
            preprocess_logits_for_metrics=argmax_logits,
        )
        trainer.train()
        runs[name] = (trainer, train_logs(trainer), trainer.evaluate())
    rows_trainer, rows_logs, rows_eval = runs["rows"]
    assert runs["shared"][0].seq_len < 2 * rows_trainer.seq_len
    keys = (*TRL_METRICS, "grad_norm", "num_tokens", "entropy", "mean_token_accuracy")
    for name in ("shared", "shared_mesh"):
        _, logs, evals = runs[name]
        assert len(logs) == len(rows_logs) == 2
        for i, (b, o) in enumerate(zip(rows_logs, logs, strict=True)):
            for key in keys:
                if i == 0 and key == "rewards/accuracies":
                    # Step 1 scores the initial policy against itself: every reward is 0 up to
                    # rounding, so `chosen > rejected` is decided by float noise of the layout.
                    assert abs(b["rewards/margins"]) < 1e-4
                    continue
                np.testing.assert_allclose(o[key], b[key], rtol=5e-5, atol=1e-6, err_msg=key)
        assert set(evals) == set(rows_eval)
        assert "eval_task_accuracy" in evals
        for key, want in rows_eval.items():
            if key.endswith(("_runtime", "_per_second")):  # HF's timings
                continue
            np.testing.assert_allclose(evals[key], want, rtol=5e-5, atol=1e-6, err_msg=key)

    # A precomputed reference (prefix-shared rows) equals the live one.
    out = tmp_path / "shared_pre"
    pre, pre_logs = dpo(
        out, hf_model_dir, tokenizer, pref_data[0], max_steps=2, prefix_sharing=True,
        precompute_ref_log_probs=True, **loss,
    )  # fmt: skip
    _check_precomputed(pre, pre_logs, runs["shared"][1], out)

    # The loss weights: a = 0.5 * log 2 + sft (the two-row run), b = log 2 + 3 * sft.
    a = rows_logs[0]["loss"]
    _, logs = dpo(
        tmp_path / "weights", hf_model_dir, tokenizer, pref_data[0], max_steps=1,
        loss_type=["sigmoid", "sft"], loss_weights=[1.0, 3.0],
    )  # fmt: skip
    sft = a - 0.5 * math.log(2)
    assert sft > 0.1
    np.testing.assert_allclose(logs[0]["loss"], math.log(2) + 3.0 * sft, rtol=1e-5)


def test_prefix_sharing_rejects_sliding_window_models(tmp_path, tokenizer):
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = tiny_config().to_dict()
    cfg = {
        k: cfg[k]
        for k in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "pad_token_id",
        )
    }
    MistralForCausalLM(MistralConfig(**cfg, sliding_window=4)).save_pretrained(tmp_path / "m")
    with pytest.raises(ValueError, match="prefix_sharing=False"):
        DPOTrainer(
            str(tmp_path / "m"),
            args=DPOConfig(**base_args(tmp_path / "o", prefix_sharing=True)),
            processing_class=tokenizer,
        )


@pytest.mark.parametrize("prefix_sharing", [False, True])
def test_head_runs_on_the_completions_only(
    tmp_path, tokenizer, hf_model_dir, pref_data, prefix_sharing
):
    """`score_span`: the LM head runs on the longest completion's positions of each pair row
    (prefix sharing: the longest chosen + rejected slots), not on the prompt; every per-pair sum
    (log-probs, token counts, logits, argmax, entropy) equals the whole-row head's. Training
    with it gives TRL-equal metrics (see the parity test); a batch whose completions are wider
    than the span is refused on the host."""
    import jax.numpy as jnp

    from jaxrl.algos.dpo import pair_logps

    data = pref_data[0].select(range(8))
    trainer = DPOTrainer(
        hf_model_dir,
        args=DPOConfig(**base_args(tmp_path, max_length=64, prefix_sharing=prefix_sharing)),
        train_dataset=data,
        processing_class=tokenizer,
    )
    c, r = (trainer.train_dataset[k] for k in ("chosen_input_ids", "rejected_input_ids"))
    pairs = zip(c, r, strict=True)
    widths = [len(a) + len(b) if prefix_sharing else max(len(a), len(b)) for a, b in pairs]
    longest = max(widths)
    assert trainer.score_span == -(-longest // 8) * 8 < trainer.seq_len
    examples = [trainer.train_dataset[i] for i in range(8)]
    mb = {k: jnp.asarray(v) for k, v in trainer._collate(examples).items()}
    model = trainer.model
    full = jax.jit(lambda mb: pair_logps(model, mb, None, True))(mb)
    spanned = jax.jit(lambda mb: pair_logps(model, mb, None, True, trainer.score_span))(mb)
    assert set(full) == set(spanned) and "entropy/chosen" in full
    for key in full:
        np.testing.assert_allclose(spanned[key], full[key], rtol=1e-6, atol=1e-6, err_msg=key)

    trainer.score_span = longest - 1
    with pytest.raises(ValueError, match="score_span"):
        trainer._collate(examples)


def test_mixed_precision_reference_keeps_matmul_weights_in_bf16(
    tmp_path, tokenizer, hf_model_dir, pref_data, monkeypatch
):
    """bf16 over f32 params: the frozen reference stores the weights its forward only reads in
    bf16 (kernels, biases) in bf16 and the rest (norm scales, the tied embedding) in f32; the
    run's metrics equal those of an all-f32 reference copy bit for bit."""
    kw = dict(bf16=True, max_steps=3, per_device_train_batch_size=4)
    trainer, logs = dpo(tmp_path / "a", hf_model_dir, tokenizer, pref_data[0], **kw)
    ref = trainer.train_state.ref_params
    dtypes = {
        jax.tree_util.keystr(path): leaf.dtype
        for path, leaf in jax.tree_util.tree_flatten_with_path(ref)[0]
    }
    for name, dtype in dtypes.items():
        kept = "norm" in name or "embed_tokens" in name
        assert dtype == (np.float32 if kept else jax.numpy.bfloat16), name
    policy = jax.tree.leaves(trainer.train_state.params)
    assert {x.dtype for x in policy} == {np.dtype(np.float32)}
    # A sync callback added once the step is compiled is refused with the fix while the
    # reference holds bf16 weights (from test_synced_reference_stays_in_the_params_dtype: this
    # compiled bf16 trainer saves it one of its own).
    with pytest.raises(ValueError, match="Pass it in `callbacks=`"):
        trainer.add_callback(SyncRefModelCallback())

    monkeypatch.setattr(DPOTrainer, "_frozen_copy", lambda self, p: jax.tree.map(jax.numpy.copy, p))
    f32_ref, f32_logs = dpo(tmp_path / "b", hf_model_dir, tokenizer, pref_data[0], **kw)
    assert {x.dtype for x in jax.tree.leaves(f32_ref.train_state.ref_params)} == {
        np.dtype(np.float32)
    }
    assert logs == f32_logs
    assert logs[-1]["rewards/margins"] != 0  # the reference and policy did diverge


def test_synced_reference_stays_in_the_params_dtype(tmp_path, tokenizer, hf_model_dir, pref_data):
    """TRL's reference sync mixes the policy into the reference in the params' dtype: with it the
    bf16 run's reference copy stays f32. A sync callback added once the step is compiled is
    compiled in (f32), or refused with the fix when the reference holds bf16 weights."""
    kw = dict(bf16=True, max_steps=1, per_device_train_batch_size=4)
    synced, _ = dpo(
        tmp_path / "a", hf_model_dir, tokenizer, pref_data[0], sync_ref_model=True, **kw
    )
    assert {x.dtype for x in jax.tree.leaves(synced.train_state.ref_params)} == {
        np.dtype(np.float32)
    }

    def late(out, **extra):
        trainer = DPOTrainer(
            hf_model_dir,
            args=DPOConfig(**base_args(out, **{**kw, **extra})),
            train_dataset=pref_data[0],
            processing_class=tokenizer,
        )
        trainer._ensure_state()  # e.g. an evaluate() before train()
        return trainer

    # (The refusal of a bf16 reference: test_mixed_precision_reference_keeps_matmul_weights_in_bf16.)
    f32 = late(tmp_path / "c", bf16=False, ref_model_sync_steps=1, ref_model_mixup_alpha=0.5)
    ref0 = [np.asarray(x) for x in jax.tree.leaves(f32.train_state.ref_params)]
    f32.add_callback(SyncRefModelCallback())
    f32.train()
    ref1 = jax.tree.leaves(f32.train_state.ref_params)
    assert any(not np.array_equal(a, b) for a, b in zip(ref0, ref1, strict=True))

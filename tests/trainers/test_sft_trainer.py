"""SFTTrainer end to end: golden numbers, exact gradient accumulation, mesh invariance, no
recompilation, packing isolation, NaN stop, optimizers and evaluation."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from trainer_utils import base_args, tiny_config, train_logs

from jaxrl import SFTConfig, SFTTrainer
from jaxrl.checkpoint import Checkpointer
from jaxrl.config import ConfigError
from jaxrl.trainers import EvalPrediction

# Golden one-step numbers of the tiny config (seed 0, f32, 8 examples). If a deliberate change
# moves them, rerun this test and paste the printed values here.
GOLDEN_LOSS = 2.7813801765441895
GOLDEN_GRAD_NORM = 2.018062114715576


def make(tmp_path, tokenizer, data, **kw):
    return SFTTrainer(
        tiny_config(),
        args=SFTConfig(**base_args(tmp_path, **kw)),
        train_dataset=data,
        processing_class=tokenizer,
    )


def run(tmp_path, tokenizer, data, **kw):
    trainer = make(tmp_path, tokenizer, data, **kw)
    trainer.train()
    return trainer, train_logs(trainer)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, tokenizer, sft_data):
    """One 4-step run at 8 rows per device on one device: the reference of the golden numbers,
    the accumulation and mesh comparisons, and the recompilation check (one trainer compiled
    once instead of once per test)."""
    return run(tmp_path_factory.mktemp("full"), tokenizer, sft_data[0], max_steps=4)


def test_golden_one_step(full_run):
    # Step 1's loss and gradient norm come before any update: the same in a run of any length.
    logs = full_run[1]
    loss, gn = logs[0]["loss"], logs[0]["grad_norm"]
    print(f"GOLDEN_LOSS = {loss!r}\nGOLDEN_GRAD_NORM = {gn!r}")
    # Random-init next-token loss is close to log(vocab) = log(16).
    assert abs(loss - math.log(16)) < 0.2
    np.testing.assert_allclose(loss, GOLDEN_LOSS, rtol=1e-5)
    np.testing.assert_allclose(gn, GOLDEN_GRAD_NORM, rtol=1e-5)


@pytest.mark.slow
def test_accumulation_is_token_weighted(tmp_path, tokenizer, sft_data, full_run):
    # Examples have different lengths (2- and 3-digit sums), so micro-batches hold different
    # token counts: a mean of micro-batch means would differ from the full-batch loss.
    full = full_run[1]
    _, accum = run(
        tmp_path,
        tokenizer,
        sft_data[0],
        max_steps=4,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=8,
    )
    for f, a in zip(full, accum, strict=True):
        for key in ("loss", "grad_norm", "mean_token_accuracy", "entropy", "num_tokens"):
            np.testing.assert_allclose(a[key], f[key], rtol=2e-5, err_msg=key)


@pytest.mark.slow
def test_mesh_shapes_give_same_metrics(tmp_path, tokenizer, sft_data, full_run):
    one = full_run[1]
    _, sharded = run(
        tmp_path,
        tokenizer,
        sft_data[0],
        max_steps=4,
        per_device_train_batch_size=2,
        mesh_data=2,
        mesh_fsdp=2,
        mesh_tensor=2,
    )
    for o, s in zip(one, sharded, strict=True):
        for key in ("loss", "grad_norm", "mean_token_accuracy"):
            np.testing.assert_allclose(s[key], o[key], rtol=2e-5, err_msg=key)


@pytest.mark.slow
def test_no_recompilation_across_steps(full_run):
    trainer, logs = full_run
    assert len(logs) == 4
    assert trainer._jit_train_step._cache_size() == 1


def test_loss_decreases_and_eval_metrics(tmp_path, tokenizer, sft_data):
    seen = []

    def compute_metrics(pred: EvalPrediction):
        seen.append(pred)
        return {"rows": float(len(pred.label_ids))}

    trainer = SFTTrainer(
        tiny_config(),
        args=SFTConfig(**base_args(tmp_path, max_steps=12, learning_rate=3e-3)),
        train_dataset=sft_data[0],
        eval_dataset=sft_data[1],
        processing_class=tokenizer,
        compute_metrics=compute_metrics,
        preprocess_logits_for_metrics=lambda logits, labels: logits.argmax(-1),
    )
    trainer.train()
    logs = train_logs(trainer)
    assert logs[-1]["loss"] < logs[0]["loss"] - 0.3
    metrics = trainer.evaluate()
    # 20 eval rows with eval batch 8: the padded last batch must not count twice.
    assert metrics["eval_rows"] == 20.0
    assert seen[0].predictions.shape == seen[0].label_ids.shape
    preds, padded = seen[0].predictions, seen[0].predictions == -100
    assert 0 <= preds[~padded].min() and preds[~padded].max() < 16  # argmax token ids
    # As HF: a narrower eval batch is padded with -100 (where it has no labels either).
    assert padded.any() and (seen[0].label_ids[padded] == -100).all()
    # HF's recipe: prediction t scores label t + 1. Token accuracy over the trained tokens of
    # each eval batch (8, 8 and 4 rows), averaged over the batches, is what the trainer logs as
    # mean_token_accuracy (TRL's per-batch values).
    preds, labels = seen[-1].predictions[:, :-1], seen[-1].label_ids[:, 1:]
    per_batch = []
    for lo in range(0, 20, 8):
        p, lab = preds[lo : lo + 8], labels[lo : lo + 8]
        per_batch.append(np.mean(p[lab != -100] == lab[lab != -100]))
    want = np.mean(per_batch)
    assert metrics["eval_mean_token_accuracy"] == pytest.approx(want, abs=1e-6)
    assert metrics["eval_loss"] < logs[0]["loss"]  # held-out loss also went down


def test_nan_stops_with_clear_error_and_no_bad_checkpoint(tmp_path, tokenizer, sft_data):
    trainer = make(
        tmp_path,
        tokenizer,
        sft_data[0],
        max_steps=6,
        optim="sgd",
        learning_rate=1e35,
        max_grad_norm=0.0,
        save_strategy="steps",
        save_steps=1,
    )
    with pytest.raises(FloatingPointError, match="Non-finite"):
        trainer.train()
    ckpt = Checkpointer(tmp_path / "checkpoints")
    abstract = {
        "train_state": jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
            trainer.train_state,
        ),
        "callbacks": {},
    }
    # Whatever was saved before the blow-up has finite params.
    for step in ckpt.all_steps():
        tree, _ = ckpt.restore(step, abstract)
        for x in jax.tree.leaves(tree["train_state"].params):
            assert np.isfinite(np.asarray(x)).all(), step


def test_user_optimizer_pair_and_bema_callback(tmp_path, tokenizer, sft_data):
    """A user (optimizer, schedule) pair sets each step's learning rate; the BEMA callback works
    with SFT and exports a loadable model. (Two checks on one 2-step run: one trainer fewer.)"""
    from transformers import AutoModelForCausalLM

    from jaxrl import BEMACallback

    schedule = optax.constant_schedule(1e-2)
    trainer = SFTTrainer(
        tiny_config(),
        args=SFTConfig(**base_args(tmp_path, max_steps=2)),
        train_dataset=sft_data[0],
        processing_class=tokenizer,
        optimizers=(optax.sgd(schedule), schedule),
        callbacks=[BEMACallback(update_freq=1, lag=1)],
    )
    trainer.train()
    logs = train_logs(trainer)
    assert logs[-1]["learning_rate"] == pytest.approx(1e-2)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "bema")
    assert exported.config.num_hidden_layers == 2


@pytest.mark.slow
def test_builtin_optimizers_train(tmp_path, tokenizer, sft_data, full_run):
    # adamw_torch (the default optim) is `full_run`'s: 4 steps at 1e-3 (one trainer fewer).
    assert full_run[0].args.optim == "adamw_torch" and full_run[0].args.learning_rate == 1e-3
    last_losses = {}
    for optim, lr in (("adamw_torch", None), ("sgd", 0.3), ("adafactor", 3e-3), ("lion", 2e-3)):
        if lr is None:
            logs = full_run[1]
        else:
            _, logs = run(tmp_path / optim, tokenizer, sft_data[0], optim=optim, max_steps=4, learning_rate=lr)  # fmt: skip
        assert len(logs) == 4
        assert logs[-1]["loss"] < logs[0]["loss"], optim  # each one actually trains
        last_losses[optim] = logs[-1]["loss"]
    # Same init and batches, different updates: the option is not ignored. (Not the second step's
    # loss: on this model no weight is large enough for Adafactor to factor, and an unfactored
    # Adafactor's first update is sign(g) * lr, as Adam's is up to its eps, so the two first
    # steps can round to the same loss; so can Lion's sign updates at a multiple of Adam's first
    # step. Momentum and the decay schedules part them by the fourth step.)
    assert len({round(v, 5) for v in last_losses.values()}) == 4, last_losses


@pytest.mark.slow
def test_packing_bfd_trains(tmp_path, tokenizer, sft_data, full_run):
    _, logs = run(
        tmp_path,
        tokenizer,
        sft_data[0],
        packing=True,
        max_length=32,
        max_steps=2,
        per_device_train_batch_size=2,
    )
    # Packed rows hold several documents: 2 rows carry more tokens than 2 of the longest examples.
    # (The unpacked rows: `full_run`'s, the same data with the defaults; no trainer of its own.)
    longest = max(len(ids) for ids in full_run[0].train_dataset["input_ids"])
    assert logs[0]["num_tokens"] > 2 * longest


@pytest.mark.slow
def test_bf16_compute_over_f32_params(tmp_path, tokenizer, sft_data):
    trainer, logs = run(tmp_path, tokenizer, sft_data[0], max_steps=3, bf16=True)
    assert all(math.isfinite(entry["loss"]) for entry in logs)
    assert abs(logs[0]["loss"] - GOLDEN_LOSS) < 0.05  # same model, lower-precision compute
    dtypes = {x.dtype for x in jax.tree.leaves(trainer.train_state.params)}
    assert dtypes == {np.dtype("float32")}  # master params stay f32
    # bf16=True keeps torch autocast's f32 residual stream (see test_residual_dtype).
    assert trainer.model.config.residual_dtype == jnp.float32


@pytest.mark.parametrize(("backend", "scanned"), [("cpu", True), ("gpu", False)])
def test_scan_layers_default_follows_the_backend(
    tmp_path, tokenizer, sft_data, monkeypatch, backend, scanned
):
    """scan_layers=None: unrolled layers on GPU (faster there, BENCHMARKS.md), a scan elsewhere;
    an explicit value wins."""
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    trainer = make(tmp_path, tokenizer, sft_data[0])
    assert trainer.args.scan_layers is None  # the args stay as given (HF semantics)
    assert trainer.scan_layers is scanned and trainer.model.config.scan_layers is scanned
    explicit = make(tmp_path / "explicit", tokenizer, sft_data[0], scan_layers=not scanned)
    assert explicit.model.config.scan_layers is (not scanned)


def test_residual_dtype(tmp_path, tokenizer, sft_data):
    """bf16=True keeps torch autocast's f32 residual stream; residual_dtype="bfloat16" asks for
    bf16 activations throughout (a different loss, same model)."""
    # (bf16=True's f32 residual stream is checked on test_bf16_compute_over_f32_params' run.)
    all_bf16 = make(tmp_path / "b", tokenizer, sft_data[0], bf16=True, residual_dtype="bfloat16")
    assert all_bf16.model.config.residual_dtype == jnp.bfloat16
    with pytest.raises(ConfigError, match="residual_dtype"):
        SFTConfig(**base_args(tmp_path, residual_dtype="int8"))


def test_fp16_on_cpu_is_a_clear_error(tmp_path, tokenizer, sft_data):
    with pytest.raises(ValueError, match="fp16=True needs a GPU"):
        make(tmp_path, tokenizer, sft_data[0], fp16=True, bf16=False)


def test_completion_only_loss_runs_the_head_on_completions(tmp_path, tokenizer, sft_data):
    """Prompt-completion rows score only their completion: `score_span` (the widest trained
    stretch of the data, rounded up to 8) is shorter than a row, and `lm_forward` restricted to
    it gives the full head's log-probs and statistics at every scored position (0 elsewhere); a
    batch wider than the span is refused on the host. Then, on the same trainer: evaluating
    on wider completions widens the span."""
    import datasets

    from jaxrl.algos.sft import lm_forward
    from jaxrl.data import collate_sft
    from jaxrl.trainers.sft import trained_width

    trainer = make(tmp_path, tokenizer, sft_data[0])
    width = trained_width(trainer.train_dataset["loss_mask"])
    assert trainer.score_span == -(-width // 8) * 8 < trainer.seq_len
    examples = [trainer.train_dataset[i] for i in range(8)]
    host = collate_sft(examples, trainer.seq_len, tokenizer.pad_token_id)
    mb = {k: jnp.asarray(v) for k, v in host.items()}
    model = trainer.model
    full = jax.jit(lambda mb: lm_forward(model, mb, None, True))(mb)
    spanned = jax.jit(lambda mb: lm_forward(model, mb, None, True, trainer.score_span))(mb)
    scored = host["loss_mask"] > 0
    prompt = np.arange(trainer.seq_len) < np.argmax(scored, axis=1)[:, None]
    assert prompt.any()
    for a, b in zip(jax.tree.leaves(spanned), jax.tree.leaves(full), strict=True):
        np.testing.assert_allclose(np.asarray(a)[scored], np.asarray(b)[scored], rtol=1e-6)
        assert not np.any(np.asarray(a)[prompt])  # the prompt's positions were not computed
    assert trained_width([[0, 1, 1, 0], [1, 0, 0, 1, 0], [0, 0]]) == 4

    span = trainer.score_span
    trainer.score_span = width - 1
    with pytest.raises(ValueError, match="score_span"):
        trainer._collate(examples)
    trainer.score_span = span

    # `evaluate(eval_dataset=...)` with completions wider than the training data's span compiles
    # the steps again with a wider one instead of refusing the batch; the loss equals the one
    # with the whole-row head. (Formerly a test of its own on another such trainer.)
    assert trainer.score_span == 8
    wide = datasets.Dataset.from_list([{"prompt": "9", "completion": "12345678"}] * 8)
    got = trainer.evaluate(eval_dataset=wide)["eval_loss"]
    assert trainer.score_span is None  # 9 trained tokens round up to 16 >= the row length
    trainer.score_span = 8  # the narrow span, forced: the host guard refuses these rows
    with pytest.raises(ValueError, match="score_span"):
        trainer._collate([trainer._prepare_dataset(wide, "eval")[0]])
    trainer.score_span = None
    trainer._compile(trainer.train_state)
    np.testing.assert_allclose(trainer.evaluate(eval_dataset=wide)["eval_loss"], got, rtol=1e-6)


def test_max_length_none_truncates_nothing(tmp_path, tokenizer):
    """TRL: `max_length=None` means no truncation, so the run's static row length is the longest
    example's (it was capped at 1024, and a longer example then failed inside `train()`)."""
    import datasets

    long_text = "12+34=46" * 140  # 1120 characters: a 1121-token row with the EOS
    # Two rows, one step of both: the 1121-long rows cost in every op, and the check needs only
    # that the long one trains (8 rows ran 4x the work for the same assertion).
    data = datasets.Dataset.from_dict({"text": [long_text, "1+2=3"]})
    trainer = make(
        tmp_path, tokenizer, data, max_length=None, max_steps=1, per_device_train_batch_size=2
    )
    assert max(len(ids) for ids in trainer.train_dataset["input_ids"]) == len(long_text) + 1
    assert trainer.seq_len == len(long_text) + 1
    trainer.train()
    assert np.isfinite(train_logs(trainer)[0]["loss"])
    capped = make(tmp_path, tokenizer, data, max_steps=1)  # TRL's default max_length=1024
    assert capped.seq_len == 1024

"""`length_buckets`: each step's batch (all micro-batches and devices) and each eval batch is
padded to the smallest bucket holding its longest row, with the same numbers as one static
length: per-step losses and metrics, gradient-accumulation and mesh invariance, exact resume,
evaluation, and predictions in HF's layout (each batch as wide as TRL pads it, batches
concatenated with -100 padding)."""

import datasets
import numpy as np
import pytest
from trainer_utils import base_args, tiny_config, train_logs

from jaxrl import DPOConfig, DPOTrainer, RewardConfig, RewardTrainer, SFTConfig, SFTTrainer
from jaxrl.config import ConfigError
from jaxrl.config_cli import parse_config
from jaxrl.data.collate import AUTO_MIN_BUCKET, bucket_length, length_buckets

BUCKETS = [16, 32]
# Three steps of 8 examples in order: short rows, then rows over 16 tokens, then over 32.
GROUP_CHARS = ((3, 9), (18, 26), (32, 42))


def _digits(rng, n: int) -> str:
    return "".join(rng.choice(list("0123456789"), n))


def _groups(rng, make, per_group: int = 8) -> list[dict]:
    rows = []
    for lo, hi in GROUP_CHARS:
        for i in range(per_group):
            n = hi if i == per_group // 2 else int(rng.integers(lo, hi + 1))
            rows.append(make(n))
    return rows


def sft_rows(seed: int = 0, per_group: int = 8) -> datasets.Dataset:
    rng = np.random.default_rng(seed)

    def make(n):
        p = max(1, n // 3)
        return {"prompt": _digits(rng, p) + "=", "completion": _digits(rng, n - p)}

    return datasets.Dataset.from_list(_groups(rng, make, per_group))


def pref_rows(seed: int = 0, per_group: int = 8) -> datasets.Dataset:
    rng = np.random.default_rng(seed)

    def make(n):
        p = max(1, n // 3)
        c = n - p
        r = int(rng.integers(max(1, c // 2), c + 1))
        return {
            "prompt": _digits(rng, p) + "=",
            "chosen": _digits(rng, c),
            "rejected": _digits(rng, r),
        }

    return datasets.Dataset.from_list(_groups(rng, make, per_group))


ALGOS = {
    "sft": (SFTTrainer, SFTConfig, sft_rows, ("loss", "mean_token_accuracy", "entropy")),
    "reward": (RewardTrainer, RewardConfig, pref_rows, ("loss", "accuracy", "margin")),
    "dpo": (
        DPOTrainer,
        DPOConfig,
        pref_rows,
        ("loss", "rewards/chosen", "rewards/margins", "logps/rejected", "logits/chosen"),
    ),
}


def _trainer(algo, out, data, eval_data=None, callbacks=None, model=None, **kw):
    trainer_cls, config_cls, _, _ = ALGOS[algo]
    kw.setdefault("train_sampling_strategy", "sequential")
    return trainer_cls(
        model or tiny_config(),
        args=config_cls(**base_args(out, **kw)),
        train_dataset=data,
        eval_dataset=eval_data,
        processing_class=_trainer.tokenizer,
        callbacks=callbacks,
    )


@pytest.fixture(autouse=True)
def _tok(tokenizer):
    _trainer.tokenizer = tokenizer


def record_step_lengths(trainer) -> list[int]:
    """The row length of every train step's batch, as collated."""
    seen = []
    collate = trainer._collate_micro

    def spy(examples, accum, real=None, seq_len=None):
        batch = collate(examples, accum, real, seq_len)
        seen.append(batch["input_ids"].shape[-1])
        return batch

    trainer._collate_micro = spy
    return seen


def expected_lengths(trainer, steps: int) -> list[int]:
    """Per step: the smallest bucket holding the longest example of the step's global batch."""
    it = trainer._train_iterator()
    lengths = np.asarray(trainer._example_lengths(trainer.train_dataset))
    return [
        bucket_length(int(lengths[it.global_indices_at(s)].max()), trainer.length_buckets)
        for s in range(steps)
    ]


# ----------------------------------------------------------------------------- buckets


def test_auto_buckets_are_powers_of_two_below_the_static_length():
    assert length_buckets(1000, "auto") == (256, 512, 1000)
    assert length_buckets(1024, "auto") == (256, 512, 1024)
    assert length_buckets(1000, "auto", multiple_of=96) == (288, 576, 1000)
    assert length_buckets(AUTO_MIN_BUCKET, "auto") == (AUTO_MIN_BUCKET,)
    assert length_buckets(60, "auto") == (60,)  # the test suite's rows: one shape
    assert length_buckets(64, [16, 32, 64, 128]) == (16, 32, 64)
    assert length_buckets(64, None) == (64,)
    assert [bucket_length(n, (16, 32, 48)) for n in (1, 16, 17, 33, 48, 99)] == [
        16, 16, 32, 48, 48, 48,
    ]  # fmt: skip


@pytest.mark.parametrize("cls", [SFTConfig, RewardConfig, DPOConfig])
def test_length_buckets_config(cls):
    assert cls(output_dir="o").length_buckets == "auto"
    assert cls(output_dir="o", length_buckets=[]).length_buckets is None
    assert cls(output_dir="o", length_buckets="none").length_buckets is None
    args, _ = parse_config(cls, cli_args=["--output_dir", "o", "--length_buckets", "128,256"])
    assert args.length_buckets == [128, 256]
    args, _ = parse_config(cls, cli_args=["--output_dir", "o", "--length_buckets", "64", "128"])
    assert args.length_buckets == [64, 128]
    args, _ = parse_config(cls, cli_args=["--output_dir", "o", "--length_buckets", "null"])
    assert args.length_buckets is None
    with pytest.raises(ConfigError, match=r"strictly increasing .* Did you mean \[128, 256\]"):
        cls(output_dir="o", length_buckets=[256, 128])
    with pytest.raises(ConfigError, match="strictly increasing"):
        cls(output_dir="o", length_buckets=[128, 128])
    with pytest.raises(ConfigError, match="integer row lengths >= 1"):
        cls(output_dir="o", length_buckets=[0, 128])
    with pytest.raises(ConfigError, match=r"\[100\] are not multiples of `pad_to_multiple_of=64`"):
        cls(output_dir="o", length_buckets=[64, 100], pad_to_multiple_of=64)
    with pytest.raises(ConfigError, match="'auto', None .* or a list of row lengths"):
        cls(output_dir="o", length_buckets="fast")


def test_the_suite_s_rows_keep_one_shape(tmp_path, sft_data):
    """The default ("auto") leaves rows of a few dozen tokens at one static length."""
    trainer = _trainer("sft", tmp_path, sft_data[0], sft_data[1])
    assert trainer.length_buckets == (trainer.seq_len,)


# ----------------------------------------------------------------------------- training


@pytest.mark.parametrize(
    "algo",
    [
        "sft",
        pytest.param("reward", marks=pytest.mark.slow),
        pytest.param("dpo", marks=pytest.mark.slow),
    ],
)
def test_buckets_give_the_static_numbers(algo, tmp_path):
    """Three steps whose longest rows fall in three different buckets, with gradient
    accumulation over a two-device mesh: the same losses, metrics, grad norms, token counts and
    evaluation as one static length; one compiled train step per bucket used."""
    _, _, rows, keys = ALGOS[algo]
    data, eval_data = rows(0), rows(1, per_group=4)
    kw = dict(
        include_num_input_tokens_seen="all",  # TRL's padded tokens, per device
        eval_strategy="steps",
        eval_steps=3,
        gradient_accumulation_steps=2,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,  # eval batches of 4 examples on 2 devices
        mesh_data=2,
    )
    static = _trainer(algo, tmp_path / "static", data, eval_data, length_buckets=None, **kw)
    static_lengths = record_step_lengths(static)
    static.train()
    trainer = _trainer(algo, tmp_path / "buckets", data, eval_data, length_buckets=BUCKETS, **kw)
    assert trainer.seq_len == static.seq_len > BUCKETS[-1]
    lengths = record_step_lengths(trainer)
    trainer.train()
    assert lengths == expected_lengths(trainer, 3) == [*BUCKETS, trainer.seq_len]
    assert trainer._jit_train_step._cache_size() == 3
    for got, want in zip(train_logs(trainer), train_logs(static), strict=True):
        for k in (*keys, "grad_norm"):
            np.testing.assert_allclose(got[k], want[k], rtol=2e-5, atol=1e-6, err_msg=k)
        assert got["num_tokens"] == want["num_tokens"]
        # The same devices' batches: the same TRL padding.
        assert got["num_input_tokens_seen"] == want["num_input_tokens_seen"]
    got, want = (
        [h for h in t.state.log_history if "eval_loss" in h][-1] for t in (trainer, static)
    )
    for k in ("eval_loss", *(f"eval_{k}" for k in keys if k != "loss")):
        np.testing.assert_allclose(got[k], want[k], rtol=2e-5, atol=1e-6, err_msg=k)
    assert static_lengths == [static.seq_len] * 3
    assert static._jit_train_step._cache_size() == 1


@pytest.mark.slow
def test_dpo_prefix_sharing_buckets(tmp_path):
    """Prefix-shared rows (prompt + chosen + rejected) take their buckets from those lengths."""
    data = pref_rows(0)
    kw = dict(prefix_sharing=True, max_steps=3)
    static = _trainer("dpo", tmp_path / "s", data, length_buckets=None, **kw)
    static.train()
    trainer = _trainer("dpo", tmp_path / "b", data, length_buckets=[16, 32, 48], **kw)
    lengths = record_step_lengths(trainer)
    trainer.train()
    assert lengths == expected_lengths(trainer, 3)
    assert len(set(lengths)) == 3 and lengths[-1] == trainer.seq_len > 48
    for got, want in zip(train_logs(trainer), train_logs(static), strict=True):
        for k in ("loss", "rewards/margins", "logps/chosen", "grad_norm", "num_tokens"):
            np.testing.assert_allclose(got[k], want[k], rtol=2e-5, atol=1e-6, err_msg=k)


@pytest.mark.slow
def test_noise_and_dropout_do_not_depend_on_the_buckets(tmp_path):
    """NEFTune noise, the model's dropout (GPT-2: embeddings, attention, residuals) and LoRA's
    dropout are drawn per position: a bucketed run trains exactly as the static one. One pair of
    runs with all three on checks each (a source that depended on the bucket would make the
    pair differ; no other can make up for it); LoRA dropout had a pair of its own before. A
    clean run (no noise, no dropout) shows they act."""
    from transformers import GPT2Config

    from jaxrl import lora

    model = GPT2Config(
        vocab_size=16, n_embd=32, n_layer=2, n_head=4, n_positions=64, attn_pdrop=0.2,
        resid_pdrop=0.2, embd_pdrop=0.2, bos_token_id=2, eos_token_id=1, pad_token_id=0,
    )  # fmt: skip

    def run(name, lora_dropout, **kw):
        peft = lora.LoraConfig(
            r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=lora_dropout
        )
        trainer = SFTTrainer(
            model,
            args=SFTConfig(
                **base_args(tmp_path / name, train_sampling_strategy="sequential", **kw)
            ),
            train_dataset=sft_rows(0),
            processing_class=_trainer.tokenizer,
            peft_config=peft,
        )
        lengths = record_step_lengths(trainer)
        trainer.train()
        return trainer, lengths

    static, static_lengths = run("s", 0.3, neftune_noise_alpha=5.0, length_buckets=None)
    trainer, lengths = run("b", 0.3, neftune_noise_alpha=5.0, length_buckets=BUCKETS)
    # The bucketed run did use three buckets (else the comparison below could not fail).
    assert lengths == [*BUCKETS, trainer.seq_len]
    assert static_lengths == [static.seq_len] * 3
    model.attn_pdrop = model.resid_pdrop = model.embd_pdrop = 0.0
    clean, _ = run("c", 0.0)
    for got, want, off in zip(*map(train_logs, (trainer, static, clean)), strict=True):
        for k in ("loss", "grad_norm", "mean_token_accuracy"):
            np.testing.assert_allclose(got[k], want[k], rtol=2e-5, atol=1e-6, err_msg=k)
        assert got["loss"] != pytest.approx(off["loss"], rel=1e-3)  # noise and dropout act


def test_sft_packing_keeps_the_static_length(tmp_path):
    kw = dict(packing=True, max_length=40, max_steps=2, length_buckets=BUCKETS)
    trainer = _trainer("sft", tmp_path, sft_rows(0), **kw)
    lengths = record_step_lengths(trainer)
    trainer.train()
    assert trainer.length_buckets != (40,) and lengths == [40, 40]


@pytest.mark.slow
def test_resume_with_buckets_is_bit_exact(tmp_path):
    """Kill after step 2 (a checkpoint) and resume: step 3 (another bucket) is the uninterrupted
    run's, bit for bit. A run killed after step 2 leaves what the uninterrupted one saved then
    (its step-2 checkpoint), so the resume starts from that checkpoint."""
    data = sft_rows(0)
    kw = dict(
        max_steps=3,
        save_strategy="steps",
        save_steps=2,
        length_buckets=BUCKETS,
        include_num_input_tokens_seen="non_padding",
        train_sampling_strategy="random",
    )
    full = _trainer("sft", tmp_path / "a", data, **kw)
    full.train()
    checkpoint = tmp_path / "a" / "checkpoints" / "checkpoint-2"
    resumed = _trainer("sft", tmp_path / "b", data, resume_from_checkpoint=str(checkpoint), **kw)
    lengths = record_step_lengths(resumed)
    resumed.train()
    assert lengths == expected_lengths(resumed, 3)[2:]
    want = train_logs(full)[2]
    (got,) = [h for h in train_logs(resumed) if h["step"] == 3]
    for k in ("loss", "grad_norm", "mean_token_accuracy", "num_tokens", "num_input_tokens_seen"):
        assert got[k] == want[k], k


# ----------------------------------------------------------------------------- predictions


def _hf_widths(lengths, per_device: int, batch: int) -> list[int]:
    """Per example: the width HF's evaluation loop gives its row (its device's longest)."""
    out = []
    for start in range(0, len(lengths), batch):
        for d in range(start, min(start + batch, len(lengths)), per_device):
            group = lengths[d : min(d + per_device, start + batch, len(lengths))]
            out += [max(group)] * len(group)
    return out


@pytest.mark.parametrize("mesh_data", [1, 2])
def test_predictions_take_hf_widths(mesh_data, tmp_path):
    """SFT predict(): each eval batch is as wide as HF makes it (its widest device's longest
    row), the batches concatenated with -100 padding; within a batch, a device's rows are -100
    past that device's longest row (HF's pad_across_processes). The same with or without
    buckets, also after `preprocess_logits_for_metrics`."""
    rows = sft_rows(2, per_group=4)
    per_device = 4 // mesh_data
    outs = {}
    for name, buckets in (("static", None), ("buckets", BUCKETS)):
        trainer = SFTTrainer(
            tiny_config(),
            args=SFTConfig(
                **base_args(
                    tmp_path / name,
                    length_buckets=buckets,
                    per_device_eval_batch_size=per_device,
                    mesh_data=mesh_data,
                )
            ),
            train_dataset=rows,
            processing_class=_trainer.tokenizer,
            preprocess_logits_for_metrics=lambda logits, labels: (logits, logits.argmax(-1)),
        )
        outs[name] = trainer.predict(rows)
    lengths = [len(ids) for ids in trainer.train_dataset["input_ids"]]
    widths = _hf_widths(lengths, per_device, 4)
    assert len(set(widths)) >= 3
    for out in outs.values():
        logits, argmax = out.predictions
        assert logits.shape == (12, max(lengths), 16) and argmax.shape == (12, max(lengths))
        assert out.label_ids.shape == (12, max(lengths))
        for i, w in enumerate(widths):
            batch_w = max(widths[i // 4 * 4 : i // 4 * 4 + 4])
            assert (logits[i, w:] == -100).all() and (out.label_ids[i, w:] == -100).all()
            assert (logits[i, :w] != -100).all() and (argmax[i, :w] >= 0).all()
            # HF pads across processes before preprocessing: the argmax of a padded (-100)
            # position is 0; the narrower batches are padded after it, with -100.
            assert (argmax[i, w:batch_w] == 0).all() and (argmax[i, batch_w:] == -100).all()
    static, bucketed = outs["static"], outs["buckets"]
    np.testing.assert_array_equal(bucketed.label_ids, static.label_ids)
    np.testing.assert_allclose(bucketed.predictions[0], static.predictions[0], rtol=1e-5, atol=1e-5)
    assert bucketed.metrics["test_loss"] == pytest.approx(static.metrics["test_loss"], rel=1e-6)

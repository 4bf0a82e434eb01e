"""SFT `padding_free=True`: each device's share of a micro-batch runs as one row of its examples
back to back. The numbers are TRL 1.16's padding-free run's, step for step, and the padded
run's; rows take the smallest bucket holding the longest device row; accumulation, a 2-device
mesh, an epoch's short last batch, kill-and-resume, NEFTune, evaluation and predict() (HF's
one-row-per-device layout) work; TRL's refusals are mirrored."""

import datasets
import numpy as np
import pytest
from trainer_utils import (
    base_args,
    killed_after_checkpoint,
    tiny_config,
    train_logs,
    trl_train_logs,
)

from jaxrl import DPOConfig, SFTConfig, SFTTrainer
from jaxrl.config import ConfigError
from jaxrl.data.char_tokenizer import build_char_tokenizer
from jaxrl.data.collate import padding_free_buckets, padding_free_longest_row

METRICS = ("loss", "mean_token_accuracy", "entropy", "num_tokens", "grad_norm")


def _rows(n: int, seed: int = 0) -> datasets.Dataset:
    """Prompt/completion sums of varied lengths (4 to ~30 tokens)."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        a, b = (int(x) for x in rng.integers(1, 10 ** int(rng.integers(1, 6)), size=2))
        tail = " yes" * int(rng.integers(0, 4))
        rows.append({"prompt": f"{a}+{b}=", "completion": f"{a + b}{tail}"})
    return datasets.Dataset.from_list(rows)


def _trainer(out, tokenizer, data, model=None, eval_data=None, callbacks=None, **kw):
    kw.setdefault("max_length", None)
    kw.setdefault("train_sampling_strategy", "sequential")
    return SFTTrainer(
        model or tiny_config(),
        args=SFTConfig(**base_args(out, **kw)),
        train_dataset=data,
        eval_dataset=eval_data,
        processing_class=tokenizer,
        callbacks=callbacks,
    )


def _record_rows(trainer) -> list[tuple[int, ...]]:
    """The shape of every train step's collated `input_ids` `[A, rows, T]`."""
    seen = []
    collate = trainer._collate_micro

    def spy(examples, accum, real=None, seq_len=None):
        batch = collate(examples, accum, real, seq_len)
        seen.append(batch["input_ids"].shape)
        return batch

    trainer._collate_micro = spy
    return seen


# ----------------------------------------------------------------------------- layout


def test_buckets_and_longest_row():
    # "auto": powers of two from 256 and their midpoints, rounded up, then the static length.
    assert padding_free_buckets(2000, "auto") == (256, 384, 512, 768, 1024, 1536, 2000)
    assert padding_free_buckets(700, "auto", 100) == (300, 400, 600, 700)
    assert padding_free_buckets(100, [16, 64, 512]) == (16, 64, 100)
    assert padding_free_buckets(100, None) == (100,)
    # Host 0 holds [3, 4, 5], host 1 [9]: devices of 2 examples hold 7, 5 and 9 tokens.
    assert padding_free_longest_row([[3, 4, 5], [9]], 2) == 9
    assert padding_free_longest_row([[3, 4, 5, 1], []], 2) == 7
    assert padding_free_longest_row([[3, 4, 5, 1]], 4) == 13


def test_config_errors(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="max_length=None"):
        _trainer(tmp_path, tokenizer, _rows(8), padding_free=True, max_length=1024)
    with pytest.raises(ConfigError, match="DPOTrainer does not run it"):
        DPOConfig(output_dir=str(tmp_path), padding_free=True)


# ----------------------------------------------------------------------------- TRL 1.16


CASES = {
    # One full batch per step: TRL's flattened row of all 8 examples.
    "one_row": (dict(per_device_train_batch_size=8), METRICS),
    # Two micro-batches of 4 (sequential order, as TRL's with `train_sampling_strategy`), rows
    # padded to a multiple of 8: TRL's `num_tokens` counts that padding. TRL averages its
    # token accuracy and entropy over the micro-batches, jaxrl over the step's tokens (with or
    # without padding_free), so those two are left out.
    "accumulation": (
        dict(
            per_device_train_batch_size=4,
            gradient_accumulation_steps=2,
            pad_to_multiple_of=8,
            train_sampling_strategy="sequential",
        ),
        ("loss", "num_tokens", "grad_norm"),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_trl(case, tmp_path, tokenizer, hf_model_dir):
    import trl

    data = _rows(8)
    options, keys = CASES[case]
    common = dict(
        max_steps=2,
        learning_rate=1e-3,
        max_length=None,
        padding_free=True,
        include_num_input_tokens_seen="all",
        **options,
    )
    _, theirs = trl_train_logs(
        trl.SFTTrainer, trl.SFTConfig, hf_model_dir, tokenizer, data, tmp_path / "trl", **common
    )
    trainer = _trainer(tmp_path / "ours", tokenizer, data, model=hf_model_dir, **common)
    trainer.train()
    ours = train_logs(trainer)
    assert len(ours) == len(theirs) == 2
    for step, (o, t) in enumerate(zip(ours, theirs, strict=True)):
        for key in keys:
            np.testing.assert_allclose(o[key], t[key], rtol=2e-5, err_msg=f"{key}, step {step}")
        assert o["num_input_tokens_seen"] == t["num_input_tokens_seen"]


def test_predict_matches_trl(tmp_path, tokenizer, hf_model_dir):
    """predict(): one row per device and eval batch (6 examples in batches of 4: rows of 4 and
    2 examples), as wide as TRL makes it, the same logits and labels as TRL's."""
    import torch
    import trl
    from transformers import AutoModelForCausalLM

    data = _rows(6, seed=1)
    common = dict(max_length=None, padding_free=True, per_device_eval_batch_size=4)
    theirs_trainer = trl.SFTTrainer(
        model=AutoModelForCausalLM.from_pretrained(hf_model_dir, dtype=torch.float32),
        args=trl.SFTConfig(
            output_dir=str(tmp_path / "trl"),
            use_cpu=True,
            bf16=False,
            report_to="none",
            pad_to_multiple_of=8,
            **common,
        ),
        train_dataset=data,
        processing_class=tokenizer,
    )
    theirs = theirs_trainer.predict(theirs_trainer.train_dataset)
    ours = _trainer(
        tmp_path / "ours", tokenizer, data, model=hf_model_dir, pad_to_multiple_of=8, **common
    ).predict(data)
    assert ours.predictions.shape == theirs.predictions.shape
    assert ours.predictions.shape[0] == 2
    np.testing.assert_array_equal(ours.label_ids, theirs.label_ids)
    np.testing.assert_allclose(ours.predictions, theirs.predictions, atol=2e-5)
    np.testing.assert_allclose(ours.metrics["test_loss"], theirs.metrics["test_loss"], rtol=2e-5)


# ----------------------------------------------------------------------------- padded layout


def test_equals_the_padded_run_on_a_mesh_with_accumulation(tmp_path, tokenizer):
    """2 devices x 2 examples x 2 micro-batches over 20 examples: the third step holds 4
    (some device rows run empty). Losses, token accuracy, entropy, grad norms and evaluation
    equal the padded run's; each step's rows are one per device and micro-batch, at the
    smallest bucket holding the longest device row; `num_tokens` and HF's
    `num_input_tokens_seen` ("all") count each device row's width as TRL pads it (a multiple of
    8)."""
    data, eval_data = _rows(20), _rows(7, seed=3)
    kw = dict(
        max_steps=3,
        mesh_data=2,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        gradient_accumulation_steps=2,
        include_num_input_tokens_seen="all",
        pad_to_multiple_of=8,
        length_buckets=[24, 32, 40, 48],
        eval_strategy="steps",
        eval_steps=3,
    )
    padded = _trainer(tmp_path / "padded", tokenizer, data, eval_data=eval_data, **kw)
    padded.train()
    flat = _trainer(
        tmp_path / "flat", tokenizer, data, eval_data=eval_data, padding_free=True, **kw
    )
    shapes = _record_rows(flat)
    flat.train()
    lengths = [len(x) for x in flat.train_dataset["input_ids"]]
    want_shapes, want_tokens, seen = [], [], 0
    for step in range(3):
        idx = list(range(8 * step, min(8 * step + 8, 20)))
        rows = [sum(lengths[i] for i in idx[d : d + 2]) for d in range(0, len(idx), 2)]
        bucket = next(b for b in (24, 32, 40, 48, 2 * flat.seq_len) if b >= max(rows))
        want_shapes.append((2, 2, bucket))
        seen += sum(-(-n // 8) * 8 for n in rows)
        want_tokens.append(seen)
    assert shapes == want_shapes and len({s[-1] for s in shapes}) > 1
    ours, theirs = train_logs(flat), train_logs(padded)
    assert len(ours) == len(theirs) == 3
    for step, (o, t) in enumerate(zip(ours, theirs, strict=True)):
        for key in ("loss", "mean_token_accuracy", "entropy", "grad_norm"):
            np.testing.assert_allclose(o[key], t[key], rtol=2e-5, err_msg=f"{key}, step {step}")
        assert o["num_tokens"] == o["num_input_tokens_seen"] == want_tokens[step]
    evals = [[h for h in t.state.log_history if "eval_loss" in h][0] for t in (flat, padded)]
    for key in ("eval_loss", "eval_mean_token_accuracy", "eval_entropy"):
        np.testing.assert_allclose(evals[0][key], evals[1][key], rtol=2e-5, err_msg=key)


def test_assistant_only_loss_equals_the_padded_run(tmp_path):
    """Conversations trained on the assistant turns only: the same numbers flattened."""
    import string

    template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' %}A:{% generation %}"
        "{{ m['content'] }}<eos>{% endgeneration %}{% else %}U:{{ m['content'] }}\n{% endif %}"
        "{% endfor %}"
    )
    tok = build_char_tokenizer(string.printable, chat_template=template)
    data = datasets.Dataset.from_list(
        [
            {
                "messages": [
                    {"role": "user", "content": r["prompt"]},
                    {"role": "assistant", "content": r["completion"]},
                ]
            }
            for r in _rows(8, seed=6)
        ]
    )
    kw = dict(max_steps=1, per_device_train_batch_size=8, assistant_only_loss=True)
    logs = []
    for padding_free in (False, True):
        trainer = _trainer(
            tmp_path / str(padding_free),
            tok,
            data,
            model=tiny_config(len(tok)),
            padding_free=padding_free,
            **kw,
        )
        trainer.train()
        logs.append(train_logs(trainer)[0])
    trained = sum(map(sum, trainer.train_dataset["loss_mask"]))
    assert 0 < trained < sum(map(len, trainer.train_dataset["input_ids"]))
    for key in METRICS:
        np.testing.assert_allclose(logs[1][key], logs[0][key], rtol=2e-5, err_msg=key)


def test_resume_is_bit_exact(tmp_path, tokenizer):
    """Kill after step 2 (a checkpoint) and resume: step 3 is the uninterrupted run's."""
    data = _rows(24, seed=4)
    kw = dict(
        max_steps=3,
        save_strategy="steps",
        save_steps=2,
        per_device_train_batch_size=4,
        padding_free=True,
        length_buckets=[32, 48, 64],
        include_num_input_tokens_seen="all",
        train_sampling_strategy="random",
    )
    full = _trainer(tmp_path / "a", tokenizer, data, **kw)
    full_shapes = _record_rows(full)
    full.train()
    killed_after_checkpoint(tmp_path / "a", 2, tmp_path / "b")
    resumed = _trainer(tmp_path / "b", tokenizer, data, resume_from_checkpoint=True, **kw)
    shapes = _record_rows(resumed)
    resumed.train()
    assert shapes == full_shapes[2:]  # the bucket follows the step's examples, not the run
    want = train_logs(full)[2]
    (got,) = [h for h in train_logs(resumed) if h["step"] == 3]
    for key in (*METRICS, "num_input_tokens_seen"):
        assert got[key] == want[key], key


def test_neftune_on_a_short_last_batch(tmp_path, tokenizer):
    """NEFTune scales its noise by each flattened row's width (TRL's padded length); an empty
    row of an epoch's short last batch stays finite."""
    data = _rows(10, seed=5)  # the second step holds 2 examples: one device row is empty
    kw = dict(max_steps=2, per_device_train_batch_size=4, mesh_data=2, padding_free=True)
    noisy = _trainer(tmp_path / "n", tokenizer, data, neftune_noise_alpha=5.0, **kw)
    noisy.train()
    clean = _trainer(tmp_path / "c", tokenizer, data, **kw)
    clean.train()
    for o, c in zip(train_logs(noisy), train_logs(clean), strict=True):
        assert np.isfinite(o["loss"]) and np.isfinite(o["grad_norm"])
        assert o["loss"] != c["loss"]

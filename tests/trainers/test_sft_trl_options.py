"""SFT's `loss_type="dft"`, `label_smoothing_factor`, `truncation_mode="keep_end"` and TRL's rule for examples without a
trained token, step for step against TRL 1.16's own `SFTTrainer` on the same model and data."""

import datasets
import numpy as np
import pytest
from trainer_utils import assert_logs_match, base_args, jaxrl_trainer, train_logs, trl_train_logs

from jaxrl import SFTConfig, SFTTrainer

METRICS = ("loss", "mean_token_accuracy", "entropy", "num_tokens")


def _prompt_completion() -> datasets.Dataset:
    """Eight prompt/completion rows of varied lengths; with max_length 12 several are cut, one
    ('1234567890123+1=') keeps no completion token under 'keep_start' (TRL drops it), and
    under 'keep_end' every row keeps its completion's end."""
    rows = [
        ("1+2=", "3"),
        ("12+30=", "42, which is forty-two"),
        ("7+8=", "15"),
        ("1234567890123+1=", "1234567890124"),
        ("5+5=", "10 for sure"),
        ("20+21=", "41"),
        ("3+3=", "6 exactly as expected"),
        ("9+1=", "10"),
    ]
    return datasets.Dataset.from_list([{"prompt": p, "completion": c} for p, c in rows])


CASES = {
    "dft": dict(loss_type="dft", max_length=64),
    "label_smoothing": dict(label_smoothing_factor=0.2, max_length=64),
    "keep_end": dict(truncation_mode="keep_end", max_length=12),
    "keep_start_drops_untrained": dict(max_length=12),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_matches_trl(case, tmp_path, tokenizer, hf_model_dir):
    import trl

    data = _prompt_completion()
    # One full batch per step: TRL's sampler and jaxrl's seeded permutation order the rows
    # differently, which a full batch's token-mean loss does not see.
    common = dict(per_device_train_batch_size=8, max_steps=2, learning_rate=1e-3, **CASES[case])
    theirs_trainer, theirs = trl_train_logs(
        trl.SFTTrainer, trl.SFTConfig, hf_model_dir, tokenizer, data, tmp_path / "trl", **common
    )
    trainer = jaxrl_trainer(
        SFTTrainer, SFTConfig, hf_model_dir, tokenizer, data, tmp_path / "ours", **common
    )
    assert trainer.train_dataset["input_ids"] == theirs_trainer.train_dataset["input_ids"]
    trainer.train()
    assert_logs_match(train_logs(trainer), theirs, METRICS, steps=2)


def test_untrained_examples_are_dropped_only_when_truncating(tokenizer):
    """TRL drops the examples without a trained token in its truncation pass, so only when it
    truncates (a `max_length`, no packing); otherwise they stay (they count in their batch and
    add no loss). Empty examples are always dropped."""
    from jaxrl.data.sft import prepare_sft_dataset

    data = datasets.Dataset.from_list(
        [
            {"input_ids": [5, 6, 7], "labels": [-100, -100, -100]},  # nothing trained
            {"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]},
            {"input_ids": [], "labels": []},  # empty
        ]
    )
    with pytest.warns(UserWarning, match="Dropped 1 of 3"):
        kept = prepare_sft_dataset(data, tokenizer, max_length=None)
    assert kept["loss_mask"] == [[0, 0, 0], [0, 0, 1, 1]]
    with pytest.warns(UserWarning, match="Dropped 2 of 3"):
        cut = prepare_sft_dataset(data, tokenizer, max_length=3)
    assert (cut["input_ids"], cut["loss_mask"]) == ([[5, 6, 7]], [[0, 0, 1]])
    with pytest.warns(UserWarning, match="Dropped 2 of 3"):
        end = prepare_sft_dataset(data, tokenizer, max_length=2, truncation_mode="keep_end")
    assert (end["input_ids"], end["loss_mask"]) == ([[7, 8]], [[1, 1]])


def _texts(n: int = 24) -> datasets.Dataset:
    return datasets.Dataset.from_list(
        [{"text": f"{i}+{i * 7 % 13}={i + i * 7 % 13}"} for i in range(n)]
    )


@pytest.mark.parametrize(
    "options",
    [
        dict(shuffle_dataset=True),
        dict(shuffle_dataset=True, packing=True, max_length=24),
        dict(shuffle_dataset=True, packing=True, packing_strategy="wrapped", max_length=16),
        dict(packing=True, eval_packing=False, max_length=24),
        dict(eval_packing=True, max_length=24),
    ],
)
def test_prepared_rows_match_trl(options, tmp_path, tokenizer, hf_model_dir):
    """`shuffle_dataset` (seeded shuffles before packing and after) and `eval_packing` (None
    follows `packing`): jaxrl's prepared train and eval rows are TRL's, in TRL's order."""
    import trl

    theirs = trl.SFTTrainer(
        model=hf_model_dir,
        args=trl.SFTConfig(
            output_dir=str(tmp_path / "trl"), report_to="none", use_cpu=True, seed=3, **options
        ),
        train_dataset=_texts(),
        eval_dataset=_texts(10),
        processing_class=tokenizer,
    )
    ours = SFTTrainer(
        hf_model_dir,
        args=SFTConfig(**base_args(tmp_path / "ours", seed=3, **options)),
        train_dataset=_texts(),
        eval_dataset=_texts(10),
        processing_class=tokenizer,
    )
    assert ours.train_dataset["input_ids"] == theirs.train_dataset["input_ids"]
    assert ours.eval_dataset["input_ids"] == theirs.eval_dataset["input_ids"]


def test_unpacked_eval_of_a_packed_run_equals_an_unpacked_run(tmp_path, tokenizer, hf_model_dir):
    """`eval_packing=False` evaluates the rows one example each while training packs them: the
    eval metrics are those of a run that never packs."""

    def evaluate(**options):
        trainer = SFTTrainer(
            hf_model_dir,
            args=SFTConfig(**base_args(tmp_path / str(options), max_length=24, **options)),
            train_dataset=_texts(),
            eval_dataset=_texts(10),
            processing_class=tokenizer,
        )
        assert ("segment_ids" in trainer.train_dataset.column_names) == options.get("packing", 0)
        return trainer.evaluate()

    packed_train = evaluate(packing=True, eval_packing=False)
    unpacked = evaluate()
    for key in ("eval_loss", "eval_mean_token_accuracy", "eval_entropy"):
        np.testing.assert_allclose(packed_train[key], unpacked[key], rtol=1e-6)
    assert packed_train["eval_loss"] != evaluate(packing=True)["eval_loss"]


def _tokenized_rows(tokenizer) -> datasets.Dataset:
    """Pre-tokenized rows, some longer than the max_length below, one with -100 labels, without
    EOS: used as given, none is cut, extended or dropped."""
    texts = ["1+2=3", "12+30=42, forty-two as it is", "7+8=15", "20+21=41 and more than that"]
    rows = [{"input_ids": tokenizer(t)["input_ids"]} for t in texts]
    for row in rows:
        row["labels"] = list(row["input_ids"])
    rows[0]["labels"][:4] = [-100] * 4
    return datasets.Dataset.from_list(rows)


@pytest.mark.slow
def test_skip_prepare_dataset_matches_trl(tmp_path, tokenizer, hf_model_dir):
    """`dataset_kwargs={"skip_prepare_dataset": True}`: rows as given (no EOS, no truncation to
    `max_length`), `labels` masking, and the same steps as TRL's trainer."""
    import trl

    data = _tokenized_rows(tokenizer)
    common = dict(
        per_device_train_batch_size=4,
        max_steps=2,
        learning_rate=1e-3,
        max_length=12,
        dataset_kwargs={"skip_prepare_dataset": True},
    )
    _, theirs = trl_train_logs(
        trl.SFTTrainer, trl.SFTConfig, hf_model_dir, tokenizer, data, tmp_path / "trl", **common
    )
    trainer = jaxrl_trainer(
        SFTTrainer, SFTConfig, hf_model_dir, tokenizer, data, tmp_path / "ours", **common
    )
    assert trainer.train_dataset["input_ids"] == data["input_ids"]
    assert trainer.seq_len >= max(len(r) for r in data["input_ids"]) > 12
    assert trainer.train_dataset["loss_mask"][0][:5] == [0, 0, 0, 0, 1]
    trainer.train()
    assert_logs_match(train_logs(trainer), theirs, METRICS, steps=2, grad_norm=False)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(dataset_kwargs={"num_proc": 2}), "only key is 'skip_prepare_dataset'"),
        (dict(dataset_kwargs="{not json"), "JSON object string"),
        (dict(dataset_kwargs={"skip_prepare_dataset": True}, packing=True), "pack the data"),
    ],
)
def test_dataset_kwargs_errors(tmp_path, options, message):
    from jaxrl.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        SFTConfig(output_dir=str(tmp_path), **options)
    assert SFTConfig(dataset_kwargs='{"skip_prepare_dataset": true}').skip_prepare_dataset


def test_skip_prepare_dataset_refuses_mask_columns_without_labels(tmp_path, tokenizer):
    from jaxrl.data.sft import rows_as_given

    rows = datasets.Dataset.from_list([{"input_ids": [5, 6], "completion_mask": [0, 1]}])
    with pytest.raises(ValueError, match="mask columns but no 'labels'"):
        rows_as_given(rows)
    with pytest.raises(ValueError, match="needs an 'input_ids' column"):
        rows_as_given(datasets.Dataset.from_list([{"text": "1+1"}]))

"""Image-text DPO (TRL's vision-preference datasets: `images` + `prompt` / `chosen` / `rejected`,
conversational or standard) of a tiny Gemma 3 equals TRL 1.16's DPOTrainer step for step, the
reference model included; the collated pairs hold TRL's `DataCollatorForVisionPreference`
batch; LoRA's reference (the base without the adapter) reads the images; accumulation, a 2-device
mesh, length buckets and a resume leave the numbers as they are; the options TRL refuses (or jaxrl
does not run) on images are errors; the CLI trains on a dataset directory with images.

The tiny model and processor are `test_sft_vision`'s (28 x 28 images, 4 tokens each)."""

import functools

import datasets
import numpy as np
import pytest
from test_length_buckets import record_step_lengths
from test_sft_vision import _image, vlm_dir  # noqa: F401  (the module-scoped model fixture)
from trainer_utils import base_args, train_logs, trl_train_logs

from jaxrl import DPOConfig, DPOTrainer

METRICS = (
    "loss",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "logits/chosen",
    "logits/rejected",
    "entropy",
    "mean_token_accuracy",
    "num_tokens",
)
COMMON = dict(per_device_train_batch_size=4, max_steps=2, learning_rate=1e-3, beta=0.1)
# jaxrl's batch of 4 as 2 accumulated micro-batches on 2 devices.
SPLIT = dict(COMMON, per_device_train_batch_size=1, gradient_accumulation_steps=2, mesh_data=2)


def _pairs(n: int = 4, seed: int = 0, conversational: bool = True, counts=(1, 2)):
    """Pairs with `counts[i % len(counts)]` images and completions of different lengths; a
    standard prompt carries the processor's image marker once per image."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        k = counts[i % len(counts)]
        good = "".join(str(d) for d in rng.integers(0, 10, size=2 + i % 3))
        bad = "".join(str(d) for d in rng.integers(0, 10, size=1 + i % 4))
        if conversational:
            row = {
                "prompt": [{"role": "user", "content": f"{i}+{i}="}],
                "chosen": [{"role": "assistant", "content": good}],
                "rejected": [{"role": "assistant", "content": bad}],
            }
        else:
            row = {"prompt": "<start_of_image>" * k + f"{i}+{i}=", "chosen": good, "rejected": bad}
        rows.append({"images": [_image(rng) for _ in range(k)], **row})
    return datasets.Dataset.from_list(rows)


def _processor(path):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(path)


def _dpo(path, out, data, eval_data=None, ref_model=None, **args):
    return DPOTrainer(
        path,
        ref_model=ref_model,
        args=DPOConfig(**base_args(out, **args)),
        train_dataset=data,
        eval_dataset=eval_data,
        processing_class=_processor(path),
    )


def _assert_trl_logs(ours, theirs):
    assert len(ours) == len(theirs) == COMMON["max_steps"]
    for step, (o, t) in enumerate(zip(ours, theirs, strict=True)):
        for key in METRICS:
            if step == 0 and key == "rewards/accuracies":
                continue  # rewards are 0 up to float noise at step 1: the sign is arbitrary
            np.testing.assert_allclose(
                o[key], t[key], rtol=2e-5, atol=1e-6, err_msg=f"{key} at step {step + 1}"
            )
        np.testing.assert_allclose(o["grad_norm"], t["grad_norm"], rtol=1e-4)


@pytest.fixture(scope="module")
def conversational_runs(vlm_dir, tmp_path_factory):  # noqa: F811
    """TRL's and jaxrl's 2 full-batch steps on 4 conversational pairs (1 and 2 images); jaxrl's
    batch of 4 is 2 accumulated micro-batches on 2 devices. jaxrl's reference is an explicit
    `ref_model` (the same checkpoint, loaded again with its vision tower), TRL's its implicit
    copy of the model: one jaxrl run serves both the TRL parity test and the explicit
    reference's check in `test_reference_model_variants` (the implicit frozen-copy reference on
    images is compared with TRL's in `test_standard_pairs_with_zero_one_and_two_images_match_trl`)."""
    import trl

    out = tmp_path_factory.mktemp("dpo_vision")
    data = _pairs()
    trl_trainer, theirs = trl_train_logs(
        trl.DPOTrainer, trl.DPOConfig, vlm_dir, _processor(vlm_dir), data, out / "trl", **COMMON
    )
    ours = _dpo(vlm_dir, out / "ours", data, ref_model=vlm_dir, **SPLIT)
    ours.train()
    return data, (ours, train_logs(ours)), (trl_trainer, theirs)


def test_conversational_matches_trl(conversational_runs):
    """Loss, every metric and the grad norm at both steps (jaxrl accumulating over 2 devices
    with an explicit `ref_model`, TRL one batch on one with its implicit reference); step 2's
    rewards hold the reference log-probs (with the same images), its log-probs the trained
    policy's. The trained models evaluate alike."""
    data, (ours, logs), (trl_trainer, theirs) = conversational_runs
    _assert_trl_logs(logs, theirs)
    assert abs(logs[1]["rewards/margins"]) > 1e-3  # the reference differs from the policy
    want, got = trl_trainer.evaluate(eval_dataset=data), ours.evaluate(eval_dataset=data)
    for key in ("eval_loss", "eval_rewards/margins", "eval_logps/chosen", "eval_logits/rejected"):
        np.testing.assert_allclose(got[key], want[key], rtol=2e-5, err_msg=key)
    # predict(): the `prompt + chosen` then `prompt + rejected` rows' logits, TRL's model's.
    batch, logits = _torch_forward(trl_trainer.model, trl_trainer.processing_class, data)
    mask = batch["attention_mask"].numpy()[..., None]
    preds = np.asarray(ours.predict(data).predictions)[:, : mask.shape[1]]
    np.testing.assert_allclose(preds * mask, logits.numpy() * mask, atol=2e-5)


def _reference_logps(logs: list[dict], side: str, step: int = 1) -> float:
    """Step `step + 1`'s (default 2) mean reference log-prob of `side`, from its policy
    log-probs and rewards."""
    return logs[step][f"logps/{side}"] - logs[step][f"rewards/{side}"] / COMMON["beta"]


def test_explicit_reference_model_is_the_initial_model(conversational_runs):
    """An explicit `ref_model` (the same checkpoint, loaded with its vision tower: the run of
    `conversational_runs`, SPLIT on `_pairs()`) is the initial model on the images: step 2 (the
    same 4 pairs) reads step 1's policy log-probs as its reference's. (The int8 reference's
    check is in `test_buckets_and_resume`, on that run.)"""
    _, (_, logs), _ = conversational_runs
    for side in ("chosen", "rejected"):
        np.testing.assert_allclose(_reference_logps(logs, side), logs[0][f"logps/{side}"], 1e-6)


def test_standard_pairs_with_zero_one_and_two_images_match_trl(vlm_dir, tmp_path):  # noqa: F811
    """Rows cut to max_length (through a completion, never an image), two weighted loss types
    (one of them the chosen rows' NLL) and LD-DPO's down-weighted tails."""
    import trl

    data = _pairs(conversational=False, counts=(0, 1, 2, 1))
    args = dict(
        COMMON, max_length=20, loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5], ld_alpha=0.5
    )
    _, theirs = trl_train_logs(
        trl.DPOTrainer, trl.DPOConfig, vlm_dir, _processor(vlm_dir), data, tmp_path / "trl", **args
    )
    ours = _dpo(vlm_dir, tmp_path / "ours", data, **args)
    assert ours.seq_len == 20  # the 2-image pair's 19-token prompt keeps 1 completion token
    ours.train()
    _assert_trl_logs(train_logs(ours), theirs)


def test_collator_holds_trls_batch(vlm_dir, tmp_path):  # noqa: F811
    """Each pair's two rows are TRL's chosen and rejected rows (ids, attention, completion mask,
    token types), its images TRL's pixel values (which repeats them for the rejected rows)."""
    from trl.trainer.dpo_trainer import DataCollatorForVisionPreference

    processor = _processor(vlm_dir)
    data = _pairs(conversational=False, counts=(2, 0, 1))
    examples = [dict(ex) for ex in data.select(range(3))]
    theirs = DataCollatorForVisionPreference(processor, max_length=19)([dict(e) for e in examples])
    trainer = _dpo(vlm_dir, tmp_path, data, max_length=19)
    ours = trainer._collate(examples, 24)
    t = theirs["input_ids"].shape[1]
    for key, want in (
        ("input_ids", theirs["input_ids"]),
        ("attention_mask", theirs["attention_mask"]),
        ("token_type_ids", theirs["token_type_ids"]),
    ):
        got = np.concatenate([ours[key][:, 0], ours[key][:, 1]])
        mask = theirs["attention_mask"].numpy()  # TRL pads with EOS where the pad id is 0
        np.testing.assert_array_equal(got[:, :t] * mask, want.numpy() * mask, key)
    loss_mask = np.concatenate([ours["loss_mask"][:, 0], ours["loss_mask"][:, 1]])
    np.testing.assert_array_equal(loss_mask[:, : t - 1], theirs["completion_mask"][:, 1:])
    assert theirs["token_type_ids"].sum() == 2 * 3 * 4  # three images, 4 tokens, in both rows
    pixels = np.concatenate([ours["pixel_values"][b, :k] for b, k in enumerate((2, 0, 1))])
    np.testing.assert_allclose(np.concatenate([pixels, pixels]), theirs["pixel_values"], atol=1e-6)
    lengths = trainer._example_lengths(trainer.train_dataset)
    widths = np.maximum(*ours["attention_mask"].sum(-1).T)
    assert lengths[:3] == widths.tolist()


def _torch_forward(model, processor, data):
    """TRL's collated batch of `data` and a transformers image-text model's logits on it."""
    import torch
    from trl.trainer.dpo_trainer import DataCollatorForVisionPreference

    batch = DataCollatorForVisionPreference(processor)([dict(ex) for ex in data])
    inputs = {k: v for k, v in batch.items() if k != "completion_mask"}
    with torch.no_grad():
        return batch, model.eval()(**inputs).logits.float()


@functools.cache
def _torch_model(path):
    """The checkpoint's transformers model, loaded once per process (only run forward, in eval
    mode, by `_torch_forward`)."""
    import transformers

    return transformers.AutoModelForImageTextToText.from_pretrained(path)


def _torch_logps(vlm_dir, data):  # noqa: F811
    """Mean (chosen, rejected) completion log-probs of `data` under the checkpoint's
    transformers model on TRL's collated batch."""
    import torch

    batch, logits = _torch_forward(_torch_model(vlm_dir), _processor(vlm_dir), data)
    logps = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["input_ids"][:, 1:, None])
    per_row = (logps[..., 0] * batch["completion_mask"][:, 1:]).sum(-1).numpy()
    chosen, rejected = np.split(per_row, 2)
    return chosen.mean(), rejected.mean()


def test_lora_reference_is_the_base_model_on_the_images(vlm_dir, tmp_path):  # noqa: F811
    """LoRA on the language model and the SigLIP layers: the reference (adapter disabled) is the
    base model reading the same images, step after step, and the policy moves away from it. An
    eval set whose rows have no images (an empty `images` list) evaluates on the text alone."""
    import peft
    from flax import nnx

    from jaxrl import lora

    data = _pairs()
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj", "fc1"])
    trainer = DPOTrainer(
        vlm_dir,
        args=DPOConfig(**base_args(tmp_path, **{**COMMON, "learning_rate": 1e-2})),
        train_dataset=data,
        processing_class=_processor(vlm_dir),
        peft_config=config,
    )
    text_only = data.remove_columns("images").add_column("images", [[]] * len(data))
    before = trainer.evaluate(eval_dataset=text_only)
    trainer.train()
    logs = train_logs(trainer)
    base = _torch_logps(vlm_dir, data)
    for side, want in zip(("chosen", "rejected"), _torch_logps(vlm_dir, text_only), strict=True):
        np.testing.assert_allclose(before[f"eval_logps/{side}"], want, rtol=1e-5, err_msg=side)
        assert abs(want - base[side == "rejected"]) > 1e-2  # the images matter
    for side, want in zip(("chosen", "rejected"), base, strict=True):
        # The adapter starts at zero: step 1's policy is the base.
        np.testing.assert_allclose(logs[0][f"logps/{side}"], want, rtol=1e-5)
        np.testing.assert_allclose(_reference_logps(logs, side), want, rtol=1e-5, err_msg=side)
        assert abs(logs[1][f"logps/{side}"] - want) > 1e-3
    vision_tower = trainer.model.vision_tower
    assert any(isinstance(m, lora.LoraDense) for _, m in nnx.iter_graph(vision_tower))


def test_buckets_and_resume(vlm_dir, tmp_path):  # noqa: F811
    """8 pairs in order, 2 steps of 4 (2 devices x 2 accumulated micro-batches of 1), the first
    step short enough for a smaller length bucket, whose log-probs are transformers' on the
    images; killed after step 1 and resumed, step 2 is the uninterrupted run's bit for bit.

    The reference is int8 (vision tower included): at both steps its log-probs are, nearly,
    transformers' initial model's on that step's images (step 2: after an update, on other
    pairs). This run used to be a test of its own (an int8 reference on `_pairs()`, reading step
    1's policy log-probs at step 2); one run checks both (in f32 the reference is the same
    frozen copy of the initial weights, quantized or not, resumed alike)."""
    short = _pairs(4, seed=1, counts=(1,))
    long = _pairs(4, seed=2, counts=(3,))
    data = datasets.concatenate_datasets([short, long])
    split = dict(
        SPLIT, train_sampling_strategy="sequential", length_buckets=[32], save_strategy="steps",
        save_steps=1, ref_model_quantization="int8",
    )  # fmt: skip
    full = _dpo(vlm_dir, tmp_path / "full", data, **split)
    lengths = record_step_lengths(full)
    full.train()
    assert full.seq_len > 32 and lengths == [32, full.seq_len]
    logs = train_logs(full)
    # transformers' initial model on each step's pairs.
    initial = [_torch_logps(vlm_dir, short), _torch_logps(vlm_dir, long)]
    for i, side in enumerate(("chosen", "rejected")):
        want = initial[0][i]
        np.testing.assert_allclose(logs[0][f"logps/{side}"], want, rtol=1e-5, err_msg=side)
        # The int8 reference: the initial model (nearly) at step 1 and, after an update, at
        # step 2; quantized, it is not step 1's full-precision (initial) policy bit for bit.
        for step in (0, 1):
            got = _reference_logps(logs, side, step)
            np.testing.assert_allclose(got, initial[step][i], rtol=1e-3, err_msg=f"{side} {step}")
        assert _reference_logps(logs, side, 0) != logs[0][f"logps/{side}"]
    # A run killed after step 1 leaves what this one saved then: its step-1 checkpoint.
    checkpoint = tmp_path / "full" / "checkpoints" / "checkpoint-1"
    resumed = _dpo(
        vlm_dir, tmp_path / "full", data, resume_from_checkpoint=str(checkpoint), **split
    )
    resumed.train()
    (got,) = [h for h in train_logs(resumed) if h["step"] == 2]
    keys = ("loss", "grad_norm", *METRICS)
    assert {k: got[k] for k in keys} == {k: logs[1][k] for k in keys}


def test_cli_trains_on_a_dataset_with_images(vlm_dir, tmp_path):  # noqa: F811
    import json

    from jaxrl.train import main

    _pairs().save_to_disk(str(tmp_path / "data"))
    argv = [
        "--algo",
        "dpo",
        "--model_name_or_path",
        vlm_dir,
        "--dataset_name",
        str(tmp_path / "data"),
    ]
    argv += ["--output_dir", str(tmp_path / "run"), "--max_steps", "1", "--report_to", "none"]
    argv += ["--per_device_train_batch_size", "4", "--save_strategy", "no"]
    assert main(argv) == 0
    rows = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    (row,) = [r for r in rows if "rewards/chosen" in r]
    assert np.isfinite(row["loss"]) and row["logps/chosen"] < 0
    assert (tmp_path / "run" / "final" / "processor_config.json").exists()


@pytest.mark.parametrize(
    "args, match",
    [
        ({"truncation_mode": "keep_end", "max_prompt_length": 8}, "keep_end"),
        ({"precompute_ref_log_probs": True}, "precompute_ref_log_probs=True is not supported"),
        ({"pad_to_multiple_of": 8}, "pad_to_multiple_of=8 is not supported"),
        ({"prefix_sharing": True}, "prefix_sharing=True is not supported"),
        ({"max_prompt_length": 8}, "max_prompt_length=8 is not supported"),
        ({"generate_during_eval": True}, "generate_during_eval=True is not supported"),
    ],
)
def test_options_refused_with_images(vlm_dir, tmp_path, args, match):  # noqa: F811
    with pytest.raises(ValueError, match=match):
        _dpo(vlm_dir, tmp_path, _pairs(2), **args)


def test_bad_inputs_are_clear_errors(vlm_dir, tmp_path, hf_model_dir, tokenizer):  # noqa: F811
    data = _pairs(2)
    with pytest.raises(ValueError, match="too short and causes image placeholder tokens"):
        _dpo(vlm_dir, tmp_path, data, max_length=5).train()
    with pytest.raises(ValueError, match="a 'tools' column is not supported"):
        _dpo(vlm_dir, tmp_path, data.add_column("tools", [[{"name": "f"}]] * 2))
    with pytest.raises(ValueError, match="needs {prompt, chosen, rejected}"):
        _dpo(vlm_dir, tmp_path, data.remove_columns("prompt"))
    with pytest.raises(ValueError, match="the model is not an image-text model"):
        _dpo(hf_model_dir, tmp_path, data)
    with pytest.raises(ValueError, match="needs the model's processor"):
        DPOTrainer(
            vlm_dir, args=DPOConfig(**base_args(tmp_path)), train_dataset=data,
            processing_class=_processor(vlm_dir).tokenizer,
        )  # fmt: skip
    text = datasets.Dataset.from_list([{"prompt": "1+1=", "chosen": "2", "rejected": "3"}] * 2)
    with pytest.raises(ValueError, match="an empty 'images' list per row"):
        _dpo(vlm_dir, tmp_path, data, eval_data=text)
    with pytest.raises(ValueError, match="eval dataset has images but the train dataset has none"):
        DPOTrainer(
            hf_model_dir, args=DPOConfig(**base_args(tmp_path)), train_dataset=text,
            eval_dataset=data, processing_class=tokenizer,
        )  # fmt: skip

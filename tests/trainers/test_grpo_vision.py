"""GRPO and RLOO on image-text prompts (TRL's prompt datasets with `images` / `image` next to a
conversational `prompt`) of a tiny Gemma 3 follow TRL 1.16's GRPOTrainer / RLOOTrainer.

- GRPO (`test_grpo_matches_trl`): one generation batch of 4 prompts with 1, 2, 1 and 2 images x
  2 completions serves two optimizer steps of two micro-batches each (the second step
  off-policy). TRL's own `_generate_and_score_completions` runs on the same rows with jaxrl's
  completions (its generation replaced): its prompt ids (the processor's chat template), pixel
  values and `token_type_ids`, the sampling policy's log-probs (TRL's image-text forward; jaxrl's
  are the sampler's, from its image prefill), the reference's, the rewards (the reward function
  gets the multimodal prompts and the `images` column) and the advantages equal jaxrl's; then
  TRL trains on its own batches in jaxrl's micro-batch order and its loss and grad norm equal
  jaxrl's at both steps, its entropy, KL and clip ratios too (TRL's per-micro-batch token means
  weighted into the step's token mean, which jaxrl logs).
- Sampling (`test_greedy_sampling_matches_transformers`): greedy decoding from image prompts
  equals transformers' `generate` (bidirectional image attention in the prefill, the image token
  suppressed) token for token, and the images change the completions.
- RLOO (`test_rloo_matches_trl`): `image` column (one image or None), KL in the reward, on a
  2-device mesh; TRL's `_compute_loss` replaying jaxrl's micro-batches (pixel values, token
  types, sampling log-probs) gives jaxrl's loss, entropy and grad norm at both steps (the
  second off-policy); the completion logs serialise without the images; `evaluate()` runs on
  the image prompts.
- LoRA (`test_lora_on_images`): the reference (adapter off) reads the images; the vision
  tower's adapters train.
- Refusals (`test_refusals`): what TRL refuses and what jaxrl cannot run, with clear errors.

The tiny model and processor are `test_sft_vision`'s (28 x 28 images, 4 tokens each). TRL is
given the processor with left padding, as TRL loads it itself (`padding_side="left"`): its
`token_type_ids` come from a padded processor call and must line up with the left-padded
prompts."""

from __future__ import annotations

import functools

import datasets
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_sft_vision import _image, vlm_dir  # noqa: F401  (the module-scoped model fixture)
from trainer_utils import assert_logs_match, base_args, train_logs, trl_train_logs

from jaxrl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer
from jaxrl.config import ConfigError
from jaxrl.core.sampling import choose_tokens
from jaxrl.generation import GenerationConfig, Sampler

G = 2  # completions per prompt
GRPO = dict(
    per_device_train_batch_size=2,
    gradient_accumulation_steps=2,
    steps_per_generation=4,  # one generation batch of 8 (4 prompts x 2) for both steps
    num_generations=G,
    max_completion_length=4,
    max_steps=2,
    learning_rate=1e-2,
    beta=0.04,  # a reference forward on the images too
)
RLOO = dict(
    per_device_train_batch_size=2,  # jaxrl: 1 per device on a 2-device mesh
    steps_per_generation=2,  # one generation batch of 4 (2 prompts x 2) for both steps
    num_generations=G,
    max_completion_length=4,
    max_steps=2,
    learning_rate=1e-2,
)


# Metrics TRL logs per micro-batch as token means (`global_masked_mean`).
TOKEN_MEANS = ("entropy", "kl", "clip_ratio/region_mean", "clip_ratio/high_mean")


def _rows(counts, seed=0, column="images", conversational=True) -> datasets.Dataset:
    """Prompts `i+i=` with `counts[i]` images (`image` column: one image or None)."""
    rng = np.random.default_rng(seed)
    rows = []
    for i, k in enumerate(counts):
        prompt = [{"role": "user", "content": f"{i}+{i}="}] if conversational else f"{i}+{i}="
        images = [_image(rng) for _ in range(k)]
        if column == "images":
            rows.append({"prompt": prompt, "images": images})
        else:
            rows.append({"prompt": prompt, "image": images[0] if images else None})
    return datasets.Dataset.from_list(rows)


class ImageReward:
    """A reward that reads what TRL passes: the multimodal prompts (their image parts carry the
    images) and the image column; it records every call."""

    __name__ = "image_reward"

    def __init__(self, column="images"):
        self.column = column
        self.calls: list[dict] = []

    def __call__(self, prompts, completions, completion_ids, **kwargs):
        self.calls.append(dict(prompts=prompts, completions=completions, kwargs=kwargs))
        images = kwargs[self.column]
        out = []
        for prompt, completion, imgs in zip(prompts, completions, images, strict=True):
            content = prompt[0]["content"]
            parts = (
                [p for p in content if p["type"] == "image"] if isinstance(content, list) else []
            )
            n = len(imgs or []) if self.column == "images" else int(imgs is not None)
            assert len(parts) == n and all(p["image"] is not None for p in parts)
            text = completion[0]["content"]
            out.append(float(len(text)) + 0.5 * n + 0.1 * sum(c.isdigit() for c in text))
        self.calls[-1]["rewards"] = out
        return out


def _processor(path, left=False):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(path)
    if left:
        processor.tokenizer.padding_side = "left"
    return processor


def _jaxrl_run(trainer_cls, config_cls, path, out, data, reward, **settings):
    """A jaxrl run that records its `_sample` calls (examples and outputs, unshuffled)."""
    trainer = trainer_cls(
        path,
        reward_funcs=reward,
        args=config_cls(**base_args(out, **settings)),
        train_dataset=data,
        processing_class=_processor(path),
    )
    calls = []
    sample = trainer._sample

    def record(params, examples, *a, **k):
        s = sample(params, examples, *a, **k)
        calls.append((examples, s))
        return s

    trainer._sample = record
    trainer.train()
    return trainer, calls


def _unshuffled_rows(s) -> np.ndarray:
    out = s["out"]
    return np.concatenate([np.asarray(out.prompt_ids_BP), np.asarray(out.completion_ids_BN)], 1)


def _order(trainer, s) -> list[int]:
    """Row r of jaxrl's shuffled buffer is row `order[r]` of the `_sample` call (rows with the
    same ids are the same prompt and completion, so any match serves)."""
    rows = _unshuffled_rows(s)
    left = list(range(len(rows)))
    order = []
    for row in np.asarray(trainer.rollout["input_ids"]):
        i = next(i for i in left if np.array_equal(rows[i], row))
        left.remove(i)
        order.append(i)
    return order


def _completion_lists(s) -> list[list[int]]:
    ids = np.asarray(s["out"].completion_ids_BN)
    return [row[:n].tolist() for row, n in zip(ids, s["lengths_N"], strict=True)]


def _pixels_by_row(pixel_values, num_images) -> list:
    import torch

    return list(torch.split(pixel_values, num_images, dim=0))


def _select(out: dict, idx: list[int]) -> dict:
    """Rows `idx` of TRL's `_generate_and_score_completions` output, as TRL's split does (the
    images travel with their rows)."""
    import torch

    batch = {}
    for key, value in out.items():
        if key == "pixel_values":
            per_row = _pixels_by_row(value, out["num_images"])
            batch[key] = torch.cat([per_row[i] for i in idx])
        elif key == "num_images":
            batch[key] = [value[i] for i in idx]
        elif isinstance(value, torch.Tensor) and value.ndim > 0:
            batch[key] = value[idx]
        else:
            batch[key] = value
    return batch


@pytest.fixture(scope="module")
def grpo_runs(vlm_dir, tmp_path_factory):  # noqa: F811
    """jaxrl's GRPO run and TRL's: TRL's `_generate_and_score_completions` on jaxrl's prompt
    rows and completions, then two TRL steps on its own batches in jaxrl's micro-batch order."""
    import trl

    out = tmp_path_factory.mktemp("grpo_vision")
    data = _rows((1, 2, 1, 2))
    ours, calls = _jaxrl_run(
        GRPOTrainer, GRPOConfig, vlm_dir, out / "ours", data, ImageReward(), **GRPO
    )
    assert len(calls) == 1  # one generation served both steps
    examples, s = calls[0]
    order = _order(ours, s)
    rows = [{k: v for k, v in ex.items() if k != "prompt_ids"} for ex in examples for _ in range(G)]
    trl_reward = ImageReward()
    seen = {}

    class Replay(trl.GRPOTrainer):
        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, n, **kw):
            seen.update(prompt_ids=prompt_ids, images=images, fields=multimodal_fields)
            return _completion_lists(s), None

        def _prepare_inputs(self, generation_batch):
            assert self.model.training
            if self._step == 0:
                seen["out"] = self._generate_and_score_completions(rows)
                b = GRPO["per_device_train_batch_size"]
                seen["micro"] = [_select(seen["out"], order[m * b : (m + 1) * b]) for m in range(4)]
            return seen["micro"][self._step % 4]

        def _compute_loss(self, model, inputs):
            # TRL logs each micro-batch's token mean of these; jaxrl the step's token mean (as
            # `grpo_metrics` documents): record the means with their token counts.
            loss = super()._compute_loss(model, inputs)
            means = {k: self._metrics["train"][k][-1] for k in TOKEN_MEANS}
            means["tokens"] = float(inputs["completion_mask"].sum())
            seen.setdefault("micro_metrics", []).append(means)
            return loss

    theirs, logs = trl_train_logs(
        Replay, trl.GRPOConfig, vlm_dir, _processor(vlm_dir, left=True), data, out / "trl",
        trainer_kwargs={"reward_funcs": trl_reward}, save_strategy="no", **GRPO,
    )  # fmt: skip
    return ours, examples, s, order, seen, logs, trl_reward


def test_grpo_matches_trl(grpo_runs):
    """TRL's scoring of jaxrl's rollouts equals jaxrl's (prompt ids, pixel values, token types,
    sampling and reference log-probs, rewards, advantages), and TRL's two steps on them equal
    jaxrl's (loss, entropy, KL, clip ratios, grad norm; rtol 2e-4, atol 2e-5)."""
    ours, examples, s, order, seen, logs, trl_reward = grpo_runs
    trl_out = seen["out"]
    image_token = ours.model.config.vision.image_token_id
    # Prompt ids: TRL's processor chat template of the multimodal prompts (4 image tokens per
    # image) = jaxrl's prepared ids (left padding stripped).
    prompt_ids = np.asarray(s["out"].prompt_ids_BP)
    prompt_mask = np.asarray(s["out"].prompt_mask_BP).astype(bool)
    ours_prompts = [row[m].tolist() for row, m in zip(prompt_ids, prompt_mask, strict=True)]
    assert [list(p) for p in seen["prompt_ids"]] == ours_prompts
    counts = [int(np.sum(np.asarray(p) == image_token)) // 4 for p in ours_prompts]
    assert counts == [len(ex["images"]) for ex in examples for _ in range(G)]
    assert sorted(counts) == [1, 1, 1, 1, 2, 2, 2, 2]
    assert trl_out["num_images"] == counts
    # Pixel values: TRL's processor call per row = jaxrl's (zeros past a row's count).
    ours_pixels = np.asarray(ours._rollout_rows(s)["pixel_values"])
    assert ours_pixels.shape == (8, 2, 3, 28, 28)
    for row, theirs in enumerate(_pixels_by_row(trl_out["pixel_values"], counts)):
        np.testing.assert_array_equal(ours_pixels[row, : counts[row]], theirs.numpy())
        assert not ours_pixels[row, counts[row] :].any()
    # TRL's token types (the processor's, left-padded, zeros on the completion) are 1 exactly
    # on the prompt's image tokens: what jaxrl's forward derives from the ids.
    trl_ids = trl_out["prompt_ids"].numpy()
    types = trl_out["token_type_ids"].numpy()
    P = trl_ids.shape[1]
    np.testing.assert_array_equal(types[:, :P], (trl_ids == image_token).astype(types.dtype))
    assert not types[:, P:].any() and types.sum() == 4 * sum(counts)
    # The sampling policy's log-probs: TRL's image-text forward = jaxrl's sampler (its image
    # prefill and text decode); the reference's = jaxrl's reference forward.
    mask = trl_out["completion_mask"].numpy().astype(bool)
    np.testing.assert_array_equal(mask, np.asarray(s["out"].completion_mask_BN).astype(bool))
    sampler_logps = np.asarray(s["out"].logprobs_BN)
    np.testing.assert_allclose(
        sampler_logps[mask], trl_out["old_per_token_logps"].numpy()[mask], rtol=1e-4, atol=2e-5
    )
    unshuffle = np.argsort(order)
    ref = np.asarray(ours.rollout["ref_logps"])[unshuffle]
    np.testing.assert_allclose(
        ref[mask], trl_out["ref_per_token_logps"].numpy()[mask], rtol=1e-4, atol=2e-5
    )
    # Rewards (the reward function got the images) and advantages.
    (ours_call,) = ours.reward_funcs[0].calls
    (trl_call,) = trl_reward.calls
    assert len(trl_call["kwargs"]["images"]) == len(ours_call["kwargs"]["images"]) == 8
    assert ours_call["completions"] == trl_call["completions"]
    np.testing.assert_allclose(ours_call["rewards"], trl_call["rewards"])
    np.testing.assert_allclose(np.asarray(s["rewards_NK"])[:, 0], trl_call["rewards"])
    advantages = np.asarray(ours.rollout["advantages"])[unshuffle]
    np.testing.assert_allclose(advantages, trl_out["advantages"].numpy(), rtol=1e-5, atol=1e-6)
    assert np.abs(advantages).max() > 0.1  # the rewards differ within groups
    # Both steps: TRL's loss on its own batches in jaxrl's micro-batch order.
    ours_logs = train_logs(ours)
    assert_logs_match(ours_logs, logs, ("loss",), steps=2)
    micro = seen["micro_metrics"]
    assert len(micro) == 4
    for step in range(2):
        pair = micro[2 * step : 2 * step + 2]
        tokens = sum(m["tokens"] for m in pair)
        for key in TOKEN_MEANS:
            want = sum(m[key] * m["tokens"] for m in pair) / tokens
            np.testing.assert_allclose(
                ours_logs[step][key], want, rtol=2e-4, atol=2e-5, err_msg=f"{key} at {step + 1}"
            )
    assert ours_logs[1]["kl"] > 1e-4  # the policy moved away from the reference
    assert ours_logs[1]["clip_ratio/region_mean"] > 0  # and clipping acts
    first = ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length")
    for key in (*first, "rewards/image_reward/mean", "num_tokens"):
        np.testing.assert_allclose(ours_logs[0][key], logs[0][key], rtol=1e-5, err_msg=key)


def test_greedy_sampling_matches_transformers(vlm_dir):  # noqa: F811
    """Greedy completions of image prompts (1, 2 and 0 images, left-padded together) equal
    transformers' `generate` with the processor's `token_type_ids` (bidirectional attention
    within each image in the prefill) and `suppress_tokens=[image_token_id]`, token for token;
    the same prompts with other images give other completions. A suppressed id is never
    chosen even where it has the largest logit (its log-prob is left as it is)."""
    import torch
    from transformers import Gemma3ForConditionalGeneration

    from jaxrl import models
    from jaxrl.data.vision_prompts import PromptImages

    processor = _processor(vlm_dir)
    data = _rows((1, 2, 0), seed=3)
    examples = [data[i] for i in range(len(data))]
    prompts = PromptImages(processor, image_shape=(3, 28, 28))
    ids = [prompts.prompt_ids(ex["prompt"], len(ex["images"])) for ex in examples]
    pixels = prompts.pixel_values(examples, ids, max_images=2)
    tok = processor.tokenizer
    image_token = tok.image_token_id
    n_new = 6
    config = GenerationConfig(
        max_new_tokens=n_new, do_sample=False, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, suppress_token_ids=(image_token,),
    )  # fmt: skip
    model = models.from_pretrained(vlm_dir, vision=True)
    sampler = Sampler(model)
    out = sampler(None, ids, config, pixel_values=pixels)
    ours = np.asarray(out.completion_ids_BN)

    hf = Gemma3ForConditionalGeneration.from_pretrained(vlm_dir, dtype=torch.float32).eval()
    width = max(map(len, ids))
    input_ids = torch.tensor([[tok.pad_token_id] * (width - len(r)) + r for r in ids])
    attention = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in ids])
    counts = [len(ex["images"]) for ex in examples]
    flat = np.concatenate([pixels[b, :k] for b, k in enumerate(counts)])
    with torch.no_grad():
        want = hf.generate(
            input_ids=input_ids, attention_mask=attention, pixel_values=torch.tensor(flat),
            token_type_ids=(input_ids == image_token).long(), max_new_tokens=n_new,
            do_sample=False, suppress_tokens=[image_token], eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )[:, width:].numpy()  # fmt: skip
    for row in range(len(ids)):
        n = int(np.asarray(out.completion_mask_BN)[row].sum())
        assert ours[row, :n].tolist() == want[row, :n].tolist(), row
        assert n == n_new or want.shape[1] == n or want[row, n] == tok.pad_token_id
    other = sampler(None, ids, config, pixel_values=pixels[::-1, ::-1].copy() * 0.5)
    assert not np.array_equal(np.asarray(other.completion_ids_BN)[:2], ours[:2])

    logits = np.zeros((2, len(tok)), np.float32)
    logits[:, image_token], logits[:, 3] = 5.0, 1.0
    for sample in (False, True):
        cfg = GenerationConfig(do_sample=sample, top_k=0, suppress_token_ids=(image_token,))
        tokens, logps, want_logp = _choose_tokens(logits, cfg)
        assert np.asarray(tokens).tolist() != [image_token] * 2
        if not sample:
            assert np.asarray(tokens).tolist() == [3, 3]
            np.testing.assert_allclose(np.asarray(logps), float(want_logp), rtol=1e-6)


@functools.partial(jax.jit, static_argnums=1)
def _choose_tokens(logits, cfg):
    """`choose_tokens` at step 0 (key 0) and the log-prob of token 3 in row 0, as one compiled
    program per config (run eagerly, each of their operations compiled a program: ~55)."""
    tokens, logps = choose_tokens(logits, jax.random.key(0), jnp.int32(0), cfg)
    return tokens, logps, jax.nn.log_softmax(logits[0])[3]


def _trl_rloo_inputs(rows: dict, image_token: int) -> dict:
    """jaxrl rollout rows (numpy) as TRL's RLOO `_compute_loss` inputs, images included."""
    import torch

    mask = rows["completion_mask"]
    C = mask.shape[1]
    ids = rows["input_ids"]
    P = ids.shape[1] - C
    counts = [int(np.sum(r[:P] == image_token)) // 4 for r in ids]
    old = np.where(mask > 0, rows["old_logps"], 0.0)
    types = np.zeros_like(ids)
    types[:, :P] = ids[:, :P] == image_token
    return {
        "prompt_ids": torch.tensor(ids[:, :P]),
        "prompt_mask": torch.tensor(rows["attention_mask"][:, :P]),
        "completion_ids": torch.tensor(ids[:, P:]),
        "completion_mask": torch.tensor(mask),
        "advantages": torch.tensor(rows["advantages"], dtype=torch.float32),
        "old_logps": torch.tensor((old * mask).sum(1), dtype=torch.float32),
        "pixel_values": torch.tensor(
            np.concatenate([rows["pixel_values"][b, :k] for b, k in enumerate(counts)])
        ),
        "num_images": counts,
        "token_type_ids": torch.tensor(types),
    }


def test_rloo_matches_trl(vlm_dir, tmp_path):  # noqa: F811
    """RLOO on an `image` column (one image, or None) on a 2-device mesh (prompts, pixel values
    and rollouts split over it): the step's metric keys, and TRL's `_compute_loss` on one
    process replaying jaxrl's two micro-batches (one generation batch; the second step
    off-policy) gives jaxrl's loss, entropy and grad norm (rtol 2e-4, atol 2e-5). `evaluate()`
    samples, scores and runs the loss on the image prompts: its rewards are the reward
    function's for the sampled and the greedy completions. The completion logs hold the prompts
    without their images."""
    import trl

    data = _rows((1, 0), seed=5, column="image")
    reward = ImageReward(column="image")
    ours, calls = _jaxrl_run(
        RLOOTrainer, RLOOConfig, vlm_dir, tmp_path / "ours", data, reward,
        **{**RLOO, "per_device_train_batch_size": 1, "mesh_data": 2, "log_completions": True},
    )  # fmt: skip
    assert len(calls) == 1
    logs = train_logs(ours)
    expected = {
        "loss", "entropy", "kl", "reward", "reward_std", "frac_reward_zero_std",
        "rewards/image_reward/mean", "rewards/image_reward/std", "clip_ratio/region_mean",
        "completions/mean_length", "num_tokens", "grad_norm",
    }  # fmt: skip
    assert expected <= set(logs[0])
    # The rows with an image got it in their prompt, the rows without got a text-only prompt
    # (`ImageReward` checks each prompt's image parts against the `image` column).
    (call,) = reward.calls
    assert {image is None for image in call["kwargs"]["image"]} == {True, False}
    buf = {k: np.asarray(v) for k, v in ours.rollout.items()}
    assert buf["pixel_values"].shape == (4, 1, 3, 28, 28)
    image_token = ours.model.config.vision.image_token_id
    b = RLOO["per_device_train_batch_size"]
    inputs = [
        _trl_rloo_inputs({k: v[m * b : (m + 1) * b] for k, v in buf.items()}, image_token)
        for m in range(2)
    ]

    class Replay(trl.RLOOTrainer):
        def _prepare_inputs(self, generation_batch):
            assert self.model.training
            return inputs[self._step]

    # TRL's beta only shapes the rewards (replayed here); 0 spares it a reference model.
    _, theirs = trl_train_logs(
        Replay, trl.RLOOConfig, vlm_dir, _processor(vlm_dir, left=True), data, tmp_path / "trl",
        trainer_kwargs={"reward_funcs": ImageReward(column="image")}, save_strategy="no",
        **{**RLOO, "beta": 0.0},
    )  # fmt: skip
    assert_logs_match(logs, theirs, ("loss", "entropy"), steps=2)
    assert abs(logs[1]["loss"]) > 1e-4  # off-policy: the ratio is not 1

    # The completion logs hold the prompts with their image parts stripped of the images (TRL's
    # `strip_images_from_messages`), so they serialise.
    import pandas as pd

    frame = pd.read_parquet(tmp_path / "ours" / "completions" / "completions_00001.parquet")
    parts = sorted(tuple(p["type"] for p in row[0]["content"]) for row in frame["prompt"])
    assert parts == [("image", "text")] * 2 + [("text",)] * 2
    assert all(p.get("image") is None for row in frame["prompt"] for p in row[0]["content"])

    metrics = ours.evaluate(eval_dataset=data)
    sampled, greedy = reward.calls[1:]
    assert len(sampled["rewards"]) == 2 * G and len(greedy["rewards"]) == 2
    np.testing.assert_allclose(metrics["eval_reward"], np.mean(sampled["rewards"]), rtol=1e-6)
    np.testing.assert_allclose(metrics["eval_greedy/reward"], np.mean(greedy["rewards"]), rtol=1e-6)
    assert np.isfinite(metrics["eval_loss"]) and np.isfinite(metrics["eval_kl"])


def test_lora_on_images(vlm_dir, tmp_path):  # noqa: F811
    """LoRA (PEFT targets in the language model and the SigLIP layers): the reference is the
    base with the adapter off, on the same images: at the first generation (adapter B = 0) its
    log-probs equal the sampler's (atol 1e-5); the adapters of the vision tower train (the
    images' gradient reaches them) and at step 2 the policy has moved from the reference."""
    import peft
    from flax import nnx

    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj", "fc1"])
    trainer = GRPOTrainer(
        vlm_dir,
        reward_funcs=ImageReward(),
        args=GRPOConfig(**base_args(tmp_path, **{**GRPO, "learning_rate": 5e-2})),
        train_dataset=_rows((1, 2, 1, 0), seed=7),
        processing_class=_processor(vlm_dir),
        peft_config=config,
    )
    calls = []
    sample = trainer._sample
    trainer._sample = lambda *a, **k: calls.append(sample(*a, **k)) or calls[-1]
    trainer.train()
    (s,) = calls
    ref = np.asarray(trainer.rollout["ref_logps"])[np.argsort(_order(trainer, s))]
    mask = np.asarray(s["out"].completion_mask_BN).astype(bool)
    np.testing.assert_allclose(ref[mask], np.asarray(s["out"].logprobs_BN)[mask], atol=1e-5)
    params = dict(nnx.to_flat_state(trainer.train_state.params))
    vision_b = [v for k, v in params.items() if k[0] == "vision_tower" and k[-1] == "lora_b"]
    assert len(vision_b) == 6  # 2 SigLIP layers x (q_proj, v_proj, fc1)
    assert all(np.abs(np.asarray(v.get_value())).max() > 0 for v in vision_b)
    assert train_logs(trainer)[1]["kl"] > 1e-4


def test_cli_on_an_image_dataset_directory(vlm_dir, tmp_path):  # noqa: F811
    """`python -m jaxrl.train --algo grpo` on a `save_to_disk` directory of image prompts, with
    TRL's script reward flags: the model loads with its vision tower and the processor (a
    text-only load would refuse the image column), both rewards are logged every step, and the
    export holds the vision tower."""
    import json

    from safetensors.numpy import load_file

    from jaxrl.train import main

    rng = np.random.default_rng(0)
    rows = [
        {"prompt": [{"role": "user", "content": f"{i}+{i}="}], "images": [_image(rng)]}
        for i in range(4)
    ]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "data"))
    out = tmp_path / "out"
    argv = ["--algo", "grpo", "--model_name_or_path", vlm_dir, "--dataset_name",
            str(tmp_path / "data"), "--reward_funcs", "think_format_reward",
            "get_soft_overlong_punishment", "--output_dir", str(out), "--max_steps", "2",
            "--num_generations", "2", "--per_device_train_batch_size", "4",
            "--max_completion_length", "4", "--mesh_fsdp", "1", "--logging_steps", "1"]  # fmt: skip
    assert main(argv) == 0
    logs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in logs if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        for name in ("think_format_reward", "soft_overlong_punishment_reward"):
            assert f"rewards/{name}/mean" in r
    assert any("vision_tower" in k for k in load_file(out / "final" / "model.safetensors"))


def test_refusals(vlm_dir, hf_model_dir, tokenizer, tmp_path):  # noqa: F811
    """TRL's error for plain-text prompts with images; images for a text-only model, with a
    tokenizer as processing_class, in the eval set only, or mismatching the prompt's image
    parts; wandb tables with log_multimodal; pixel values for a sampler of a text model."""

    def make(model=vlm_dir, data=None, processing_class=None, eval_dataset=None, **kw):
        return GRPOTrainer(
            model,
            reward_funcs=ImageReward(),
            args=GRPOConfig(**base_args(tmp_path / "out", **{**GRPO, **kw})),
            train_dataset=_rows((1, 2)) if data is None else data,
            eval_dataset=eval_dataset,
            processing_class=_processor(vlm_dir) if processing_class is None else processing_class,
        )

    with pytest.raises(ValueError, match="Multimodal training requires conversational prompts"):
        make(data=_rows((1, 0), conversational=False))
    with pytest.raises(ValueError, match="not an image-text model"):
        make(model=hf_model_dir, processing_class=tokenizer)
    with pytest.raises(ValueError, match="processing_class is a tokenizer"):
        make(processing_class=_processor(vlm_dir).tokenizer)
    text = datasets.Dataset.from_list([{"prompt": "1+1="}] * 2)
    with pytest.raises(ValueError, match="eval dataset has images"):
        make(data=text, eval_dataset=_rows((1, 1)), processing_class=tokenizer, model=hf_model_dir)
    rng = np.random.default_rng(0)
    two_slots = [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "1+1="}]
    mismatch = datasets.Dataset.from_list(
        [{"prompt": [{"role": "user", "content": two_slots}], "images": [_image(rng)]}] * 2
    )
    with pytest.raises(ValueError, match=r"Number of images provided \(1\) does not match"):
        make(data=mismatch)
    with pytest.raises(ConfigError, match="log_multimodal=False"):
        make(log_completions=True, report_to=["wandb"])
    from jaxrl import models

    sampler = Sampler(models.from_pretrained(hf_model_dir))
    with pytest.raises(ValueError, match="no vision tower"):
        sampler(
            None,
            [[1, 2]],
            GenerationConfig(max_new_tokens=2),
            pixel_values=np.zeros((1, 1, 3, 28, 28)),
        )


def test_continuous_engine_equals_static_on_image_prompts(vlm_dir):  # noqa: F811
    """Image prompts (1, 2 and 0 images), sampled in groups of 2 with one decode slot (every
    row prefilled into it in turn, its prompt's images with it): the static engine's tokens."""
    from jaxrl import models
    from jaxrl.data.vision_prompts import PromptImages

    processor = _processor(vlm_dir)
    data = _rows((1, 2, 0), seed=5)
    examples = [data[i] for i in range(len(data))]
    prompts = PromptImages(processor, image_shape=(3, 28, 28))
    ids = [prompts.prompt_ids(ex["prompt"], len(ex["images"])) for ex in examples]
    pixels = prompts.pixel_values(examples, ids, max_images=2)
    tok = processor.tokenizer
    config = GenerationConfig(
        max_new_tokens=5, do_sample=True, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, suppress_token_ids=(tok.image_token_id,),
    )  # fmt: skip
    model = models.from_pretrained(vlm_dir, vision=True)
    kwargs = dict(seed=2, group_size=2, pixel_values=pixels, max_new_tokens=[5, 2, 1, 5, 3, 4])
    want = Sampler(model, engine="static")(None, ids, config, **kwargs)
    got = Sampler(model, num_slots=1)(None, ids, config, **kwargs)
    np.testing.assert_array_equal(np.asarray(got.completion_ids_BN), want.completion_ids_BN)
    np.testing.assert_array_equal(np.asarray(got.completion_mask_BN), want.completion_mask_BN)
    np.testing.assert_allclose(np.asarray(got.logprobs_BN), want.logprobs_BN, atol=1e-5)

"""algos.rollout: completion hidden states, log-probs and entropies of `prompt + completion` rows
against a NumPy log-softmax of the same tiny model, the image prompts' token types, the entropy
gradient of the bonus path, and the MoE token weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.algos import rollout
from jaxrl.trainers.grpo_config import GRPOConfig
from tests.algos.tiny_lm import (
    IMAGE_TOKEN,
    TinyLM,
    np_completion_logits,
    np_logprobs_and_entropy,
    rollout_batch,
    tiny_params,
)


def test_completion_hidden_takes_the_positions_that_predict_completion_tokens():
    params, batch = tiny_params(), rollout_batch()
    h_BCD, targets_BC = rollout.completion_hidden(TinyLM(params), batch)
    ids = batch["input_ids"]
    P = ids.shape[1] - batch["completion_mask"].shape[1]
    np.testing.assert_array_equal(targets_BC, ids[:, P:])
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    want = ((p["emb"][ids] + p["pos"][: ids.shape[1]]) * batch["attention_mask"][..., None])[
        :, P - 1 : -1
    ]
    np.testing.assert_allclose(h_BCD, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "temperature, softcap, chunk", [(1.0, None, None), (0.7, None, 3), (1.3, 2.5, 2)]
)
def test_completion_logprobs_and_entropy_equal_numpy(temperature, softcap, chunk):
    params, batch = tiny_params(1), rollout_batch(1)
    logps, stats = rollout.completion_logprobs(
        TinyLM(params, softcap), batch, temperature=temperature, chunk_size=chunk, with_stats=True
    )
    want_logps, want_entropy = np_logprobs_and_entropy(
        params, batch, temperature=temperature, softcap=softcap
    )
    assert logps.shape == batch["completion_mask"].shape
    np.testing.assert_allclose(logps, want_logps, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(stats["entropy"], want_entropy, rtol=1e-5, atol=1e-5)
    plain = rollout.completion_logprobs(
        TinyLM(params, softcap), batch, temperature=temperature, chunk_size=chunk
    )
    np.testing.assert_array_equal(plain, logps)


def test_image_prompts_mark_only_the_prompts_image_tokens():
    params, batch = tiny_params(), rollout_batch()
    ids = batch["input_ids"].copy()
    ids[0, 1] = IMAGE_TOKEN  # in the prompt: image tokens
    ids[3, 2] = IMAGE_TOKEN  # (the prompt's last position: it predicts the first completion token)
    ids[2, 5] = IMAGE_TOKEN  # in the completion: text, whatever its id
    pixels = np.full((4, 1, 3, 2, 2), 0.25, np.float32)
    model = TinyLM(params)
    logps = rollout.completion_logprobs(
        model, {**batch, "input_ids": ids, "pixel_values": pixels}, temperature=1.0, chunk_size=4
    )
    (kwargs,) = model.calls
    want_types = np.zeros(ids.shape, np.int32)
    want_types[0, 1] = want_types[3, 2] = 1
    np.testing.assert_array_equal(kwargs["token_type_ids"], want_types)
    np.testing.assert_array_equal(kwargs["pixel_values"], pixels)
    # The image reaches the model: only the hidden state at row 3's position P - 1 moves.
    text_model = TinyLM(params)
    text = rollout.completion_logprobs(
        text_model, {**batch, "input_ids": ids}, temperature=1.0, chunk_size=4
    )
    assert text_model.calls == [{}]
    changed = np.asarray(logps) != np.asarray(text)
    want_changed = np.zeros(changed.shape, bool)
    want_changed[3, 0] = True
    np.testing.assert_array_equal(changed, want_changed)


def test_entropy_path_differentiates_the_entropies_and_matches_the_plain_path():
    params, batch = tiny_params(2), rollout_batch(2)
    kw = dict(temperature=0.8, chunk_size=2)
    logps, stats, entropies = rollout.completion_logprobs_and_entropy(TinyLM(params), batch, **kw)
    logps2, stats2 = rollout.completion_logprobs(TinyLM(params), batch, with_stats=True, **kw)
    np.testing.assert_array_equal(logps, logps2)
    np.testing.assert_array_equal(entropies, stats2["entropy"])
    np.testing.assert_array_equal(stats["entropy"], stats2["entropy"])

    def bonus_entropy(params):
        return jnp.sum(rollout.completion_logprobs_and_entropy(TinyLM(params), batch, **kw)[2])

    def stats_entropy(params):
        return jnp.sum(
            rollout.completion_logprobs_and_entropy(TinyLM(params), batch, **kw)[1]["entropy"]
        )

    def full_logits_entropy(params):  # the reference: the whole softmax in jnp
        h_BCD, _ = rollout.completion_hidden(TinyLM(params), batch)
        logp = jax.nn.log_softmax(h_BCD @ params["w"] / kw["temperature"], axis=-1)
        return jnp.sum(-jnp.exp(logp) * logp)

    got = jax.grad(bonus_entropy)(params)
    want = jax.grad(full_logits_entropy)(params)
    for k in params:
        assert float(jnp.max(jnp.abs(want[k]))) > 1e-3, k
        np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-5, err_msg=k)
    for k, g in jax.grad(stats_entropy)(params).items():
        np.testing.assert_array_equal(g, np.zeros_like(g), err_msg=k)


def test_rollout_token_weights_are_prompt_mask_then_loss_mask():
    batch = rollout_batch()
    batch["completion_mask"] = batch["completion_mask"].copy()
    batch["completion_mask"][1] = 0  # a truncated completion masked out of the loss
    got = rollout.rollout_token_weights(batch)
    P = batch["input_ids"].shape[1] - batch["completion_mask"].shape[1]
    want = np.concatenate([batch["attention_mask"][:, :P], batch["completion_mask"]], axis=1)
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(got, want.astype(np.float32))
    assert float(got[1, P:].sum()) == 0.0 and float(got[1, :P].sum()) == P - 1


def test_make_policy_logps_uses_the_configs_temperature():
    params, batch = tiny_params(3), rollout_batch(3)
    config = GRPOConfig(output_dir="unused", temperature=0.6, logprob_chunk_size=2)
    logps = jax.jit(rollout.make_policy_logps(config, TinyLM))(params, batch)
    want, _ = np_logprobs_and_entropy(params, batch, temperature=0.6)
    np.testing.assert_allclose(logps, want, rtol=1e-5, atol=1e-5)
    z, _ = np_completion_logits(params, batch, temperature=1.0)
    assert not np.allclose(want, np.take_along_axis(z, batch["input_ids"][:, 3:, None], -1)[..., 0])


def test_buffer_step_feeds_the_planned_slices_as_micro_batches():
    def step(state, batch_A):
        return state + 1, batch_A

    update = rollout.make_buffer_step(step, steps_per_generation=3)
    buffer = {"x": jnp.arange(12).reshape(6, 2), "y": jnp.arange(6)}
    state, seen = jax.jit(update)(jnp.int32(0), buffer, jnp.asarray([2, 0], jnp.int32))
    assert int(state) == 1
    np.testing.assert_array_equal(seen["y"], [[4, 5], [0, 1]])
    np.testing.assert_array_equal(seen["x"], [[[8, 9], [10, 11]], [[0, 1], [2, 3]]])

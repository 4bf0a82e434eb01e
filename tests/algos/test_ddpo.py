"""`jaxrl.algos.ddpo` without a trainer, on a tiny linear stand-in for the UNet: the per-timestep
loss against a numpy computation of DDIM's transition log-prob and TRL's clipped ratio loss,
approx_kl and clipfrac; one inner epoch's update against the loss and AdamW by hand (and
gradient accumulation against the larger batch); the sampling program; row placement."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from jaxrl import parallel
from jaxrl.algos import ddpo
from jaxrl.core.state import TrainState
from jaxrl.models.diffusion.ddim import DDIMScheduler, decode_latents, sample_with_logprob
from jaxrl.models.diffusion.tiny import SCHEDULER
from jaxrl.trainers.ddpo_config import DDPOConfig

SCHED = DDIMScheduler.from_config(SCHEDULER)
STEPS = 4
B, C, H, W, S, D = 4, 2, 3, 3, 3, 4


class Frozen(nnx.Variable):
    """A UNet weight outside the trained params (as the base weights under LoRA)."""


class TinyUNet(nnx.Module):
    """eps(x, t, ctx) = w * x + v * mean(ctx) + b * t / 1000: linear in its two trained weights."""

    def __init__(self):
        self.w = nnx.Param(jnp.float32(0.3))
        self.v = nnx.Param(jnp.float32(-0.7))
        self.b = Frozen(jnp.float32(0.2))

    def __call__(self, x, t, ctx):
        t = jnp.broadcast_to(jnp.asarray(t, jnp.float32), (x.shape[0],))
        shift = self.v * ctx.mean(axis=(1, 2)) + self.b * t / 1000
        return self.w * x + shift[:, None, None, None]


def np_eps(w, v, b, x, t, ctx):
    return w * x + (v * ctx.mean(axis=(1, 2)) + b * t / 1000)[:, None, None, None]


def np_step(x, t, pos, neg, *, guidance=3.0, eta=1.0, w=0.3, v=-0.7, b=0.2):
    """DDIM's reverse step x_t -> N(mean, std^2) (TRL v0.7.2 `scheduler_step`), float64 numpy,
    with classifier-free guidance when `neg` is given."""
    x, t = np.float64(x), np.asarray(t)
    eps = np_eps(w, v, b, x, t, np.float64(pos))
    if neg is not None:
        uncond = np_eps(w, v, b, x, t, np.float64(neg))
        eps = uncond + guidance * (eps - uncond)
    ac = np.float64(SCHED.alphas_cumprod())
    n = SCHED.num_train_timesteps
    a_t = ac[t][:, None, None, None]
    a_prev = ac[np.clip(t - n // STEPS, 0, n - 1)][:, None, None, None]
    x0 = (x - np.sqrt(1 - a_t) * eps) / np.sqrt(a_t)
    std = eta * np.sqrt((1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev))
    mean = np.sqrt(a_prev) * x0 + np.sqrt(1 - a_prev - std**2) * eps
    return mean, std


def np_log_prob(x, t, nxt, pos, neg, **kw):
    """The step's Gaussian log-density of `nxt`, averaged over the non-batch dims."""
    mean, std = np_step(x, t, pos, neg, **kw)
    logp = -((np.float64(nxt) - mean) ** 2) / (2 * std**2) - np.log(std)
    return (logp - 0.5 * math.log(2 * math.pi)).mean(axis=(1, 2, 3))


def np_ddpo_loss(logp, old, adv, *, clip_range, adv_clip_max):
    """TRL `calculate_loss` after the log-prob: (loss, approx_kl, clipfrac)."""
    adv = np.clip(adv, -adv_clip_max, adv_clip_max)
    ratio = np.exp(logp - old)
    clipped = np.clip(ratio, 1 - clip_range, 1 + clip_range)
    loss = np.mean(np.maximum(-adv * ratio, -adv * clipped))
    approx_kl = 0.5 * np.mean((logp - old) ** 2)
    clipfrac = np.mean(np.abs(ratio - 1) > clip_range)
    return loss, approx_kl, clipfrac


def config(**kw) -> DDPOConfig:
    base = dict(
        sample_num_steps=STEPS,
        sample_batch_size=B,
        sample_num_batches_per_epoch=1,
        train_batch_size=2,
        sample_guidance_scale=3.0,
        sample_eta=1.0,
        train_clip_range=0.1,
        train_adv_clip_max=5.0,
        train_learning_rate=1e-2,
        mixed_precision="no",
    )
    return DDPOConfig(**{**base, **kw})


def split_unet():
    return nnx.split(TinyUNet(), nnx.Param, ...)


def no_placement(x, dim=0):
    return x


def transitions(seed: int, n: int = B) -> dict:
    """One timestep's micro-batch: latents, their next latents and prompt embeddings."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, C, H, W)).astype(np.float32)
    t = np.resize(SCHED.timesteps(STEPS), n)
    pos, neg = rng.normal(size=(2, n, S, D)).astype(np.float32)
    mean, std = np_step(x, t, pos, neg)  # next latents drawn from the guided step
    nxt = mean + std * rng.normal(size=x.shape)
    return {
        "latents": x,
        "timesteps": t,
        "next_latents": nxt.astype(np.float32),
        "prompt_embeds": pos,
        "negative_prompt_embeds": neg,
    }


@pytest.mark.parametrize("train_cfg", [True, False])
def test_loss_matches_numpy(train_cfg):
    """Ratios both sides of the clip range (one right on 1), an advantage past adv_clip_max, and
    guidance on and off: loss, approx_kl and clipfrac as TRL computes them."""
    c = config(train_cfg=train_cfg)
    mb = transitions(0)
    neg = mb["negative_prompt_embeds"] if train_cfg else None
    args = (mb["latents"], mb["timesteps"], mb["next_latents"], mb["prompt_embeds"], neg)
    logp = np_log_prob(*args, guidance=3.0, eta=1.0)
    # log-ratios: outside the range above and below (clipped), inside it, and zero.
    delta = np.array([0.3, -0.25, 0.05, 0.0])
    mb["log_probs"] = (logp - delta).astype(np.float32)
    mb["advantages"] = np.array([1.5, -2.0, 7.0, -0.5], np.float32)  # 7 is clipped to 5
    unet_def, params, rest = split_unet()
    loss_fn = jax.jit(ddpo.make_loss(c, SCHED, ddpo.make_train_unet(unet_def)))
    loss, out = loss_fn(params, rest, mb)

    want = np_ddpo_loss(logp, mb["log_probs"], mb["advantages"], clip_range=0.1, adv_clip_max=5.0)
    np.testing.assert_allclose(float(loss), want[0], rtol=1e-5)
    np.testing.assert_allclose(float(out.loss), want[0], rtol=1e-5)
    np.testing.assert_allclose(float(out.approx_kl), want[1], rtol=1e-4)
    assert float(out.clipfrac) == want[2] == 0.5
    # The numbers themselves: sample 0 (adv 1.5, ratio e^0.3 > 1.1) takes the clipped term,
    # sample 2 (adv 7 -> 5, ratio e^0.05) the unclipped one.
    ratio = np.exp(delta)
    terms = [-1.5 * 1.1, max(2.0 * ratio[1], 2.0 * 0.9), -5.0 * ratio[2], 0.5 * ratio[3]]
    np.testing.assert_allclose(float(loss), np.mean(terms), rtol=1e-4)
    np.testing.assert_allclose(float(out.approx_kl), 0.5 * np.mean(delta**2), rtol=1e-4)


def epoch_samples(seed: int, n: int = B) -> dict:
    """An epoch's samples: `SAMPLE_KEYS` with the step axis, advantages, prompt embeddings;
    old log-probs a little off the tiny UNet's own, so that the ratios are not all 1."""
    rng = np.random.default_rng(seed)
    timesteps = np.broadcast_to(SCHED.timesteps(STEPS), (n, STEPS))
    pos, neg = rng.normal(size=(2, n, S, D)).astype(np.float32)
    latents, logp = [rng.normal(size=(n, C, H, W))], []
    for j in range(STEPS):  # a sampling trajectory of the tiny UNet
        mean, std = np_step(latents[-1], timesteps[:, j], pos, neg)
        latents.append((mean + std * rng.normal(size=mean.shape)).astype(np.float32))
        logp.append(np_log_prob(latents[-2], timesteps[:, j], latents[-1], pos, neg))
    latents, logp = np.stack(latents, axis=1).astype(np.float32), np.stack(logp, axis=1)
    return {
        "timesteps": timesteps.copy(),
        "latents": latents[:, :-1],
        "next_latents": latents[:, 1:],
        "log_probs": (logp + rng.normal(scale=0.05, size=logp.shape)).astype(np.float32),
        "advantages": rng.normal(size=n).astype(np.float32),
        "prompt_embeds": pos,
        "negative_prompt_embeds": neg,
    }


def run_update(c: DDPOConfig, samples: dict, key):
    unet_def, params, rest = split_unet()
    tx = ddpo.make_optimizer(c)
    state = TrainState.create(params, tx, seed=0, frozen={"unet": rest})
    update = ddpo.make_update(c, SCHED, ddpo.make_train_unet(unet_def), tx, no_placement)
    return state, jax.jit(update)(state, samples, key)


def test_update_equals_the_loss_and_adamw_by_hand():
    """One inner epoch of 4 samples in updates of 2, every timestep trained: each update's
    metrics are the mean over its micro-steps (timesteps) of `make_loss` on its two shuffled
    samples, and its params move by TRL's AdamW step (global-norm clipping 1.0, betas 0.9 /
    0.999, eps 1e-8, weight decay 1e-4) on the mean gradient."""
    c = config()
    samples, key = epoch_samples(1), jax.random.key(3)
    state0, (state, metrics_U) = run_update(c, samples, key)
    assert int(state.step) == 2
    assert {k: v.shape for k, v in metrics_U.items()} == {
        "loss": (2,),
        "approx_kl": (2,),
        "clipfrac": (2,),
    }

    unet_def, _, rest = split_unet()
    loss_fn = ddpo.make_loss(c, SCHED, ddpo.make_train_unet(unet_def))

    @jax.jit
    def mean_loss(params, mb):
        def one(j):
            step = {k: (v[:, j] if k in ddpo.SAMPLE_KEYS else v) for k, v in mb.items()}
            return loss_fn(params, rest, step)

        (_, outs) = jax.vmap(one)(jnp.arange(STEPS))
        return outs.loss.mean(), jax.tree.map(jnp.mean, outs._asdict())

    perm_key, _ = jax.random.split(key)  # the update's sample shuffle
    perm = np.asarray(jax.random.permutation(perm_key, B))
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(1e-2, b1=0.9, b2=0.999, eps=1e-8, weight_decay=1e-4),
    )
    params, opt_state = state0.params, tx.init(state0.params)
    for u, rows in enumerate((perm[:2], perm[2:])):
        mb = {k: v[rows] for k, v in samples.items()}
        (_, want), grads = jax.value_and_grad(mean_loss, has_aux=True)(params, mb)
        for k in ("loss", "approx_kl", "clipfrac"):
            np.testing.assert_allclose(metrics_U[k][u], want[k], rtol=1e-5, atol=1e-8, err_msg=k)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    assert float(metrics_U["approx_kl"][0]) > 1e-4  # the old log-probs are off: ratios != 1
    for got, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(params), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    # The frozen part is not trained.
    np.testing.assert_array_equal(state.frozen["unet"]["b"][...], np.float32(0.2))


def test_accumulation_equals_the_larger_batch():
    """2 micro-batches of 1 sample accumulated == 1 batch of 2: the update's mean gradient
    and its metrics (Accelerate divides each micro-step by GA x num_train_timesteps)."""
    samples, key = epoch_samples(2), jax.random.key(4)
    _, (big, m_big) = run_update(config(train_batch_size=2), samples, key)
    _, (acc, m_acc) = run_update(
        config(train_batch_size=1, train_gradient_accumulation_steps=2), samples, key
    )
    assert int(big.step) == int(acc.step) == 2
    for k in ("loss", "approx_kl", "clipfrac"):
        np.testing.assert_allclose(m_acc[k], m_big[k], rtol=1e-5, atol=1e-8, err_msg=k)
    for a, b in zip(jax.tree.leaves(acc.params), jax.tree.leaves(big.params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_timestep_fraction_trains_a_shuffled_subset():
    """train_timestep_fraction 0.25 of 4 steps: each sample trains 1 timestep, drawn by the
    update's per-sample timestep shuffle; the metrics are the loss at those timesteps."""
    c = config(train_timestep_fraction=0.25, train_batch_size=4)
    assert c.num_train_timesteps == 1
    samples, key = epoch_samples(5), jax.random.key(6)
    state0, (_, metrics_U) = run_update(c, samples, key)
    perm_key, time_key = jax.random.split(key)
    perm = np.asarray(jax.random.permutation(perm_key, B))
    t_perm = jax.vmap(lambda k: jax.random.permutation(k, STEPS))(jax.random.split(time_key, B))
    first = np.asarray(t_perm)[:, 0]  # the trained timestep of each shuffled sample
    mb = {k: v[perm] for k, v in samples.items()}
    mb = {k: (v[np.arange(B), first] if k in ddpo.SAMPLE_KEYS else v) for k, v in mb.items()}
    unet_def, _, rest = split_unet()
    _, want = ddpo.make_loss(c, SCHED, ddpo.make_train_unet(unet_def))(state0.params, rest, mb)
    np.testing.assert_allclose(metrics_U["loss"], [want.loss], rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(metrics_U["approx_kl"], [want.approx_kl], rtol=1e-5)


class TinyVAE(nnx.Module):
    def __init__(self):
        self.k = nnx.Param(jnp.float32(1.5))

    def decode(self, z):
        return self.k * jnp.concatenate([z, z[:, :1]], axis=1)  # 3 image channels


def test_sample_is_ddim_sampling_then_decode():
    """`make_sample`'s program == `sample_with_logprob` on the same UNet and key, its images
    the VAE decode of the final latents in [0, 1]; the final latents are not returned."""
    c = config(sample_num_steps=3)
    unet_def, params, rest = split_unet()
    vae_def, vae_state = nnx.split(TinyVAE())
    sample = ddpo.make_sample(
        c, SCHED, unet_def, vae_def, latent_shape=(C, H, W), scaling_factor=0.5, rows=no_placement
    )
    mb = transitions(7)
    key = jax.random.key(8)
    s, images = jax.jit(sample)(
        params, rest, vae_state, mb["prompt_embeds"], mb["negative_prompt_embeds"], key
    )
    unet = nnx.merge(unet_def, params, rest)
    want = sample_with_logprob(
        unet,
        SCHED,
        mb["prompt_embeds"],
        mb["negative_prompt_embeds"],
        key,
        latent_shape=(C, H, W),
        num_inference_steps=3,
        guidance_scale=3.0,
        eta=1.0,
    )
    assert s.final_latents is None
    for k in ("latents", "next_latents", "log_probs", "timesteps"):
        np.testing.assert_allclose(getattr(s, k), getattr(want, k), rtol=1e-5, atol=1e-6)
    assert images.shape == (B, 3, H, W)
    decoded = decode_latents(nnx.merge(vae_def, vae_state).decode, want.final_latents, 0.5)
    np.testing.assert_allclose(images, decoded, rtol=1e-5, atol=1e-6)
    assert float(images.min()) >= 0.0 and float(images.max()) <= 1.0


def test_place_rows_splits_samples_over_the_batch_rule():
    """Rows over data x fsdp where they divide evenly, else replicated; scalars untouched."""
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2, 1), ("data", "fsdp", "tensor"))
    rules = parallel.merge_rules(None)
    x = {"even": np.zeros((4, 3)), "odd": np.zeros((3, 2)), "step": np.float32(1)}
    placed = ddpo.place_rows(mesh, rules, x)
    assert placed["even"].sharding.spec == PartitionSpec(("data", "fsdp"), None)
    assert placed["odd"].sharding.spec in (PartitionSpec(), PartitionSpec(None, None))
    assert placed["step"] is x["step"]
    second = ddpo.place_rows(mesh, rules, np.zeros((2, 4, 5)), dim=1)
    assert second.sharding.spec == PartitionSpec(None, ("data", "fsdp"), None)


def test_epoch_metrics_average_every_update():
    got = ddpo.epoch_metrics([{"loss": jnp.array([1.0, 2.0])}, {"loss": jnp.array([6.0])}])
    assert float(got["loss"]) == 3.0

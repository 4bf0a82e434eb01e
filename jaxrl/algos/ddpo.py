"""DDPO's traced math (TRL v0.7.2 `DDPOTrainer`): the sampling program, the per-timestep loss and
one inner epoch's update, as factories of pure functions built from a `DDPOConfig`.

- `make_sample`: DDIM sampling with per-step log-probs in one `lax.scan`
  (`jaxrl.models.diffusion.ddim.sample_with_logprob`), then the VAE decode to images in [0, 1];
- `make_loss`: one timestep's micro-batch loss, the current UNet's transition log-prob
  (`transition_log_prob`) into the clipped ratio loss (`jaxrl.losses.ddpo.ddpo_loss`);
- `make_update`: one inner epoch over an epoch's samples: samples shuffled, each sample's
  timesteps shuffled independently and the first `num_train_timesteps` trained, one optimizer
  update per `train_batch_size * train_gradient_accumulation_steps` samples x
  `num_train_timesteps` timesteps with the mean gradient (Accelerate's accumulation), all as
  nested `lax.scan`s;
- `make_optimizer`: TRL's AdamW with global-norm clipping.

`config` is a `DDPOConfig`, read for its fields only. Prompts, rewards, advantages, images,
logging and checkpoints stay on the host, in `jaxrl.trainers.ddpo`; nothing here touches them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from jaxrl import parallel
from jaxrl.core import loops
from jaxrl.core.state import TrainState
from jaxrl.core.step import make_apply_grads
from jaxrl.losses.ddpo import DDPOLoss, ddpo_loss
from jaxrl.models.diffusion.ddim import (
    DDIMScheduler,
    decode_latents,
    sample_with_logprob,
    transition_log_prob,
)

# The per-timestep entries of a sample batch (step axis 1); the others are per sample.
SAMPLE_KEYS = ("timesteps", "latents", "next_latents", "log_probs")


def row_sharding(mesh: Mesh, rules: Any, shape: tuple[int, ...], dim: int = 0) -> NamedSharding:
    """Dim `dim` (samples) over the `batch` rule (data x fsdp) where it divides evenly, else
    replicated; other dims replicated."""
    axes = tuple("batch" if i == dim else None for i in range(len(shape)))
    return NamedSharding(mesh, parallel.logical_to_spec(axes, rules, shape, mesh))


def place_rows(mesh: Mesh, rules: Any, x: Any, dim: int = 0) -> Any:
    """Place (host) or constrain (traced) every array of `x` by `row_sharding`."""

    def one(a):
        if np.ndim(a) <= dim:
            return a
        sharding = row_sharding(mesh, rules, np.shape(a), dim)
        if isinstance(a, jax.core.Tracer):
            return jax.lax.with_sharding_constraint(a, sharding)
        return jax.device_put(a, sharding)

    return jax.tree.map(one, x)


def make_encode(text_def: Any) -> Callable:
    """`encode_ids(text_state, ids_BT) -> [B, S, D]` prompt embeddings of the text encoder."""

    def encode_ids(text_state, ids_BT):
        return nnx.merge(text_def, text_state)(ids_BT)

    return encode_ids


def make_sample(
    config: Any,
    scheduler: DDIMScheduler,
    unet_def: Any,
    vae_def: Any,
    *,
    latent_shape: tuple[int, int, int],
    scaling_factor: float,
    rows: Callable,
) -> Callable:
    """`sample(params, rest, vae_state, embeds_BSD, neg_BSD, key) -> (samples, images)`: DDIM
    sampling of `config.sample_num_steps` steps with guidance and the images decoded in [0, 1];
    `samples` is `ddim.Samples` without its final latents. `rows(x)` places the UNet's inputs
    on the mesh (`place_rows`)."""
    c = config
    steps = c.sample_num_steps

    def unet_fn(params, rest):
        unet = nnx.merge(unet_def, params, rest)
        # Data parallel: every sampling UNet call splits its rows, prompts and both CFG
        # halves, over the mesh; the weights stay where the rules put them.
        return lambda x, t, ctx: unet(rows(x), rows(t), rows(ctx))

    def sample(params, rest, vae_state, embeds_BSD, neg_BSD, key):
        s = sample_with_logprob(
            unet_fn(params, rest),
            scheduler,
            embeds_BSD,
            neg_BSD,
            key,
            latent_shape=latent_shape,
            num_inference_steps=steps,
            guidance_scale=c.sample_guidance_scale,
            eta=c.sample_eta,
        )
        vae = nnx.merge(vae_def, vae_state)
        images = decode_latents(vae.decode, s.final_latents, scaling_factor)
        return s._replace(final_latents=None), images

    return sample


def make_train_unet(unet_def: Any) -> Callable:
    """`unet_fn(params, rest) -> unet` of the training forward."""

    def train_unet_fn(params, rest):
        # No sharding constraints inside the differentiated UNet: with FSDP/tensor-sharded
        # weights, XLA's SPMD partitioner (jax 0.10.2, CPU) returns wrong gradients (up to
        # 100% off, forward exact) when the UNet's inputs are constrained to the batch
        # sharding. The micro-batches are already placed row-sharded, and propagation keeps
        # them so; test_mesh_equals_one_device checks the updated params.
        return nnx.merge(unet_def, params, rest)

    return train_unet_fn


def make_loss(config: Any, scheduler: DDIMScheduler, unet_fn: Callable) -> Callable:
    """`loss_fn(params, rest, mb) -> (loss, DDPOLoss)` of one timestep's micro-batch (TRL
    `calculate_loss`): `mb` holds `[B, ...]` `latents`, `timesteps`, `next_latents`,
    `log_probs` (the sampler's) of that timestep, `advantages` and the `prompt_embeds` /
    `negative_prompt_embeds` (guidance when `config.train_cfg`); `unet_fn(params, rest)` is the
    UNet to score with (`make_train_unet`)."""
    c = config
    steps = c.sample_num_steps

    def micro_loss(params, rest, mb) -> tuple[jax.Array, DDPOLoss]:
        logp_B = transition_log_prob(
            unet_fn(params, rest),
            scheduler,
            steps,
            mb["latents"],
            mb["timesteps"],
            mb["next_latents"],
            mb["prompt_embeds"],
            mb["negative_prompt_embeds"] if c.train_cfg else None,
            guidance_scale=c.sample_guidance_scale,
            eta=c.sample_eta,
        )
        out = ddpo_loss(
            logp_B,
            mb["log_probs"],
            mb["advantages"],
            clip_range=c.train_clip_range,
            adv_clip_max=c.train_adv_clip_max,
        )
        return out.loss, out

    return micro_loss


def make_optimizer(config: Any) -> optax.GradientTransformation:
    """TRL's optimizer: AdamW (`train_adam_*`, `train_learning_rate`) after clipping the global
    gradient norm to `train_max_grad_norm`."""
    c = config
    return optax.chain(
        optax.clip_by_global_norm(c.train_max_grad_norm),
        optax.adamw(
            c.train_learning_rate,
            b1=c.train_adam_beta1,
            b2=c.train_adam_beta2,
            eps=c.train_adam_epsilon,
            weight_decay=c.train_adam_weight_decay,
        ),
    )


def make_update(
    config: Any,
    scheduler: DDIMScheduler,
    unet_fn: Callable,
    tx: optax.GradientTransformation,
    rows: Callable,
) -> Callable:
    """`update(state, samples, key) -> (state, metrics_U)`: one inner epoch over an epoch's
    samples (leading axis N; `SAMPLE_KEYS` with the step axis next, plus `advantages` and the
    prompt embeddings), `metrics_U` the `DDPOLoss` fields of each of its U optimizer updates
    (the mean over that update's micro-steps). `state.frozen["unet"]` holds the UNet's frozen
    part; `rows(x, dim)` places each micro-batch's rows on the mesh (`place_rows`)."""
    c = config
    steps = c.sample_num_steps
    n_t = c.num_train_timesteps
    ga, bs = c.train_gradient_accumulation_steps, c.train_batch_size
    apply_grads = make_apply_grads(tx)
    grad_fn = jax.value_and_grad(make_loss(config, scheduler, unet_fn), has_aux=True)

    def update(state: TrainState, samples: dict, key: jax.Array):
        """One inner epoch over the epoch's samples (leading axis N)."""
        n = samples["advantages"].shape[0]
        perm_key, time_key = jax.random.split(key)
        perm = jax.random.permutation(perm_key, n)
        samples = jax.tree.map(lambda x: x[perm], samples)
        t_perm_NT = jax.vmap(lambda k: jax.random.permutation(k, steps))(
            jax.random.split(time_key, n)
        )
        for k in SAMPLE_KEYS:  # per-sample timestep shuffle; train the first n_t
            x = samples[k]
            idx = t_perm_NT.reshape(t_perm_NT.shape + (1,) * (x.ndim - 2))
            samples[k] = jnp.take_along_axis(x, idx, axis=1)[:, :n_t]
        n_updates = n // (bs * ga)
        # [U, GA, bs, ...]; per-timestep keys also get the timestep axis in front of bs.
        batches = jax.tree.map(lambda x: x.reshape(n_updates, ga, bs, *x.shape[1:]), samples)
        batches = rows(batches, dim=2)  # each micro-batch's rows over the mesh
        rest = state.frozen["unet"]

        def one_update(state, batch):
            def micro(grads, xs):
                g_i, j = xs
                mb = jax.tree.map(lambda x: x[g_i], batch)
                mb = {k: (v[:, j] if k in SAMPLE_KEYS else v) for k, v in mb.items()}
                (_, out), g = grad_fn(state.params, rest, mb)
                grads = jax.tree.map(jnp.add, grads, g)
                return grads, out

            zeros = jax.tree.map(jnp.zeros_like, state.params)
            g_idx = jnp.repeat(jnp.arange(ga), n_t)
            j_idx = jnp.tile(jnp.arange(n_t), ga)
            grads, outs = loops.scan(micro, zeros, (g_idx, j_idx))
            # Accelerate divides each micro-step's loss by its accumulation count
            # (GA * num_train_timesteps): the update uses the mean gradient.
            grads = jax.tree.map(lambda g: g / (ga * n_t), grads)
            state, _ = apply_grads(state, grads, state.extras)
            return state, jax.tree.map(jnp.mean, outs._asdict())

        state, metrics_U = loops.scan(one_update, state, batches)
        return state, metrics_U

    return update


def epoch_metrics(metrics: list[dict]) -> dict:
    """The mean of each metric over an epoch's inner epochs' `metrics_U` (all its updates)."""
    return {k: jnp.mean(jnp.concatenate([m[k] for m in metrics])) for k in metrics[0]}

"""DDPOTrainer: TRL v0.7.2's DDPO (denoising diffusion policy optimisation) on the one online shell
(`jaxrl.trainers.online.OnlineLoop`: rollout -> score -> update, on `TrainLoop`).

One loop step is one DDPO epoch (TRL `step(epoch, global_step)`; the rollout is steps 1-3, the
update step 4):
1. `_generate_samples`: `sample_num_batches_per_epoch` batches of `sample_batch_size` prompts
   from `prompt_function`, each sampled with DDIM + per-step log-probs in one jitted `lax.scan`
   and decoded to images in [0, 1];
2. rewards from `reward_function(images, prompts, metadata) -> (rewards, metadata)`, optionally
   on a thread pool overlapping the next batch's sampling;
3. advantages by per-prompt stat tracking or global normalisation;
4. `train_num_inner_epochs` passes of the jitted update: samples shuffled, each sample's
   timesteps shuffled independently and the first `num_train_timesteps` of them trained, one
   optimizer update per `train_batch_size * train_gradient_accumulation_steps` samples x
   `num_train_timesteps` timesteps (gradients averaged over those micro-steps, as Accelerate's
   accumulation does), all as one jitted call of nested `lax.scan`s.

Logged per loop step (= epoch): reward_mean, reward_std, and the mean over that epoch's optimizer
updates of loss, approx_kl, clipfrac, plus inner_epoch and epoch. TRL logs the train metrics at
every optimizer update; `global_step` here (TRL's update count) is `epoch * updates_per_epoch`.

This is the host shell: prompts, rewards, advantages, images, placement and checkpoints. The
traced math (sampling program, per-timestep loss, update) is built by `jaxrl.algos.ddpo`; keep
it there.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl import parallel, seeding
from jaxrl.algos import ddpo
from jaxrl.callbacks.base import TrainerCallback
from jaxrl.core.state import TrainState
from jaxrl.losses.ddpo import PerPromptStatTracker, normalize_rewards
from jaxrl.models.diffusion.ddim import DDIMScheduler
from jaxrl.models.diffusion.hf import StableDiffusion, load_pipeline, save_unet
from jaxrl.models.diffusion.lora import LoRAParam, add_lora, save_lora_weights
from jaxrl.models.diffusion.tiny import tiny_pipeline
from jaxrl.trainers.ddpo_config import DDPOConfig
from jaxrl.trainers.online import OnlineLoop

PromptFn = Callable[[], tuple[str, Any]]
RewardFn = Callable[[np.ndarray, tuple, tuple], tuple[Any, Any]]


class _Epochs:
    """The loop's iterator: DDPO epoch numbers (on-policy, no data to replay), with `.skip`."""

    def __init__(self):
        self.epoch = 0

    def skip(self, n: int) -> None:
        self.epoch += n

    def __next__(self) -> int:
        self.epoch += 1
        return self.epoch - 1


class DDPOTrainer(OnlineLoop):
    """TRL v0.7.2 `DDPOTrainer(config, reward_function, prompt_function, sd_pipeline,
    image_samples_hook)`. `sd_pipeline` is a diffusers SD 1.x/2.x directory (TRL's
    `pretrained_model`) or a `StableDiffusion` from `load_pipeline`; None uses
    `config.pretrained_model`, or the package's tiny random pipeline when that is empty."""

    def __init__(
        self,
        config: DDPOConfig,
        reward_function: RewardFn,
        prompt_function: PromptFn,
        sd_pipeline: str | Path | StableDiffusion | None = None,
        image_samples_hook: Callable | None = None,
        callbacks: list[TrainerCallback] | None = None,
    ):
        self.args = self.config = config
        # TRL's DDPOTrainer seeds the host generators: a prompt function drawing from NumPy's
        # or Python's (TRL's examples) repeats its prompts, and resumes them, as the loop
        # checkpoints those generators' states.
        seeding.set_seed(config.seed)
        self.reward_fn = reward_function
        self.prompt_fn = prompt_function
        self.image_samples_hook = image_samples_hook
        self.mesh = parallel.config_mesh(config.mesh_data, config.mesh_fsdp, config.mesh_tensor)
        self.rules = parallel.merge_rules(config.logical_axis_rules)
        dtype = jnp.bfloat16 if config.dtype == "bfloat16" else jnp.float32
        if sd_pipeline is None:
            sd_pipeline = config.pretrained_model or tiny_pipeline()
        if isinstance(sd_pipeline, (str, Path)):
            # Born sharded: each tensor is placed into its sharding as it is read.
            sd_pipeline = load_pipeline(sd_pipeline, dtype=dtype, mesh=self.mesh, rules=self.rules)
        self.sd = sd_pipeline
        self.processing_class = self.sd.tokenizer
        self.scheduler = DDIMScheduler.from_config(self.sd.scheduler_config)
        unet = self.sd.unet
        if config.use_lora:
            add_lora(unet, rank=config.lora_rank, seed=config.seed)
            trainable = LoRAParam
        else:
            trainable = nnx.Param
        for module in (unet, self.sd.vae, self.sd.text_encoder):
            # A given pipeline's weights and new LoRA adapters onto the mesh, by the rules
            # (weights already loaded into their sharding stay where they are).
            state = nnx.state(module)
            nnx.update(
                module,
                jax.device_put(state, parallel.param_shardings(state, self.mesh, self.rules)),
            )
        self._unet_def, self._unet_params, self._unet_rest = nnx.split(unet, trainable, ...)
        self._vae_def, self._vae_state = nnx.split(self.sd.vae)
        self._text_def, self._text_state = nnx.split(self.sd.text_encoder)
        ucfg = unet.config
        self.latent_shape = (ucfg.in_channels, ucfg.sample_size, ucfg.sample_size)
        self.stat_tracker = (
            PerPromptStatTracker(
                config.per_prompt_stat_tracking_buffer_size,
                config.per_prompt_stat_tracking_min_count,
            )
            if config.per_prompt_stat_tracking
            else None
        )
        self._executor = None
        if config.async_reward_computation:
            self._executor = futures.ThreadPoolExecutor(max_workers=config.max_workers)
        self._init_loop(callbacks)
        neg = "" if config.negative_prompts is None else config.negative_prompts
        self._compile()
        self.neg_prompt_embed = self._encode([neg])  # [1, S, D]

    # ------------------------------------------------------------------ pieces
    def _tokenize(self, prompts: list[str]) -> np.ndarray:
        tok = self.sd.tokenizer
        return np.asarray(
            tok(
                list(prompts),
                padding="max_length",
                max_length=tok.model_max_length,
                truncation=True,
            ).input_ids,
            np.int32,
        )

    def _encode(self, prompts: list[str]) -> jax.Array:
        return self._encode_ids(self._text_state, self._rows(self._tokenize(prompts)))

    def _rows(self, x: Any, dim: int = 0) -> Any:
        """Place every array of `x` with its dim `dim` (samples) over the mesh's `batch` rule."""
        return ddpo.place_rows(self.mesh, self.rules, x, dim)

    def _compile(self) -> None:
        c = self.config
        self._encode_ids = jax.jit(ddpo.make_encode(self._text_def))
        self._sample = jax.jit(
            ddpo.make_sample(
                c,
                self.scheduler,
                self._unet_def,
                self._vae_def,
                latent_shape=self.latent_shape,
                scaling_factor=self.sd.vae.config.scaling_factor,
                rows=self._rows,
            )
        )
        # Jitted with the state's shardings in `_ensure_state`.
        self._update_fn = ddpo.make_update(
            c,
            self.scheduler,
            ddpo.make_train_unet(self._unet_def),
            ddpo.make_optimizer(c),
            self._rows,
        )

    # ------------------------------------------------------------------ TrainLoop hooks
    def _ensure_state(self) -> None:
        if self.train_state is not None:
            return
        state = TrainState.create(
            self._unet_params,
            ddpo.make_optimizer(self.config),
            seed=self.config.seed,
            frozen={"unet": self._unet_rest},
        )
        # Params and Adam moments keep their params' shardings; scalars (step, rng, counts)
        # are replicated over the mesh.
        replicated = NamedSharding(self.mesh, PartitionSpec())
        shardings = jax.tree.map(
            lambda x: (
                x.sharding
                if isinstance(x.sharding, NamedSharding) and x.sharding.mesh == self.mesh
                else replicated
            ),
            state,
        )
        self.train_state = jax.device_put(state, shardings)
        self._jit_update = jax.jit(self._update_fn, out_shardings=(shardings, replicated))

    def _has_train_data(self) -> bool:
        return True

    def _train_iterator(self) -> _Epochs:
        return _Epochs()

    @property
    def steps_per_epoch(self) -> int:
        return 1

    @property
    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    @property
    def updates_per_epoch(self) -> int:
        c = self.config
        n = c.sample_batch_size * c.sample_num_batches_per_epoch
        return n // (c.train_batch_size * c.train_gradient_accumulation_steps)

    # The online iteration (`OnlineLoop`): each epoch samples and scores images, then trains.
    def _global_step(self, epoch: int) -> int:
        """TRL's optimizer-update count at the start of `epoch`."""
        return epoch * self.updates_per_epoch * self.config.train_num_inner_epochs

    def _rollout(self, epoch: int) -> None:
        self._epoch_rollout = self._sample_and_score(epoch, self._global_step(epoch))

    def _update(self, epoch: int, generated: bool) -> dict:
        rollout, self._epoch_rollout = self._epoch_rollout, None  # its samples are not kept
        return self._train_epoch(*rollout)

    # ------------------------------------------------------------------ DDPO
    def _epoch_key(self, epoch: int) -> jax.Array:
        return jax.random.fold_in(self.train_state.rng, epoch)

    def _generate_samples(
        self, iterations: int, batch_size: int, key: jax.Array
    ) -> tuple[dict, list, list]:
        """Sample `iterations` batches; returns (samples with leading axis N, prompt_image_data
        [[images, prompts, metadata], ...], reward results or futures per batch)."""
        state = self.train_state
        batches, pairs, rewards = [], [], []
        for i in range(iterations):
            prompts, metadata = zip(*[self.prompt_fn() for _ in range(batch_size)], strict=True)
            ids = self._tokenize(list(prompts))
            embeds = self._encode_ids(self._text_state, self._rows(ids))
            neg = self._rows(jnp.broadcast_to(self.neg_prompt_embed, embeds.shape))
            s, images = self._sample(
                state.params,
                state.frozen["unet"],
                self._vae_state,
                embeds,
                neg,
                jax.random.fold_in(key, i),
            )
            batches.append(
                {
                    "prompt_ids": ids,
                    "prompt_embeds": embeds,
                    "negative_prompt_embeds": neg,
                    "timesteps": s.timesteps,
                    "latents": s.latents,
                    "next_latents": s.next_latents,
                    "log_probs": s.log_probs,
                }
            )
            images = np.asarray(images)  # waits for this batch; the next one is dispatched after
            if self._executor is not None:
                # Submitted now, scored while the next batch samples (ddpo-pytorch / jannerm).
                # TRL v0.7.2's async path maps over the pairs only after all sampling and then
                # calls `.result()` on the reward function's return value, so it neither
                # overlaps nor works with an ordinary reward function.
                rewards.append(self._executor.submit(self.reward_fn, images, prompts, metadata))
            else:
                rewards.append(self.reward_fn(images, prompts, metadata))
            pairs.append([images, prompts, metadata])
        samples = {
            k: np.concatenate([b[k] for b in batches])
            if k == "prompt_ids"
            else jnp.concatenate([b[k] for b in batches])
            for k in batches[0]
        }
        return samples, pairs, rewards

    def step(self, epoch: int, global_step: int) -> dict:
        """One DDPO epoch (TRL `step`): sample, score, compute advantages, train. Returns the
        epoch's metrics (device arrays for the train metrics)."""
        self._ensure_state()
        return self._train_epoch(*self._sample_and_score(epoch, global_step))

    def _sample_and_score(self, epoch: int, global_step: int) -> tuple[dict, np.ndarray, jax.Array]:
        """The epoch's rollout: samples with their advantages placed on the mesh, the rewards,
        and the key of the training phase."""
        c = self.config
        key = self._epoch_key(epoch)
        sample_key, train_key = jax.random.split(key)
        samples, pairs, results = self._generate_samples(
            c.sample_num_batches_per_epoch, c.sample_batch_size, sample_key
        )
        if self._executor is not None:
            results = [r.result() for r in results]
        rewards_list, reward_meta = [], []
        for data, (r, meta) in zip(pairs, results, strict=True):
            r = np.asarray(r, np.float32).reshape(-1)
            data.extend([r, meta])
            rewards_list.append(r)
            reward_meta.append(meta)
        rewards = np.concatenate(rewards_list)
        self.last_rewards = rewards
        self._images_out(pairs, epoch, global_step)
        advantages = self._advantages(samples.pop("prompt_ids"), rewards)
        samples["advantages"] = jnp.asarray(advantages, jnp.float32)
        return self._rows(samples), rewards, train_key

    def _train_epoch(self, samples: dict, rewards: np.ndarray, train_key: jax.Array) -> dict:
        """`train_num_inner_epochs` passes of the jitted update over the epoch's samples."""
        c = self.config
        metrics_U = []
        for inner_epoch in range(c.train_num_inner_epochs):
            self.train_state, m = self._jit_update(
                self.train_state, samples, jax.random.fold_in(train_key, inner_epoch)
            )
            metrics_U.append(m)
        train = ddpo.epoch_metrics(metrics_U)
        return {
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()),
            **train,
            "inner_epoch": float(c.train_num_inner_epochs - 1),
        }

    def _advantages(self, prompt_ids: np.ndarray, rewards: np.ndarray) -> np.ndarray:
        """Per-prompt stat tracking on the decoded prompts (TRL decodes the token ids), or
        global normalisation."""
        if self.stat_tracker is None:
            return normalize_rewards(rewards)
        prompts = self.sd.tokenizer.batch_decode(prompt_ids, skip_special_tokens=True)
        return self.stat_tracker.update(prompts, rewards)

    def calculate_loss(
        self,
        latents: jax.Array,
        timesteps: jax.Array,
        next_latents: jax.Array,
        log_probs: jax.Array,
        advantages: jax.Array,
        embeds: jax.Array,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """TRL `calculate_loss` with the current params: (loss, approx_kl, clipfrac). `embeds` is
        [negative; prompt] (2B rows) when train_cfg, else the prompt embeddings."""
        c = self.config
        self._ensure_state()
        state = self.train_state
        b = latents.shape[0]
        neg, pos = (embeds[:b], embeds[b:]) if c.train_cfg else (None, embeds)
        mb = {
            "latents": latents,
            "timesteps": timesteps,
            "next_latents": next_latents,
            "log_probs": log_probs,
            "advantages": advantages,
            "prompt_embeds": pos,
            "negative_prompt_embeds": neg,
        }
        loss_fn = ddpo.make_loss(c, self.scheduler, ddpo.make_train_unet(self._unet_def))
        _, out = loss_fn(state.params, state.frozen["unet"], mb)
        return out.loss, out.approx_kl, out.clipfrac

    # ------------------------------------------------------------------ images
    def _tracker(self) -> Any:
        report = self.args.report_to
        report = [report] if isinstance(report, str) else list(report or [])
        if "wandb" in report or "all" in report:
            import wandb

            return wandb.run
        return None

    def _images_out(self, pairs: list, epoch: int, global_step: int) -> None:
        tracker = self._tracker()
        if self.image_samples_hook is not None:
            self.image_samples_hook(pairs, global_step, tracker)
        elif tracker is not None:
            import wandb

            images, prompts, _, rewards, _ = pairs[-1]
            tracker.log(
                {
                    "images": [
                        wandb.Image(np.transpose(im, (1, 2, 0)), caption=f"{p} | {r:.2f}")
                        for im, p, r in zip(images, prompts, rewards, strict=True)
                    ]
                },
                commit=False,
            )
        if self.is_world_process_zero() and epoch % self.config.save_freq == 0:
            from PIL import Image

            out = Path(self.args.output_dir) / "images" / f"epoch_{epoch}"
            out.mkdir(parents=True, exist_ok=True)
            images, prompts, _, rewards, _ = pairs[-1]
            for i, (im, r) in enumerate(zip(images, rewards, strict=True)):
                u8 = np.round(np.transpose(im, (1, 2, 0)) * 255).clip(0, 255).astype(np.uint8)
                Image.fromarray(u8).save(out / f"{i}_{r:.3f}.png")
            (out / "prompts.json").write_text(json.dumps(list(prompts)))

    # ------------------------------------------------------------------ checkpoints
    def _wandb_options(self) -> dict:
        # TRL: accelerate's init_trackers(project_name=tracker_project_name,
        # init_kwargs=tracker_kwargs), whose "wandb" entry holds wandb.init's arguments.
        kwargs = self.args.tracker_kwargs or {}
        return {"project": self.args.tracker_project_name, "init_kwargs": kwargs.get("wandb")}

    def _host_state(self) -> dict:
        # The per-prompt reward buffers: later epochs' advantages depend on them.
        if self.stat_tracker is None:
            return {}
        return {
            "stat_tracker": {k: [float(x) for x in v] for k, v in self.stat_tracker.stats.items()}
        }

    def _load_host_state(self, state: dict) -> None:
        if self.stat_tracker is None:
            return
        # Back to the float32 rewards `step` feeds the tracker (JSON holds them exactly as
        # floats): float64 buffers would move every later advantage by an ulp or so.
        self.stat_tracker.stats = {
            k: deque(np.asarray(v, np.float32), maxlen=self.stat_tracker.buffer_size)
            for k, v in state.get("stat_tracker", {}).items()
        }

    def save_model(self, output_dir: str | None = None) -> str:
        """Save the trained UNet (LoRA: the adapters in diffusers' LoRA format; else the full
        UNet as a diffusers `unet/` directory) under `output_dir` (default args.output_dir)."""
        out = Path(output_dir or self.args.output_dir)
        unet = nnx.merge(self._unet_def, self.train_state.params, self.train_state.frozen["unet"])
        if self.config.use_lora:
            save_lora_weights(unet, out)
        else:
            save_unet(unet, out / "unet")
        return str(out)

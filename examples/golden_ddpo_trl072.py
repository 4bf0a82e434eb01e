"""Golden numbers for jaxrl's DDPO pieces from TRL v0.7.2 (+ diffusers 0.24), stored in
tests/golden/ddpo_trl072.json so the tests never need the old TRL.

Run with the TRL 0.7.2 environment:
    /work/.peer-trl072/bin/python examples/golden_ddpo_trl072.py

Records, on a tiny UNet/VAE whose weights and inputs follow a deterministic numpy recipe
(`fill_weights`, `make_inputs`; the tests rebuild the same models with current diffusers):
  - TRL `scheduler_step` (DDIM step with log-prob): log-probs and prev-sample means (TRL's random
    draw is patched to zeros to expose the mean), for several timesteps and eta values;
  - TRL `pipeline_step` (the DDPO sampler, CFG, guidance 5, eta 1) with its per-step noise
    patched to fixed arrays: all latents, all log-probs and the decoded images;
  - the CFG noise prediction at the first step;
  - `DDPOTrainer.calculate_loss` (loss, approx_kl, clipfrac), with and without train_cfg.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parent.parent / "tests" / "golden" / "ddpo_trl072.json"


def _tiny_configs():
    # jaxrl's tiny pipeline configs, loaded by file path: this script runs in TRL 0.7.2's venv,
    # which has no JAX for the jaxrl package to import.
    path = Path(__file__).resolve().parent.parent / "jaxrl" / "models" / "diffusion" / "tiny.py"
    spec = importlib.util.spec_from_file_location("jaxrl_tiny_configs", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TINY = _tiny_configs()
# The tiny pipeline's UNet with a cross-attention width (12) unlike any channel count, so a
# mixed-up dimension fails loudly.
UNET = dict(TINY.UNET, cross_attention_dim=12)
# Two of the tiny VAE's four blocks: 16x16 images keep the recorded decodes small (the golden was
# recorded with the pipeline's v1 VAE, which had two); every block runs the same code.
VAE = dict(
    TINY.VAE,
    block_out_channels=(8, 16),
    down_block_types=("DownEncoderBlock2D",) * 2,
    up_block_types=("UpDecoderBlock2D",) * 2,
)
SCHEDULER = TINY.SCHEDULER
BATCH, STEPS, TOKENS, LATENT = 2, 10, 5, (4, 8, 8)
GUIDANCE, ETA = 5.0, 1.0


def fill_weights(state_dict: dict, seed: int) -> dict[str, np.ndarray]:
    """Deterministic weights for every key (sorted): norms 1 + 0.1 N(0,1), biases 0.1 N(0,1),
    other tensors N(0,1) / sqrt(fan_in)."""
    rng = np.random.default_rng(seed)
    out = {}
    for key in sorted(state_dict):
        shape = tuple(state_dict[key].shape)
        x = rng.standard_normal(shape).astype(np.float32)
        if "norm" in key and key.endswith("weight"):
            x = 1.0 + 0.1 * x
        elif key.endswith("bias") or len(shape) < 2:
            x = 0.1 * x
        else:
            x = x / math.sqrt(float(np.prod(shape[1:])))
        out[key] = x
    return out


def make_inputs() -> dict[str, np.ndarray]:
    """Fixed inputs: prompt / negative embeddings, initial latents, per-step sampler noise, and
    the step-level test tensors."""
    rng = np.random.default_rng(1234)
    f = np.float32
    return {
        "prompt_embeds": rng.standard_normal((BATCH, TOKENS, 12)).astype(f),
        "negative_prompt_embeds": rng.standard_normal((1, TOKENS, 12)).astype(f),
        "initial_latents": rng.standard_normal((BATCH, *LATENT)).astype(f),
        "step_noise": rng.standard_normal((STEPS, BATCH, *LATENT)).astype(f),
        "model_output": rng.standard_normal((BATCH, *LATENT)).astype(f),
        "sample": rng.standard_normal((BATCH, *LATENT)).astype(f),
        "prev_sample": rng.standard_normal((BATCH, *LATENT)).astype(f),
    }


# (timesteps per sample, eta) for the step-level cases; 1 is the last SD step (prev clamped to 0).
STEP_CASES = [([901, 901], 1.0), ([501, 1], 1.0), ([1, 301], 0.5)]
LOSS_CASES = [
    # step index, old log-prob offsets, advantages, train_cfg
    (3, [-2e-4, 5e-5], [-7.0, 0.8], True),
    (7, [1e-5, 3e-4], [2.0, -0.3], False),
]
STAT_BATCHES = [
    (["cat", "dog", "cat"], [1.0, 2.0, 4.0]),
    (["cat", "dog", "dog", "cat"], [0.5, 3.0, -1.0, 2.5]),
    (["cat", "cat", "bird"], [7.0, -2.0, 0.25]),
]


def main() -> None:
    import contextlib
    import types

    import diffusers
    import torch
    import trl
    import trl.models.modeling_sd_base as sd_base
    from trl import DDPOConfig, DDPOTrainer

    torch.set_grad_enabled(False)
    inputs = make_inputs()
    t = {k: torch.from_numpy(v) for k, v in inputs.items()}

    unet = diffusers.UNet2DConditionModel(**UNET).eval()
    unet.load_state_dict(
        {k: torch.from_numpy(v) for k, v in fill_weights(unet.state_dict(), 0).items()}
    )
    vae = diffusers.AutoencoderKL(**VAE).eval()
    vae.load_state_dict(
        {k: torch.from_numpy(v) for k, v in fill_weights(vae.state_dict(), 1).items()}
    )
    scheduler = diffusers.DDIMScheduler(**SCHEDULER)
    scheduler.set_timesteps(STEPS)

    # 1. One DDIM step: log-prob of a given prev_sample, and the mean (random draw patched to 0).
    zeros_randn = lambda shape, **kw: torch.zeros(shape, dtype=kw.get("dtype"))  # noqa: E731
    steps = []
    for timesteps, eta in STEP_CASES:
        ts = torch.tensor(timesteps)
        scored = sd_base.scheduler_step(
            scheduler, t["model_output"], ts, t["sample"], eta, prev_sample=t["prev_sample"]
        )
        original = sd_base.randn_tensor
        sd_base.randn_tensor = zeros_randn
        try:
            mean = sd_base.scheduler_step(scheduler, t["model_output"], ts, t["sample"], eta)
        finally:
            sd_base.randn_tensor = original
        steps.append(
            {
                "timesteps": timesteps,
                "eta": eta,
                "log_prob": scored.log_probs.tolist(),
                "prev_sample_mean": mean.latents.numpy().tolist(),
            }
        )

    # 2. The sampler with fixed per-step noise.
    pipe = diffusers.StableDiffusionPipeline(
        vae=vae,
        text_encoder=None,
        tokenizer=None,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    noise_iter = iter(t["step_noise"])
    sd_base.randn_tensor = lambda shape, **kw: next(noise_iter).clone()
    neg = t["negative_prompt_embeds"].repeat(BATCH, 1, 1)
    out = sd_base.pipeline_step(
        pipe,
        prompt_embeds=t["prompt_embeds"],
        negative_prompt_embeds=neg,
        num_inference_steps=STEPS,
        guidance_scale=GUIDANCE,
        eta=ETA,
        latents=t["initial_latents"],
        output_type="pt",
    )
    all_latents = torch.stack(out.latents, dim=1)
    all_log_probs = torch.stack(out.log_probs, dim=1)
    timesteps = scheduler.timesteps.tolist()

    t0 = scheduler.timesteps[0]
    noise = unet(
        torch.cat([t["initial_latents"]] * 2), t0, torch.cat([neg, t["prompt_embeds"]])
    ).sample
    uncond, cond = noise.chunk(2)
    cfg_noise = uncond + GUIDANCE * (cond - uncond)

    # 3. DDPOTrainer.calculate_loss on recorded transitions.
    losses = []
    for step, offsets, advantages, train_cfg in LOSS_CASES:
        config = DDPOConfig(
            sample_guidance_scale=GUIDANCE,
            sample_eta=ETA,
            train_cfg=train_cfg,
            train_clip_range=1e-4,
            train_adv_clip_max=5,
        )
        trainer = object.__new__(DDPOTrainer)
        trainer.config = config
        trainer.autocast = contextlib.nullcontext
        trainer.sd_pipeline = types.SimpleNamespace(
            unet=unet,
            scheduler_step=lambda *a, **k: sd_base.scheduler_step(scheduler, *a, **k),
        )
        embeds = torch.cat([neg, t["prompt_embeds"]]) if train_cfg else t["prompt_embeds"]
        old = all_log_probs[:, step] + torch.tensor(offsets)
        loss, approx_kl, clipfrac = trainer.calculate_loss(
            all_latents[:, step],
            torch.tensor([timesteps[step]] * BATCH),
            all_latents[:, step + 1],
            old,
            torch.tensor(advantages),
            embeds,
        )
        losses.append(
            {
                "step": step,
                "old_log_prob_offsets": offsets,
                "advantages": advantages,
                "train_cfg": train_cfg,
                "old_log_probs": old.tolist(),
                "loss": loss.item(),
                "approx_kl": approx_kl.item(),
                "clipfrac": clipfrac.item(),
            }
        )

    # 4. PerPromptStatTracker over three batches (buffer 4, min_count 3).
    from trl.trainer.utils import PerPromptStatTracker

    tracker = PerPromptStatTracker(buffer_size=4, min_count=3)
    tracker_steps = []
    for prompts, rewards in STAT_BATCHES:
        adv = tracker.update(prompts, np.asarray(rewards))
        tracker_steps.append({"prompts": prompts, "rewards": rewards, "advantages": adv.tolist()})
    stats = {k: {kk: float(vv) for kk, vv in v.items()} for k, v in tracker.get_stats().items()}

    golden = {
        "source": f"trl {trl.__version__}, diffusers {diffusers.__version__}, torch {torch.__version__}",
        "recipe": "examples/golden_ddpo_trl072.py: fill_weights(state_dict, seed 0 UNet / 1 VAE), "
        "make_inputs() (numpy default_rng(1234))",
        "unet": {k: list(v) if isinstance(v, tuple) else v for k, v in UNET.items()},
        "vae": {k: list(v) if isinstance(v, tuple) else v for k, v in VAE.items()},
        "scheduler": SCHEDULER,
        "num_inference_steps": STEPS,
        "guidance_scale": GUIDANCE,
        "eta": ETA,
        "step_cases": steps,
        "timesteps": timesteps,
        "cfg_noise_pred_step0": cfg_noise.numpy().tolist(),
        "all_latents": all_latents.numpy().tolist(),
        "all_log_probs": all_log_probs.numpy().tolist(),
        "images": out.images.numpy().tolist(),
        "loss_cases": losses,
        "stat_tracker": {"buffer_size": 4, "min_count": 3, "steps": tracker_steps, "stats": stats},
    }
    OUT.write_text(json.dumps(golden))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()

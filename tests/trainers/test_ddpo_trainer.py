"""DDPOTrainer on the package's tiny random SD pipeline: metrics against a hand computation with
the pure pieces, advantages, async rewards, resume, LoRA-only training, config checks, CLI."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import os
import signal
import subprocess
import sys
import time

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from xla_flags import with_devices

from jaxrl.algos.ddpo import SAMPLE_KEYS
from jaxrl.callbacks.base import TrainerCallback
from jaxrl.checkpoint import Checkpointer
from jaxrl.losses.ddpo import PerPromptStatTracker, ddpo_loss, normalize_rewards
from jaxrl.models.diffusion import jpeg_compressibility
from jaxrl.models.diffusion.ddim import transition_log_prob
from jaxrl.models.diffusion.hf import StableDiffusion, load_pipeline
from jaxrl.models.diffusion.lora import LoRAParam
from jaxrl.models.diffusion.tiny import TINY_PROMPTS, tiny_pipeline
from jaxrl.trainers.ddpo import DDPOTrainer
from jaxrl.trainers.ddpo_config import DDPOConfig

SMALL = dict(
    num_epochs=2,
    sample_num_steps=2,
    sample_batch_size=4,
    sample_num_batches_per_epoch=1,
    train_batch_size=2,
    train_learning_rate=1e-2,
    mixed_precision="no",
    # One device: 8 fake CPU devices on 2 cores only slow these down; the sharded trainer is
    # checked against one device in test_mesh_equals_one_device.
    mesh_fsdp=1,
)


@pytest.fixture(scope="module")
def sd_path():
    return tiny_pipeline()


@pytest.fixture(scope="module")
def sd(sd_path):
    """The pipeline loaded once; `make` gives each trainer its own copy (a trainer adds LoRA to
    its UNet and places the weights onto its mesh in place)."""
    return load_pipeline(sd_path)


def cycling_prompts():
    cyc = itertools.cycle(TINY_PROMPTS[:2])
    return lambda: (next(cyc), {})


def fresh(pipeline):
    """A path as is (the trainer loads it), or a copy of a loaded pipeline's modules."""
    if not isinstance(pipeline, StableDiffusion):
        return pipeline
    modules = ("unet", "vae", "text_encoder")
    return dataclasses.replace(pipeline, **{m: nnx.clone(getattr(pipeline, m)) for m in modules})


def make(pipeline, tmp_path, reward=jpeg_compressibility, **kw):
    cfg = DDPOConfig(**{**SMALL, "logdir": str(tmp_path), **kw})
    return DDPOTrainer(cfg, reward, cycling_prompts(), fresh(pipeline))


def recording(reward_fn, threads):
    """`reward_fn` that appends the name of the thread scoring each batch to `threads`."""

    def reward(images, prompts, metadata):
        import threading

        threads.append(threading.current_thread().name)
        return reward_fn(images, prompts, metadata)

    return reward


# One epoch of SMALL's 4 samples drawn as two batches of 2: the same update program (4 samples,
# two updates of train_batch_size 2) as SMALL, and two reward calls per epoch, so that async
# scoring of the first batch overlaps the sampling of the second.
TWO_BATCHES = dict(num_epochs=1, sample_batch_size=2, sample_num_batches_per_epoch=2)


@pytest.fixture(scope="module")
def small_trainer(sd, tmp_path_factory):
    """One trainer (built with async rewards) shared by the one-epoch tests below: each new
    trainer traces and compiles its sample and update programs again (~20 s)."""
    threads = []
    reward = recording(jpeg_compressibility, threads)
    tr = make(
        sd, tmp_path_factory.mktemp("small"), reward, **TWO_BATCHES, async_reward_computation=True
    )
    tr.reward_threads = threads
    return tr


@pytest.fixture(scope="module")
def small_run(small_trainer):
    """The epoch-0 `step` of `small_trainer` twice from the same initial state: first scoring
    rewards synchronously, then asynchronously. Each run: its metrics, rewards, the sampled
    batch (spied on `_generate_samples`), the threads that scored it, and the state after it.

    The sync run sets the trainer's reward executor aside: `async_reward_computation=False` is
    exactly `_executor = None` (DDPOTrainer.__init__), so that run takes the code path of a trainer
    built without async rewards (test_advantages_per_prompt_and_global checks that such a trainer
    has no executor), and both runs share one compiled sample and update program."""
    tr = small_trainer
    tr._ensure_state()
    state0 = tr.train_state
    generate = tr._generate_samples
    runs, captured = {}, {}

    def spy(*a, **kw):
        out = generate(*a, **kw)
        captured["samples"] = dict(out[0])
        return out

    executor = tr._executor
    assert executor is not None  # async_reward_computation=True made one
    for name, ex in (("sync", None), ("async", executor)):
        captured.clear()
        tr._generate_samples, tr._executor, tr.train_state = spy, ex, state0
        n = len(tr.reward_threads)
        metrics = tr.step(0, 0)
        runs[name] = dict(
            metrics=metrics,
            rewards=np.asarray(tr.last_rewards),
            samples=captured["samples"],
            threads=tr.reward_threads[n:],
            state=tr.train_state,
        )
    tr._generate_samples, tr._executor = generate, executor
    runs["state0"] = state0
    return runs


def test_config_checks():
    with pytest.raises(ValueError, match="greater than or equal"):
        DDPOConfig(sample_batch_size=1, train_batch_size=2, mixed_precision="no")
    with pytest.raises(ValueError, match="divisible by the train batch size"):
        DDPOConfig(sample_batch_size=3, train_batch_size=2, mixed_precision="no")
    with pytest.raises(ValueError, match="samples per epoch"):
        DDPOConfig(
            sample_batch_size=2,
            sample_num_batches_per_epoch=1,
            train_batch_size=2,
            train_gradient_accumulation_steps=2,
        )
    with pytest.raises(ValueError, match="use_8bit_adam.*optax.adamw"):
        DDPOConfig(train_use_8bit_adam=True)
    with pytest.raises(ValueError, match="mixed_precision.*dtype"):
        DDPOConfig(mixed_precision="bf16")
    with pytest.raises(ValueError, match="allow_tf32"):
        DDPOConfig(allow_tf32=False)
    with pytest.raises(ValueError, match="tensorboard"):
        DDPOConfig(log_with="tensorboard")
    cfg = DDPOConfig(
        save_freq=3, num_checkpoint_limit=2, resume_from="x/checkpoints/checkpoint-3", logdir="d"
    )
    assert (cfg.save_steps, cfg.save_total_limit, cfg.output_dir) == (3, 2, "d")
    assert cfg.resume_from_checkpoint == "x/checkpoints/checkpoint-3"
    assert cfg.num_train_epochs == 100 and cfg.num_train_timesteps == 50
    assert DDPOConfig(sample_num_steps=10, train_timestep_fraction=0.25).num_train_timesteps == 2


@functools.partial(jax.jit, static_argnums=0)
def _hand_timestep(tr, params, rest, mb):
    """(loss, ddpo_loss outputs) and grads of one timestep's micro-step on the batch `mb`."""
    c = tr.config

    def loss(p):
        out = ddpo_loss(
            transition_log_prob(
                lambda x, t, ctx: nnx.merge(tr._unet_def, p, rest)(x, t, ctx),
                tr.scheduler,
                c.sample_num_steps,
                mb["latents"],
                mb["timesteps"],
                mb["next_latents"],
                mb["prompt_embeds"],
                mb["negative_prompt_embeds"],
                guidance_scale=c.sample_guidance_scale,
                eta=c.sample_eta,
            ),
            mb["log_probs"],
            mb["advantages"],
        )
        return out.loss, out._asdict()

    return jax.value_and_grad(loss, has_aux=True)(params)


def _hand_metrics(tr, params, rest, batch):
    """Mean over all (timestep) micro-steps of ddpo_loss on `batch` with `params`, and the mean
    gradient (one compiled timestep program for every call)."""
    metrics, grads = [], []
    for j in range(tr.config.sample_num_steps):
        step_j = {k: (v[:, j] if k in SAMPLE_KEYS else v) for k, v in batch.items()}
        (_, m), g = _hand_timestep(tr, params, rest, step_j)
        metrics.append(m)
        grads.append(g)
    mean = {k: jnp.mean(jnp.stack([m[k] for m in metrics])) for k in metrics[0]}
    return mean, _mean_tree(grads)


@jax.jit
def _mean_tree(trees):
    # Jitted: eagerly, each leaf shape of the UNet's gradients would compile its own sum.
    return jax.tree.map(lambda *g: sum(g) / len(g), *trees)


@pytest.mark.slow
def test_step_metrics_equal_hand_computation(small_trainer, small_run):
    """The synchronous epoch of `small_run` (4 samples in two sampled batches, two updates of
    2): its metrics == the pure pieces by hand; calculate_loss == the pure pieces."""
    tr, run = small_trainer, small_run["sync"]
    params0, rest = small_run["state0"].params, small_run["state0"].frozen["unet"]
    # The state right after this epoch (the shared trainer may since have run another).
    tr.train_state = run["state"]
    metrics, s, rewards = run["metrics"], dict(run["samples"]), run["rewards"]
    np.testing.assert_allclose(metrics["reward_mean"], rewards.mean(), rtol=1e-6)
    np.testing.assert_allclose(metrics["reward_std"], rewards.std(), rtol=1e-6)
    s.pop("prompt_ids")
    s["advantages"] = jnp.asarray(normalize_rewards(rewards), jnp.float32)
    # The trainer's sample shuffle (same key derivation); the timestep shuffle does not change
    # a mean over all trained timesteps (train_timestep_fraction=1).
    key = jax.random.fold_in(tr.train_state.rng, 0)
    _, train_key = jax.random.split(key)
    perm_key, _ = jax.random.split(jax.random.fold_in(train_key, 0))
    perm = np.asarray(jax.random.permutation(perm_key, 4))
    first = {k: v[perm[:2]] for k, v in s.items()}
    second = {k: v[perm[2:]] for k, v in s.items()}
    m1, g1 = _hand_metrics(tr, params0, rest, first)
    c = tr.config
    tx = optax.chain(
        optax.clip_by_global_norm(c.train_max_grad_norm),
        optax.adamw(c.train_learning_rate, 0.9, 0.999, 1e-8, weight_decay=1e-4),
    )

    @jax.jit  # eagerly, every op on every leaf shape would compile on its own
    def adam_step(grads, params):
        updates, _ = tx.update(grads, tx.init(params), params)
        return optax.apply_updates(params, updates)

    params1 = adam_step(g1, params0)
    m2, _ = _hand_metrics(tr, params1, rest, second)
    assert float(m1["approx_kl"]) < 1e-9  # first update: sampling policy == trained policy
    assert float(m2["approx_kl"]) > 0 and float(m2["clipfrac"]) > 0
    for k in ("loss", "approx_kl", "clipfrac"):
        want = (float(m1[k]) + float(m2[k])) / 2
        np.testing.assert_allclose(float(metrics[k]), want, rtol=2e-3, atol=1e-7, err_msg=k)
    assert int(tr.train_state.step) == 2  # 4 samples / train_batch_size 2
    # calculate_loss (TRL signature) with the current params == the pure pieces.
    tr.train_state = tr.train_state.replace(params=params0)
    embeds = jnp.concatenate([first["negative_prompt_embeds"], first["prompt_embeds"]])
    # Under jit: the same computation, compiled as one program rather than op by op.
    loss, kl, cf = jax.jit(tr.calculate_loss)(
        first["latents"][:, 0],
        first["timesteps"][:, 0],
        first["next_latents"][:, 0],
        first["log_probs"][:, 0],
        first["advantages"],
        embeds,
    )
    np.testing.assert_allclose(float(loss), -float(jnp.mean(first["advantages"])), atol=1e-5)
    assert float(kl) < 1e-9 and float(cf) == 0.0


def test_advantages_per_prompt_and_global(sd, small_trainer, tmp_path):
    tr = make(
        sd,
        tmp_path,
        per_prompt_stat_tracking=True,
        per_prompt_stat_tracking_buffer_size=4,
        per_prompt_stat_tracking_min_count=2,
    )
    prompts = ["a photo of a cat", "a photo of a dog", "a photo of a cat", "a photo of a dog"]
    ids = tr._tokenize(prompts)
    rewards = np.array([1.0, 5.0, 3.0, 9.0], np.float32)
    got = tr._advantages(ids, rewards)
    ref = PerPromptStatTracker(4, 2)
    np.testing.assert_allclose(got, ref.update(prompts, rewards), rtol=1e-6)
    np.testing.assert_allclose(got, [-1, -1, 1, 1], atol=1e-5)  # per prompt, not global
    # Without per-prompt tracking (the shared one-epoch trainer): global normalisation.
    assert small_trainer.stat_tracker is None
    np.testing.assert_allclose(
        small_trainer._advantages(ids, rewards), normalize_rewards(rewards), rtol=1e-6
    )
    # async_reward_computation=False (the default, as here) sets up no reward executor: the
    # sync run of `small_run` takes this path.
    assert tr._executor is None


@pytest.mark.slow
def test_async_rewards_equal_sync(small_run):
    """`small_run`'s two runs of one epoch (two reward calls each): sync scores on the main
    thread, async on worker threads, with the same rewards and metrics."""
    sync, asy = small_run["sync"], small_run["async"]
    assert len(sync["threads"]) == 2 and all(t == "MainThread" for t in sync["threads"])
    assert len(asy["threads"]) == 2 and all(t != "MainThread" for t in asy["threads"])
    np.testing.assert_array_equal(sync["rewards"], asy["rewards"])
    for k in sync["metrics"]:
        np.testing.assert_allclose(
            float(asy["metrics"][k]), float(sync["metrics"][k]), rtol=1e-6, err_msg=k
        )


class _Killed(Exception):
    pass


class _KillAfterSave(TrainerCallback):
    """Dies right after the first checkpoint is written, as a preempted run would."""

    def on_save(self, args, state, control, **kwargs):
        raise _Killed


def _metric_rows(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines if "train_runtime" not in x]


def numpy_prompts():
    """TRL's example prompt function: prompts drawn from NumPy's global generator."""
    return lambda: (str(np.random.choice(TINY_PROMPTS[:2])), {})


def prompt_recording(reward_fn, seen):
    """`reward_fn` that appends each batch's prompts to `seen`."""

    def reward(images, prompts, metadata):
        seen.append(list(prompts))
        return reward_fn(images, prompts, metadata)

    return reward


@pytest.mark.slow  # end to end: full training runs
def test_resume_is_exact_and_lora_trains_only_adapters(sd, tmp_path, caplog):
    """Killed after epoch 1 and resumed == uninterrupted, bit for bit (metrics.jsonl), with
    per-prompt stat tracking (host state in the checkpoint), async rewards and prompts drawn
    from NumPy's global generator, whose state the checkpoint carries into the new process
    (was: its draws restarted, so epochs after a resume had other prompts). The resume is asked
    for as the CLI asks, `resume_from="true"`, with no warning of a changed config field."""
    kw = dict(
        # Two sampled batches of 2 per epoch, as `small_trainer`: the same compiled programs
        # (a persistent compilation cache hit where that ran first), and async scoring that
        # overlaps sampling.
        **{**TWO_BATCHES, "num_epochs": 3},
        per_prompt_stat_tracking=True,
        per_prompt_stat_tracking_min_count=2,
        async_reward_computation=True,
    )
    want_prompts, got_prompts = [], []
    full_cfg = DDPOConfig(**{**SMALL, **kw, "logdir": str(tmp_path / "full")})
    reward = prompt_recording(jpeg_compressibility, want_prompts)
    full = DDPOTrainer(full_cfg, reward, numpy_prompts(), fresh(sd))
    base0 = jax.tree.map(np.asarray, full._unet_rest)
    lora0 = jax.tree.map(np.asarray, full._unet_params)
    full.train()
    # LoRA: only LoRAParam leaves are trained; the base UNet is untouched.
    params = full.train_state.params
    assert all(isinstance(v, LoRAParam) for _, v in nnx.to_flat_state(params))
    changed = jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != b)), params, lora0)
    assert any(jax.tree.leaves(changed))
    chex.assert_trees_all_equal(full.train_state.frozen["unet"], base0, strict=True)
    run = tmp_path / "part"
    cfg = DDPOConfig(**{**SMALL, **kw, "logdir": str(run)})
    with pytest.raises(_Killed):
        DDPOTrainer(
            cfg, jpeg_compressibility, numpy_prompts(), fresh(sd), None, [_KillAfterSave()]
        ).train()
    np.random.seed(12345)  # a new process's generator, whatever it holds
    cfg = DDPOConfig(**{**SMALL, **kw, "logdir": str(run), "resume_from": "true"})
    reward = prompt_recording(jpeg_compressibility, got_prompts)
    resumed = DDPOTrainer(cfg, reward, numpy_prompts(), fresh(sd))
    caplog.clear()
    resumed.train()
    assert "changed config fields" not in caplog.text
    assert got_prompts == want_prompts[2:]  # epochs 2-3: two batches each
    want, got = _metric_rows(tmp_path / "full"), _metric_rows(run)
    assert [r["step"] for r in got] == [1, 2, 3]
    assert got == want


def brightness(images, prompts, metadata):
    # A smooth reward: a JPEG's size can jump when one pixel rounds the other way, as it may
    # when a different device layout sums in a different order.
    return images.mean(axis=(1, 2, 3)), {}


@pytest.mark.slow  # end to end: full training runs
def test_mesh_equals_one_device(sd, sd_path, tmp_path):
    """One epoch data parallel over prompts and FSDP/tensor over the UNet on a (2, 2, 2) mesh
    == the same epoch on one device: rewards, the updates' metrics and the updated params, over
    two inner epochs (the second update's ratios are far from 1: approx_kl ~ 6e3, clipfrac 1).
    Both full fine-tunes (use_lora=False): the one-device trainer's state is checked to hold the
    UNet's params, all trained."""
    kw = dict(
        num_epochs=1,
        use_lora=False,
        train_batch_size=4,
        train_num_inner_epochs=2,
        # Adam's first step is sign(grad): near-zero grads would flip with the summation order.
        train_adam_epsilon=1e-3,
    )
    one = make(sd, tmp_path / "one", brightness, mesh_fsdp=1, **kw)
    mesh = make(
        sd_path, tmp_path / "mesh", brightness, mesh_data=2, mesh_fsdp=2, mesh_tensor=2, **kw
    )
    assert one.mesh.size == 1 and dict(mesh.mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    # use_lora=False trains the UNet's own params (no LoRA leaves, conv_in among them) and
    # freezes nothing of it.
    one._ensure_state()
    flat = nnx.to_flat_state(one.train_state.params)
    assert not any(isinstance(v, LoRAParam) for _, v in flat)
    assert any("conv_in" in [str(p) for p in path] for path, _ in flat)
    assert not jax.tree.leaves(one.train_state.frozen["unet"])
    mesh._ensure_state()
    specs = [v.sharding.spec for v in jax.tree.leaves(mesh.train_state.params)]
    assert any("fsdp" in s and "tensor" in s for s in specs)  # e.g. attention q/k/v kernels
    params0 = [np.asarray(x) for x in jax.tree.leaves(mesh.train_state.params)]
    update, seen = mesh._jit_update, []

    def spy(state, samples, key):
        seen.append(samples["latents"].sharding.spec[0])
        return update(state, samples, key)

    mesh._jit_update = spy
    m_one, m_mesh = one.step(0, 0), mesh.step(0, 0)
    assert seen == [("data", "fsdp")] * 2  # 4 prompts per micro-batch, one per data x fsdp shard
    np.testing.assert_allclose(mesh.last_rewards, one.last_rewards, rtol=1e-5)
    for k in ("reward_mean", "reward_std", "loss", "approx_kl", "clipfrac"):
        # atol: the first update's loss is -mean(advantages) ~ 0, a sum of O(1) terms.
        np.testing.assert_allclose(
            float(m_mesh[k]), float(m_one[k]), rtol=1e-4, atol=5e-5, err_msg=k
        )
    p_mesh = jax.tree.leaves(mesh.train_state.params)
    moved = [not np.array_equal(np.asarray(b), a) for a, b in zip(params0, p_mesh, strict=True)]
    assert np.mean(moved) > 0.5
    # The updated params: this caught XLA's wrong sharded gradients (100%+ off, gap 0.019; see
    # `train_unet_fn`). The gradients now match to ~1e-4 relative (|dg| ~ 7e-6 after global-norm
    # clipping), and Adam's first step lr * g / (|g| + eps) moves by at most lr / eps * |dg|
    # ~ 7e-5; measured 2.5e-5 after the first update, 3.4e-5 after the second.
    chex.assert_trees_all_close(p_mesh, jax.tree.leaves(one.train_state.params), rtol=0, atol=1e-4)


@pytest.mark.slow
def test_cli_reward_rises(tmp_path):
    """`python -m jaxrl.train --algo ddpo` with its tiny defaults: the reward rises over 8 epochs
    (the last three epochs' mean beats the first three's by more than the rewards' mean spread
    within an epoch), the model and the one checkpoint are written.

    A subprocess, for its own XLA flags: the suite compiles at LLVM -O0 (tests/conftest.py), under
    which this run's 8 updates (256 UNet forwards and backwards each) take ~8 s apiece against
    ~1.3 s at -O1, which outweighs -O1's longer compile (~48 s against ~28 s) and the ~6 s of
    imports of a fresh interpreter."""
    flags = with_devices(1).replace(
        "--xla_backend_optimization_level=0", "--xla_backend_optimization_level=1"
    )
    env = {**os.environ, "XLA_FLAGS": flags}
    argv = [sys.executable, "-m", "jaxrl.train", "--algo", "ddpo", "--logdir", str(tmp_path)]
    argv += ["--save_freq", "8"]  # one checkpoint, after the 8th and last epoch (not every one)
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward_mean"] for r in rows if "reward_mean" in r]
    spread = np.mean([r["reward_std"] for r in rows if "reward_std" in r])
    assert len(rewards) == 8
    assert np.mean(rewards[-3:]) - np.mean(rewards[:3]) > spread, (rewards, spread)
    assert (tmp_path / "unet" / "config.json").exists()
    assert (tmp_path / "checkpoints" / "checkpoint-8").is_dir()


@pytest.mark.slow
def test_cli_sigterm_exits_143_and_resumes(sd_path, tmp_path, monkeypatch):
    """`python -m jaxrl.train --algo ddpo` on SIGTERM: the epoch saved, status 143 and the
    resume command on stderr, no traceback (was: `TrainingInterrupted` escaped, status 1); that
    command (`--resume_from_checkpoint true`, once taken for a path) continues the run with no
    epoch logged twice."""
    from jaxrl.train import main

    out = tmp_path / "run"
    small = ["--sample_num_steps", "2", "--sample_batch_size", "2", "--train_batch_size", "2",
             "--sample_num_batches_per_epoch", "1", "--train_gradient_accumulation_steps", "1",
             "--mesh_fsdp", "1", "--save_freq", "1000", "--logdir", str(out)]  # fmt: skip
    env = {**os.environ, "XLA_FLAGS": with_devices(1), "JAXRL_CACHE": str(sd_path.parent)}
    argv = [sys.executable, "-m", "jaxrl.train", "--algo", "ddpo", "--num_epochs", "200", *small]
    proc = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    try:
        deadline = time.time() + 600
        while not metrics.exists() or not metrics.read_text():
            assert proc.poll() is None and time.time() < deadline
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        err = proc.communicate(timeout=300)[1]
    finally:
        proc.kill()
    assert proc.returncode == 143, err[-3000:]
    assert "rerun with --resume_from_checkpoint true" in err and "Traceback" not in err
    (saved,) = Checkpointer(out / "checkpoints").all_steps()
    assert 0 < saved < 200
    monkeypatch.setenv("JAXRL_CACHE", str(sd_path.parent))
    resume = ["--num_epochs", str(saved + 1), *small, "--resume_from_checkpoint", "true"]
    assert main(["--algo", "ddpo", *resume]) == 0
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if "reward_mean" in x]
    assert [r["step"] for r in rows] == list(range(1, saved + 2))

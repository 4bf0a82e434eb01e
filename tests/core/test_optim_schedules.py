"""Every HF scheduler jaxrl accepts gives transformers' own learning rates, step for step, and the
HF optimizer names map to optax updates equal to torch's."""

import numpy as np
import pytest

from jaxrl import SFTConfig
from jaxrl.config_checks import LR_SCHEDULERS
from jaxrl.core import optim

LR, TOTAL, WARMUP = 3e-4, 40, 6
CASES = [
    ("linear", {}),
    ("cosine", {}),
    ("cosine", {"num_cycles": 1.5}),
    ("cosine_with_restarts", {"num_cycles": 3}),
    ("polynomial", {"lr_end": 1e-5, "power": 2.0}),
    ("constant", {}),
    ("constant_with_warmup", {}),
    ("inverse_sqrt", {}),
    ("inverse_sqrt", {"timescale": 15}),
    ("cosine_with_min_lr", {"min_lr": 1e-5}),
    ("cosine_with_min_lr", {"min_lr_rate": 0.1}),
    ("cosine_warmup_with_min_lr", {"min_lr_rate": 0.1}),
    ("cosine_warmup_with_min_lr", {"min_lr": 2e-5, "warmup_lr_rate": 0.05}),
    ("warmup_stable_decay", {"num_decay_steps": 10}),
    (
        "warmup_stable_decay",
        {
            "num_decay_steps": 8,
            "num_stable_steps": 20,
            "warmup_type": "1-sqrt",
            "decay_type": "linear",
            "min_lr_ratio": 0.1,
        },
    ),  # fmt: skip
    (
        "warmup_stable_decay",
        {"num_decay_steps": 12, "warmup_type": "cosine", "decay_type": "1-sqrt"},
    ),
]


def _transformers_lrs(name: str, kwargs: dict) -> np.ndarray:
    import torch
    from transformers import get_scheduler

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    sched = get_scheduler(name, opt, WARMUP, TOTAL, scheduler_specific_kwargs=dict(kwargs))
    lrs = []
    for _ in range(TOTAL + 3):  # a few steps past the end, as resumed or over-long runs see
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    return np.asarray(lrs)


@pytest.mark.parametrize(("name", "kwargs"), CASES, ids=lambda c: str(c))
def test_schedule_equals_transformers(name, kwargs):
    SFTConfig(lr_scheduler_type=name, lr_scheduler_kwargs=kwargs or None, learning_rate=LR)
    schedule = optim.make_schedule(name, LR, TOTAL, WARMUP, kwargs)
    ours = np.asarray([schedule(step) for step in range(TOTAL + 3)], np.float64)
    np.testing.assert_allclose(
        ours, _transformers_lrs(name, kwargs), rtol=2e-6, atol=1e-10
    )  # f32 near zero


def test_every_accepted_scheduler_is_checked():
    assert {name for name, _ in CASES} == set(LR_SCHEDULERS) == set(optim.SCHEDULERS)


@pytest.mark.parametrize(
    ("optim_name", "torch_cls", "torch_kw"),
    [
        ("adagrad", "Adagrad", {}),
        ("rmsprop", "RMSprop", {}),
        ("adamw_torch_fused", "AdamW", {"betas": (0.9, 0.999), "eps": 1e-8}),
    ],
)
def test_optimizer_names_match_torch(optim_name, torch_cls, torch_kw):
    import jax.numpy as jnp
    import optax
    import torch

    config = SFTConfig(optim=optim_name, weight_decay=0.01)
    rng = np.random.default_rng(0)
    w0 = rng.normal(size=(4, 3)).astype(np.float32)
    grads = [rng.normal(size=(4, 3)).astype(np.float32) for _ in range(4)]
    tx = optim.make_optimizer(
        optim=config.optax_optimizer,
        schedule=lambda _: 1e-2,
        weight_decay=config.weight_decay,
        adam_beta1=config.adam_beta1,
        adam_beta2=config.adam_beta2,
        adam_epsilon=config.adam_epsilon,
        max_grad_norm=None,
    )
    params = {"w": jnp.asarray(w0)}
    state = tx.init(params)
    for g in grads:
        updates, state = tx.update({"w": jnp.asarray(g)}, state, params)
        params = optax.apply_updates(params, updates)
    p = torch.nn.Parameter(torch.tensor(w0))
    opt = getattr(torch.optim, torch_cls)([p], lr=1e-2, weight_decay=0.01, **torch_kw)
    for g in grads:
        p.grad = torch.tensor(g)
        opt.step()
    np.testing.assert_allclose(np.asarray(params["w"]), p.detach().numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["adamw_8bit", "paged_adamw_32bit", "adamw_bnb_8bit"])
def test_quantized_state_optimizers_are_rejected(name):
    from jaxrl.config import ConfigError

    with pytest.raises(ConfigError, match="quantized"):
        SFTConfig(optim=name)

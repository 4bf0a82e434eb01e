"""`set_seed`: the host-side random generators (Python's `random`, NumPy's global generator)
seeded at once, as transformers' `set_seed`; `host_rng_state` / `set_host_rng_state` carry their
states through a checkpoint, so a resumed run draws what an uninterrupted one would.

Bottom layer: no jaxrl imports. JAX randomness never comes from here; it comes from
`config.seed` keys folded per step.
"""

from __future__ import annotations

import random

import numpy as np


def set_seed(seed: int) -> None:
    """Seed Python and NumPy (host-side shuffles); JAX randomness comes from `config.seed`."""
    random.seed(seed)
    np.random.seed(seed)


def host_rng_state() -> dict:
    """Python's and NumPy's global generator states as JSON-serialisable lists (the host part of
    HF's per-checkpoint `rng_state.pth`), for a checkpoint's metadata."""
    version, internal, gauss_next = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": [version, list(internal), gauss_next],
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
    }


def set_host_rng_state(state: dict) -> None:
    """Restore what `host_rng_state` returned, so the draws after a resume are those an
    uninterrupted run makes (HF's `_load_rng_state`)."""
    if "python" in state:
        version, internal, gauss_next = state["python"]
        random.setstate((version, tuple(internal), gauss_next))
    if "numpy" in state:
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.asarray(keys, np.uint32), pos, has_gauss, cached))

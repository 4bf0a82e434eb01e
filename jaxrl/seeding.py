"""Host-side seeding (HF's `set_seed`): Python's and NumPy's global generators, for host shuffles
and samplers that read them. JAX randomness never comes from here: it is `config.seed` folded with
the step inside the jitted programs."""

from __future__ import annotations

import random

import numpy as np


def set_seed(seed: int) -> None:
    """Seed Python and NumPy (host-side shuffles); JAX randomness comes from `config.seed`."""
    random.seed(seed)
    np.random.seed(seed)

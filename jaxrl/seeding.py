"""`set_seed`: the host-side random generators (Python's `random`, NumPy's global generator)
seeded at once, as transformers' `set_seed`.

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

"""`jaxrl.seeding.set_seed` (also `jaxrl.set_seed`): Python's and NumPy's global generators."""

from __future__ import annotations

import random

import numpy as np

import jaxrl
from jaxrl.seeding import set_seed


def test_set_seed_replays_python_and_numpy_draws():
    set_seed(3)
    first = (random.random(), np.random.permutation(10).tolist())
    set_seed(3)
    assert (random.random(), np.random.permutation(10).tolist()) == first
    set_seed(4)
    assert (random.random(), np.random.permutation(10).tolist()) != first


def test_package_root_exports_the_same_function():
    assert jaxrl.set_seed is set_seed

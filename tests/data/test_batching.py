"""BatchIterator: seeded per-epoch order, resume equality, host sharding, clear errors."""

import numpy as np
import pytest
from datasets import Dataset

from jaxrl.data import BatchIterator


def ids_of(examples):
    return [ex["i"] for ex in examples]


def make(n=10, **kw):
    kw = {"global_batch_size": 4, "seed": 0, "collate_fn": ids_of} | kw
    return BatchIterator({"i": list(range(n))}, **kw)


def test_order_is_the_seeded_epoch_permutation():
    it = make(num_epochs=2)
    assert it.steps_per_epoch == 2
    batches = list(it)
    for epoch in (0, 1):
        perm = np.random.default_rng([0, epoch]).permutation(10)
        assert batches[2 * epoch] == perm[:4].tolist()
        assert batches[2 * epoch + 1] == perm[4:8].tolist()
    assert batches[0] != batches[2]  # a new permutation each epoch
    assert list(make(shuffle=False, num_epochs=1)) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_resume_reproduces_uninterrupted_run():
    full = [next(it) for it in [make()] for _ in range(7)]
    first = make()
    head = [next(first) for _ in range(3)]
    resumed = make()
    resumed.load_state_dict(first.state_dict())
    skipped = make()
    skipped.skip(3)
    assert head + [next(resumed) for _ in range(4)] == full
    assert [next(skipped) for _ in range(4)] == full[3:]
    with pytest.raises(ValueError, match="seed"):
        make(seed=1).load_state_dict(first.state_dict())


def test_hosts_partition_each_global_batch_in_order():
    glob = make(global_batch_size=6, n=20)
    hosts = [make(global_batch_size=6, n=20, process_index=p, process_count=3) for p in range(3)]
    for step in range(7):
        parts = [h.batch_at(step) for h in hosts]
        assert all(len(p) == 2 for p in parts)
        assert sum(parts, []) == glob.batch_at(step)


def test_drop_last_false_and_dataset_input():
    ds = Dataset.from_dict({"i": list(range(10))})
    it = BatchIterator(
        ds,
        global_batch_size=4,
        seed=0,
        collate_fn=ids_of,
        shuffle=False,
        drop_last=False,
        num_epochs=1,
    )
    assert list(it) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_errors():
    with pytest.raises(ValueError, match="fewer than one global batch"):
        make(n=3)
    with pytest.raises(ValueError, match="divisible"):
        make(process_count=3)

"""Deterministic, resumable, multi-host batching of a tokenized dataset.

Global batch `g` of epoch `e` is positions `[g*G, (g+1)*G)` of the permutation
`np.random.default_rng([seed, e]).permutation(n)` (identity when not shuffling; with `lengths`,
that permutation regrouped by length as HF's `LengthGroupedSampler` does). Host `p` of `P`
takes the contiguous slice `[p*G/P, (p+1)*G/P)` of it, so every host computes the same order
without communication and the hosts' slices partition the global batch in order (what
`jax.make_array_from_process_local_data` expects). The position in the stream is one integer, the
global step, so resuming is `load_state_dict(saved)` or `skip(step)`.
"""

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import datasets
import numpy as np

CollateFn = Callable[[list[dict[str, Any]]], Any]


def length_grouped_order(
    permutation: np.ndarray, lengths: Sequence[int], batch_size: int
) -> np.ndarray:
    """HF's `get_length_grouped_indices` over a given random `permutation`: cut it into
    megabatches of `min(n // (4 * batch_size), 50)` (at least 1) times `batch_size` indices,
    sort each by length, longest first (ties keep their order), then swap the longest example of
    all to the very front, so a run that runs out of memory does so at once."""
    n = len(permutation)
    mult = max(min(n // (batch_size * 4), 50), 1)
    size = mult * batch_size
    lengths = np.asarray(lengths)
    megabatches = []
    for start in range(0, n, size):
        chunk = np.asarray(permutation[start : start + size])
        megabatches.append(chunk[np.argsort(-lengths[chunk], kind="stable")])
    longest = int(np.argmax([lengths[mb[0]] for mb in megabatches]))
    first, other = megabatches[0], megabatches[longest]
    first[0], other[0] = other[0], first[0]
    return np.concatenate(megabatches)


class BatchIterator:
    """Yields collated host-local batches forever (or for `num_epochs` epochs).

    `data` is a `datasets.Dataset` or a mapping of equal-length columns. `collate_fn` receives the
    host's examples as a list of dicts (e.g. `functools.partial(collate_sft, seq_len=..,
    pad_token_id=..)`). With `drop_last=False` the last batch of an epoch holds the remaining
    examples (fewer rows: a different shape), split across hosts as evenly as possible.
    With `lengths` (one per example) each epoch's order is `length_grouped_order` of its
    permutation, in groups of `group_batch_size` (default: the global batch). With
    `with_global_indices`, each item is `(collated, global_indices)`: the dataset indices of the
    whole global batch, which every host knows alike (e.g. to agree on a padded length without
    communicating).
    """

    def __init__(
        self,
        data: datasets.Dataset | Mapping[str, Sequence[Any]],
        *,
        global_batch_size: int,
        seed: int,
        collate_fn: CollateFn,
        shuffle: bool = True,
        drop_last: bool = True,
        process_index: int = 0,
        process_count: int = 1,
        num_epochs: int | None = None,
        lengths: Sequence[int] | None = None,
        group_batch_size: int | None = None,
        with_global_indices: bool = False,
    ) -> None:
        if isinstance(data, datasets.Dataset):
            self._num_examples = len(data)
        else:
            sizes = {len(v) for v in data.values()}
            if len(sizes) != 1:
                raise ValueError("BatchIterator columns must all have the same length.")
            self._num_examples = sizes.pop()
        if global_batch_size < 1:
            raise ValueError(f"global_batch_size must be >= 1, got {global_batch_size}.")
        if not 0 <= process_index < process_count:
            raise ValueError(f"process_index {process_index} is not in [0, {process_count}).")
        if global_batch_size % process_count:
            raise ValueError(
                f"global_batch_size ({global_batch_size}) must be divisible by the number of "
                f"processes ({process_count}); change per_device_train_batch_size or "
                "gradient_accumulation_steps."
            )
        if self._num_examples < global_batch_size and drop_last:
            raise ValueError(
                f"The dataset has {self._num_examples} examples, fewer than one global batch "
                f"({global_batch_size}); lower the batch size or use more data."
            )
        if self._num_examples == 0:
            raise ValueError("The dataset is empty.")
        self._data = data
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.process_index = process_index
        self.process_count = process_count
        self.num_epochs = num_epochs
        if lengths is not None and len(lengths) != self._num_examples:
            raise ValueError(
                f"Got {len(lengths)} lengths for {self._num_examples} examples; give one per "
                "example."
            )
        self.lengths = None if lengths is None else np.asarray(lengths)
        self.group_batch_size = group_batch_size or global_batch_size
        self._cached_order: tuple[int | None, np.ndarray | None] = (None, None)
        self._collate_fn = collate_fn
        self.with_global_indices = with_global_indices
        self.step = 0

    @property
    def steps_per_epoch(self) -> int:
        full, rest = divmod(self._num_examples, self.global_batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    @property
    def epoch(self) -> int:
        """Epoch of the next batch."""
        return self.step // self.steps_per_epoch

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self._num_examples)
        if self._cached_order[0] != epoch:  # every batch of an epoch reads the same order
            order = np.random.default_rng([self.seed, epoch]).permutation(self._num_examples)
            if self.lengths is not None:
                order = length_grouped_order(order, self.lengths, self.group_batch_size)
            self._cached_order = (epoch, order)
        return self._cached_order[1]

    def global_indices_at(self, step: int) -> np.ndarray:
        """Dataset indices of global batch `step` (counted from 0), every host's share in order."""
        epoch, b = divmod(step, self.steps_per_epoch)
        return self._order(epoch)[b * self.global_batch_size : (b + 1) * self.global_batch_size]

    def indices_at(self, step: int) -> np.ndarray:
        """Dataset indices of this host's share of global batch `step` (counted from 0)."""
        return self.host_share(self.global_indices_at(step))

    def host_share(self, global_idx: np.ndarray) -> np.ndarray:
        """This host's contiguous slice of a global batch's indices (possibly empty in an epoch's
        last batch when it holds fewer examples than there are hosts)."""
        return np.array_split(global_idx, self.process_count)[self.process_index]

    def batch_at(self, step: int) -> Any:
        """The collated host-local batch at global step `step` (with `with_global_indices`, and
        the global batch's indices); does not move the iterator."""
        global_idx = self.global_indices_at(step)
        idx = self.host_share(global_idx).tolist()
        if isinstance(self._data, datasets.Dataset):
            columns = self._data[idx]
        else:
            columns = {k: [v[i] for i in idx] for k, v in self._data.items()}
        examples = [
            dict(zip(columns, values, strict=True))
            for values in zip(*columns.values(), strict=True)
        ]
        batch = self._collate_fn(examples)
        return (batch, global_idx) if self.with_global_indices else batch

    def skip(self, num_batches: int) -> None:
        """Advance past `num_batches` batches without reading them."""
        if num_batches < 0:
            raise ValueError(f"Cannot skip a negative number of batches ({num_batches}).")
        self.step += num_batches

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "seed": self.seed, "global_batch_size": self.global_batch_size}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Resume at a saved position; refuses a state saved with another seed or batch size."""
        for key in ("seed", "global_batch_size"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"Data state was saved with {key}={state[key]} but this run uses "
                    f"{getattr(self, key)}; resuming would replay different batches."
                )
        self.step = int(state["step"])

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        if self.num_epochs is not None and self.step >= self.num_epochs * self.steps_per_epoch:
            raise StopIteration
        batch = self.batch_at(self.step)
        self.step += 1
        return batch

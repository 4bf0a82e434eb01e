"""Deterministic, resumable, multi-host batching of a tokenized dataset.

Global batch `g` of epoch `e` is positions `[g*G, (g+1)*G)` of the permutation
`np.random.default_rng([seed, e]).permutation(n)` (identity when not shuffling). Host `p` of `P`
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


class BatchIterator:
    """Yields collated host-local batches forever (or for `num_epochs` epochs).

    `data` is a `datasets.Dataset` or a mapping of equal-length columns. `collate_fn` receives the
    host's examples as a list of dicts (e.g. `functools.partial(collate_sft, seq_len=..,
    pad_token_id=..)`). With `drop_last=False` the last batch of an epoch holds the remaining
    examples (fewer rows: a different shape), split across hosts as evenly as possible.
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
    ) -> None:
        if isinstance(data, datasets.Dataset):
            self._num_examples = len(data)
        else:
            lengths = {len(v) for v in data.values()}
            if len(lengths) != 1:
                raise ValueError("BatchIterator columns must all have the same length.")
            self._num_examples = lengths.pop()
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
        self._collate_fn = collate_fn
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
        return np.random.default_rng([self.seed, epoch]).permutation(self._num_examples)

    def indices_at(self, step: int) -> np.ndarray:
        """Dataset indices of this host's share of global batch `step` (counted from 0)."""
        epoch, b = divmod(step, self.steps_per_epoch)
        global_idx = self._order(epoch)[
            b * self.global_batch_size : (b + 1) * self.global_batch_size
        ]
        return np.array_split(global_idx, self.process_count)[self.process_index]

    def batch_at(self, step: int) -> Any:
        """The collated host-local batch at global step `step`; does not move the iterator."""
        idx = self.indices_at(step).tolist()
        if isinstance(self._data, datasets.Dataset):
            columns = self._data[idx]
        else:
            columns = {k: [v[i] for i in idx] for k, v in self._data.items()}
        examples = [
            dict(zip(columns, values, strict=True))
            for values in zip(*columns.values(), strict=True)
        ]
        return self._collate_fn(examples)

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

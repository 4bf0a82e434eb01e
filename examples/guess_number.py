"""An `environment_factory` environment for GRPO/RLOO (TRL 1.16's semantics): find a hidden number
between 1 and 100 with a `guess` tool that answers "higher", "lower" or "correct". Plain Python,
stateful, no network.

The trainer makes one `GuessNumber` per rollout, calls `reset(**example)` before each batch (the
example's `target` column is the hidden number; the string returned is appended to the user
message), exposes `guess` as the model's tool, and scores the rollout with `get_reward()`
(1 / number of guesses once found, 0 otherwise), logged as `rewards/GuessNumber/mean`.

    from guess_number import GuessNumber, dataset
    trainer = GRPOTrainer(model, reward_funcs=None, train_dataset=dataset(64),
                          environment_factory=GuessNumber, processing_class=tokenizer, args=...)

or from the command line, with a tool-calling chat model and a dataset with `prompt` and `target`
columns: `PYTHONPATH=examples python -m jaxrl.train --algo grpo --model_name_or_path MODEL
--dataset_name DATA --environment_factory guess_number:GuessNumber`.
"""

from __future__ import annotations

import random

LOW, HIGH = 1, 100


class GuessNumber:
    """The guessing game; state: the hidden number, the guesses so far, whether it was found."""

    def __init__(self) -> None:
        self.target = LOW
        self.guesses = 0
        self.solved = False

    def reset(self, target: int | None = None, **example) -> str:
        self.target = random.randint(LOW, HIGH) if target is None else int(target)
        self.guesses = 0
        self.solved = False
        return (
            f" A number between {LOW} and {HIGH} is hidden. Find it with the `guess` tool, in as "
            "few guesses as you can."
        )

    def guess(self, number: int) -> str:
        """Guess the hidden number.

        Args:
            number: The guess, an integer between 1 and 100.
        """
        if not LOW <= number <= HIGH:
            raise ValueError(f"The guess must be between {LOW} and {HIGH}.")
        if self.solved:
            return "The number was already found."
        self.guesses += 1
        if number == self.target:
            self.solved = True
            return "correct"
        return "higher" if number < self.target else "lower"

    def get_reward(self) -> float:
        return 1.0 / self.guesses if self.solved else 0.0


def dataset(n: int, seed: int = 0):
    """`n` games: a user prompt and the hidden `target` (a `datasets.Dataset`)."""
    import datasets  # only for building the dataset

    rng = random.Random(seed)
    rows = [
        {"prompt": [{"role": "user", "content": "Let's play."}], "target": rng.randint(LOW, HIGH)}
        for _ in range(n)
    ]
    return datasets.Dataset.from_list(rows)

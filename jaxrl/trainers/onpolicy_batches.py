"""Which prompts each optimizer step of the online trainers (GRPO, RLOO) consumes: `StepPlan`,
`GenerationBatches` (TRL's `RepeatSampler` order over generation batches, `.skip(n)` on resume)
and `OnPolicyBatchesMixin`, the trainer's batch sizes, prompt iterator and steps per epoch.

`OnPolicyBatchesMixin` is one of the pieces `jaxrl.trainers.onpolicy.OnPolicyTrainer` is
composed of. Host-side bookkeeping of indices only: no sampling, no scoring, no model, no traced
code; it does not import `jaxrl.trainers.onpolicy`.
"""

from __future__ import annotations

import dataclasses

from jaxrl.data.batching import BatchIterator


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What one optimizer step consumes: the prompt batch of generation `generation`, whether
    this step starts its cycle, and the buffer slice of each micro-step."""

    generation: int
    starts_cycle: bool
    examples: list[dict]
    slices: tuple[int, ...]


class GenerationBatches:
    """Per optimizer step, a `StepPlan` (TRL `RepeatSampler` order); `.skip(n)` for resume."""

    def __init__(
        self, prompts: BatchIterator, *, generate_every: int, steps_per_generation: int, accum: int
    ):
        self.prompts = prompts
        self.generate_every = generate_every
        self.steps_per_generation = steps_per_generation
        self.accum = accum
        self.step = 0

    def skip(self, n: int) -> None:
        self.step += n

    def __iter__(self):
        return self

    def __next__(self) -> StepPlan:
        m0 = self.step * self.accum  # first micro-step of this optimizer step
        generation = m0 // self.generate_every
        self.step += 1
        return StepPlan(
            generation=generation,
            starts_cycle=m0 % self.generate_every == 0,
            examples=self.prompts.batch_at(generation),
            slices=tuple((m0 + j) % self.steps_per_generation for j in range(self.accum)),
        )


class OnPolicyBatchesMixin:
    """`OnPolicyTrainer`'s sizes and train iterator (reads `generation_batch_size`,
    `generate_every`, `steps_per_generation`, set by `OnPolicyTrainer.__init__`)."""

    # ----------------------------------------------------------------- sizes and iteration
    @property
    def train_batch_size(self) -> int:
        return (
            self.args.per_device_train_batch_size * self.dp * self.args.gradient_accumulation_steps
        )

    @property
    def prompts_per_generation(self) -> int:
        return self.generation_batch_size // self.args.num_generations

    def _prompt_iterator(self) -> BatchIterator:
        return BatchIterator(
            self.train_dataset,
            global_batch_size=self.prompts_per_generation,
            seed=self.args.seed,
            shuffle=self.args.shuffle_dataset,
            drop_last=True,
            collate_fn=list,
        )

    @property
    def steps_per_epoch(self) -> int:
        n_gen = self._prompt_iterator().steps_per_epoch
        return max(1, n_gen * self.generate_every // self.args.gradient_accumulation_steps)

    def _train_iterator(self) -> GenerationBatches:
        return GenerationBatches(
            self._prompt_iterator(),
            generate_every=self.generate_every,
            steps_per_generation=self.steps_per_generation,
            accum=self.args.gradient_accumulation_steps,
        )

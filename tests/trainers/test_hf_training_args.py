"""HF `TrainingArguments` fields the offline trainers implement with transformers 5.23 / TRL 1.16
semantics: `neftune_noise_alpha`, `eval_delay`, `data_seed`, `include_num_input_tokens_seen`,
`train_sampling_strategy` and `length_column_name`. References are transformers' and TRL's own
code (their samplers, collators and flow callback) wherever it runs without a model."""

import functools

import jax
import numpy as np
import pytest
import torch
from flax import nnx
from trainer_utils import base_args, killed_after_checkpoint, tiny_config, train_logs

from jaxrl import DPOConfig, DPOTrainer, RewardConfig, RewardTrainer, SFTConfig, SFTTrainer
from jaxrl.algos import neftune
from jaxrl.callbacks.base import DefaultFlowCallback, TrainerControl, TrainerState
from jaxrl.config import ConfigError
from jaxrl.config_cli import parse_config
from jaxrl.data.batching import length_grouped_order
from jaxrl.data.collate import (
    collate_preference,
    collate_preference_shared,
    collate_reward,
    collate_sft,
    trl_input_tokens,
)
from jaxrl.data.packing import pack_bfd
from jaxrl.models.hf_config import config_from_hf
from jaxrl.models.layers import Embed
from jaxrl.trainers.grpo_config import GRPOConfig

PAD = 0


def sft(tmp_path, tokenizer, data, eval_data=None, callbacks=None, **kw):
    trainer = SFTTrainer(
        tiny_config(),
        args=SFTConfig(**base_args(tmp_path, **kw)),
        train_dataset=data,
        eval_dataset=eval_data,
        processing_class=tokenizer,
        callbacks=callbacks,
    )
    trainer.train()
    return trainer


def eval_logs(trainer) -> list[dict]:
    return [h for h in trainer.state.log_history if "eval_loss" in h]


def _token_rows(seed: int, n: int, low: int = 2, high: int = 20) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 16, rng.integers(low, high)).tolist() for _ in range(n)]


# ----------------------------------------------------------------------------- NEFTune


class Embeddings(nnx.Module):
    """A "model" whose forward returns its token embeddings (so the noise can be read off) and,
    as GPT-2 adds them, its position embeddings."""

    def __init__(self):
        config = config_from_hf(tiny_config())
        self.tokens = Embed(16, 32, "vocab", config, nnx.Rngs(0))
        self.positions = Embed(64, 32, "position", config, nnx.Rngs(1))

    def hidden_states(self, input_ids_BT, attention_mask=None, positions=None, segment_ids=None):
        return self.tokens(input_ids_BT), self.positions(positions)


@functools.cache
def _embeddings() -> Embeddings:
    return Embeddings()


def _noise_per_row(batch_rows, example_mask, per_device, multiple_of, alpha=5.0):
    """The noise [R, T, D] a training forward adds to the token embeddings of `batch_rows`."""
    policy = _embeddings()
    params = nnx.state(policy)
    seg = batch_rows.get("segment_ids")

    @jax.jit
    def forwards(ids, pos, seg, mask):
        clean = policy.hidden_states(ids, None, pos, seg)
        with neftune.training_noise(
            params, jax.random.key(3), alpha, mask, per_device, multiple_of
        ):
            noisy = neftune.noisy_policy(policy, params).hidden_states(ids, None, pos, seg)
            # A model built from other params (a reference) stays clean.
            ref = neftune.noisy_policy(policy, nnx.state(policy)).hidden_states(ids, None, pos, seg)
        return clean, noisy, ref

    clean, noisy, ref = forwards(
        batch_rows["input_ids"], batch_rows["positions"], seg, np.asarray(example_mask)
    )
    np.testing.assert_array_equal(ref[0], clean[0])
    np.testing.assert_array_equal(noisy[1], clean[1])  # the position table is never noised
    assert not np.array_equal(noisy[0], clean[0])
    return np.asarray(noisy[0] - clean[0])


def _check_bound(noise_RTD, trl_lengths_R, alpha=5.0):
    d = noise_RTD.shape[-1]
    for row, length in zip(noise_RTD, trl_lengths_R, strict=True):
        bound = alpha / np.sqrt(length * d)
        # U(-m, m): never beyond m, and over ~1000 draws its extremes come within 5% of it.
        assert np.abs(row).max() <= bound * (1 + 1e-6)
        assert np.abs(row).max() >= 0.95 * bound
        assert abs(row.mean()) < 0.1 * bound  # zero-mean


def test_neftune_noise_bound_follows_trl_padded_batches():
    """m = alpha / sqrt(T * D) with T the length TRL's collator pads each device's rows to
    (its longest, rounded up to pad_to_multiple_of; one flattened row when padding-free), read
    off the noise a training forward adds; reference forwards are untouched."""
    from trl.trainer.dpo_trainer import DataCollatorForPreference
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    rows = _token_rows(0, 8)
    rows[5] = rows[5] + [7] * (31 - len(rows[5]))  # one long row on the second device
    batch = collate_sft([{"input_ids": r} for r in rows], 32, PAD)
    mask = np.ones(8, np.float32)
    noise = _noise_per_row(batch, mask, per_device=4, multiple_of=8)
    trl = DataCollatorForLanguageModeling(pad_token_id=PAD, pad_to_multiple_of=8)
    want = [trl([{"input_ids": r} for r in rows[d : d + 4]])["input_ids"].shape[1] for d in (0, 4)]
    assert want == [24, 32]
    _check_bound(noise, [want[0]] * 4 + [want[1]] * 4)

    # Best-fit packed rows: TRL's padding-free mode flattens each device's rows into one row.
    packed = pack_bfd({"input_ids": _token_rows(1, 20)}, 24)
    examples = [{k: packed[k][i] for k in packed.column_names} for i in range(4)]
    batch = collate_sft(examples, 24, PAD)
    noise = _noise_per_row(batch, np.ones(4, np.float32), per_device=2, multiple_of=None)
    trl = DataCollatorForLanguageModeling(pad_token_id=PAD, padding_free=True)
    want = [
        trl([{"input_ids": e["input_ids"]} for e in examples[d : d + 2]])["input_ids"].shape[1]
        for d in (0, 2)
    ]
    _check_bound(noise, [want[0]] * 2 + [want[1]] * 2)

    # DPO rows (chosen rows, then rejected rows): a device pads its pairs' four rows together.
    pairs = [
        {"prompt_input_ids": p, "chosen_input_ids": c, "rejected_input_ids": r}
        for p, c, r in zip(
            _token_rows(2, 4, 2, 6), _token_rows(3, 4), _token_rows(4, 4), strict=True
        )
    ]
    batch = collate_preference(pairs, 32, PAD)
    noise = _noise_per_row(batch, np.ones(4, np.float32), per_device=2, multiple_of=None)
    trl = DataCollatorForPreference(pad_token_id=PAD)
    as_trl = [
        {"prompt_ids": e["prompt_input_ids"], "chosen_ids": e["chosen_input_ids"],
         "rejected_ids": e["rejected_input_ids"]}
        for e in pairs
    ]  # fmt: skip
    want = [trl(as_trl[d : d + 2])["input_ids"].shape[1] for d in (0, 2)]
    _check_bound(noise, [want[0]] * 2 + [want[1]] * 2 + [want[0]] * 2 + [want[1]] * 2)


def _step_tokens(trainer) -> list[float]:
    """Each step's training tokens (TRL's num_tokens per step): a fingerprint of its batch."""
    totals = [h["num_tokens"] for h in train_logs(trainer)]
    return list(np.diff([0.0, *totals]))


def test_neftune_and_data_seed(tmp_path, tokenizer, sft_data):
    """One clean run (seed 0) is the reference of two checks (one trainer fewer than a clean
    run for each).

    NEFTune: the noise changes training steps (from the step's key: two runs agree bit for
    bit) and never an evaluation: eval_on_start (the same params) gives the same eval_loss with
    or without it; predict() at the trained params is the clean forward of those params.

    data_seed: changes only the data order. The same seed with another data_seed: the same
    initial model (eval before training), another data order; data_seed=0 with seed=5: the
    batches of seed 0, from another initial model."""
    data, eval_data = sft_data[0], sft_data[1].select(range(4))
    kw = dict(max_steps=3, eval_strategy="steps", eval_steps=3, eval_on_start=True)
    base = sft(tmp_path / "a", tokenizer, data, eval_data, seed=0, **kw)

    # NEFTune.
    noisy = sft(tmp_path / "b", tokenizer, data, eval_data, neftune_noise_alpha=5.0, **kw)
    again = sft(tmp_path / "c", tokenizer, data, eval_data, neftune_noise_alpha=5.0, **kw)
    assert eval_logs(noisy)[0]["eval_loss"] == eval_logs(base)[0]["eval_loss"]
    assert train_logs(noisy)[0]["loss"] != pytest.approx(train_logs(base)[0]["loss"], rel=1e-4)
    for x, y in zip(train_logs(noisy), train_logs(again), strict=True):
        assert x["loss"] == y["loss"] and x["grad_norm"] == y["grad_norm"]
    assert eval_logs(noisy)[-1]["eval_loss"] == eval_logs(again)[-1]["eval_loss"]
    with_noise = noisy.predict(eval_data).metrics["test_loss"]
    assert with_noise == pytest.approx(eval_logs(noisy)[-1]["eval_loss"], rel=1e-6)

    # data_seed.
    other_data = sft(tmp_path / "d", tokenizer, data, eval_data, seed=0, data_seed=11, **kw)
    same_data = sft(tmp_path / "e", tokenizer, data, eval_data, seed=5, data_seed=0, **kw)
    assert eval_logs(other_data)[0]["eval_loss"] == eval_logs(base)[0]["eval_loss"]
    assert _step_tokens(other_data) != _step_tokens(base)
    assert _step_tokens(same_data) == _step_tokens(base)
    assert eval_logs(same_data)[0]["eval_loss"] != eval_logs(base)[0]["eval_loss"]


@pytest.mark.slow
def test_neftune_resume_is_bit_exact_and_does_not_depend_on_the_mesh(tmp_path, tokenizer, sft_data):
    """One noisy run (2 data-parallel devices x 2 micro-batches of 4, 4 steps through 64 rows)
    is the reference of two checks (one trainer fewer than a run for each).

    Resume: killed after step 2 (a checkpoint, mid-epoch), resumed: steps 3-4 (noise, loss,
    token count) are those of the uninterrupted run.

    Mesh: the same devices' batches on another mesh layout (data-parallel vs fsdp x tensor):
    the same noise, so the same losses up to float reduction order (steps 1-2; the learning
    rate is constant, so a 2-step run's steps are the 4-step run's first two)."""
    kw = dict(
        save_strategy="steps",
        save_steps=2,
        neftune_noise_alpha=5.0,
        include_num_input_tokens_seen="non_padding",
        gradient_accumulation_steps=2,
        per_device_train_batch_size=4,
    )
    data = sft_data[0]
    full = sft(tmp_path / "a", tokenizer, data, max_steps=4, mesh_data=2, **kw)
    killed_after_checkpoint(tmp_path / "a", 2, tmp_path / "b")
    resumed = sft(
        tmp_path / "b", tokenizer, data, max_steps=4, mesh_data=2, resume_from_checkpoint=True,
        **kw,
    )  # fmt: skip
    want = train_logs(full)[2:]
    got = [h for h in train_logs(resumed) if h["step"] > 2]
    assert [h["step"] for h in got] == [3, 4]
    for x, y in zip(want, got, strict=True):
        for k in ("loss", "grad_norm", "num_input_tokens_seen"):
            assert x[k] == y[k], k

    kw["save_strategy"] = "no"
    other = sft(tmp_path / "c", tokenizer, data, max_steps=2, mesh_fsdp=2, mesh_tensor=2, **kw)
    assert len(train_logs(other)) == 2
    for x, y in zip(train_logs(full)[:2], train_logs(other), strict=True):
        for k in ("loss", "grad_norm"):
            np.testing.assert_allclose(x[k], y[k], rtol=2e-5, err_msg=k)


@pytest.mark.slow
def test_neftune_never_noises_the_dpo_reference(tmp_path, tokenizer, pref_data):
    """With noise on, the live reference forward gives what the precomputed (clean) reference
    log-probs give: the first step's metrics agree. Reward training is noised too.

    The DPO pair also runs HF's length-grouped sampler over a length column (one trainer fewer
    than a run of its own): its first step trains the pairs HF's sampler puts first, their four
    TRL rows' real tokens (prompt twice) are the step's count. (test_sampling_strategy_choices
    checks the refusal without the column.)"""
    # A length column: HF infers lengths from 'input_ids' only.
    data = pref_data[0].select(range(16)).add_column("length", list(range(16)))
    kw = dict(
        max_steps=1,
        neftune_noise_alpha=5.0,
        train_sampling_strategy="group_by_length",
        per_device_train_batch_size=2,
        include_num_input_tokens_seen="non_padding",
    )
    runs = {}
    for precompute in (False, True):
        trainer = DPOTrainer(
            tiny_config(),
            args=DPOConfig(
                **base_args(tmp_path / str(precompute), precompute_ref_log_probs=precompute, **kw)
            ),
            train_dataset=data,
            processing_class=tokenizer,
        )
        trainer.train()
        runs[precompute] = train_logs(trainer)[0]
    for k in ("loss", "rewards/chosen", "rewards/rejected", "logps/chosen"):
        assert runs[False][k] == pytest.approx(runs[True][k], rel=1e-5, abs=1e-6), k
    # Policy == reference at step 1: only the policy's noise makes its rewards non-zero.
    assert abs(runs[False]["rewards/chosen"]) > 1e-4

    # The length-grouped order.
    first = _hf_grouped(list(range(16)), 2, seed=0)[:2]
    ds = trainer.train_dataset
    want = sum(
        2 * len(ds[i]["prompt_input_ids"])
        + len(ds[i]["chosen_input_ids"])
        + len(ds[i]["rejected_input_ids"])
        for i in first
    )
    assert first[0] == 15  # the longest first
    assert runs[False]["num_input_tokens_seen"] == runs[True]["num_input_tokens_seen"] == want

    # Reward training: the first step's noised loss is not the clean loss at the same params
    # and rows. The clean loss is an evaluation before training (never noised, see
    # test_neftune_and_data_seed) on the step's 8 rows (one batch of all of them, so the same
    # mean in any order): one reward trainer fewer than a clean run of its own.
    data = pref_data[0].select(range(8))
    reward = RewardTrainer(
        tiny_config(),
        args=RewardConfig(
            **base_args(
                tmp_path / "rm", max_steps=1, neftune_noise_alpha=5.0, per_device_eval_batch_size=8
            )
        ),
        train_dataset=data,
        eval_dataset=data,
        processing_class=tokenizer,
    )
    clean = reward.evaluate()["eval_loss"]
    reward.train()
    assert train_logs(reward)[0]["loss"] != pytest.approx(clean, rel=1e-5)


def test_neftune_is_rejected_where_not_implemented():
    with pytest.raises(ConfigError, match="neftune_noise_alpha=5.0"):
        GRPOConfig(output_dir="x", neftune_noise_alpha=5.0)
    with pytest.raises(ConfigError, match="neftune_noise_alpha"):
        SFTConfig(output_dir="x", neftune_noise_alpha=-1.0)


# ----------------------------------------------------------------------------- eval_delay


@pytest.mark.parametrize(
    "strategy, eval_steps, delay",
    [("steps", 2, 0), ("steps", 2, 3), ("steps", 3, 5.5), ("epoch", None, 1.5)],
)
def test_eval_delay_flow_matches_transformers(tmp_path, strategy, eval_steps, delay):
    """Which steps evaluate, step by step through 3 epochs of 4 steps, as transformers'
    DefaultFlowCallback decides with the same arguments."""
    from transformers import TrainingArguments
    from transformers.trainer_callback import DefaultFlowCallback as HFFlow
    from transformers.trainer_callback import TrainerControl as HFControl
    from transformers.trainer_callback import TrainerState as HFState

    common = dict(eval_strategy=strategy, eval_steps=eval_steps, eval_delay=delay)
    hf_args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", **common)
    args = SFTConfig(output_dir=str(tmp_path), **common)
    hf_state, state = HFState(max_steps=12, eval_steps=eval_steps or 0), TrainerState(max_steps=12)
    state.compute_steps(args, 12)
    got, want = [], []
    for step in range(1, 13):
        for s, flow, control, out in (
            (state, DefaultFlowCallback(), TrainerControl(), got),
            (hf_state, HFFlow(), HFControl(), want),
        ):
            s.global_step, s.epoch = step, step / 4
            flow.on_step_end(args if out is got else hf_args, s, control)
            if step % 4 == 0:
                flow.on_epoch_end(args if out is got else hf_args, s, control)
            if control.should_evaluate:
                out.append(step)
    assert got == want
    assert (min(got) if got else 13) >= (delay if strategy == "steps" else delay * 4)


# ----------------------------------------------------------------------------- data order


def test_length_grouped_order_is_transformers_sampler():
    """HF's get_length_grouped_indices, fed the same random permutation."""
    from unittest import mock

    from transformers.trainer_pt_utils import get_length_grouped_indices

    rng = np.random.default_rng(0)
    for n, batch_size in [(100, 4), (37, 8), (1000, 3), (5, 8), (400, 2)]:
        lengths = rng.integers(1, 20, n).tolist()
        perm = np.random.default_rng([1, 0]).permutation(n)
        with mock.patch("torch.randperm", lambda n, generator=None, p=perm: torch.as_tensor(p)):
            want = get_length_grouped_indices(lengths, batch_size)
        assert length_grouped_order(perm, lengths, batch_size).tolist() == want


def _hf_grouped(lengths, batch_size, seed, epoch=0):
    from unittest import mock

    from transformers.trainer_pt_utils import LengthGroupedSampler

    perm = np.random.default_rng([seed, epoch]).permutation(len(lengths))
    with mock.patch("torch.randperm", lambda n, generator=None: torch.as_tensor(perm)):
        return list(LengthGroupedSampler(batch_size, lengths=list(lengths)))


def test_group_by_length_batches_are_hf_length_grouped(tmp_path, tokenizer, sft_data):
    """Each step trains on the examples HF's LengthGroupedSampler puts there (megabatches of
    per_device_train_batch_size x gradient_accumulation_steps, seeded by data_seed), read off the
    logged real-token counts; a `length` column in the dataset decides the grouping instead."""
    # 60 examples: megabatches of 3 x 4 (HF's size, 4 = 2 per device x 2 accumulation steps)
    # differ from the 7 x 2 that grouping by the per-device batch alone would give.
    data = sft_data[0].select(range(60))
    kw = dict(
        max_steps=4,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        train_sampling_strategy="group_by_length",
        include_num_input_tokens_seen="non_padding",
        data_seed=3,
    )
    trainer = sft(tmp_path / "a", tokenizer, data, **kw)
    lengths = [len(x) for x in trainer.train_dataset["input_ids"]]
    order = _hf_grouped(lengths, 4, seed=3)
    want = np.cumsum([sum(lengths[i] for i in order[s * 4 : (s + 1) * 4]) for s in range(4)])
    assert [h["num_input_tokens_seen"] for h in train_logs(trainer)] == want.tolist()
    # The first batch holds the longest example and the batches shrink within a megabatch.
    assert max(lengths) in [lengths[i] for i in order[:4]]

    column = [-n for n in lengths]  # a length column that sorts the other way round
    by_column = sft(tmp_path / "b", tokenizer, data.add_column("length", column), **kw)
    order = _hf_grouped(column, 4, seed=3)
    want = np.cumsum([sum(lengths[i] for i in order[s * 4 : (s + 1) * 4]) for s in range(4)])
    assert [h["num_input_tokens_seen"] for h in train_logs(by_column)] == want.tolist()


def test_sampling_strategy_choices(tmp_path, tokenizer, pref_data):
    """The refusals; a DPO run with a length column is checked in
    test_neftune_never_noises_the_dpo_reference."""
    with pytest.raises(ConfigError, match="batch_rebalance.*one row length"):
        SFTConfig(output_dir="x", train_sampling_strategy="batch_rebalance")
    with pytest.raises(ConfigError, match="train_sampling_strategy='x'"):
        SFTConfig(output_dir="x", train_sampling_strategy="x")
    with pytest.raises(ConfigError, match="shuffle_dataset"):
        GRPOConfig(output_dir="x", train_sampling_strategy="sequential")
    # HF infers lengths from 'input_ids' only: preference pairs need a length column.
    data = pref_data[0].select(range(16))
    kw = dict(train_sampling_strategy="group_by_length", per_device_train_batch_size=2)
    with pytest.raises(ValueError, match="Add a 'length' column"):
        DPOTrainer(
            tiny_config(),
            args=DPOConfig(**base_args(tmp_path / "a", **kw)),
            train_dataset=data,
            processing_class=tokenizer,
        )


# ----------------------------------------------------------------------------- token counts


def _hf_count(batch, mode):
    """transformers' _track_num_input_tokens on one collated TRL batch."""
    if mode == "all":
        return batch["input_ids"].numel()
    if "attention_mask" in batch:
        return int(batch["attention_mask"].sum())
    return int((batch["input_ids"] != PAD).sum())


@pytest.mark.parametrize("mode", ["all", "non_padding"])
def test_input_token_counts_match_trl_collators(mode):
    """Per layout, jaxrl's count on its static-shape micro-batch (2 devices x 4 examples, the
    last 2 examples a partial batch's fill) equals transformers' count on the batches TRL's
    collators build for each device."""
    from trl.trainer.dpo_trainer import DataCollatorForPreference
    from trl.trainer.reward_trainer import DataCollatorForPreference as RewardCollator
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    real = np.array([1, 1, 1, 1, 1, 1, 0, 0], np.float32)
    devices = [slice(0, 4), slice(4, 6)]  # the real examples of each device

    def check(batch, trl_examples, collator):
        got = trl_input_tokens(
            batch, real, mode=mode, pad_token_id=PAD, per_device=4, multiple_of=8
        )
        want = sum(_hf_count(collator(trl_examples[d]), mode) for d in devices)
        assert got == want

    rows = _token_rows(5, 8)
    rows[2][0] = PAD  # a real token equal to the pad id
    check(
        collate_sft([{"input_ids": r} for r in rows], 32, PAD),
        [{"input_ids": r} for r in rows],
        DataCollatorForLanguageModeling(pad_token_id=PAD, pad_to_multiple_of=8),
    )
    packed = pack_bfd({"input_ids": _token_rows(6, 30)}, 24)
    examples = [{k: packed[k][i] for k in packed.column_names} for i in range(8)]
    examples[1]["input_ids"][0] = PAD  # padding-free batches count tokens that are not the pad id
    check(
        collate_sft(examples, 24, PAD),
        [{"input_ids": e["input_ids"]} for e in examples],
        DataCollatorForLanguageModeling(pad_token_id=PAD, padding_free=True, pad_to_multiple_of=8),
    )
    prompts, chosen, rejected = _token_rows(7, 8, 2, 8), _token_rows(8, 8), _token_rows(9, 8)
    pairs = [
        {"prompt_input_ids": p, "chosen_input_ids": c, "rejected_input_ids": r}
        for p, c, r in zip(prompts, chosen, rejected, strict=True)
    ]
    as_trl = [
        {"prompt_ids": p, "chosen_ids": c, "rejected_ids": r}
        for p, c, r in zip(prompts, chosen, rejected, strict=True)
    ]
    rows = collate_preference(pairs, 48, PAD)
    dpo_batch = {k: np.stack([v[:8], v[8:]], axis=1) for k, v in rows.items()}
    dpo_collator = DataCollatorForPreference(pad_token_id=PAD, pad_to_multiple_of=8)
    check(dpo_batch, as_trl, dpo_collator)
    # Prefix sharing holds each prompt once; TRL's rows hold it twice, and so does the count.
    check(collate_preference_shared(pairs, 64, PAD), as_trl, dpo_collator)
    rows = collate_reward(
        [
            {"chosen_input_ids": c, "rejected_input_ids": r}
            for c, r in zip(chosen, rejected, strict=True)
        ],
        32,
        PAD,
    )
    reward_batch = {k: np.stack([v[:8], v[8:]], axis=1) for k, v in rows.items() if k != "margin"}
    check(
        reward_batch,
        [{"chosen_ids": c, "rejected_ids": r} for c, r in zip(chosen, rejected, strict=True)],
        RewardCollator(pad_token_id=PAD, pad_to_multiple_of=8),
    )


def test_num_input_tokens_seen_is_logged_as_hf_and_eval_delay(tmp_path, tokenizer, sft_data):
    """Two checks on one run (one trainer fewer than a run for each).

    Token counts: sequential batches of 2 on one device: each step adds 2 x its longest example
    rounded up to pad_to_multiple_of ("all"), not jaxrl's one static row length; every log
    (training, eval, summary) carries the running total, training logs also HF's
    train_tokens_per_second.

    eval_delay: with an evaluation every step, none before step eval_delay=2; a negative delay
    is refused."""
    # Rows of 9 or 10 tokens; pairs of 9s pad to 9, pairs with a 10 to 12, the static rows to 12.
    data = sft_data[0].select([16, 17, 0, 2, 36, 37, 4, 5, 29, 30, 6, 7])
    trainer = SFTTrainer(
        tiny_config(),
        args=SFTConfig(
            **base_args(
                tmp_path,
                max_steps=6,
                per_device_train_batch_size=2,
                include_num_input_tokens_seen=True,
                train_sampling_strategy="sequential",
                pad_to_multiple_of=3,
                eval_strategy="steps",
                eval_steps=1,
                eval_delay=2,
            )
        ),
        train_dataset=data,
        eval_dataset=sft_data[1].select(range(4)),
        processing_class=tokenizer,
    )
    assert trainer.args.include_num_input_tokens_seen == "all"
    output = trainer.train()
    lengths = [len(x) for x in trainer.train_dataset["input_ids"]]
    per_step = [2 * -(-max(lengths[s * 2 : (s + 1) * 2]) // 3) * 3 for s in range(6)]
    assert len(set(per_step)) > 1  # some batches are shorter than the run's static rows
    logs = train_logs(trainer)
    assert [h["num_input_tokens_seen"] for h in logs] == np.cumsum(per_step).tolist()
    assert all(h["train_tokens_per_second"] > 0 for h in logs)
    assert [h["step"] for h in eval_logs(trainer)] == [2, 3, 4, 5, 6]  # eval_delay
    evals = [h["num_input_tokens_seen"] for h in eval_logs(trainer)]
    assert evals == np.cumsum(per_step)[1:].tolist()
    assert output.metrics["num_input_tokens_seen"] == sum(per_step)
    assert trainer.state.num_input_tokens_seen == sum(per_step)
    with pytest.raises(ConfigError, match="eval_delay"):
        SFTConfig(output_dir="x", eval_delay=-1)


def test_include_num_input_tokens_seen_values(tmp_path):
    assert SFTConfig(output_dir="x").include_num_input_tokens_seen == "no"
    assert (
        SFTConfig(output_dir="x", include_num_input_tokens_seen=False).include_num_input_tokens_seen
        == "no"
    )
    config, _ = parse_config(SFTConfig, cli_args=["--include_num_input_tokens_seen"])
    assert config.include_num_input_tokens_seen == "all"
    config, _ = parse_config(SFTConfig, cli_args=["--include_num_input_tokens_seen", "non_padding"])
    assert config.include_num_input_tokens_seen == "non_padding"
    config, _ = parse_config(SFTConfig, cli_args=["--include_num_input_tokens_seen", "true"])
    assert config.include_num_input_tokens_seen == "all"
    with pytest.raises(ConfigError, match="include_num_input_tokens_seen='some'"):
        SFTConfig(output_dir="x", include_num_input_tokens_seen="some")
    with pytest.raises(ConfigError, match="num_tokens"):
        GRPOConfig(output_dir="x", include_num_input_tokens_seen="all")
    with pytest.raises(ConfigError, match="data_seed"):
        GRPOConfig(output_dir="x", data_seed=3)

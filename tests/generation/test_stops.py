"""Stop sequences, `stop_strings` and per-row `max_new_tokens`: greedy runs equal transformers
`generate` token for token (stop strings: `generate(stop_strings=, tokenizer=)` on a byte-level
BPE tokenizer trained here, strings that span tokens and overhang them), and each row ends
exactly where a plain string search over its text says it must."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import transformers
from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
from tokenizers.models import BPE

from jaxrl import models
from jaxrl.data.stop_strings import token_texts
from jaxrl.generation import GenerationConfig, Sampler
from tests.generation.conftest import hf_generate, ragged_prompts
from tests.models.conftest import FAMILIES, VOCAB, _build

N_NEW = 10
TEXT = (
    "The quick brown fox jumps over the lazy dog; stop signs stopped a topper, lasting stops, "
    "pots and tops stood still. Jackdaws love my big sphinx of quartz! Whiskey-vexed zebras "
    "plod by 12345 67890 (WX) [YZ] {Q} <tool_call> </tool_call> = + - * / ? "
) * 20


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level BPE of exactly the models' VOCAB ids, with multi-character tokens."""
    tok = Tokenizer(BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        [TEXT], trainers.BpeTrainer(vocab_size=VOCAB, initial_alphabet=[], show_progress=False)
    )
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok)
    assert len(fast) == VOCAB and max(len(t) for t in fast.get_vocab()) >= 4
    return fast


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    factory, kwargs = FAMILIES["llama"]
    path = tmp_path_factory.mktemp("llama_stops")
    return _build(factory, kwargs, path, transformers.AutoModelForCausalLM, seed=3)


@pytest.fixture(scope="module")
def sampler(llama):
    return Sampler(models.from_pretrained(llama.path))


@pytest.fixture(scope="module")
def free_run(llama):
    """Prompts and transformers' greedy completions of them without any stop."""
    prompts = ragged_prompts(seed=1)
    ids, _ = hf_generate(
        llama.model, prompts, max_new_tokens=N_NEW, do_sample=False, eos_token_id=None
    )
    return prompts, ids


def text_stop_step(texts, prompt, completion, strings) -> int | None:
    """The first step whose token an occurrence of a stop string overlaps (ends inside), by
    plain search over the decoded prompt + completion; None if no row-ending step."""
    joined = b"".join(texts[t] for t in prompt)
    for step, tok in enumerate(completion):
        start = len(joined)
        joined += texts[int(tok)]
        for s in strings:
            s = s.encode()
            at = joined.find(s, max(0, start - len(s) + 1))
            if at >= 0 and at + len(s) > start:
                return step
    return None


def greedy(**kw) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=N_NEW, eos_token_id=None, pad_token_id=0, **kw)


def lengths_of(out) -> np.ndarray:
    mask = np.asarray(out.completion_mask_BN)
    assert (np.diff(mask, axis=1) <= 0).all()  # 1s then 0s
    return mask.sum(1)


def stop_string_cases(tokenizer, free_run) -> list[list[str]]:
    """Strings cut from row 0's free-run text: one across the boundary of steps 4|5, one inside
    the multi-character token of the latest step that has one (overhanging it both ends)."""
    texts, _ = token_texts(tokenizer)
    _, ids = free_run
    row = [texts[int(t)].decode("latin-1") for t in ids[0]]
    across = row[4][-1:] + row[5][:1]
    inner = next((row[t][1:-1] for t in range(N_NEW - 1, -1, -1) if len(row[t]) >= 3), row[2])
    return [[across], [inner], [across, inner]]


def test_stop_strings_match_transformers_generate(tokenizer, llama, sampler, free_run):
    prompts, free = free_run
    texts, as_bytes = token_texts(tokenizer)
    assert as_bytes  # the byte-level path, as for GPT-2/Qwen tokenizers
    stopped_early = 0
    for strings in stop_string_cases(tokenizer, free_run):
        want, _ = hf_generate(
            llama.model, prompts, max_new_tokens=N_NEW, do_sample=False, eos_token_id=None,
            stop_strings=strings, tokenizer=tokenizer,
        )  # fmt: skip
        out = sampler(None, prompts, greedy(stop_strings=strings), tokenizer=tokenizer)
        lengths = lengths_of(out)
        got = np.asarray(out.completion_ids_BN)
        for b, prompt in enumerate(prompts):
            step = text_stop_step(texts, prompt, free[b], strings)
            expect = N_NEW if step is None else step + 1
            assert lengths[b] == expect, (strings, b)
            np.testing.assert_array_equal(got[b, :expect], free[b, :expect])
            np.testing.assert_array_equal(got[b, :expect], want[b, :expect])
            assert (got[b, expect:] == 0).all()
            stopped_early += expect < N_NEW
    assert stopped_early >= 3  # the cases do stop rows, at different steps


def test_stop_string_completed_by_the_first_token_counts_the_prompt(
    tokenizer, llama, sampler, free_run
):
    """transformers matches over prompt + completion: a string that starts in the prompt's text
    and ends in the first generated token stops the row after one token."""
    prompts, free = free_run
    texts, _ = token_texts(tokenizer)
    strings = [(texts[prompts[0][-1]][-1:] + texts[int(free[0, 0])][:1]).decode("latin-1")]
    want, _ = hf_generate(
        llama.model, prompts[:1], max_new_tokens=N_NEW, do_sample=False, eos_token_id=None,
        stop_strings=strings, tokenizer=tokenizer,
    )  # fmt: skip
    out = sampler(None, prompts[:1], greedy(stop_strings=strings), tokenizer=tokenizer)
    assert lengths_of(out)[0] == 1
    assert (want[0, 1:] == 0).all() and want[0, 0] == free[0, 0]


def test_stop_sequences_end_rows_after_the_sequence(sampler, free_run):
    prompts, free = free_run
    seq = tuple(int(t) for t in free[1, 3:5])
    out = sampler(None, prompts, greedy(stop_sequences=[seq, (VOCAB + 5, 1, 2)]))
    got, lengths = np.asarray(out.completion_ids_BN), lengths_of(out)
    for b in range(len(prompts)):
        ends = [t + 1 for t in range(1, N_NEW) if tuple(free[b, t - 1 : t + 1]) == seq]
        expect = ends[0] if ends else N_NEW
        assert lengths[b] == expect
        np.testing.assert_array_equal(got[b, :expect], free[b, :expect])
    assert lengths[1] == 5
    # The prompt is not searched: a sequence made of the prompt's last token and the first
    # completion token does not stop the row there.
    straddle = (prompts[2][-1], int(free[2, 0]))
    out = sampler(None, prompts, greedy(stop_sequences=[straddle]))
    assert lengths_of(out)[2] > 1 or tuple(free[2, :2]) == straddle


def test_per_row_max_new_tokens_truncate_each_row(sampler, free_run):
    prompts, free = free_run
    limits = [3, N_NEW, 1, 7]
    out = sampler(None, prompts, greedy(), max_new_tokens=limits)
    got = np.asarray(out.completion_ids_BN)
    np.testing.assert_array_equal(lengths_of(out), limits)
    for b, n in enumerate(limits):
        np.testing.assert_array_equal(got[b, :n], free[b, :n])
        assert (got[b, n:] == 0).all() and (np.asarray(out.logprobs_BN)[b, n:] == 0).all()


def test_per_row_limits_keep_sampled_tokens_and_group_rows(sampler, free_run):
    """Sampled with a group of 2: one limit per prompt covers its group; tokens within a row's
    limit are those of the run without limits (the same seed)."""
    prompts, _ = free_run
    config = GenerationConfig(max_new_tokens=N_NEW, do_sample=True, top_k=0, eos_token_id=None)
    full = sampler(None, prompts, config, seed=4, group_size=2)
    limited = sampler(None, prompts, config, seed=4, group_size=2, max_new_tokens=[2, 5, 9, 1])
    np.testing.assert_array_equal(lengths_of(limited), [2, 2, 5, 5, 9, 9, 1, 1])
    mask = np.asarray(limited.completion_mask_BN).astype(bool)
    for a, b in ((full.completion_ids_BN, limited.completion_ids_BN),
                 (full.logprobs_BN, limited.logprobs_BN)):  # fmt: skip
        np.testing.assert_array_equal(np.asarray(a)[mask], np.asarray(b)[mask])


def test_bad_stop_settings_are_clear_errors(sampler, free_run):
    prompts, _ = free_run
    with pytest.raises(ValueError, match="need the tokenizer"):
        sampler(None, prompts, greedy(stop_strings=["ab"]))
    with pytest.raises(ValueError, match=r"in \[1, 10\]"):
        sampler(None, prompts, greedy(), max_new_tokens=[0, 1, 2, 3])
    with pytest.raises(ValueError, match="one per completion row"):
        sampler(None, prompts, greedy(), max_new_tokens=[1, 2])
    with pytest.raises(ValueError, match="non-empty sequences"):
        greedy(stop_sequences=[()])
    with pytest.raises(ValueError, match="non-empty strings"):
        greedy(stop_strings=[""])


def test_from_transformers_reads_stop_strings():
    hf = transformers.GenerationConfig(max_new_tokens=4, stop_strings=["</tool_call>"])
    config = GenerationConfig.from_transformers(hf)
    assert config.stop_strings == ("</tool_call>",)
    assert GenerationConfig(stop_strings="x").stop_strings == ("x",)
    # The static config stays hashable (a jit static argument).
    jax.jit(lambda x, c: x, static_argnums=1)(1, config)

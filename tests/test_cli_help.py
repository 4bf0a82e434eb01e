"""`python -m jaxrl.train --help`: each algorithm's flags in groups (model and data, training,
the algorithm's own, logging and saving, TRL-compatibility-only last), one described line each,
refused flags marked; the descriptions are the committed table the generator writes."""

import dataclasses
import re

import pytest

from jaxrl import config_docs
from jaxrl.config import ConfigError
from jaxrl.train import usage
from jaxrl.trainers.registry import ALGORITHMS

ALGOS = sorted(ALGORITHMS)


def _groups(text: str) -> dict[str, list[tuple[str, str]]]:
    """{group header: [(flag, description)]} of a --help text."""
    groups: dict[str, list[tuple[str, str]]] = {}
    lines = text.splitlines()
    current = None
    for i, line in enumerate(lines):
        if re.fullmatch(r"\S.*:", line) and not line.startswith("Flags of"):
            current = groups.setdefault(line[:-1], [])
        elif line.startswith("  --"):
            description = lines[i + 1].strip() if i + 1 < len(lines) else ""
            current.append((line.split()[0][2:], description))
    return groups


@pytest.mark.parametrize("algo", ALGOS)
def test_help_groups_describe_and_mark_every_flag(algo):
    groups = _groups(usage(algo))
    config = ALGORITHMS[algo].config_class.__name__
    want = ["Model and data", "Training", f"{config} (the algorithm's own)",
            "Logging, evaluation and saving", config_docs.COMPAT]  # fmt: skip
    assert list(groups) == want  # every group has flags, in this order
    flags = [flag for rows in groups.values() for flag, _ in rows]
    fields = {f.name for c in config_docs.flag_classes(algo) for f in dataclasses.fields(c)}
    assert sorted(flags) == sorted(fields - {"algo"} - _not_init(algo))  # each flag once
    for group, rows in groups.items():
        for flag, description in rows:
            assert description and not description.startswith("--"), flag
            refused = config_docs._refused(algo, flag) is not None
            assert refused == (group == config_docs.COMPAT), flag
            assert description.startswith(config_docs.REFUSED) == refused, flag
    # Core options come first: nothing torch-only before the model and the learning rate.
    assert ("model_name_or_path" if algo != "ddpo" else "pretrained_model") in dict(
        groups["Model and data"]
    )
    assert "tf32" not in dict(groups["Training"])


def _not_init(algo):
    return {
        f.name for c in config_docs.flag_classes(algo) for f in dataclasses.fields(c) if not f.init
    }


def test_trl_words_where_we_behave_the_same():
    trl = pytest.importorskip("trl")

    sft = {f.name: f.metadata.get("help") for f in dataclasses.fields(trl.SFTConfig)}
    text = dict(_groups(usage("sft"))["Training"])
    assert text["learning_rate"] == sft["learning_rate"]  # TRL's SFT default help, not HF's
    assert text["mesh_fsdp"] == config_docs.OWN_HELP["mesh_fsdp"]  # jaxrl's own


@pytest.mark.parametrize(
    ("algo", "field", "value"),
    [("grpo", "use_vllm", True), ("sft", "tf32", True), ("dpo", "padding_free", True)],
)
def test_marked_flags_are_refused(algo, field, value, tmp_path):
    assert config_docs._refused(algo, field) is not None
    with pytest.raises(ConfigError, match=field):
        ALGORITHMS[algo].config_class(output_dir=str(tmp_path), **{field: value})


@pytest.mark.parametrize(
    ("cls_name", "field", "value"),
    [(c, f, v) for c, rows in config_docs.LEGACY_REFUSED.items() if c.endswith("Config")
     for f, v in zip(rows, [{"a": 1}] * len(rows), strict=True)],
)  # fmt: skip
def test_legacy_refusals_are_real(cls_name, field, value, tmp_path):
    cls = next(s.config_class for s in ALGORITHMS.values() if s.config_class.__name__ == cls_name)
    default = next(f for f in dataclasses.fields(cls) if f.name == field)
    bad = {dict: {"a": 1}, bool: True, str: "bf16"}
    kind = type(
        default.default_factory() if default.default is dataclasses.MISSING else default.default
    )
    bad_value = {bool: not default.default}.get(kind, bad.get(kind, "bf16"))
    with pytest.raises(ValueError, match=field):
        cls(**{field: bad_value})


def test_help_table_is_in_sync_with_the_generator():
    pytest.importorskip("trl")
    assert config_docs.help_table() == config_docs.load_help(), (
        "Regenerate with `python -m jaxrl.config_docs --help-table`."
    )

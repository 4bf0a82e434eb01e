"""docs/config_fields.md, jaxrl's config classes and the installed TRL/transformers agree: every
TRL field exists on the jaxrl class, fields jaxrl cannot honour keep TRL's default and are
rejected when set, and the table is what `python -m jaxrl.config_docs` generates."""

import dataclasses
from pathlib import Path

import pytest

from jaxrl import DPOConfig, KTOConfig, RewardConfig, SFTConfig, TrainingConfig, config_docs
from jaxrl.config import ConfigError

DOC = Path(__file__).resolve().parents[1] / "docs" / "config_fields.md"


def _default(f: dataclasses.Field):
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def test_table_is_generated_from_the_installed_trl():
    pytest.importorskip("trl")
    assert DOC.read_text() == config_docs.render(), (
        "docs/config_fields.md is stale: run `python -m jaxrl.config_docs > docs/config_fields.md`"
    )
    assert "| missing |" not in DOC.read_text()


@pytest.mark.parametrize("cls", [TrainingConfig, SFTConfig, RewardConfig, DPOConfig, KTOConfig])
def test_rejected_fields_keep_trl_defaults_and_are_rejected_when_set(cls):
    refs = config_docs.reference_classes()
    ref = refs["TrainingArguments" if cls is TrainingConfig else cls.__name__]
    theirs = {f.name: _default(f) for f in dataclasses.fields(ref)}
    for foreign in cls._all_foreign_fields():
        assert foreign.name in theirs, foreign.name
        assert theirs[foreign.name] == foreign.default, foreign.name
        value = "x" if foreign.type in (str, str | None) else True
        if foreign.default is True:
            value = False
        with pytest.raises(ConfigError, match=f"`{foreign.name}="):
            cls(**{foreign.name: value})


def test_torch_only_fields_name_the_jaxrl_equivalent():
    with pytest.raises(ConfigError, match="use `mesh_fsdp`"):
        SFTConfig(fsdp="full_shard")
    with pytest.raises(ConfigError, match="mesh_data"):
        SFTConfig(ddp_backend="nccl")
    with pytest.raises(ConfigError, match="jax_default_matmul_precision"):
        SFTConfig(tf32=True)


@pytest.mark.parametrize("name", ["GRPOConfig", "RLOOConfig"])
def test_online_unsupported_fields_keep_trl_defaults_and_are_rejected_when_set(name):
    """GRPO/RLOO fields jaxrl has no backend for (vLLM, ...) sit at TRL's default, at which
    they do nothing, and any other value is an error naming the field."""
    from jaxrl.trainers.grpo_config import GRPOConfig
    from jaxrl.trainers.rloo_config import RLOOConfig

    cls = {"GRPOConfig": GRPOConfig, "RLOOConfig": RLOOConfig}[name]
    ref = config_docs.reference_classes()[name]
    theirs = {f.name: _default(f) for f in dataclasses.fields(ref)}
    unsupported = cls.unsupported_fields()
    assert "use_vllm" in unsupported and "vllm_mode" in unsupported
    for field_name, (inactive, _) in unsupported.items():
        if field_name in theirs:
            assert theirs[field_name] == inactive, field_name
        value = {bool: not inactive, str: "x", float: 0.5, int: 7}.get(type(inactive), 0.5)
        with pytest.raises(ConfigError, match=f"`{field_name}="):
            cls(**{field_name: value})

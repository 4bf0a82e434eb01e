"""TRL's scripting surface on jaxrl: `TrlParser`, `ScriptArguments`, `ModelConfig`,
`DatasetMixtureConfig`, `get_dataset`, `get_peft_config` and `get_quantization_config`.

TRL's example scripts (`trl/scripts/sft.py`, `dpo.py`, `reward.py`) run on jaxrl with only their
imports changed from `trl` to `jaxrl`. Parsing follows `HfArgumentParser`/`TrlParser`: dataclass
fields become flags (`--field value`, `--field=value`, bare `--flag`, `--no_flag`, `--list a b`),
`--config FILE.yaml` sets defaults that flags override, and the YAML's `env` mapping sets
environment variables. Fields that have no meaning on JAX are accepted and rejected when set, with
a message naming the alternative; nothing is silently ignored. Bad input ends the program with
status 2 and one paragraph on stderr, as argparse does. This module builds configs and datasets;
it never trains.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from jaxrl import lora
from jaxrl.config_checks import ATTN_IMPLEMENTATIONS, DTYPES
from jaxrl.config_cli import (
    ConfigError,
    PeftArguments,
    coerce,
    field_types,
    kinds_of_keys,
    read_yaml,
    split_cli,
)

logger = logging.getLogger("jaxrl")


@dataclass
class ScriptArguments:
    """TRL `ScriptArguments`: which dataset a script trains on."""

    dataset_name: str | None = None  # hub id, local file or directory (`datasets.load_dataset`)
    dataset_config: str | None = None
    dataset_train_split: str = "train"
    dataset_test_split: str = "test"
    dataset_streaming: bool = False
    ignore_bias_buffers: bool = False

    def __post_init__(self) -> None:
        if self.dataset_streaming:
            raise ConfigError(
                "`dataset_streaming=True` is not supported: jaxrl tokenizes the dataset once and "
                "sizes its static batch shape from it, which needs a map-style dataset. Remove "
                "the flag."
            )
        if self.ignore_bias_buffers:
            raise ConfigError(
                "`ignore_bias_buffers=True` is a torch DDP workaround; jaxrl has no buffers to "
                "ignore (models are pure parameter pytrees). Remove the flag."
            )


@dataclass
class ModelConfig(PeftArguments):
    """TRL `ModelConfig`. The model path, dtype and attention implementation reach the trainer
    through `model_init_kwargs` (as TRL's scripts pass them); the PEFT and bitsandbytes fields
    (`PeftArguments`) through `get_peft_config` / `get_quantization_config`."""

    model_name_or_path: str | None = None
    model_revision: str = "main"  # only "main": give a local path for another revision
    dtype: str | None = "float32"  # -> param_dtype ("float32", "bfloat16", "float16")
    attn_implementation: str | None = None  # eager/sdpa/flash_attention_* -> XLA attention
    trust_remote_code: bool = False  # only False: jaxrl never runs a checkpoint's own code

    def __post_init__(self) -> None:
        if self.trust_remote_code:
            raise ConfigError(
                "`trust_remote_code=True` is not supported: jaxrl runs its own JAX implementation "
                "of each model family, never a checkpoint's Python code. Remove the flag."
            )
        # Checked here too (the trainer checks model_init_kwargs again) so a bad flag stops the
        # script at parse time with status 2.
        if self.attn_implementation not in (None, *ATTN_IMPLEMENTATIONS):
            raise ConfigError(
                f"`attn_implementation={self.attn_implementation!r}` has no JAX counterpart; "
                f"jaxrl's XLA attention computes exact softmax attention, which "
                f"{list(ATTN_IMPLEMENTATIONS)} all map to."
            )
        if self.dtype not in (None, *DTYPES):
            raise ConfigError(
                f"`dtype={self.dtype!r}` is not supported; choose one of {list(DTYPES)} (it sets "
                "the parameter dtype; 'auto' is not supported)."
            )
        if self.model_revision != "main":
            raise ConfigError(
                f"`model_revision={self.model_revision!r}` is not supported: jaxrl loads a local "
                "directory or the hub's main revision; download the revision and pass its path."
            )
        if self.bnb_4bit_quant_storage is not None:
            raise ConfigError(
                "bnb_4bit_quant_storage is a bitsandbytes storage dtype (for FSDP of packed 4-bit "
                "weights); jaxrl's NF4 base stores packed uint8 codes whatever the mesh. Remove it."
            )
        # PEFT/quantization options jaxrl does not implement (DoRA, fp4, nested quantization)
        # fail here, at parse time, with the fix in the message.
        try:
            get_peft_config(self)
            get_quantization_config(self)
        except ValueError as error:
            raise ConfigError(str(error)) from error


@dataclass
class DatasetConfig:
    """One dataset of a mixture; the arguments of `datasets.load_dataset` (TRL semantics)."""

    path: str
    name: str | None = None
    data_dir: str | None = None
    data_files: str | list[str] | dict[str, str] | None = None
    split: str = "train"
    columns: list[str] | None = None
    # Target share of the mixture (set for all datasets or none); no dataset is oversampled.
    fraction: float | None = None


@dataclass
class DatasetMixtureConfig:
    """TRL `DatasetMixtureConfig`: datasets concatenated by `get_dataset` (YAML `datasets:`)."""

    datasets: list[Any] = field(default_factory=list)
    streaming: bool = False
    test_split_size: float | None = None

    def __post_init__(self) -> None:
        self.datasets = [
            DatasetConfig(**d) if isinstance(d, dict) else d for d in self.datasets or []
        ]
        if self.streaming:
            raise ConfigError(
                "`streaming=True` is not supported: jaxrl needs map-style datasets (it sizes the "
                "static batch shape from them). Remove the setting."
            )


def get_dataset(mixture_config: DatasetMixtureConfig) -> Any:
    """Load and concatenate the mixture's datasets into a `DatasetDict` ("train", plus "test"
    when `test_split_size` is set), with TRL's column selection and `fraction` rules."""
    import datasets

    loaded = []
    for cfg in mixture_config.datasets:
        ds = datasets.load_dataset(
            path=cfg.path,
            name=cfg.name,
            data_dir=cfg.data_dir,
            data_files=cfg.data_files,
            split=cfg.split,
        )
        loaded.append(ds.select_columns(cfg.columns) if cfg.columns is not None else ds)
    if not loaded:
        raise ValueError(
            "The dataset mixture is empty; list at least one dataset under `datasets`."
        )
    fractions = [cfg.fraction for cfg in mixture_config.datasets]
    if any(f is not None for f in fractions):
        if any(f is None for f in fractions):
            raise ValueError(
                "`fraction` must be set for either all datasets in the mixture or none."
            )
        weights = [f / sum(fractions) for f in fractions]
        # The largest mixture in which no dataset is asked for more rows than it has.
        total = min(len(ds) / w for ds, w in zip(loaded, weights, strict=True) if w > 0)
        loaded = [ds.select(range(round(w * total))) for ds, w in zip(loaded, weights, strict=True)]
    combined = datasets.concatenate_datasets(loaded)
    if mixture_config.test_split_size is not None:
        return combined.train_test_split(test_size=mixture_config.test_split_size)
    return datasets.DatasetDict({"train": combined})


def get_peft_config(model_args: ModelConfig) -> Any:
    """TRL's `get_peft_config`: a `jaxrl.lora.LoraConfig` from the `lora_*` fields, or None
    without `use_peft`. Pass it to a trainer as `peft_config=`."""
    return lora.LoraConfig.from_trl(model_args)


def get_quantization_config(model_args: ModelConfig) -> Any:
    """TRL's `get_quantization_config`: the frozen-base scheme `load_in_8bit` / `load_in_4bit`
    ask for ("int8", "nf4") or None. Pass it to a trainer as `quantization_config=`."""
    return lora.base_quantization(model_args)


class TrlParser:
    """TRL's `TrlParser` over jaxrl's config dataclasses (HfArgumentParser's command-line forms).

    `parse_args_and_config()` returns one instance per dataclass type, in order. A key is given
    to every dataclass that has a field of that name.
    """

    def __init__(self, dataclass_types: Any = None, prog: str | None = None, **kwargs: Any):
        if dataclass_types is None:
            dataclass_types = []
        elif dataclasses.is_dataclass(dataclass_types):
            dataclass_types = [dataclass_types]
        self.dataclass_types = list(dataclass_types)
        for cls in self.dataclass_types:
            if "config" in {f.name for f in dataclasses.fields(cls)}:
                raise ValueError(
                    f"Dataclass {cls.__name__} has a field named 'config'; that name is reserved "
                    "for the config file path."
                )
        self.prog = prog or os.path.basename(sys.argv[0])
        self._types: dict[str, Any] = {}
        for cls in self.dataclass_types:
            for name, annotation in field_types(cls).items():
                self._types.setdefault(name, annotation)

    # ----------------------------------------------------------------- public API (TRL's)
    def parse_args_and_config(
        self,
        args: Iterable[str] | None = None,
        return_remaining_strings: bool = False,
        fail_with_unknown_args: bool = True,
        separate_remaining_strings: bool = False,
    ) -> tuple[Any, ...]:
        """Dataclass instances from `--config FILE.yaml` (defaults) and the command line.

        Unknown keys are errors even with `fail_with_unknown_args=False` (where TRL drops
        unknown YAML keys silently) unless `return_remaining_strings` asks for them back."""
        args = list(sys.argv[1:] if args is None else args)
        try:
            config_path, args = self._pop_config(args)
            yaml_values = {}
            if config_path is not None:
                yaml_values = read_yaml(config_path)
                env = yaml_values.pop("env", {}) or {}
                if not isinstance(env, dict):
                    raise ConfigError(f"{config_path}: `env` must be a mapping of NAME: value.")
                for key, value in env.items():
                    os.environ[str(key)] = str(value)
            if "-h" in args or "--help" in args:
                self._print_help()
            values, remaining = self._cli_values(args)
            yaml_known = {k: v for k, v in yaml_values.items() if k in self._types}
            yaml_unknown = [
                item
                for k, v in yaml_values.items()
                if k not in self._types
                for item in (f"--{k}", str(v))
            ]
            outputs = self._build({**yaml_known, **values}, config_path)
        except ConfigError as error:
            self._exit(str(error))
        if return_remaining_strings:
            if separate_remaining_strings:
                return (*outputs, yaml_unknown, remaining)
            return (*outputs, yaml_unknown + remaining)
        unknown = yaml_unknown + remaining
        if unknown:
            self._exit(
                f"Unknown arguments {unknown}: no field of {self._names()} has these names. "
                "Remove them or fix their spelling."
            )
        return outputs

    def parse_args_into_dataclasses(
        self, args: Iterable[str] | None = None, return_remaining_strings: bool = False, **_: Any
    ) -> tuple[Any, ...]:
        """Command-line flags only (no `--config` file)."""
        args = list(sys.argv[1:] if args is None else args)
        try:
            values, remaining = self._cli_values(args)
            outputs = self._build(values, None)
        except ConfigError as error:
            self._exit(str(error))
        if return_remaining_strings:
            return (*outputs, remaining)
        if remaining:
            self._exit(f"Unknown arguments {remaining} for {self._names()}.")
        return outputs

    def parse_dict(self, args: dict[str, Any], allow_extra_keys: bool = False) -> tuple[Any, ...]:
        """Dataclass instances from a dict of field values (raises on unknown keys)."""
        unknown = sorted(set(args) - set(self._types))
        if unknown and not allow_extra_keys:
            raise ConfigError(f"Unknown keys {unknown} for {self._names()}.")
        return self._build({k: v for k, v in args.items() if k in self._types}, None)

    def parse_yaml_file(self, yaml_file: str, allow_extra_keys: bool = False) -> tuple[Any, ...]:
        return self.parse_dict(read_yaml(yaml_file), allow_extra_keys=allow_extra_keys)

    # ----------------------------------------------------------------- helpers
    def _names(self) -> str:
        return ", ".join(cls.__name__ for cls in self.dataclass_types)

    @staticmethod
    def _pop_config(args: list[str]) -> tuple[str | None, list[str]]:
        rest, path, i = [], None, 0
        while i < len(args):
            if args[i] == "--config" and i + 1 < len(args):
                path, i = args[i + 1], i + 2
            elif args[i].startswith("--config="):
                path, i = args[i].split("=", 1)[1], i + 1
            else:
                rest.append(args[i])
                i += 1
        return path, rest

    def _cli_values(self, args: list[str]) -> tuple[dict[str, Any], list[str]]:
        """Known flags -> raw values; unknown flags (with their values) -> remaining strings."""
        bool_keys, list_keys = kinds_of_keys(self._types)
        known, remaining, i = [], [], 0
        while i < len(args):
            key = args[i][2:].split("=", 1)[0].replace("-", "_") if args[i].startswith("--") else ""
            j = i + 1
            while j < len(args) and not args[j].startswith("--"):
                j += 1
            ours = key in self._types or (key.startswith("no_") and key[3:] in bool_keys)
            (known if ours else remaining).extend(args[i:j])
            i = j
        return split_cli(known, bool_keys, list_keys), remaining

    def _build(self, values: dict[str, Any], source: str | None) -> tuple[Any, ...]:
        outputs = []
        for cls in self.dataclass_types:
            types = field_types(cls)
            kwargs = {k: coerce(k, v, types[k]) for k, v in values.items() if k in types}
            try:
                outputs.append(cls(**kwargs))
            except ConfigError as error:
                where = f" (from {source} and the command line)" if source else ""
                raise ConfigError(f"{cls.__name__}{where}: {error}") from None
        return tuple(outputs)

    def _print_help(self) -> None:
        lines = [f"usage: {self.prog} [--config FILE.yaml] [--field value ...]", ""]
        for cls in self.dataclass_types:
            lines.append(f"{cls.__name__}:")
            for f in dataclasses.fields(cls):
                if f.init:
                    default = f.default_factory() if callable(f.default_factory) else f.default
                    lines.append(f"  --{f.name} (default: {default!r})")
        print("\n".join(lines))
        sys.exit(0)

    def _exit(self, message: str) -> typing.NoReturn:
        # argparse's convention: usage errors end the program with status 2.
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)

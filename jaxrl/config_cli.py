"""The YAML + command-line loader of jaxrl's configs, and the CLI's script-level dataclasses.

`parse_config` builds any config dataclass from defaults < a YAML file < command-line flags <
overrides, with HF `HfArgumentParser`'s flag spellings (`split_cli`) and a clear `ConfigError`
naming the key for unknown keys and bad values; `coerce` converts one YAML/CLI value to a field's
annotation. `PeftArguments`, `ScriptArguments` and `OnlineScriptArguments` are the script-level
flags of `python -m jaxrl.train` (TRL's names). This module knows no config class and no trainer:
it never imports the rest of jaxrl, and never touches arrays or devices.
"""

import dataclasses
import difflib
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A config key or value the user supplied is invalid; the message names the fix."""


class MissingExtraError(ImportError):
    """What the user asked for needs an optional dependency that is not installed (torch to read
    a `.bin` checkpoint, ...); the message names the pip extra to install. The CLI exits 2."""


@dataclass
class PeftArguments:
    """TRL `ModelConfig`'s PEFT / bitsandbytes fields (same names and defaults), shared by the
    CLI's `ScriptArguments` and `jaxrl.scripting.ModelConfig`; both build the trainer's LoRA with
    `scripting.get_peft_config` / `get_quantization_config`."""

    use_peft: bool = False
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.05
    lora_target_modules: list[str] | None = None
    lora_target_parameters: list[str] | None = None
    lora_modules_to_save: list[str] | None = None
    lora_task_type: str | None = "CAUSAL_LM"
    use_rslora: bool = False
    use_dora: bool = False
    load_in_8bit: bool = False
    load_in_4bit: bool = False
    bnb_4bit_quant_type: str = "nf4"
    use_bnb_nested_quant: bool = False
    bnb_4bit_quant_storage: str | None = None


@dataclass
class ScriptArguments(PeftArguments):
    """Script-level flags of `python -m jaxrl.train` (TRL `ScriptArguments` / `ModelConfig` names)."""

    algo: str | None = None
    config: str | None = None
    model_name_or_path: str | None = None
    tokenizer_name_or_path: str | None = None  # None -> model_name_or_path
    dataset_name: str | None = None  # hub id, local file or directory
    dataset_config: str | None = None
    dataset_train_split: str = "train"
    dataset_test_split: str = "test"
    # lora_task_type None: the trainer's own (CAUSAL_LM, or SEQ_CLS for reward).
    lora_task_type: str | None = None


@dataclass
class OnlineScriptArguments(ScriptArguments):
    """`--algo grpo` / `--algo rloo` script flags: TRL's `GRPOScriptArguments` (trl/scripts/grpo.py).
    `reward_model_name_or_path`: a reward model directory, scored first; `reward_funcs`: names
    from `jaxrl.rewards.SCRIPT_REWARD_FUNCS` or dotted import paths (`my_lib.rewards.fn`).
    Neither: the embedded arithmetic task's `arith_correct` (only without `dataset_name`)."""

    reward_model_name_or_path: str | None = None
    reward_funcs: list[str] | None = None
    # TRL's `tools=` / `environment_factory=` as import paths (`module:function`, `module:Class`);
    # `--tools` takes several paths and may be repeated.
    tools: list[str] | None = None
    environment_factory: str | None = None


_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def _union_members(annotation: Any) -> tuple[Any, ...]:
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return typing.get_args(annotation)
    return (annotation,)


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    """Convert a YAML/CLI value to `annotation`, or raise ConfigError naming the key."""
    members = _union_members(annotation)
    # "null"/"None" spell None; a lowercase "none" stays a string where strings are allowed
    # (e.g. report_to="none").
    if value is None or (
        isinstance(value, str)
        and (value in ("null", "None", "~") or (str not in members and value.lower() == "none"))
    ):
        if type(None) in members:
            return None
        raise ConfigError(f"`{key}` cannot be null.")
    errors = []
    for member in members:
        if member is type(None):
            continue
        try:
            return _coerce_one(value, member)
        except (ValueError, TypeError, yaml.YAMLError) as error:
            errors.append(str(error))
    expected = " or ".join(getattr(m, "__name__", str(m)) for m in members)
    raise ConfigError(f"`{key}` expects {expected}; got {value!r} ({'; '.join(errors)}).")


class _YamlLoader(yaml.SafeLoader):
    """SafeLoader that also reads `1e-4` (no dot) as a float, as JSON and Python do."""


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def _parse_text(text: str) -> Any:
    # YAML is a superset of JSON, so this reads both.
    return yaml.load(text, Loader=_YamlLoader)


def _coerce_one(value: Any, target: Any) -> Any:
    origin = typing.get_origin(target)
    if target is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE + _FALSE:
            return value.lower() in _TRUE
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise ValueError("not a boolean (use true/false)")
    if target is int:
        if isinstance(value, bool):
            raise TypeError("not an integer")
        if isinstance(value, float) and value.is_integer():
            return int(value)
        return int(value) if isinstance(value, int | str) else _fail("not an integer")
    if target is float:
        if isinstance(value, bool):
            raise TypeError("not a number")
        return float(value) if isinstance(value, int | float | str) else _fail("not a number")
    if target is str:
        return value if isinstance(value, str) else _fail("not a string")
    if target is list or origin is list:
        if isinstance(value, str):
            text = value.strip()
            value = _parse_text(text) if text.startswith("[") else text.split(",")
        if not isinstance(value, list | tuple):
            value = [value]
        (item_type,) = typing.get_args(target) or (None,)
        if item_type is None:
            return list(value)
        return [
            _coerce_one(item.strip() if isinstance(item, str) else item, item_type)
            for item in value
        ]
    if target is dict or origin is dict:
        if isinstance(value, str):
            value = _parse_text(value)
        return dict(value) if isinstance(value, dict) else _fail("not a mapping (use JSON/YAML)")
    raise TypeError(f"unsupported annotation {target}")


# List flags whose occurrences add up (`--tools a:f --tools b:g`) instead of the last winning.
_REPEATABLE = frozenset({"tools"})


def _fail(message: str) -> typing.NoReturn:
    raise ValueError(message)


def split_cli(
    cli_args: list[str], bool_keys: set[str], list_keys: set[str] = frozenset()
) -> dict[str, str | bool | list[str]]:
    """Command-line tokens -> {key: raw value}, with HF `HfArgumentParser`'s spellings:
    `--key value`, `--key=value`, a bare `--flag` (bool fields), `--no_flag` (bool false) and
    `--key v1 v2 ...` (list fields)."""
    parsed: dict[str, str | bool | list[str]] = {}
    i = 0
    while i < len(cli_args):
        token = cli_args[i]
        if not token.startswith("--") or token == "--":
            raise ConfigError(
                f"Unexpected command-line argument {token!r}; flags look like `--field value`."
            )
        key, eq, raw = token[2:].partition("=")
        key = key.replace("-", "_")
        values = []
        while i + 1 + len(values) < len(cli_args) and not cli_args[i + 1 + len(values)].startswith(
            "--"
        ):
            values.append(cli_args[i + 1 + len(values)])
            if key not in list_keys:
                break
        if key in _REPEATABLE and key in list_keys and (eq or values):
            # A repeatable list flag: each occurrence adds its values.
            previous = parsed.get(key, [])
            parsed[key] = [*previous, *([raw] if eq else values)]
            i += 1 if eq else 1 + len(values)
        elif eq:
            parsed[key] = raw
            i += 1
        elif values:
            parsed[key] = values if key in list_keys and len(values) > 1 else values[0]
            i += 1 + len(values)
        elif key in bool_keys:
            parsed[key] = True
            i += 1
        elif key.startswith("no_") and key[3:] in bool_keys:
            parsed[key[3:]] = False
            i += 1
        else:
            raise ConfigError(f"Flag `--{key}` needs a value: `--{key} VALUE` or `--{key}=VALUE`.")
    return parsed


def field_types(cls: type) -> dict[str, Any]:
    """Init fields of dataclass `cls` -> their resolved type annotations."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def kinds_of_keys(types_by_key: dict[str, Any]) -> tuple[set[str], set[str]]:
    """(bool keys, list keys) of a {key: annotation} map, for `split_cli`."""
    bool_keys = {k for k, t in types_by_key.items() if bool in _union_members(t)}
    list_keys = {
        k
        for k, t in types_by_key.items()
        if any(m is list or typing.get_origin(m) is list for m in _union_members(t))
    }
    return bool_keys, list_keys


def read_yaml(path: str | Path) -> dict[str, Any]:
    """A YAML mapping from `path`, or ConfigError naming the file (and line) and the fix."""
    try:
        values = _parse_text(Path(path).read_text()) or {}
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", None) or str(error)
        raise ConfigError(
            f"{path}{where} is not valid YAML ({problem}); fix the file there (each line is "
            "`field: value`, lists as `[a, b]`)."
        ) from None
    except OSError as error:
        raise ConfigError(f"Cannot read config file {path}: {error.strerror}.") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{path} must contain a mapping of field: value.")
    return values


def coerce(key: str, value: Any, annotation: Any) -> Any:
    """Convert a YAML/CLI value to `annotation`, or raise ConfigError naming the key."""
    return _coerce(key, value, annotation)


# Any config dataclass (`jaxrl.config.TrainingConfig` and the trainers' configs).
_Config = typing.TypeVar("_Config")


def parse_config(
    cls: type[_Config],
    yaml_path: str | Path | None = None,
    cli_args: list[str] | None = None,
    overrides: dict[str, Any] | None = None,
    script_class: type[ScriptArguments] = ScriptArguments,
) -> tuple[_Config, ScriptArguments]:
    """Build `cls` from defaults < YAML file < CLI flags < `overrides`.

    Script-level keys (`script_class` fields: `ScriptArguments`, or `OnlineScriptArguments` for
    GRPO/RLOO) may appear in any source and are returned separately. `--config FILE` on the command line is used when `yaml_path` is not given.
    Unknown keys and bad values raise ConfigError naming the key and the closest valid keys.
    """
    script_types = field_types(script_class)
    all_types = {**script_types, **field_types(cls)}
    bool_keys, list_keys = kinds_of_keys(all_types)

    cli_values = split_cli(list(cli_args or []), bool_keys, list_keys)
    if yaml_path is None and "config" in cli_values:
        yaml_path = str(cli_values["config"])

    sources: list[tuple[str, dict[str, Any]]] = []
    if yaml_path is not None:
        sources.append((str(yaml_path), read_yaml(yaml_path)))
    sources += [("the command line", cli_values), ("overrides", dict(overrides or {}))]

    config_kwargs: dict[str, Any] = {}
    script_kwargs: dict[str, Any] = {"config": None if yaml_path is None else str(yaml_path)}
    for source, values in sources:
        for key, value in values.items():
            if key not in all_types:
                close = difflib.get_close_matches(key, list(all_types), n=3, cutoff=0.6)
                hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
                raise ConfigError(f"Unknown key {key!r} in {source} for {cls.__name__}.{hint}")
            target = script_kwargs if key in script_types else config_kwargs
            target[key] = _coerce(key, value, all_types[key])
    try:
        config = cls(**config_kwargs)
    except ConfigError as error:
        raise ConfigError(f"{cls.__name__}: {error}") from None
    return config, script_class(**script_kwargs)

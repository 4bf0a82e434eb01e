"""Load a dataset from whatever the user passed as `--dataset_name`.

Accepts an in-memory `datasets.Dataset`/`DatasetDict`, a local `.json`/`.jsonl`/`.parquet`/`.csv`
file, a directory of such files, a `save_to_disk` directory, or a Hugging Face Hub id (only when
online). Never tokenizes; see `sft.py`, `preference.py`, `reward.py`.

Local files are checked on the way in, so a bad file is one clear error naming the file, line,
row or column (an empty file, a malformed JSON line, a null or non-string value in a text
column) rather than a traceback from deep inside `datasets` or a tokenizer.
"""

import json
import os
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
# TRL's text columns: each holds a string (standard format) or a list of messages
# (conversational format); anything else would fail later inside the tokenizer.
TEXT_COLUMNS = ("text", "prompt", "completion", "chosen", "rejected", "messages")


class DatasetFileError(ValueError):
    """A local dataset file cannot be used; the message names the file and the fix."""


def _first_bad_json_line(path: Path) -> tuple[int, str] | None:
    """(line number, parser message) of the first line of a JSON Lines file that is not JSON."""
    with path.open(encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                json.loads(line.rstrip("\n"))
            except json.JSONDecodeError as err:
                return number, f"{err.msg} at column {err.colno}"
    return None


def _explain_load_error(files: list[Path], err: Exception) -> DatasetFileError:
    for f in files:
        if f.suffix.lower() not in (".json", ".jsonl"):
            continue
        text_start = f.read_text(encoding="utf-8", errors="replace")[:1].strip()
        if text_start == "[" or text_start == "{" and f.suffix.lower() == ".json":
            try:  # a single JSON document (array of records)
                json.loads(f.read_text(encoding="utf-8", errors="replace"))
                continue
            except json.JSONDecodeError as jerr:
                if text_start == "[":
                    return DatasetFileError(
                        f"{f}: line {jerr.lineno} is not valid JSON ({jerr.msg} at column "
                        f"{jerr.colno}). Fix the file, or write one JSON object per line (.jsonl)."
                    )
        bad = _first_bad_json_line(f)
        if bad is not None:
            return DatasetFileError(
                f"{f}: line {bad[0]} is not valid JSON ({bad[1]}). Each line of a JSON Lines "
                "file must be one JSON object; fix or delete that line."
            )
    names = ", ".join(str(f) for f in files)
    return DatasetFileError(
        f"Could not read dataset file(s) {names}: {type(err).__name__}: {err}. Check that each "
        "file is valid for its extension (.jsonl/.json/.parquet/.csv) and that all files share "
        "the same columns."
    )


def check_text_columns(data: Any, source: str) -> None:
    """Raise DatasetFileError naming the column and row of the first null or non-text value in
    one of TRL's text columns (rows counted from 1, in file order)."""
    splits = data.items() if isinstance(data, datasets.DatasetDict) else [(None, data)]
    for split, ds in splits:
        where = source if split is None else f"{source} (split {split!r})"
        if len(ds) == 0:
            raise DatasetFileError(
                f"{where} has no rows. Point dataset_name at a file with at least one example."
            )
        table = ds.data.table if hasattr(ds.data, "table") else ds.data
        for name in TEXT_COLUMNS:
            if name not in ds.column_names:
                continue
            column = table.column(name)
            kind = column.type
            typed = pa.types.is_string(kind) or pa.types.is_large_string(kind)
            typed = typed or pa.types.is_list(kind) or pa.types.is_large_list(kind)
            if typed:  # one Arrow type: only nulls can be wrong, found without a Python loop
                nulls = np.asarray(pc.is_null(column).to_numpy(zero_copy_only=False))
                bad = [int(np.argmax(nulls))] if nulls.any() else []
            else:  # numbers, or a mix of types: find the first row that is not text
                bad = [i for i, v in enumerate(ds[name]) if not isinstance(v, str | list)][:1]
            if bad:
                row = bad[0]
                value = ds[row][name]
                what = "null (missing)" if value is None else f"{value!r} ({type(value).__name__})"
                raise DatasetFileError(
                    f"{where}: column {name!r} at row {row + 1} is {what}, but every row "
                    "must hold text (a string, or a list of chat messages). Fix or drop that "
                    "row (rows counted from 1 in file order)."
                )


def _offline() -> bool:
    flags = (os.environ.get(k, "").lower() for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
    return any(v in ("1", "true", "yes", "on") for v in flags)


def _select_split(data: Any, split: str | None, source: str) -> Any:
    if split is None or not isinstance(data, datasets.DatasetDict):
        return data
    if split not in data:
        raise ValueError(
            f"Split {split!r} not found in {source}; available splits: {sorted(data)}. "
            "Set dataset_train_split / dataset_test_split to one of them."
        )
    return data[split]


def _load_files(files: list[Path], split: str | None, source: str, **kw: Any) -> Any:
    exts = {_BUILDERS[f.suffix.lower()] for f in files}
    if len(exts) > 1:
        raise ValueError(f"{source} mixes file types {sorted(exts)}; keep one format per dataset.")
    for f in files:
        if f.stat().st_size == 0 or (
            f.suffix.lower() != ".parquet"
            and not f.read_text(encoding="utf-8", errors="replace").strip()
        ):
            raise DatasetFileError(
                f"Dataset file {f} is empty. Point dataset_name at a file with at least one "
                "example (one JSON object per line for .jsonl)."
            )
    by_split: dict[str, list[str]] = {}
    for f in files:
        # `train.jsonl`, `test-00001.parquet`, ... name their split; anything else is "train".
        name = f.name.split(".")[0].split("-")[0].split("_")[0]
        key = name if name in ("train", "test", "validation", "eval") else "train"
        by_split.setdefault(key, []).append(str(f))
    try:
        data = datasets.load_dataset(exts.pop(), data_files=by_split, **kw)
    except Exception as err:  # datasets wraps parser errors; name the file and line instead
        raise _explain_load_error(files, err) from err
    data = _select_split(data, split, source)
    check_text_columns(data, source)
    return data


def load_dataset_any(
    name_or_path: str | os.PathLike | datasets.Dataset | datasets.DatasetDict,
    split: str | None = "train",
    **kw: Any,
) -> datasets.Dataset | datasets.DatasetDict:
    """Return the `split` of a dataset (the whole `DatasetDict` when `split` is None).

    - `Dataset` objects are returned unchanged; a `DatasetDict` gives its `split`.
    - A single data file holds only the "train" split.
    - A directory of data files maps files named `train*`, `test*`, `validation*`, `eval*` to those
      splits (any other name counts as "train").
    - A `save_to_disk` directory is read with `datasets.load_from_disk`.
    - Anything else is treated as a Hub id; offline (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE) that is
      an error asking for a local path. `kw` is passed to `datasets.load_dataset`.
    """
    if isinstance(name_or_path, datasets.Dataset | datasets.DatasetDict):
        return _select_split(name_or_path, split, "the given DatasetDict")
    path = Path(os.path.expanduser(str(name_or_path)))
    source = str(name_or_path)
    if path.is_file():
        if path.suffix.lower() not in _BUILDERS:
            raise ValueError(
                f"Unsupported data file {source}: use .json, .jsonl, .parquet or .csv "
                "(or a save_to_disk directory)."
            )
        if split not in (None, "train"):
            raise ValueError(
                f"{source} is a single file, which holds only the 'train' split (asked for "
                f"{split!r}); pass the {split} file itself as the dataset for that split."
            )
        return _load_files([path], "train", source, **kw)
    if path.is_dir():
        if (path / "dataset_dict.json").exists() or (path / "state.json").exists():
            return _select_split(datasets.load_from_disk(str(path)), split, source)
        files = sorted(f for f in path.rglob("*") if f.is_file() and f.suffix.lower() in _BUILDERS)
        if not files:
            found = sorted(p.name for p in path.iterdir())[:5]
            raise DatasetFileError(
                f"Directory {source} has no .json/.jsonl/.parquet/.csv files and is not a "
                f"save_to_disk directory (it holds {found or 'nothing'}). Pass a data file, a "
                "directory of such files, or a directory written by Dataset.save_to_disk."
            )
        return _load_files(files, split, source, **kw)
    looks_local = source.startswith(("/", "./", "../", "~")) or path.suffix.lower() in _BUILDERS
    if looks_local:
        raise FileNotFoundError(f"Dataset path {source} does not exist.")
    if _offline():
        raise ValueError(
            f"{source!r} is not a local file or directory, and the Hugging Face Hub is offline "
            "(HF_HUB_OFFLINE/HF_DATASETS_OFFLINE is set). Pass a local path (.jsonl/.json/"
            ".parquet/.csv file, directory, or save_to_disk directory) as dataset_name."
        )
    try:
        return datasets.load_dataset(source, split=split, **kw)
    except (ConnectionError, OSError) as err:
        raise ValueError(
            f"Could not download {source!r} from the Hugging Face Hub ({err}). If you are offline, "
            "pass a local path as dataset_name."
        ) from err

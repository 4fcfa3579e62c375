"""The rows of a prompt data set, from the files and Hugging Face `datasets` sources users have.

Design choices:
- A source is one string (`env.math.source`, `env.prompts.source`):
  - a `.jsonl` / `.json` (one object per line), `.parquet` or `.csv` (header line; every cell kept as the text it
    is, so `42` stays "42") file, read here with every row checked;
  - a directory written by `datasets`' `save_to_disk` (a `Dataset` or a `DatasetDict`), or a directory of data
    files of one type, read with Hugging Face `datasets` (`pip install datasets`), which reads one type per
    directory: a directory mixing types is refused rather than read in part;
  - a hub id (`name` or `org/name`) that `datasets` has already cached on this machine, read in offline mode: the
    hub is never asked (a data set that is not cached is an error saying so, at once).
- `split` picks the split of a `DatasetDict`, a directory of data files or a hub data set (`train` by default); a
  single file or a saved `Dataset` has only its rows, and a split other than `train` is then an error.
- Rows are `(location, dict)` pairs; the location ("line 7", "row 3") names the row in errors. Reading is cached per
  process (keyed by source, split and the source's size and modification time), since each trajectory constructs
  its own env.
- Every error is a ValueError naming the source and what to do.
"""

from __future__ import annotations

import csv
import json
import os
import re
from functools import lru_cache
from pathlib import Path

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
OWN_FILES = (".jsonl", ".json", ".parquet", ".csv")  # read here, every row checked with its line or row number


def read_rows(source: str, split: str = "train") -> tuple[tuple[str, dict], ...]:
    """Every row of `source` (a file, a `datasets` directory or a cached hub id) as (location, row dict)."""
    return _read_cached(*source_key(source), split)


def source_key(source: str) -> tuple[str, int, int]:
    """(resolved source, size, modification time): what a cache of the source's contents is keyed by. A source that
    is neither a path nor a hub id is a ValueError."""
    path = Path(source).expanduser()
    if path.is_symlink() and not path.exists():
        raise ValueError(f"data source {source!r} is a link that leads nowhere (a loop of links, or a missing target); "
                         "give the file or directory itself")
    if path.exists():
        stat = path.stat()
        return str(path.resolve()), stat.st_size, stat.st_mtime_ns
    if not HUB_ID.fullmatch(source) or path.suffix.lower() in OWN_FILES:
        raise ValueError(f"data source {source!r} does not exist (a .jsonl / .json / .parquet / .csv file, a "
                         "directory saved with datasets' save_to_disk, or a hub data set id already in the cache)")
    return source, 0, 0


@lru_cache(maxsize=8)
def _read_cached(source: str, size: int, mtime_ns: int, split: str) -> tuple[tuple[str, dict], ...]:
    path = Path(source)
    suffix = path.suffix.lower()
    if path.is_file() and suffix in OWN_FILES:
        if split != "train":
            raise ValueError(f"{source}: a single file has no split {split!r}; leave the split at train")
        rows = {".parquet": _read_parquet, ".csv": _read_csv}.get(suffix, _read_jsonl)(path)
    elif path.is_file():
        raise ValueError(f"data file {source!r}: unsupported type {path.suffix!r}; use .jsonl, .json, .parquet or "
                         ".csv, or a directory saved with datasets' save_to_disk")
    else:
        rows = [(f"row {i}", row) for i, row in enumerate(_hf_rows(source, path, split))]
    if not rows:
        raise ValueError(f"data source {source!r} holds no rows" + (f" in split {split!r}" if split != "train" else ""))
    return tuple(rows)


def _hf_rows(source: str, path: Path, split: str) -> list[dict]:
    """The rows of a `save_to_disk` directory, a directory of data files or a cached hub id."""
    datasets = _datasets(source)
    if path.is_dir() and _saved_to_disk(path):
        data = datasets.load_from_disk(str(path))
        if isinstance(data, datasets.DatasetDict):
            if split not in data:
                raise ValueError(f"{source} has no split {split!r}; its splits: {', '.join(data)}")
            return data[split].to_list()
        if split != "train":
            raise ValueError(f"{source} is a single Dataset (no splits); leave the split at train")
        return data.to_list()
    if path.is_dir():
        _check_one_file_type(path)
    return _load_offline(datasets, source, split)


DATA_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".tsv": "csv", ".parquet": "parquet",
                      ".arrow": "arrow", ".txt": "text"}  # suffix -> the `datasets` builder that reads it


def _check_one_file_type(path: Path) -> None:
    """`datasets` reads a directory's data files of one builder only (the most frequent) and drops the others
    silently: refuse a directory that mixes them."""
    found: dict[str, list[str]] = {}
    for file in sorted(path.rglob("*")):
        builder = DATA_FILE_BUILDERS.get(file.suffix.lower())
        if builder and file.is_file() and not any(part.startswith(".") for part in file.relative_to(path).parts):
            found.setdefault(builder, []).append(file.suffix.lower())
    if len(found) > 1:
        kinds = ", ".join(f"{len(v)} {'/'.join(sorted(set(v)))}" for _, v in sorted(found.items()))
        raise ValueError(f"data directory {path} mixes data file types ({kinds}); datasets reads one type per "
                         "directory and would drop the other files' rows: convert them to one type, or give one file")


def _saved_to_disk(path: Path) -> bool:
    """A directory written by `save_to_disk`: `dataset_info.json` + `state.json`, or a `dataset_dict.json`."""
    return (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()


def _load_offline(datasets, source: str, split: str) -> list[dict]:
    """`datasets.load_dataset(source, split=split)` with the hub switched off: only local data and the cache."""
    from huggingface_hub import constants

    saved = datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE = True
    try:
        return datasets.load_dataset(source, split=split).to_list()
    except (ConnectionError, FileNotFoundError) as e:
        where = "directory" if Path(source).is_dir() else "hub data set"
        raise ValueError(f"{where} {source!r} cannot be read offline ({_first_line(e)}); a hub data set must already "
                         f"be in the local cache ({datasets.config.HF_DATASETS_CACHE}): load it once with "
                         "datasets.load_dataset where there is network access, or save_to_disk it and give that "
                         "directory") from None
    except ValueError as e:  # an unknown split, among others
        raise ValueError(f"{source}: {_first_line(e)}") from None
    finally:
        datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE = saved


def _datasets(source: str):
    try:
        import datasets
    except ImportError as e:
        raise ValueError(f"reading {source!r} needs Hugging Face datasets: pip install datasets") from e
    datasets.disable_progress_bars()
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    return datasets


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else error.__class__.__name__


def _read_jsonl(path: Path) -> list[tuple[str, dict]]:
    """(location, row) of every non-blank line of a JSONL file; a bad line is a ValueError naming it."""
    rows = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}: line {number} is not valid UTF-8 (byte 0x{raw[e.start]:02x} at column "
                                 f"{e.start + 1}); save the file as UTF-8") from None
            if line.strip():
                rows.append((f"line {number}", _json_object(line, f"{path}: line {number}")))
    return rows


def _read_csv(path: Path) -> list[tuple[str, dict]]:
    """(location, row) of every row of a CSV file with a header line; every cell is kept as the text it is. Quoting is
    strict: an unclosed quote is an error naming the line its row starts on, not a cell that swallows the file."""
    rows, start = [], 1
    try:
        with open(path, encoding="utf-8", newline="") as f:
            reader = csv.DictReader(f, strict=True)
            reader.fieldnames  # the header line, read (and checked) first
            start = reader.line_num + 1
            for row in reader:
                rows.append((f"line {reader.line_num}", dict(row)))
                start = reader.line_num + 1
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not valid UTF-8 (byte 0x{e.object[e.start]:02x}); save the file as UTF-8") from None
    except csv.Error as e:
        raise ValueError(f"{path}: the row starting on line {start} is not valid CSV ({e}); close every quoted cell's "
                         'quote, and write a quote inside a quoted cell twice ("")') from None
    return rows


def _json_object(line: str, where: str) -> dict:
    """The JSON object on one line; an integer past Python's 4,300-digit conversion limit keeps its digits as text."""
    try:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise
        except ValueError:  # an integer too long for int(): read every integer of the line as its digits
            row = json.loads(line, parse_int=str)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where} is not valid JSON ({e.msg}); expected one object per line (JSONL)") from None
    except RecursionError:
        raise ValueError(f"{where} nests arrays or objects too deeply to parse; store the value as a string") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where} is a JSON {type(row).__name__}, not an object")
    return row


def _read_parquet(path: Path) -> list[tuple[str, dict]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ValueError(f"reading {str(path)!r} needs pyarrow: pip install 'rldynamics[parquet]'") from e
    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a damaged file
        raise ValueError(f"{path}: not a readable Parquet file ({e})") from e
    return [(f"row {i}", row) for i, row in enumerate(rows)]

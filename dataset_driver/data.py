"""Prompt datasets for `ppoz train`: reading records, checking them, and the order drivers take them in.

A record is `{prompt, ground_truth, data_source, extra_info?}`:
- `prompt`: a non-empty string, or chat messages (`[{"role": ..., "content": ...}, ...]`, rendered
  with the model's chat template by the actor);
- `ground_truth`: what the reward compares with (any JSON value; verl's layout, the ground truth
  under `reward_model.ground_truth`, is read too); optional, for rewards that need none (a reward
  model, a dialogue judge): the built-ins refuse a record without one, naming it;
- `data_source`: a string naming the dataset (it picks the built-in reward; default "default");
- `extra_info`: an optional object handed to the reward function.

Files: JSON (an array of records), JSONL (one record per line) or Parquet (pyarrow), chosen by the
suffix. A bad record is named by file, line or row, and field, and is either fatal (`strict`) or
skipped and counted (`DatasetReport.skipped`, with the first few reasons).

`PromptOrder` is the order of work: epochs, each a permutation of the records by a seeded
generator (or in file order), each record `rollout_n` times in a row; a position in it is one
integer, so a driver that stops can resume where it stopped.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SUFFIXES = (".json", ".jsonl", ".parquet")
MAX_REASONS = 10  # bad records named in a report; the rest are counted


class DatasetError(ValueError):
    """A dataset that cannot be read, or a bad record in strict mode: names the file, the line or row, the field."""


@dataclass(frozen=True)
class PromptRecord:
    prompt: str | list[dict[str, str]]
    ground_truth: Any
    data_source: str
    extra_info: dict[str, Any]
    where: str  # "train.jsonl line 3": how errors about it name it


@dataclass
class DatasetReport:
    path: str
    read: int = 0  # records found in the file
    skipped: int = 0
    reasons: list[str] = field(default_factory=list)  # the first MAX_REASONS bad records, named

    def skip(self, reason: str) -> None:
        self.skipped += 1
        if len(self.reasons) < MAX_REASONS:
            self.reasons.append(reason)


def load_dataset(
    path: str | Path, strict: bool = False, fits: Callable[[PromptRecord], str] | None = None
) -> tuple[list[PromptRecord], DatasetReport]:
    """Every good record of `path`, in file order, and what was skipped. Strict: the first bad record is a DatasetError.
    `fits(record)`: why a well-formed record cannot be sent ("" if it can), such as a prompt over the broker's limits
    (dataset_driver/driver.py `request_problem`); such a record is a bad record, named with its line and the limit."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path}: no such file")
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise DatasetError(f"{path}: unknown format {suffix or '(no suffix)'!r}; use one of {', '.join(SUFFIXES)}")
    report = DatasetReport(str(path))
    records = []
    for where, raw in _raw_records(path, suffix, report):
        report.read += 1
        try:
            record = check_record(raw, where)
            problem = fits(record) if fits is not None else ""
            if problem:
                raise DatasetError(f"{where}: {problem}")
            records.append(record)
        except DatasetError as e:
            if strict:
                raise
            report.skip(str(e))
    if report.skipped:
        log.warning("%s: %d of %d records skipped, first: %s", path, report.skipped, report.read, report.reasons[0])
    if not records:
        raise DatasetError(f"{path}: no usable record ({report.read} read, {report.skipped} skipped: {report.reasons[:3]})")
    return records, report


def _raw_records(path: Path, suffix: str, report: DatasetReport) -> Iterator[tuple[str, Any]]:
    name = path.name
    if suffix == ".jsonl":
        with path.open("rb") as f:  # decoded line by line: one line of bad UTF-8 is that record's fault alone
            for number, raw_line in enumerate(f, start=1):
                where = f"{name} line {number}"
                try:
                    line = raw_line.decode("utf-8")
                except UnicodeDecodeError as e:
                    yield where, _Unreadable(f"not valid UTF-8 at byte {e.start}")
                    continue
                if not line.strip():
                    continue
                try:
                    yield where, json.loads(line)
                except json.JSONDecodeError as e:
                    yield where, _Unreadable(f"not valid JSON: {e.msg} at column {e.colno}")
    elif suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DatasetError(f"{path}: not valid JSON: {e}") from e
        if isinstance(data, dict) and isinstance(data.get("data"), list):
            data = data["data"]
        if not isinstance(data, list):
            raise DatasetError(f'{path}: a JSON dataset is an array of records (or {{"data": [...]}}), got {type(data).__name__}')
        for index, raw in enumerate(data):
            yield f"{name} record {index}", raw
    else:
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as e:  # noqa: BLE001 - pyarrow raises several kinds for a damaged file
            raise DatasetError(f"{path}: cannot read it as Parquet: {type(e).__name__}: {e}") from e
        for index, raw in enumerate(table.to_pylist()):
            yield f"{name} row {index}", raw


@dataclass(frozen=True)
class _Unreadable:
    reason: str


def check_record(raw: Any, where: str) -> PromptRecord:
    """A record as PromptRecord, or a DatasetError naming `where` and the field at fault."""
    if isinstance(raw, _Unreadable):
        raise DatasetError(f"{where}: {raw.reason}")
    if not isinstance(raw, dict):
        raise DatasetError(f"{where}: a record is an object, got {type(raw).__name__}")
    raw = {k: v for k, v in raw.items() if v is not None}  # a Parquet table's missing fields are nulls
    prompt = raw.get("prompt")
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DatasetError(f"{where}: field `prompt` is empty")
    elif isinstance(prompt, list):
        _check_messages(prompt, where)
    else:
        raise DatasetError(f"{where}: field `prompt` must be a string or a list of chat messages, got {type(prompt).__name__}")
    ground_truth = raw.get("ground_truth")
    if ground_truth is None and isinstance(raw.get("reward_model"), dict):
        ground_truth = raw["reward_model"].get("ground_truth")  # verl's layout
    data_source = raw.get("data_source", "default")
    if not isinstance(data_source, str) or not data_source:
        raise DatasetError(f"{where}: field `data_source` must be a non-empty string, got {data_source!r:.60}")
    extra_info = raw.get("extra_info") or {}
    if not isinstance(extra_info, dict):
        raise DatasetError(f"{where}: field `extra_info` must be an object, got {type(extra_info).__name__}")
    return PromptRecord(prompt, ground_truth, data_source, extra_info, where)


def _check_messages(messages: list[Any], where: str) -> None:
    if not messages:
        raise DatasetError(f"{where}: field `prompt` is an empty list of messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
            raise DatasetError(f'{where}: field `prompt` message {i} must be {{"role": str, "content": str}}, got {message!r:.80}')


@dataclass(frozen=True)
class PromptOrder:
    """The order of work over `n_records`: `epochs` passes (0: without end), each a permutation drawn
    from `seed` and the epoch's number (or file order without `shuffle`), each record `rollout_n`
    times in a row. Position p is the p-th sample of the whole run; resuming at p continues exactly."""

    n_records: int
    epochs: int = 1
    rollout_n: int = 1
    shuffle: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.n_records < 1:
            raise ValueError(f"a prompt order needs records, got {self.n_records}")
        if self.epochs < 0:
            raise ValueError(f"`epochs` must be >= 0 (0: without end), got {self.epochs}")
        if self.rollout_n < 1:
            raise ValueError(f"`rollout_n` must be >= 1, got {self.rollout_n}")

    @property
    def per_epoch(self) -> int:
        return self.n_records * self.rollout_n

    @property
    def total(self) -> int | None:
        """Samples in the whole run; None without end."""
        return self.per_epoch * self.epochs if self.epochs else None

    def permutation(self, epoch: int) -> list[int]:
        order = list(range(self.n_records))
        if self.shuffle:
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def at(self, position: int) -> tuple[int, int, int]:
        """(epoch, record index, sample index within the record's rollout_n) at `position`."""
        if position < 0 or (self.total is not None and position >= self.total):
            raise IndexError(f"position {position} is outside the run's {self.total} samples")
        epoch, within = divmod(position, self.per_epoch)
        slot, sample = divmod(within, self.rollout_n)
        return epoch, self.permutation(epoch)[slot], sample

    def positions(self, start: int = 0) -> Iterator[tuple[int, int, int, int]]:
        """(position, epoch, record index, sample index) from `start` to the end of the run."""
        position = start
        epoch = -1
        order: list[int] = []
        while self.total is None or position < self.total:
            e, within = divmod(position, self.per_epoch)
            if e != epoch:
                epoch, order = e, self.permutation(e)
            slot, sample = divmod(within, self.rollout_n)
            yield position, epoch, order[slot], sample
            position += 1

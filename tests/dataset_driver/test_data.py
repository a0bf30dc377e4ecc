"""Prompt datasets: the three formats, bad records named (skipped and counted, or fatal), and the order of work."""

from __future__ import annotations

import json
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dataset_driver.data import DatasetError, PromptOrder, load_dataset

GOOD = [
    {"prompt": "What is 2+3?", "ground_truth": "5", "data_source": "arithmetic"},
    {"prompt": [{"role": "user", "content": "Capital of France?"}], "ground_truth": "Paris", "data_source": "qa", "extra_info": {"id": 7}},
    {"prompt": "verl's layout", "reward_model": {"ground_truth": "42", "style": "rule"}, "data_source": "openai/gsm8k"},
]


def test_the_three_formats_give_the_same_records(tmp_path) -> None:
    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in GOOD) + "\n\n")  # a blank line is no record
    as_json = tmp_path / "train.json"
    as_json.write_text(json.dumps(GOOD))
    parquet = tmp_path / "train.parquet"  # a fixed schema: GOOD[0] and GOOD[2] share their columns' types
    pq.write_table(pa.Table.from_pylist([{**GOOD[0], "reward_model": None}, {**GOOD[2], "ground_truth": None}]), parquet)
    a, report = load_dataset(jsonl)
    b, _ = load_dataset(as_json)
    assert report.read == 3 and report.skipped == 0
    assert [(r.prompt, r.ground_truth, r.data_source, r.extra_info) for r in a] == [
        (r.prompt, r.ground_truth, r.data_source, r.extra_info) for r in b
    ]
    assert a[1].prompt == [{"role": "user", "content": "Capital of France?"}] and a[1].extra_info == {"id": 7}
    assert a[2].ground_truth == "42" and a[0].where == "train.jsonl line 1" and b[2].where == "train.json record 2"
    c, _ = load_dataset(parquet)  # GOOD[0] got a null reward_model, GOOD[2] a null ground_truth: read as absent
    assert [(r.prompt, r.ground_truth, r.data_source, r.where) for r in c] == [
        ("What is 2+3?", "5", "arithmetic", "train.parquet row 0"),
        ("verl's layout", "42", "openai/gsm8k", "train.parquet row 1"),
    ]


def test_bad_records_are_named_by_file_line_and_field_then_skipped_and_counted_or_fatal(tmp_path) -> None:
    path = tmp_path / "mixed.jsonl"
    lines = [
        json.dumps(GOOD[0]),
        "{not json",
        json.dumps({"prompt": "", "ground_truth": "1"}),
        json.dumps({"prompt": "p", "data_source": ""}),
        json.dumps({"prompt": 5, "ground_truth": "1"}),
        json.dumps({"prompt": [{"role": "user"}], "ground_truth": "1"}),
        json.dumps({"prompt": "p", "ground_truth": "1", "data_source": 3}),
        json.dumps({"prompt": "p", "ground_truth": "1", "extra_info": [1]}),
        json.dumps(["a list"]),
        json.dumps(GOOD[1]),
    ]
    path.write_text("\n".join(lines))
    records, report = load_dataset(path)
    assert len(records) == 2 and report.read == 10 and report.skipped == 8
    assert report.reasons == [
        "mixed.jsonl line 2: not valid JSON: Expecting property name enclosed in double quotes at column 2",
        "mixed.jsonl line 3: field `prompt` is empty",
        "mixed.jsonl line 4: field `data_source` must be a non-empty string, got ''",
        "mixed.jsonl line 5: field `prompt` must be a string or a list of chat messages, got int",
        "mixed.jsonl line 6: field `prompt` message 0 must be {\"role\": str, \"content\": str}, got {'role': 'user'}",
        "mixed.jsonl line 7: field `data_source` must be a non-empty string, got 3",
        "mixed.jsonl line 8: field `extra_info` must be an object, got list",
        "mixed.jsonl line 9: a record is an object, got list",
    ]
    with pytest.raises(DatasetError, match="mixed.jsonl line 2: not valid JSON"):
        load_dataset(path, strict=True)
    # A line of bad UTF-8 is that record's fault alone.
    raw = tmp_path / "bytes.jsonl"
    raw.write_bytes(json.dumps(GOOD[0]).encode() + b'\n{"prompt": "caf\xe9", "ground_truth": "x"}\n' + json.dumps(GOOD[0]).encode())
    records, report = load_dataset(raw)
    assert len(records) == 2 and report.reasons == ["bytes.jsonl line 2: not valid UTF-8 at byte 15"]


def test_files_that_cannot_be_datasets(tmp_path) -> None:
    with pytest.raises(DatasetError, match="no such file"):
        load_dataset(tmp_path / "absent.jsonl")
    (tmp_path / "d.csv").write_text("a,b")
    with pytest.raises(DatasetError, match="unknown format '.csv'"):
        load_dataset(tmp_path / "d.csv")
    (tmp_path / "d.json").write_text('{"prompt": "x"}')
    with pytest.raises(DatasetError, match="array of records"):
        load_dataset(tmp_path / "d.json")
    (tmp_path / "d.parquet").write_bytes(b"not parquet")
    with pytest.raises(DatasetError, match="cannot read it as Parquet"):
        load_dataset(tmp_path / "d.parquet")
    (tmp_path / "bad.jsonl").write_text('{"prompt": ""}\n')
    with pytest.raises(DatasetError, match="no usable record .1 read, 1 skipped"):
        load_dataset(tmp_path / "bad.jsonl")


def test_the_order_of_work_epochs_rollout_n_shuffling_and_resume() -> None:
    order = PromptOrder(n_records=5, epochs=2, rollout_n=3, seed=1)
    run = list(order.positions())
    assert len(run) == order.total == 30
    # each epoch holds every record rollout_n times, in a row
    for epoch in (0, 1):
        records = [r for _, e, r, _ in run if e == epoch]
        assert Counter(records) == {i: 3 for i in range(5)}
        assert all(records[i] == records[i + 1] == records[i + 2] for i in range(0, 15, 3))
        assert [s for _, e, _, s in run if e == epoch] == [0, 1, 2] * 5
    first, second = [r for _, e, r, s in run if e == 0 and s == 0], [r for _, e, r, s in run if e == 1 and s == 0]
    assert first != second and sorted(first) == list(range(5))  # a fresh permutation each epoch (seed 1 draws two)
    assert first == PromptOrder(5, 2, 3, seed=1).permutation(0)  # the same seed, the same order
    assert PromptOrder(5, 2, 3, seed=2).permutation(0) != first or PromptOrder(5, 2, 3, seed=2).permutation(1) != second
    # resume: from any position the rest of the run is exactly what the whole run had there
    assert list(order.positions(17)) == run[17:]
    assert all(order.at(p) == (e, r, s) for p, e, r, s in run)
    assert [r for _, _, r, _ in PromptOrder(3, 1, 1, shuffle=False).positions()] == [0, 1, 2]
    endless = PromptOrder(2, epochs=0).positions()
    assert len([next(endless) for _ in range(7)]) == 7 and PromptOrder(2, epochs=0).total is None
    with pytest.raises(IndexError, match="outside the run's 30 samples"):
        order.at(30)
    for bad in (dict(n_records=0), dict(n_records=2, epochs=-1), dict(n_records=2, rollout_n=0)):
        with pytest.raises(ValueError):
            PromptOrder(**bad)


def test_a_record_the_broker_would_refuse_is_a_bad_record_named_with_its_line_and_the_limit(tmp_path) -> None:
    """Checked when the dataset is read, by the broker's own rules on the request `generate` would send: a prompt
    over max_prompt_chars or max_messages, or a request over max_message_bytes (which ZeroMQ drops unanswered when
    far over: it showed only as a timeout after the deadline) (issue 28)."""
    from common.protocol import Limits
    from dataset_driver.data import PromptRecord
    from dataset_driver.driver import Sampling, request_problem

    limits = Limits(max_message_bytes=4096, max_prompt_chars=3000, max_messages=2)
    rows = [
        {"prompt": "short"},
        {"prompt": "x" * 3001},
        {"prompt": "é" * 2900},  # within max_prompt_chars, but 5,800 bytes of UTF-8: over the message size
        {"prompt": [{"role": "user", "content": "a"}] * 3},
    ]
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    sampling = Sampling(max_new_tokens=8)
    records, report = load_dataset(path, fits=lambda record: request_problem(record, sampling, limits))
    assert [r.prompt for r in records] == ["short"] and report.skipped == 3
    first, second, third = report.reasons
    assert first == "train.jsonl line 2: over the broker's limits: `prompt` has 3001 characters, the limit is 3000"
    size = int(second.split(" bytes")[0].rsplit(" ", 1)[1])  # the whole request, task id and rid at their longest
    assert second == f"train.jsonl line 3: its generate request is {size} bytes, over the broker's max_message_bytes (4096)"
    assert 5800 < size < 6200
    assert third == "train.jsonl line 4: over the broker's limits: `messages` has 3 entries, the limit is 2"
    with pytest.raises(DatasetError, match="train.jsonl line 2: over the broker's limits"):
        load_dataset(path, strict=True, fits=lambda record: request_problem(record, sampling, limits))
    # under the chat template a text prompt goes as one message: the same rules hold for it
    chat = Sampling(max_new_tokens=8, chat_template=True)
    assert "`messages` hold 3001 characters" in request_problem(PromptRecord("x" * 3001, None, "d", {}, "w"), chat, limits)
    assert request_problem(PromptRecord("short", None, "d", {}, "w"), Sampling(max_new_tokens=9000), Limits()) == (
        "over the broker's limits: `sampling.max_new_tokens` is 9000, the limit is 4096"
    )

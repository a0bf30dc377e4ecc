"""`ppoz bench gpu --device cpu`: the GPU bench's own code at tiny sizes, as CI runs it between GPU runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.processes import ppoz


@pytest.mark.slow
def test_bench_gpu_runs_every_part_on_the_cpu_and_prints_one_json_object(tmp_path: Path) -> None:
    proc = ppoz("bench", "gpu", "--device", "cpu", "--json", timeout=600, cwd=tmp_path)  # 4 benches in processes: 20 s alone; x30
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert set(result) == {"scoring", "generate", "generate_targets", "weights", "gae", "head", "update", "decode", "train", "setup"}
    assert not [name for name, part in result.items() if "error" in part], proc.stdout
    assert result["gae"]["tokens"] == 131_072 and 0 < result["gae"]["ms"]
    head = result["head"]
    assert head["vocab"] == 151_936 and head["head_logits_ms"] > 0 and head["upcast_per_call_ms"] > 0
    assert head["within_exact_bound"] and head["float32_copy_kept"]  # the CPU's way: its float32 copy kept
    update = result["update"]
    assert update["shape"] == "tiny-qwen2" and update["dtype"] == "float32" and update["lora_rank"] == 8
    assert update["gradient_checkpointing"] is False and update["tokens"] > 0 and update["seconds"] > 0
    engine = result["generate"]["default"]["ppoz"]
    assert engine["differing_outputs"] == 0  # greedy outputs equal to transformers' own
    assert result["generate_targets"]["vs_one_at_a_time"] == engine["vs_one_at_a_time"]
    assert result["scoring"]["cases"] and result["weights"]["medians"]
    decode = result["decode"]
    assert decode["rows"] == decode["active"] == 4 and decode["wall_ms_per_step"] > 0  # every row still decoding
    assert result["train"] == {"skipped": "no --trl-python: trl's environment cannot be made without a package index"}
    assert result["setup"]["device"] == "cpu" and result["setup"]["gpu"] is None


def test_bench_gpu_refuses_a_bad_budget_and_device(tmp_path: Path) -> None:
    proc = ppoz("bench", "gpu", "--device", "cpu", "--budget-s", "0", cwd=tmp_path)
    assert proc.returncode != 0 and "--budget-s must be positive, got 0.0" in proc.stderr
    proc = ppoz("bench", "gpu", "--device", "tpu", cwd=tmp_path)
    assert proc.returncode == 2 and "argument --device: invalid choice: 'tpu'" in proc.stderr

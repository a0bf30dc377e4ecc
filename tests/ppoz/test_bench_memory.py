"""`ppoz bench memory`: each part's peak traced on the meta device, and the instrument against a real CPU run."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.processes import ppoz


def test_the_trace_counts_what_the_cpu_allocates() -> None:
    """The same candidate update (Qwen2.5's vocabulary at hidden 64, two layers, float32) run on the CPU for real
    and traced on meta: the traced peak is the real one to within a few percent (the host's own small tensors,
    index lists and the like, are the difference)."""
    from tools.bench.memory import cross_check

    check = cross_check("tiny-qwen2")
    assert 0.9 <= check["traced_over_cpu"] <= 1.1, check


def test_the_bench_reports_each_part_at_two_depths_with_its_budget(tmp_path: Path) -> None:
    """At Qwen2.5-1.5B's shape, two parts, two depths: their peaks grow with depth, the fit's figure is the
    model's 28 layers, and the start-up's peak stays within 1.2x of what the process holds after (a float32 copy
    of the model for the start-up checks would make it about 3x)."""
    parts = "startup_learner,actor_scoring"
    proc = ppoz("bench", "memory", "--shape", "qwen2.5-1.5b", "--parts", parts, "--depths", "2,4", "--json", timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["shape"] == "qwen2.5-1.5b" and list(result["parts"]) == parts.split(",")
    for name, part in result["parts"].items():
        two, four = part["measured_gb"]["2"], part["measured_gb"]["4"]
        assert 0 < two < four < part["peak_gb"], (name, part)
        assert "28 layers" in part["how"] or " to 28" in part["how"]
    startup = result["parts"]["startup_learner"]
    assert startup["met"] and startup["ratio"] <= 1.2 and startup["steady_gb"] > 3  # 1.5B parameters in bf16: 3.1 GB
    proc = ppoz("bench", "memory", "--depths", "3", cwd=tmp_path)
    assert proc.returncode == 2 and "--depths takes two or more layer counts" in proc.stderr


def test_a_storage_resized_to_nothing_is_counted_free() -> None:
    """FSDP2 frees a block's gathered parameters by resizing their storage to 0 and gathers them again into the same
    storage: a storage's own `resize_`, which no dispatch mode sees. Counted as allocated all along, a sharded
    7B's update would seem to hold every block's gathered weights at once (26 GB a rank more)."""
    from tools.bench.memory_peak import peak_memory

    mb = 1 << 20

    def work() -> None:
        a = torch.empty(mb, dtype=torch.uint8)
        a.untyped_storage().resize_(0)
        b = torch.empty(mb, dtype=torch.uint8)
        del b
        a.untyped_storage().resize_(3 * mb)

    peak = peak_memory(work)
    assert peak.total == 3 * mb and peak.end == 0, peak


def test_the_sharded_trace_counts_what_the_cpu_allocates() -> None:
    """A full fine-tune on rank 0 of 2 (FSDP2, collectives fake) at hidden 64 with Qwen2.5's vocabulary, computed on
    real CPU tensors and traced on fake ones, both on the CPU's branches: the same peak within a few percent (0.967
    here, where the vocabulary's logits are nearly all of it: the real backward holds a third chunk's gradient at
    once; 1.000 at Qwen2.5-0.5B's width, docs/benchmarks.md)."""
    from tools.bench.memory_sharded import check

    result = check("tiny-qwen2", 2)
    assert 0.9 <= result["traced_over_cpu"] <= 1.1, result

"""`ppoz bench midflight`: new weights while responses run, three ways, at tiny sizes."""

from __future__ import annotations

import json
from pathlib import Path

from tests.processes import ppoz


def test_midflight_bench_runs_its_three_legs_and_only_resubmit_leaves_responses_unfinished(tmp_path: Path) -> None:
    sizes = ["--rows", "4", "--requests", "8", "--longest", "40", "--every", "12", "--repeats", "1"]
    proc = ppoz("bench", "midflight", *sizes, "--json", timeout=300, cwd=tmp_path)  # 3-10 s alone; x30
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["drain"]["unfinished"] == result["continue"]["unfinished"] == 0
    assert result["resubmit"]["unfinished"] > 0  # budgets past --every never finish when restarted at each version
    assert result["continue"]["recomputed"] > 0 and result["drain"]["recomputed"] == 0
    assert result["continue"]["steps"] < result["drain"]["steps"]  # no tail of idle rows before each version
    assert result["setup"]["requests"] == 8

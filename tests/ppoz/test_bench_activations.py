"""`ppoz bench activations`: the bytes one forward keeps for its backward, four ways, at a tiny width."""

from __future__ import annotations

import json
from pathlib import Path

from tests.processes import ppoz


def test_checkpointing_keeps_only_each_layers_input_and_autocast_less_than_plain(tmp_path: Path) -> None:
    proc = ppoz("bench", "activations", "--shape", "tiny-qwen2", "--tokens", "64", "--json", timeout=300, cwd=tmp_path)  # 5 s alone
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    plain, autocast, checkpointed = (result[k]["bytes_per_token_per_layer"] for k in ("plain", "autocast", "checkpointing"))
    assert checkpointed < autocast < plain
    # what checkpointing keeps a layer: about its bf16 input (hidden 64 x 2 bytes), not its inner activations
    assert checkpointed <= 4 * 64 * 2
    assert result["setup"] == {"shape": "tiny-qwen2", "hidden": 64, "layers": 2, "tokens": 64}

"""The checkpoint's recent segment ids: written id by id as encoded when added, read back in order."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import msgpack
import torch

from learner_node import checkpoint


def _save(directory: Path, update: int, recent: checkpoint.RecentIds | None) -> Path:
    return checkpoint.save(directory, update, {"w": torch.ones(3)}, {"v": torch.zeros(2)}, {}, {"updates": update}, 2, None, recent)


def test_recent_ids_keep_the_newest_in_order_and_forget_the_oldest(tmp_path: Path) -> None:
    recent = checkpoint.RecentIds(maxlen=5)
    # ids of the shapes seg ids take ("<task_id>:<epoch>:<seq>"), with non-ASCII and a 40k-character task id
    ids = [f"task-{i % 3}:0:{i}" for i in range(7)] + ["émulateur-7:2:0", "x" * 40_000 + ":0:1"]
    for seg_id in ids:
        recent.add(seg_id)
    assert list(recent) == ids[-5:] and len(recent) == 5
    assert ids[3] not in recent and ids[4] in recent and ids[-1] in recent
    assert msgpack.unpackb(recent.packed()) == ids[-5:]

    path = _save(tmp_path, 1, recent)
    assert checkpoint.read_state(path) == {"updates": 1, "recent_segments": ids[-5:]}
    recent.add("next:0:0")  # what a later checkpoint holds is the window then, not an append to the last file
    assert checkpoint.read_state(_save(tmp_path, 2, recent))["recent_segments"] == ids[-4:] + ["next:0:0"]
    assert checkpoint.read_state(_save(tmp_path, 3, None))["recent_segments"] == []


def test_a_window_of_100k_ids_packs_as_msgpack_of_the_list_and_an_old_checkpoint_still_reads(tmp_path: Path) -> None:
    recent = checkpoint.RecentIds(maxlen=100_000)
    ids = [f"kea-{i % 64}:{i // 64}:{i}" for i in range(120_000)]
    for seg_id in ids:
        recent.add(seg_id)
    started = time.perf_counter()
    packed = recent.packed()
    took = time.perf_counter() - started
    assert packed == msgpack.packb(ids[-100_000:])  # the array header past 65,535 items (0xdd) included
    print(f"packed 100k ids in {took * 1000:.1f} ms")  # the speed is a benchmark's business, not this test's

    old = tmp_path / "ckpt-00000001"  # written before recent_segments.msgpack: the ids in state.json
    old.mkdir()
    (old / "state.json").write_text(json.dumps({"updates": 1, "recent_segments": ["a:0:0", "b:0:1"]}))
    assert checkpoint.read_state(old)["recent_segments"] == ["a:0:0", "b:0:1"]


def test_a_model_whose_head_is_tied_to_its_embedding_saves_all_its_weights_and_loads_back(
    tmp_path: Path, tiny_model: Callable[..., str]
) -> None:
    """All weights trained (lora_rank 0) on a Qwen2-style model: its head and embedding are one tensor under two
    names, which safetensors refused to write (the learner's first checkpoint crashed on the CPU)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model("qwen2"))
    tensors = dict(model.state_dict())
    assert tensors["lm_head.weight"].data_ptr() == tensors["model.embed_tokens.weight"].data_ptr(), "the model is no longer tied"
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(0.5)  # "trained": the values the checkpoint must keep
    path = checkpoint.save(tmp_path, 1, tensors, {"v": torch.zeros(2)}, {}, {"updates": 1}, 2)
    loaded, _, _, _ = checkpoint.load(path)
    assert set(loaded) == set(tensors)
    fresh = AutoModelForCausalLM.from_pretrained(tiny_model("qwen2"))
    fresh.load_state_dict(loaded)
    assert torch.equal(fresh.lm_head.weight, model.lm_head.weight) and torch.equal(fresh.model.embed_tokens.weight, model.lm_head.weight)


def test_optimizer_states_saved_on_a_gpu_load_onto_the_host(tmp_path: Path) -> None:
    """A checkpoint's optimizer states as a learner on cuda:3 writes them (the device named in the file) load onto
    the host, from where each optimizer moves its states to its parameters' device: loaded as saved, they would
    land on cuda:3 first, another process's GPU or one this host lacks (here: no GPU at all)."""
    import zipfile

    path = checkpoint.save(
        tmp_path, 1, {"w": torch.ones(3)}, {"v": torch.zeros(2)}, {"policy": {"state": {0: {"exp_avg": torch.ones(3)}}}}, {"updates": 1}, 2
    )
    optim = path / "optim.pt"
    with zipfile.ZipFile(optim) as z:
        members = {name: z.read(name) for name in z.namelist()}
    pickled = next(name for name in members if name.endswith("data.pkl"))
    assert b"X\x03\x00\x00\x00cpu" in members[pickled]
    members[pickled] = members[pickled].replace(b"X\x03\x00\x00\x00cpu", b"X\x06\x00\x00\x00cuda:3")  # the location torch.save records
    with zipfile.ZipFile(optim, "w") as z:
        for name, data in members.items():
            z.writestr(zipfile.ZipInfo(name), data)
    _, _, optimizers, _ = checkpoint.load(path)
    assert optimizers["policy"]["state"][0]["exp_avg"].device == torch.device("cpu")
    assert torch.equal(optimizers["policy"]["state"][0]["exp_avg"], torch.ones(3))

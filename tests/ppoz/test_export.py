"""`ppoz export`: each kind of checkpoint the learner writes becomes a model folder that transformers alone loads,
and that writes what the actor writes with the trained weights.

Per kind (a LoRA adapter with the tiny models' head and final norm trained beside it; all weights, `lora_rank 0`;
a sharded FSDP checkpoint) two architectures: the learner trains (the learner process's own update and
checkpoint code: `Learner.run` on a Redis stream, or for a sharded checkpoint the update and the sharded save on
a one-rank gloo group, as tests/learner_node/test_sharding.py runs them), the real `ppoz export` runs as a user
runs it (a process, from a working directory outside the repository, with relative paths), and a fresh Python
process that imports nothing of PPOZ loads the folder with `AutoModelForCausalLM.from_pretrained` and writes
greedily. Its tokens must be the actor's greedy tokens (actor_node's generation engine, temperature 0, with the
weights the learner published loaded as an actor loads them) and its last-position logits the actor's model's;
the trained weights must have moved the policy away from the base (other greedy tokens, logits far apart), so
an export of the base, or of the base with part of the training, fails.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from actor_node.llm_policy import LLMPolicy, SamplingConfig
from actor_node.responses import Generated
from actor_node.weight_follower import WeightFollower
from common.redis_server import connect
from common.shared_settings import PolicySpec, StoreSettings
from learner_node import checkpoint
from learner_node.config import LearnerConfig
from learner_node.worker import Learner
from models.policy_model import ModelSpec, load_policy
from ppoz.cli import main as ppoz_main
from tests.helpers import REDIS_S
from tests.learner_node.test_resume import write_segments
from tests.processes import PPOZ

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ["actor_node", "bindings", "broker", "client", "common", "conformance", "envs", "gateway"]
PACKAGES += ["dataset_driver", "learner_node", "models", "ppoz", "rewards", "tests", "tools"]
# prompts of 1 to 75 tokens (the byte tokenizer: the start token, then a token a character)
PROMPTS = ["", "Pick", "Pick the best colour.", "Which action should I choose next? I shall choose No. 1: TouchEvent(Cart)"]
NEW_TOKENS = 12
LOGITS_TOLERANCE = 1e-4  # the merged adapter against the unmerged one: float32 rounding, about 1e-6
MOVED = 0.05  # the trained policy's logits must be at least this far from the base's (500x the tolerance)
EXPORT_TIMEOUT_S = 180.0  # one export: torch, transformers and peft imported (about 4 s) and a tiny model merged
LOAD_TIMEOUT_S = 180.0  # one process loading two tiny models: about 5 s; the rest is for a loaded machine


@dataclasses.dataclass
class Run:
    """One trained policy: where its checkpoint is, what the actor serves, and how `ppoz export` is to be called."""

    arch: str
    policy: PolicySpec  # as the learner was given it
    export_args: list[str]  # relative to the working directory `work`
    out: str  # relative to `work`
    published: dict[str, torch.Tensor]  # the weights the learner published to the actors
    serve_model: str = ""  # the base the actor serves: where it is now (a moved base) or the recorded one
    stderr: str = ""


# --- producing checkpoints ----------------------------------------------------------------------------------------
def learner_run(base: str, lora_rank: int, redis_url: str, prefix: str, ckpt: Path) -> dict[str, torch.Tensor]:
    """Two real updates of the learner on 16 bandit steps in its stream (checkpoints ckpt-00000001 and -2); the
    weights it published last, as an actor fetches them."""
    client = connect(redis_url, socket_timeout=REDIS_S)
    try:
        write_segments(client, prefix, 16)
        cfg = LearnerConfig(
            policy=PolicySpec(model=base, lora_rank=lora_rank, normalisation="token"),  # lora_trainable: auto
            device="cpu",
            store=StoreSettings(redis_url=redis_url, key_prefix=prefix),
            rollout_batch=8,
            policy_minibatch=4,
            micro_batch=4,
            max_policy_lag=1000,
            target_kl=0.0,
            policy_lr=1e-2,  # large: two updates move the policy far from the base
            checkpoint_dir=str(ckpt),
            tensorboard_dir="",
            weights_bind="tcp://127.0.0.1:*",
            max_updates=2,
            read_block_ms=200,
        )
        Learner(cfg, client).run()  # it closes itself
        assert [p.name for p in sorted(ckpt.glob("ckpt-*"))] == ["ckpt-00000001", "ckpt-00000002"]
        follower = WeightFollower(client, prefix)  # what an actor loads: the newest snapshot in Redis
        try:
            ann = follower.newest(time.monotonic(), -1)
            assert ann is not None and ann.version == 2
            from common import weights

            return weights.fetch(client, prefix, ann)
        finally:
            follower.close()
    finally:
        for key in client.scan_iter(f"{prefix}:*"):
            client.delete(key)
        client.close()


def untied_qwen2(folder: Path) -> str:
    """A tiny Qwen2 whose head is its own (as Qwen2.5-7B and larger), not the embedding table."""
    from transformers import AutoModelForCausalLM

    from models.tiny_models import build_byte_tokenizer, tiny_config

    config = tiny_config("qwen2")
    config.tie_word_embeddings = False
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(folder))
    build_byte_tokenizer(folder)
    return str(folder)


# --- the actor, the export, the loader ----------------------------------------------------------------------------
def actor_outputs(policy: PolicySpec, published: dict[str, torch.Tensor] | None) -> tuple[list[list[int]], list[torch.Tensor]]:
    """The actor's greedy responses to PROMPTS (its generation engine, temperature 0) with the published weights
    loaded as an actor loads them (None: the base), and its model's logits after each prompt."""
    model, tokenizer = load_policy(ModelSpec.of(policy, "cpu"))
    actor = LLMPolicy(model, tokenizer, SamplingConfig())
    if published is not None:
        actor.set_weights(published, 2, "trained")
    engine = actor.generation_engine()
    jobs = [
        {"job": i, "task_id": f"t{i}", "obs": {"prompt": p, "sampling": {"max_new_tokens": NEW_TOKENS, "temperature": 0.0}}}
        for i, p in enumerate(PROMPTS)
    ]
    answers = dict((job["job"], answer) for job, answer in engine.add(jobs))
    for _ in range(10 * NEW_TOKENS):
        if not engine.active:
            break
        answers.update((job["job"], answer) for job, answer in engine.step())
    assert not engine.active and len(answers) == len(PROMPTS), answers
    responses = []
    for i in range(len(PROMPTS)):
        answer = answers[i]
        assert isinstance(answer, Generated), answer
        responses.append(answer.response_ids)
    with torch.inference_mode():
        logits = [model(input_ids=torch.tensor([tokenizer(p)["input_ids"]])).logits[0, -1].float() for p in PROMPTS]
    return responses, logits


LOADER = r"""
import json, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

folders, prompts, new_tokens, packages, repo = json.loads(sys.argv[1])
models = {}
for folder in folders:
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    rows = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
            out = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
            logits = model(input_ids=ids).logits[0, -1].float()
            rows.append({"response": out[0, ids.shape[1]:].tolist(), "logits": logits.tolist()})
    models[folder] = {"dtype": str(model.dtype), "rows": rows}
def ours(module):  # a module of PPOZ's packages, or one read from the repository (its virtual environment aside)
    path = str(getattr(module, "__file__", None) or "")
    return path.startswith(repo + "/") and not path.startswith(sys.prefix + "/")
imported = sorted(name for name, module in list(sys.modules.items()) if name.split(".")[0] in packages or ours(module))
print(json.dumps({"models": models, "ppoz_modules": imported}))
"""


def export(work: Path, run: Run) -> None:
    """`ppoz export` as a user runs it, from `work` with the run's relative paths; its progress kept."""
    done = subprocess.run([*PPOZ, "export", *run.export_args], cwd=work, capture_output=True, text=True, timeout=EXPORT_TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(work / run.out)  # the folder, alone, on stdout; progress on stderr
    assert "done:" in done.stderr
    run.stderr = done.stderr


def load_without_ppoz(work: Path, folders: list[str]) -> dict[str, Any]:
    """What a Python process with transformers alone makes of the folders (LOADER), run from `work`."""
    args = json.dumps([folders, PROMPTS, NEW_TOKENS, PACKAGES, str(REPO)])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", LOADER, args], cwd=work, capture_output=True, text=True, timeout=LOAD_TIMEOUT_S, env=env)
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    assert result["ppoz_modules"] == [], f"the loader imported PPOZ: {result['ppoz_modules'][:5]}"
    return result


def check_exports(work: Path, runs: list[Run]) -> None:
    """Export every run, load every folder in one fresh process, and hold each against its actor."""
    for run in runs:
        export(work, run)
    loaded = load_without_ppoz(work, [str(work / run.out) for run in runs])["models"]
    for run in runs:
        served = dataclasses.replace(run.policy, model=run.serve_model or run.policy.model)
        trained, trained_logits = actor_outputs(served, run.published)
        base, base_logits = actor_outputs(served, None)
        got = loaded[str(work / run.out)]
        assert got["dtype"] == "torch.float32"  # the base's dtype
        assert [row["response"] for row in got["rows"]] == trained, f"{run.arch}: the export writes other tokens than the actor"
        for row, mine in zip(got["rows"], trained_logits):
            torch.testing.assert_close(torch.tensor(row["logits"]), mine, atol=LOGITS_TOLERANCE, rtol=0, msg=run.arch)
        # trained away from the base: an export of the base (or the base and part of the training) fails above
        assert trained != base, f"{run.arch}: the training did not change a greedy token; nothing would tell the base's export"
        assert min(float((a - b).abs().max()) for a, b in zip(trained_logits, base_logits)) > MOVED, run.arch


@pytest.fixture(scope="module")
def lora_runs(tiny_models: dict[str, str], redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, list[Run]]]:
    """LoRA runs of Qwen2 and GPT-2 (heads tied to the embedding, trained beside the adapter as a tiny model's are),
    each trained on a copy of its base that is then moved, as a user moves a folder: the checkpoint's recorded
    base is gone, `--model` names the new place."""
    work = tmp_path_factory.mktemp("lora-work")
    runs = []
    for arch in ("qwen2", "gpt2"):
        base = work / "bases" / arch
        shutil.copytree(tiny_models[arch], base)
        published = learner_run(str(base), 4, redis_url, f"export-lora-{arch}-{os.getpid()}", work / "runs" / arch)
        (work / "moved").mkdir(exist_ok=True)
        base.rename(work / "moved" / arch)
        args = [f"runs/{arch}", "--out", f"exported/{arch}", "--model", f"moved/{arch}"]  # a folder of checkpoints
        runs.append(Run(arch, PolicySpec(model=str(base), lora_rank=4), args, f"exported/{arch}", published, str(work / "moved" / arch)))
    yield work, runs


@pytest.mark.slow
def test_a_lora_checkpoint_exports_as_a_merged_model_that_writes_what_the_actor_writes(lora_runs: tuple[Path, list[Run]]) -> None:
    work, runs = lora_runs
    check_exports(work, runs)
    for run in runs:
        assert "holds 2 checkpoints: exporting the newest, ckpt-00000002" in run.stderr
        files = {p.name for p in (work / run.out).iterdir()}
        assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= files
        assert not any("adapter" in name for name in files)  # merged: no adapter beside the weights
        assert json.loads((work / run.out / "config.json").read_text())["tie_word_embeddings"] is False  # the trained head kept
    assert not list(work.glob("exported/.*"))  # no temporary folder left


@pytest.mark.slow  # the module's LoRA runs; the checks themselves take a second
def test_export_refuses_bad_input_by_name_and_writes_nothing(
    lora_runs: tuple[Path, list[Run]], tiny_models: dict[str, str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each input a user can get wrong: exit 2, a message naming it, nothing written. Paths relative to the working directory."""
    work, _ = lora_runs
    monkeypatch.chdir(work)
    (work / "empty").mkdir()
    (work / "not-a-folder").write_text("x")

    def refused(*args: str) -> str:
        assert ppoz_main(["export", *args]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err
        return err

    assert f"{work}/nowhere does not exist" in refused("nowhere", "--out", "a")
    assert f"{work}/not-a-folder is not a checkpoint" in refused("not-a-folder", "--out", "a")
    assert f"{work}/empty is not a checkpoint (no state.json) nor a folder of checkpoints" in refused("empty", "--out", "a")
    # the base the checkpoint records moved away: named, and --model suggested
    err = refused("runs/qwen2", "--out", "a")
    assert f"the base model {work}/bases/qwen2, recorded in {work}/runs/qwen2/ckpt-00000002/state.json, is not there" in err
    assert "--model" in err
    assert f"the base model {work}/gone (--model) is not a folder" in refused("runs/qwen2", "--out", "a", "--model", "./gone")
    # a base of another architecture: the adapter does not fit it
    err = refused("runs/qwen2", "--out", "a", "--model", tiny_models["gpt2"])
    assert (
        f"{work}/runs/qwen2/ckpt-00000002/policy.safetensors does not fit the policy recorded in {work}/runs/qwen2/ckpt-00000002/state.json"
        in err
    )
    # a destination in use: kept as it was without --force; the checkpoint itself never
    (work / "taken").mkdir()
    (work / "taken" / "mine.txt").write_text("keep me")
    err = refused("runs/qwen2", "--out", "taken", "--model", "moved/qwen2")
    assert f"--out {work}/taken exists and is not empty" in err and "--force" in err
    assert [p.name for p in (work / "taken").iterdir()] == ["mine.txt"]
    err = refused("runs/qwen2", "--out", "runs", "--model", "moved/qwen2", "--force")
    assert f"--out {work}/runs would replace the checkpoint {work}/runs/qwen2/ckpt-00000002" in err
    assert not (work / "a").exists() and not list(work.glob(".*.tmp"))
    # --force replaces an earlier export only, never a folder of the user's (`--out . --force` would have removed it)
    err = refused("runs/qwen2", "--out", "taken", "--model", "moved/qwen2", "--force")
    assert f"--out {work}/taken holds files and no ppoz_export.json" in err
    assert [p.name for p in (work / "taken").iterdir()] == ["mine.txt"]
    assert ppoz_main(["export", "runs/qwen2/ckpt-00000002", "--out", "taken-2", "--model", "moved/qwen2"]) == 0
    capsys.readouterr()
    # with --force an export is replaced whole, through a temporary folder beside it
    assert ppoz_main(["export", "runs/qwen2/ckpt-00000001", "--out", "taken-2", "--model", "moved/qwen2", "--force"]) == 0
    assert capsys.readouterr().out.strip() == str(work / "taken-2")
    assert (work / "taken-2" / "model.safetensors").exists()
    assert json.loads((work / "taken-2" / "ppoz_export.json").read_text())["checkpoint"] == str(work / "runs/qwen2/ckpt-00000001")
    assert not list(work.glob(".*.tmp"))


@pytest.mark.slow
def test_a_full_weights_checkpoint_exports_as_a_model_that_writes_what_the_actor_writes(
    tiny_models: dict[str, str], redis_url: str, tmp_path: Path
) -> None:
    """lora_rank 0: every weight trained. Llama, and a Qwen2 with a head of its own (the tied Qwen2's full-weights
    checkpoint is tested in tests/learner_node/test_checkpoint.py, and exported in the sharded test)."""
    work = tmp_path
    runs = []
    for arch, base in (("llama", tiny_models["llama"]), ("qwen2", untied_qwen2(tmp_path / "qwen2-untied"))):
        published = learner_run(base, 0, redis_url, f"export-full-{arch}-{os.getpid()}", work / "runs" / arch)
        args = [f"runs/{arch}/ckpt-00000002", "--out", f"exported/{arch}"]  # the checkpoint itself; the recorded base
        runs.append(Run(arch, PolicySpec(model=base, lora_rank=0), args, f"exported/{arch}", published))
    check_exports(work, runs)
    for run in runs:
        assert "holds 2 checkpoints" not in run.stderr and "all weights" in run.stderr


def _sharded_job(rank: int, world: int, model_dir: str, lora_rank: int, redis_url: str, out: str) -> None:
    """One rank of a gloo group: the learner's policy sharded (FSDP2), a real token-level update, then the learner's
    sharded checkpoint (DCP shards in the staging folder, then checkpoint.save renames it), and the weights it
    publishes (gathered shard by shard) for the actor."""
    from learner_node import sharding
    from learner_node.optim import adam
    from learner_node.policy import LearnerPolicy
    from learner_node.token_update import generation_update
    from tests.learner_node.test_sharding import CFG, GEN, LR, fixed_batch

    policy = PolicySpec(model=model_dir, lora_rank=lora_rank)
    cfg = LearnerConfig(
        policy=policy, device="cpu", store=StoreSettings(redis_url=redis_url), parallelism="fsdp", checkpoint_dir=f"{out}/runs"
    )
    torch.manual_seed(0)
    model, tokenizer = load_policy(ModelSpec.of(policy, "cpu"))
    lp = LearnerPolicy(model, tokenizer, "token", 1.0, [16], token_value_hidden=GEN.value_hidden)
    sharding.shard(lp.model, mixed_precision=False)
    if lp.frozen is not None:
        sharding.shard(lp.frozen, mixed_precision=False)
    popt, vopt, tvopt = (
        adam(lp.trainable_parameters(), LR),
        adam(lp.value_head.parameters(), LR),
        adam(lp.token_value_head.parameters(), LR),
    )
    generation_update(lp, popt, tvopt, fixed_batch(), CFG, GEN)
    staging = checkpoint.staging(cfg.checkpoint_dir, 1, create=rank == 0)
    parts = {
        "policy": sharding.TrainState(lp.model, popt),
        "value": sharding.TrainState(lp.value_head, vopt),
        "token_value": sharding.TrainState(lp.token_value_head, tvopt),
    }
    sharding.save_sharded(staging / checkpoint.SHARDED, parts)
    state = {"run_id": "sharded", "version": 1, "updates": 1, "kl_coef": 0.0, "counters": {}, "config": dataclasses.asdict(cfg)}
    checkpoint.save(cfg.checkpoint_dir, 1, None, None, {}, {**state, "last_entries": []}, cfg.keep_checkpoints, None, None)
    published = {k: v.clone() for k, v in sharding.full_state_chunks(lp.model, sharding.policy_names(lp.model))}
    torch.save(published, f"{out}/published.pt")


@pytest.mark.slow
def test_a_sharded_checkpoint_exports_as_a_model_that_writes_what_the_actor_writes(
    tiny_models: dict[str, str], redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """FSDP: all weights of a Qwen2 whose head is its embedding table (a large full fine-tune is what the learner
    shards by default), and a Llama LoRA adapter with its head and final norm trained beside it (`parallelism =
    "fsdp"`). (Not GPT-2: FSDP2 warns that its decoder returns a view, and the tests take warnings for errors.)"""
    from tests.learner_node.test_sharding import run_ranks

    work = tmp_path
    runs = []
    for arch, lora_rank in (("qwen2", 0), ("llama", 4)):
        run_ranks(_sharded_job, tiny_models[arch], lora_rank, redis_url, str(work / arch), world=1)
        assert checkpoint.is_sharded(work / arch / "runs" / "ckpt-00000001")
        published = torch.load(work / arch / "published.pt")
        args = [f"{arch}/runs", "--out", f"exported/{arch}"]
        runs.append(Run(arch, PolicySpec(model=tiny_models[arch], lora_rank=lora_rank), args, f"exported/{arch}", published))
    check_exports(work, runs)
    assert json.loads((work / "exported/qwen2/config.json").read_text())["tie_word_embeddings"] is True  # one tensor, trained as one
    # a base that no longer says it is a tiny model (its build record left behind in a copy): `lora_trainable = auto`
    # resolves to no module trained in full, the shards hold the head and final norm; refused, not exported without them
    shutil.copytree(tiny_models["llama"], work / "llama-copy", ignore=shutil.ignore_patterns("ppoz_tiny.json"))
    monkeypatch.chdir(work)
    assert ppoz_main(["export", "llama/runs", "--out", "misfit", "--model", "llama-copy"]) == 2
    err = capsys.readouterr().err
    assert f"{work}/llama/runs/ckpt-00000001/sharded does not fit the policy recorded in" in err and "lm_head" in err
    assert not (work / "misfit").exists()


@pytest.mark.slow  # the module's LoRA runs; the exports themselves take a second
def test_the_export_is_in_the_base_models_dtype_or_the_one_named(
    lora_runs: tuple[Path, list[Run]], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bfloat16 base gives a bfloat16 model (the dtype a user of that base expects), the adapter merged into it
    as into the float32 base and rounded once; `--dtype float32` gives float32."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    work, _ = lora_runs
    monkeypatch.chdir(work)
    # the moved base saved in bfloat16, without the tiny model's build record: the adapter's own record of what it
    # trained in full (adapter/adapter_config.json) is what fits it
    AutoModelForCausalLM.from_pretrained("moved/qwen2", dtype=torch.bfloat16).save_pretrained("bf16")
    AutoTokenizer.from_pretrained("moved/qwen2").save_pretrained("bf16")
    assert ppoz_main(["export", "runs/qwen2", "--out", "as-bf16", "--model", "bf16"]) == 0
    assert ppoz_main(["export", "runs/qwen2", "--out", "as-f32", "--model", "bf16", "--dtype", "float32"]) == 0
    capsys.readouterr()
    tensors = {}
    for name, dtype in (("as-bf16", "bfloat16"), ("as-f32", "float32")):
        assert json.loads((work / name / "config.json").read_text())["dtype"] == dtype
        with safe_open(str(work / name / "model.safetensors"), "pt") as f:
            tensors[name] = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 - safe_open is no mapping
        assert {str(t.dtype) for t in tensors[name].values()} == {f"torch.{dtype}"}
    assert tensors["as-bf16"].keys() == tensors["as-f32"].keys()
    for key, value in tensors["as-bf16"].items():
        assert torch.equal(value, tensors["as-f32"][key].to(torch.bfloat16)), key  # W + delta summed in float32, rounded once

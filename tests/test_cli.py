"""The `ppoz` command line, run as users run it (a real process)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
import redis

from common import learner_figures
from tests.helpers import command_help, wait_for
from tests.processes import PPOZ, free_port, ppoz

SUBCOMMANDS = [
    ["broker"],
    ["actor"],
    ["learner"],
    ["up"],
    ["play"],
    ["gateway"],
    ["keygen"],
    ["demo"],
    ["bench"],
    ["bench", "broker"],
    ["bench", "scoring"],
    ["bench", "learner"],
    ["bench", "rag"],
    ["bench", "learning"],
    ["bench", "generate"],
    ["bench", "drivers"],
    ["bench", "train"],
    ["bench", "weights"],
    ["bench", "farm"],
    ["train"],
    ["reward-server"],
    ["export"],
    ["tiny-model"],
    ["bench", "stability"],
    ["bench", "update"],
    ["bench", "memory"],
    ["bench", "kea"],
    ["bench", "pace"],
    ["fuzz"],
    ["soak"],
    ["status"],
]


def test_top_level_help_lists_every_subcommand():
    result = ppoz("--help")  # the command itself, in a process of its own (the other help tests read the parser in this one)
    assert result.returncode == 0
    for name in ("broker", "actor", "learner", "up", "demo", "bench", "status", "fuzz", "soak"):
        assert name in result.stdout


def test_a_command_that_needs_no_model_starts_without_importing_torch():
    """The benchmarks import torch; their options are read only for `ppoz bench NAME`, so `ppoz broker`,
    `gateway` and `status` start in well under a second instead of spending 2 s of CPU on torch."""
    probe = (
        "import sys; from ppoz.cli import build_parser; build_parser().parse_args(['broker']);"
        "print(sorted(name for name in ('torch', 'transformers', 'peft') if name in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)  # 0.5 s alone; x200
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_a_benchmark_gets_its_own_options_when_it_is_chosen():
    from ppoz.cli import build_parser

    args = build_parser().parse_args(["bench", "scoring", "--repeats", "2"])
    assert args.repeats == 2 and args.func.__module__ == "tools.bench.scoring"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "broker", "--lora-rank", "2"])  # another benchmark's option


@pytest.mark.parametrize("words", SUBCOMMANDS, ids=lambda w: " ".join(w))
def test_every_subcommand_has_help(words):
    text = command_help(*words)
    assert "usage: ppoz" in text and len(text) > 200


def test_every_broker_option_has_help_text():
    out = command_help("broker")
    for flag in ("--segment-len", "--session-ttl-s", "--request-timeout-ms", "--max-actions", "--redis-url", "--config"):
        assert flag in out
    assert "(default: 32)" in out


def test_invalid_config_fails_at_start_naming_key_and_value(tmp_path):
    path = tmp_path / "ppoz.toml"
    path.write_text("[broker]\nsegment_len = -3\n")
    result = ppoz("broker", "--config", str(path))
    assert result.returncode == 2
    assert "`segment_len` must be positive, got -3" in result.stderr
    result = ppoz("actor", "--credits", "0")
    assert result.returncode == 2 and "`credits` must be positive, got 0" in result.stderr


def test_missing_required_settings_fail_naming_them():
    result = ppoz("learner")
    assert result.returncode == 2 and "`model` is required" in result.stderr
    result = ppoz("up")  # a learner to start, and no model for it
    assert result.returncode == 2 and "[learner]" in result.stderr and "`model` is required" in result.stderr
    result = ppoz("up", "--no-learner", "--env", "chess")
    assert result.returncode == 2 and "env='chess': not an environment" in result.stderr


@pytest.mark.slow
def test_broker_serves_status_and_stops_cleanly_on_sigterm(redis_url, key_prefix):
    front, back = free_port(), free_port()
    proc = subprocess.Popen(
        [
            *PPOZ,
            "broker",
            "--frontend",
            f"tcp://127.0.0.1:{front}",
            "--backend",
            f"tcp://127.0.0.1:{back}",
            "--redis-url",
            redis_url,
            "--key-prefix",
            key_prefix,
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    actor = subprocess.Popen(
        [*PPOZ, "actor", "--broker", f"tcp://127.0.0.1:{back}", "--name", "cli-actor"], stderr=subprocess.PIPE, text=True
    )
    try:
        # `ppoz broker` (1 s alone) and a uniform `ppoz actor`, which imports torch (2-5 s alone), started together; each
        # probe a `ppoz status` process. It was 30 s (x6): 60 s
        status = wait_for(lambda: _status(front), timeout=60, what="ppoz status to show the actor")
        assert status["actors"][0]["name"] == "cli-actor" and status["sessions"] == 0
        # The learner's counters as a learner leaves them in Redis after a discarded, non-finite update (issue 28).
        counters = {"transitions_stored": 8, "dropped_nonfinite": 8, "discarded_updates": 1}
        learner_figures.write_latest(
            redis.Redis.from_url(redis_url), key_prefix, {"version": 0, "updates": 0, **{f"counters/{k}": v for k, v in counters.items()}}
        )
        table = ppoz("status", "--broker", f"tcp://127.0.0.1:{front}")
        assert table.returncode == 0 and "cli-actor" in table.stdout and "sessions 0" in table.stdout
        assert "non-finite 8 (updates discarded: 1)" in table.stdout, table.stdout
        assert "limits: " in table.stdout and "max_message_bytes" in table.stdout, table.stdout  # the client's limits, shown
        assert "at zero not shown" in table.stdout and "replayed" not in table.stdout, table.stdout  # an idle broker's zeros hidden
        for p in (actor, proc):
            p.send_signal(signal.SIGTERM)
            assert p.wait(20) == 0  # nothing in flight: an exit in under 1 s alone; x20
        assert "SIGTERM received" in proc.stderr.read()
    finally:
        for p in (actor, proc):
            if p.poll() is None:
                p.kill()
                p.wait()


def _status(front: int) -> dict | None:
    """One probe of a poll (its caller's deadline bounds the poll): a running broker answers `ppoz status` in ms."""
    result = ppoz("status", "--broker", f"tcp://127.0.0.1:{front}", "--json", "--timeout", "2")
    if result.returncode != 0:
        return None
    status = json.loads(result.stdout)
    return status if status["actors"] else None


def test_status_labels_each_kind_of_update_when_the_learner_trained_both():
    """A learner fed candidate choices and generated responses reports both updates' figures (tests/test_up.py and
    tests/test_generation_end_to_end.py run `ppoz status` against each kind alone); a figure that is not a number is
    left out."""
    from ppoz.status import last_update

    figures = {"losses/policy_loss": 0.5, "losses/clipfrac": 0.125, "generation/policy_loss": -0.25, "generation/kl_ref": float("nan")}
    assert last_update({**figures, "version": 3.0}) == "candidates: policy_loss 0.5  clipfrac 0.125; generation: policy_loss -0.25"


def test_the_demo_s_exit_status_says_whether_the_trained_policy_beat_random_unless_it_was_stopped(tmp_path, capsys):
    """The summary's verdict and the exit status agree: 0 when the trained policy beats the random one, 1 when it does
    not after the whole run; a run stopped with Ctrl-C (the README's test stops it) is the user's choice and exits 0.
    The export command is shown once there is a checkpoint to export."""
    from types import SimpleNamespace

    from ppoz.demo import print_summary

    def episodes(ret: float) -> list[SimpleNamespace]:
        return [SimpleNamespace(ret=ret, policy_version=int(i >= 10), steps=10) for i in range(60)]

    learner = SimpleNamespace(updates=3, version=3)
    curve = tmp_path / "learning_curve.png"
    assert print_summary(episodes(4.0), 1.5, learner, curve, tmp_path) == 0
    assert "beats the random one" in capsys.readouterr().out
    assert print_summary(episodes(1.5), 1.5, learner, curve, tmp_path) == 1
    shown = capsys.readouterr().out
    assert "did NOT clearly beat the random one" in shown and "ppoz export" not in shown  # no checkpoint yet
    (tmp_path / "checkpoints" / "ckpt-00000003").mkdir(parents=True)
    assert print_summary(episodes(1.5), 1.5, learner, curve, tmp_path, interrupted=True) == 0
    shown = capsys.readouterr().out
    assert "stopped early" in shown and f"ppoz export {tmp_path / 'checkpoints'} --out {tmp_path / 'model'}" in shown


def test_an_update_s_figures_replace_the_last_update_s_whole_in_redis(redis_client, key_prefix):
    """A learner that trained candidate choices, then generated responses: `ppoz status` showed the old candidate
    update's figures beside the new one's as its last update, since the figures were merged into the hash."""
    from common.learner_figures import read_latest, write_latest
    from ppoz.status import last_update

    write_latest(redis_client, key_prefix, {"losses/policy_loss": 0.5, "counters/transitions_trained": 64.0, "version": 1.0})
    write_latest(redis_client, key_prefix, {"generation/policy_loss": -0.25, "version": 2.0})
    figures = read_latest(redis_client, key_prefix)
    assert last_update(figures) == "policy_loss -0.25"
    assert figures["counters/transitions_trained"] == 64.0 and figures["version"] == 2.0  # the rest stays
    write_latest(redis_client, key_prefix, {"counters/transitions_trained": 96.0})  # a write without an update's figures
    assert last_update(read_latest(redis_client, key_prefix)) == "policy_loss -0.25"


def test_status_without_a_broker_fails_clearly():
    result = ppoz("status", "--broker", f"tcp://127.0.0.1:{free_port()}", "--timeout", "0.5")  # its timeout is under test
    assert result.returncode == 1 and "no answer from" in result.stderr


@pytest.mark.parametrize("task", ["kea", "arithmetic"])
@pytest.mark.parametrize("flags", [["--minutes", "-1"], ["--minutes", "0"], ["--clients", "0"]])
def test_demo_refuses_a_run_that_would_train_nothing(task, flags, tmp_path):
    result = ppoz("demo", "--task", task, *flags, "--out", str(tmp_path / "demo"), timeout=120)  # refused at start: 2-3 s; x40
    assert result.returncode == 2 and "--minutes must be positive" in result.stderr, result.stderr[-2000:]
    assert not (tmp_path / "demo").exists()


@pytest.mark.parametrize(
    ("task", "responses", "said"), [("arithmetic", "-5", "--responses 0 or more"), ("kea", "100", "for --task arithmetic")]
)
def test_demo_refuses_responses_it_cannot_count(task, responses, said, tmp_path):
    result = ppoz("demo", "--task", task, "--responses", responses, "--out", str(tmp_path / "demo"), timeout=120)
    assert result.returncode == 2 and said in result.stderr, result.stderr[-2000:]
    assert not (tmp_path / "demo").exists()


@pytest.mark.slow
def test_bench_rag_runs_and_reports_retrieval_cost_side_by_side(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "guide.md").write_text("On the Cart screen, Checkout opens payment. Back returns to the list. " * 20)
    # a tiny model's steps with and without retrieval: 10-20 s alone; x15
    result = ppoz(
        "bench", "rag", "--corpus", str(corpus), "--tasks", "1", "--steps", "3", "--max-context-tokens", "128", "--json", timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    figures = json.loads(result.stdout)
    assert figures["steps"] == 3 and figures["corpus_chunks"] >= 2
    assert figures["step_ms"] > 0 and figures["retrieve_ms"] > 0 and figures["rag_step_ms"] >= figures["retrieve_ms"]
    assert 0 < figures["added_tokens_max"] <= 128  # the token budget holds


@pytest.mark.slow
def test_bench_broker_fairness_runs_both_queues_and_reports_the_polite_client_s_latency():
    """Runs, and runs both queues: not a timing test (the figures live in docs/benchmarks.md), but the flooded
    first come, first served queue must at least show the flood (its p99 above the round-robin's)."""
    small = ("--seconds", "1.5", "--flood", "200", "--repeats", "1", "--batch-ms", "20")
    result = ppoz("bench", "broker", "--scenario", "fairness", *small, "--json", timeout=300)  # two 1.5 s legs and a start; x15
    assert result.returncode == 0, result.stderr[-2000:]
    figures = json.loads(result.stdout)
    assert figures["errors"] == 0 and set(figures["summary"]) == {"fair", "fifo"}
    # The flood reached both queues; how much it delays the polite client under each is the bench's figure
    # (docs/benchmarks.md), not a test's: a count per leg or a latency compared fails on a busy machine.
    assert all(len(runs) == 1 and runs[0]["flooded"]["n"] > 0 for runs in figures["runs"].values())


@pytest.mark.parametrize("rank", ["4", "0"])
def test_bench_update_measures_the_guards_snapshot_and_its_restore_is_exact(rank):
    small = ["--responses", "4", "--min-len", "2", "--max-len", "20", "--prompt", "6", "--hidden", "32", "--layers", "1"]
    result = ppoz("bench", "update", *small, "--vocab", "128", "--runs", "1", "--lora-rank", rank, "--json", timeout=300)  # 5-10 s; x30
    assert result.returncode == 0, result.stderr[-2000:]
    figures = json.loads(result.stdout)
    assert figures["equal"] and figures["snapshot_restores_exactly"]
    assert figures["snapshot_s"] > 0 and figures["restore_s"] > 0 and figures["trainable_params"] > 0
    assert ("full fine-tune" in figures["model"]) == (rank == "0")


@pytest.mark.slow
@pytest.mark.timeout(660)  # past the bench's timeout below (the suite's 300 s would cut it first and hide its output)
def test_bench_learning_runs_the_three_methods_on_the_same_budget():
    # three methods' runs of 64 steps of a tiny model: well under a minute alone; x10 and more
    result = ppoz("bench", "learning", "--steps", "64", "--seeds", "1", "--lag", "2", "--rollout-batch", "16", "--json", timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    figures = json.loads(result.stdout)
    assert figures["random_return"] == 0.25 and set(figures["methods"]) == {"sync", "drop_stale", "decoupled"}
    sync, drop, decoupled = (figures["methods"][m] for m in ("sync", "drop_stale", "decoupled"))
    assert sync["used"] == 64 and sync["dropped"] == 0  # lag 0: every rollout trained at once
    assert decoupled["dropped"] == 0 and decoupled["used"] == 64 - 2 * 16  # the last 2 rollouts are still in the queue
    assert drop["dropped"] > 0 and drop["used"] + drop["dropped"] == decoupled["used"]  # same samples, most thrown away
    assert all(0.0 <= m["return"] <= 1.0 for m in figures["methods"].values())
    assert figures["update_epochs"] == 2  # the learner's own default (learner_node/config.py)


@pytest.mark.parametrize(
    "args",
    [
        ["soak", "--clients", "0"],
        ["fuzz", "--messages", "0"],
        ["bench", "rag", "--steps", "0"],
        ["bench", "learning", "--lag", "0"],
        ["bench", "learning", "--update-epochs", "0"],
    ],
)
def test_load_commands_refuse_nonsense_counts(args):
    result = ppoz(*args)
    assert result.returncode != 0 and "must be positive" in result.stderr

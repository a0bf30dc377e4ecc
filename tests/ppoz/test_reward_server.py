"""`ppoz reward-server` as users run it, alone and under `ppoz up` (real processes, loopback ports)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading

import pytest

from rewards.reward_model import RewardModel, RewardModelConfig
from rewards.service import RemoteJudge, RemoteRewardModel, RewardServiceClient, RewardServiceError
from tests.helpers import PROCESS_STOP_S, TORCH_START_S, wait_for
from tests.processes import PPOZ, Up, alive, free_port
from tools.bench.judge_stand_in import chat_server


def answers(endpoint: str) -> bool:
    client = RewardServiceClient(endpoint, timeout_s=1.0, retries=0)  # one probe of a poll: a ping takes ms once it is up
    try:
        return bool(client.ping())
    except RewardServiceError:
        return False
    finally:
        client.close()


@pytest.mark.slow
def test_the_command_serves_until_sigterm_and_finishes_the_requests_in_progress(tmp_path, tiny_reward_model) -> None:
    rm_dir = tiny_reward_model()
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    with chat_server(lambda body, n: (200, 1.5, "Score: 1")) as api:
        lines: list[str] = []
        server = subprocess.Popen(
            [*PPOZ, "reward-server", "--bind", endpoint, "--reward-model", rm_dir]
            + ["--judge-model", "judge-1", "--judge-base-url", api.base_url],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        output = server.stdout
        assert output is not None

        def read() -> None:
            for line in output:
                lines.append(line.rstrip("\n"))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            # a process importing torch and transformers and loading the tiny reward model
            wait_for(lambda: any("reward service ready on" in line for line in lines), timeout=TORCH_START_S, what="the readiness line")
            assert any(f"reward service ready on {endpoint}: reward model {rm_dir}, judge judge-1" in line for line in lines)
            pairs = [("Say hi.", "hi"), ("What is 2+3?", "5")]
            assert RemoteRewardModel(endpoint, timeout_s=30).score(pairs) == pytest.approx(  # two pairs: 50-200 ms alone; x150
                RewardModel(RewardModelConfig(rm_dir)).score(pairs), abs=1e-5
            )
            verdicts: list = []
            judging = threading.Thread(  # the stand-in answers after 1.5 s, a timer, then ms of work; x20
                target=lambda: verdicts.extend(RemoteJudge(endpoint, timeout_s=30, retries=0).judge_many([("p", "r", "1")]))
            )
            judging.start()
            wait_for(lambda: api.requests, what="the judge request to reach the stand-in")
            server.send_signal(signal.SIGTERM)  # while the judge request is in progress: it is finished, then the server exits
            judging.join(30)  # as the request's own 30 s
            assert server.wait(PROCESS_STOP_S) == 0  # the judge request's end (1.5 s from its start), then the exit
        finally:
            if server.poll() is None:
                server.kill()
            reader.join(10)  # the process has exited: the pipe's end comes at once (ms); x1000
    assert [v.reward for v in verdicts] == [1.0]
    text = "\n".join(lines)
    assert "SIGTERM received: finishing the requests in progress" in text
    assert "reward service stopped: answered/judge 1, answered/rm_score 1" in text, text[-2000:]


@pytest.mark.slow
def test_up_starts_the_reward_service_and_restarts_it_when_it_dies(tmp_path) -> None:
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    with chat_server(lambda body, n: "Score: 1") as api:  # a judge alone: no model to load, a fast start
        config = tmp_path / "up.toml"
        config.write_text(
            # stop_timeout_s: the service exits in under a second of SIGTERM alone; x20
            "[up]\nbroker = false\nlearner = false\nactors = 0\nreward_service = true\nstop_timeout_s = 20\n"
            f'[reward_service]\nbind = "tcp://127.0.0.1:{port}"\njudge_model = "judge-1"\njudge_base_url = "{api.base_url}"\n'
        )
        up = Up(config)
        try:
            # `ppoz up` and the reward service's process start, no model to load: 3-8 s alone; x15
            wait_for(lambda: answers(endpoint), timeout=120, what=f"the reward service to answer\n{up.text()[-2000:]}")
            assert [v.reward for v in RemoteJudge(endpoint, timeout_s=10).judge_many([("p", "r", "1")])] == [1.0]  # ms; x1000
            assert "reward-server | " in up.text() and "reward service ready on" in up.text()
            first = up.pid("reward-server")
            assert first is not None
            os.kill(first, signal.SIGKILL)
            # the supervisor's first restart waits 1 s, a timer, then starts it (ms): x30; then its start, as above
            wait_for(lambda: up.pid("reward-server", 2), timeout=60, what="the reward service to be restarted")
            wait_for(lambda: answers(endpoint), timeout=120, what="the restarted reward service to answer")
            assert [v.reward for v in RemoteJudge(endpoint, timeout_s=10).judge_many([("q", "r", "1")])] == [1.0]  # ms; x1000
            second = up.pid("reward-server", 2)
        finally:
            code = up.stop()
    assert code == 0, up.text()[-3000:]
    assert "reward-server died (killed by SIGKILL)" in up.text()
    assert "stopped reward-server (exit code 0)" in up.text() and "reward service stopped:" in up.text()
    assert second is not None and not alive(second)

"""The systemd units, example config and environment file in deploy/.

`systemd-analyze verify` runs on the units where it is installed (skipped with a
reason where not); the other tests always run and read the unit files themselves:
notify and watchdog, restart policy, hardening that still lets an actor or learner
see its GPU, and the command lines checked against the real `ppoz` parser and the
example config against the real config loader.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from actor_node.config import ActorConfig
from broker.config import BrokerConfig
from common.config import load
from gateway.config import GatewayConfig
from learner_node.config import LearnerConfig
from ppoz.cli import build_parser

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
EXAMPLE_CONFIG = DEPLOY / "ppoz.toml"
ENV_FILE = DEPLOY / "ppoz.env"

SERVICES = {  # unit file -> the `ppoz` subcommand it runs
    "ppoz-broker.service": "broker",
    "ppoz-learner.service": "learner",
    "ppoz-actor@.service": "actor",
    "ppoz-gateway.service": "gateway",
}
GPU_SERVICES = ("ppoz-learner.service", "ppoz-actor@.service")
CPU_SERVICES = ("ppoz-broker.service", "ppoz-gateway.service")
TARGET = "ppoz.target"
CONFIGS = {"broker": BrokerConfig, "actor": ActorConfig, "learner": LearnerConfig, "gateway": GatewayConfig}

PPOZ_PROGRAM = "/opt/ppoz/venv/bin/ppoz"  # the documented install location (deploy/README.md)
INSTALLED_ENV_FILE = "/etc/ppoz/ppoz.env"
STATE_DIR = "/var/lib/ppoz"  # StateDirectory=ppoz
# Sample values for the specifiers systemd expands in ExecStart (systemd.unit(5), "Specifiers").
SPECIFIERS = {"%i": "3", "%H": "gpu-host-7", "%%": "%"}


# ---- reading unit files ----


def parse_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """A unit file as {section: {key: [every value, in order]}}: comments, continuation lines and
    repeated keys handled as systemd does (the last value of a single-valued key wins)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    pending = ""
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = (pending + " " + raw.strip()) if pending else raw.strip()
        pending = ""
        if line.endswith("\\"):
            pending = line[:-1].rstrip()
            continue
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        key, sep, value = line.partition("=")
        assert sep and current is not None, f"{path.name}:{number}: not `Key=value` inside a [Section]: {raw!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    assert not pending, f"{path.name}: ends in a continuation line"
    return sections


def unit(name: str) -> dict[str, dict[str, list[str]]]:
    return parse_unit(DEPLOY / name)


def value(name: str, section: str, key: str) -> str:
    """The effective value of a single-valued key; fails naming the unit when it is missing."""
    values = unit(name).get(section, {}).get(key)
    assert values, f"{name}: [{section}] has no {key}="
    return values[-1]


def words(name: str, section: str, key: str) -> list[str]:
    """Every space-separated word of a list-valued key such as After= or WantedBy= (an empty assignment resets it)."""
    result: list[str] = []
    for v in unit(name).get(section, {}).get(key, []):
        result = [] if v == "" else result + v.split()
    return result


def is_yes(text: str | None) -> bool:
    return text is not None and text.lower() in ("yes", "true", "on", "1")


def setting(name: str, key: str) -> str | None:
    values = unit(name).get("Service", {}).get(key)
    return values[-1] if values else None


_TIME_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "hr": 3600, "d": 86400}


def seconds(span: str) -> float:
    """A systemd time span ("90", "30s", "15min", "1min 30s") in seconds."""
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", span.strip())
    assert parts and "".join(n + u for n, u in parts) == span.replace(" ", ""), f"not a time span: {span!r}"
    return sum(float(n) * _TIME_UNITS[u or "s"] for n, u in parts)


def exec_start(name: str) -> list[str]:
    """ExecStart's words, with the specifiers and ${VAR}s replaced by sample values."""
    line = value(name, "Service", "ExecStart")
    env = env_file()
    line = re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], line)
    line = re.sub(r"%.", lambda m: SPECIFIERS[m.group(0)], line)
    return shlex.split(line)


def env_file() -> dict[str, str]:
    env = {}
    for line in ENV_FILE.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, sep, val = line.partition("=")
            assert sep and re.fullmatch(r"[A-Za-z_]\w*", key), f"ppoz.env: not VAR=value: {line!r}"
            env[key] = val
    return env


# ---- (a) systemd's own verifier ----

SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
# Our units by name, as systemd-analyze names them (the template verifies as ppoz-actor@i.service);
# lines about systemd's own units are not ours to fix.
OUR_UNIT = re.compile(r"\bppoz(?:-broker|-learner|-gateway|-actor@\w*)?\.(?:service|target)\b")
SYSTEMCTL = shutil.which("systemctl")


def install_root(tmp_path: Path) -> Path:
    """A file-system root with the units installed as deploy/README.md installs them: in
    /etc/systemd/system next to a copy of systemd's own units, ExecStart's program present."""
    root = tmp_path / "root"
    for system_units in (Path("/usr/lib/systemd/system"), Path("/lib/systemd/system")):
        if system_units.is_dir():
            shutil.copytree(system_units, root / "usr/lib/systemd/system", symlinks=True)
            break
    units = root / "etc/systemd/system"
    units.mkdir(parents=True)
    for name in [*SERVICES, TARGET]:
        shutil.copy(DEPLOY / name, units / name)
    (root / "etc/ppoz").mkdir()
    shutil.copy(ENV_FILE, root / "etc/ppoz/ppoz.env")
    shutil.copy(EXAMPLE_CONFIG, root / "etc/ppoz/ppoz.toml")
    program = root / PPOZ_PROGRAM.lstrip("/")
    program.parent.mkdir(parents=True)
    program.write_text("#!/bin/sh\nexit 0\n")
    program.chmod(0o755)
    return root


@pytest.mark.skipif(
    SYSTEMD_ANALYZE is None,
    reason="systemd-analyze is not installed (Debian: apt-get install systemd); "
    "test_units_parse_as_unit_files and the checks below still run",
)
def test_systemd_analyze_verify_finds_nothing_to_say(tmp_path):
    root = install_root(tmp_path)
    # A canary with a key systemd does not know proves that this setup reports problems at all.
    (root / "etc/systemd/system/ppoz-canary.service").write_text(
        f"[Service]\nType=notify\nExecStart={PPOZ_PROGRAM} broker\nNoSuchSetting=yes\n"
    )
    names = [*(n for n in SERVICES if "@" not in n), "ppoz-actor@0.service", "ppoz-actor@.service", TARGET]
    result = subprocess.run(
        [SYSTEMD_ANALYZE, "verify", f"--root={root}", "--man=no", *names, "ppoz-canary.service"],
        capture_output=True,
        text=True,
        timeout=120,  # systemd-analyze reads a dozen unit files offline: 1-3 s alone; x40
    )
    output = (result.stdout + result.stderr).splitlines()
    assert any("ppoz-canary.service" in line and "NoSuchSetting" in line for line in output), (
        "systemd-analyze verify did not report the canary's unknown key: the check is not working\n" + "\n".join(output)
    )
    ours = [line for line in output if OUR_UNIT.search(line)]
    assert not ours, "systemd-analyze verify about our units:\n" + "\n".join(ours)
    assert result.returncode == 0, "systemd-analyze verify failed:\n" + "\n".join(output)


@pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed (Debian: apt-get install systemd)")
def test_systemd_analyze_security_rates_every_service_ok(tmp_path):
    """Exposure 4.0 or less of 10 ("OK"): a guard against dropping hardening by accident."""
    root = install_root(tmp_path)
    names = [*(n for n in SERVICES if "@" not in n), "ppoz-actor@0.service"]
    result = subprocess.run(
        [SYSTEMD_ANALYZE, "security", "--offline=yes", "--threshold=40", f"--root={root}", *names],
        capture_output=True,
        text=True,
        timeout=120,  # as above
    )
    overall = [line for line in result.stdout.splitlines() if "Overall exposure level" in line]
    assert len(overall) == len(names), result.stdout + result.stderr
    assert result.returncode == 0, "\n".join(overall) + "\n" + result.stderr


@pytest.mark.skipif(SYSTEMCTL is None, reason="systemctl is not installed (Debian: apt-get install systemd)")
def test_enabling_as_the_readme_says_puts_the_services_under_the_target(tmp_path):
    """`systemctl enable` works offline on a --root: the README's commands, one actor per GPU."""
    root = install_root(tmp_path)
    enable = [
        "ppoz.target",
        "ppoz-broker.service",
        "ppoz-learner.service",
        "ppoz-gateway.service",
        "ppoz-actor@0.service",
        "ppoz-actor@1.service",
    ]
    # systemctl writes a few links offline: under 1 s alone; x60
    result = subprocess.run([SYSTEMCTL, f"--root={root}", "enable", *enable], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    wants = root / "etc/systemd/system/ppoz.target.wants"
    assert sorted(p.name for p in wants.iterdir()) == sorted(enable[1:])
    assert (root / "etc/systemd/system/multi-user.target.wants/ppoz.target").is_symlink()


# ---- (b) the units, read by this test ----


def test_every_file_is_there():
    for name in [*SERVICES, TARGET, "ppoz.toml", "ppoz.env", "README.md"]:
        assert (DEPLOY / name).is_file(), f"deploy/{name} is missing"


@pytest.mark.parametrize("name", [*SERVICES, TARGET])
def test_units_parse_as_unit_files(name):
    sections = unit(name)
    assert "Unit" in sections and "Install" in sections, f"{name}: sections {sorted(sections)}"
    assert value(name, "Unit", "Description")
    if name in SERVICES:
        assert set(sections) == {"Unit", "Service", "Install"}


@pytest.mark.parametrize("name", SERVICES)
def test_service_tells_systemd_when_ready_and_is_watched(name):
    assert value(name, "Service", "Type") == "notify"
    assert value(name, "Service", "NotifyAccess") == "main"
    watchdog = seconds(value(name, "Service", "WatchdogSec"))
    if name == "ppoz-learner.service":
        assert watchdog >= 10 * 60, "the learner feeds its watchdog only between updates, which take minutes"
    elif name == "ppoz-actor@.service":
        assert 60 <= watchdog <= 300, "long enough for one batch forward, short enough to catch a hang"
    else:
        assert 10 <= watchdog <= 60
    assert seconds(value(name, "Service", "TimeoutStartSec")) >= 60


@pytest.mark.parametrize("name", SERVICES)
def test_service_stops_on_sigterm_with_time_to_drain(name):
    assert value(name, "Service", "KillSignal") in ("SIGTERM", "TERM", "15")
    stop = seconds(value(name, "Service", "TimeoutStopSec"))
    component = SERVICES[name]
    cfg = load(CONFIGS[component], EXAMPLE_CONFIG)
    if component == "learner":
        assert stop >= 15 * 60, "an update in flight finishes and is checkpointed before the learner exits"
    elif component == "broker":
        assert stop > getattr(cfg, "drain_timeout_s", 0) + 10
    elif component == "gateway":
        assert stop > cfg.request_deadline_s, "requests in flight may wait their whole deadline"
    else:
        assert stop >= 60, "the batch being scored finishes"


@pytest.mark.parametrize("name", SERVICES)
def test_service_restarts_on_failure_within_sane_limits(name):
    assert value(name, "Service", "Restart") == "on-failure"
    restart_s = seconds(value(name, "Service", "RestartSec"))
    assert restart_s >= 1
    # The start limit belongs in [Unit]; in [Service] systemd ignores it with a warning.
    assert "StartLimitIntervalSec" not in unit(name)["Service"] and "StartLimitBurst" not in unit(name)["Service"]
    interval = seconds(value(name, "Unit", "StartLimitIntervalSec"))
    burst = int(value(name, "Unit", "StartLimitBurst"))
    assert interval > 0, "0 turns the limit off: a broken service would restart forever"
    # The default (5 starts in 10 s) gives up after 25 s of failing starts, e.g. a short Redis outage.
    assert burst * restart_s >= 60, f"{burst} starts {restart_s:g} s apart: gives up in under a minute"
    assert interval >= burst * restart_s, "the limit must be reachable by a crash loop, or it never stops one"
    assert "2" in words(name, "Service", "RestartPreventExitStatus"), "a config error (exit 2) is not retried"


@pytest.mark.parametrize("name", SERVICES)
def test_service_runs_as_ppoz_with_its_state_directory(name):
    assert value(name, "Service", "User") == "ppoz"
    assert value(name, "Service", "Group") == "ppoz"
    assert value(name, "Service", "StateDirectory") == "ppoz"
    assert value(name, "Service", "WorkingDirectory") == STATE_DIR
    assert value(name, "Service", "EnvironmentFile").lstrip("-") == INSTALLED_ENV_FILE


@pytest.mark.parametrize("name", SERVICES)
def test_service_is_ordered_after_network_and_a_local_redis(name):
    assert "network-online.target" in words(name, "Unit", "Wants")
    after = words(name, "Unit", "After")
    assert "network-online.target" in after
    if name != "ppoz-gateway.service":  # the gateway talks to the broker only
        assert "redis-server.service" in after
    assert "redis-server.service" not in words(name, "Unit", "Requires") + words(name, "Unit", "Wants"), (
        "Redis may run on another machine: order after it, never pull it in"
    )


@pytest.mark.parametrize("name", SERVICES)
def test_exec_start_runs_the_component_with_the_config(name):
    raw = shlex.split(value(name, "Service", "ExecStart"))
    assert raw[0] == PPOZ_PROGRAM, "an absolute path into the virtual environment (deploy/README.md)"
    assert raw[1] == SERVICES[name]
    assert raw[raw.index("--config") + 1] == "${PPOZ_CONFIG}"
    for var in re.findall(r"\$\{?(\w+)", value(name, "Service", "ExecStart")):
        assert var in env_file(), f"{name} uses ${{{var}}}, which ppoz.env does not set"
    assert env_file()["PPOZ_CONFIG"] == "/etc/ppoz/ppoz.toml"


def test_actor_template_takes_its_gpu_from_the_instance_name():
    raw = shlex.split(value("ppoz-actor@.service", "Service", "ExecStart"))
    assert raw[raw.index("--device") + 1] == "cuda:%i"
    assert "%i" in raw[raw.index("--name") + 1] and "%H" in raw[raw.index("--name") + 1]


def test_learner_resumes_from_its_checkpoint():
    assert "--resume" in shlex.split(value("ppoz-learner.service", "Service", "ExecStart"))


HARDENING = {
    "NoNewPrivileges": "yes",
    "ProtectSystem": "strict",
    "ProtectHome": "yes",
    "PrivateTmp": "yes",
    "ProtectKernelTunables": "yes",
    "ProtectKernelModules": "yes",
    "ProtectControlGroups": "yes",
    "RestrictNamespaces": "yes",
    "LockPersonality": "yes",
    "RestrictRealtime": "yes",
    "SystemCallArchitectures": "native",
}


@pytest.mark.parametrize("name", SERVICES)
def test_service_is_hardened(name):
    for key, expected in HARDENING.items():
        got = setting(name, key)
        assert got is not None and (got == expected or expected == "yes" and is_yes(got)), f"{name}: {key}={got}, want {expected}"


@pytest.mark.parametrize("name", GPU_SERVICES)
def test_gpu_services_keep_their_gpu_and_jit(name):
    # PrivateDevices hides /dev/nvidia*; ProtectClock adds a DeviceAllow= entry, which under
    # DevicePolicy=auto blocks every device not listed; MemoryDenyWriteExecute breaks Triton.
    for key in ("PrivateDevices", "ProtectClock", "MemoryDenyWriteExecute"):
        assert not is_yes(setting(name, key)), f"{name}: {key}=yes takes the GPU (or its JIT) away"
    assert setting(name, "DevicePolicy") in (None, "auto")
    assert setting(name, "DeviceAllow") is None


@pytest.mark.parametrize("name", CPU_SERVICES)
def test_cpu_services_get_the_full_sandbox(name):
    for key in ("PrivateDevices", "MemoryDenyWriteExecute", "ProtectClock"):
        assert is_yes(setting(name, key)), f"{name}: {key}= should be yes"


def test_writable_paths_are_in_the_state_directory():
    # ProtectSystem=strict leaves only the StateDirectory writable, ProtectHome=yes hides /home.
    env = env_file()
    for key in ("HF_HOME", "XDG_CACHE_HOME", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        assert env[key].startswith(STATE_DIR + "/"), f"ppoz.env: {key}={env[key]}"
    cfg = load(LearnerConfig, EXAMPLE_CONFIG)
    for path in (cfg.checkpoint_dir, cfg.tensorboard_dir):
        assert not path.startswith("/") or path.startswith(STATE_DIR + "/"), path
    assert "CUDA_VISIBLE_DEVICES" not in env, "it would renumber the GPUs under ppoz-actor@N's cuda:N"


@pytest.mark.parametrize("name", SERVICES)
def test_target_groups_the_services(name):
    assert TARGET in words(name, "Install", "WantedBy"), "`systemctl enable` adds the service to ppoz.target"
    assert TARGET in words(name, "Unit", "PartOf"), "`systemctl stop/restart ppoz.target` reaches the service"


def test_target_starts_at_boot_and_documents_one_actor_per_gpu():
    assert "multi-user.target" in words(TARGET, "Install", "WantedBy")
    text = (DEPLOY / TARGET).read_text()
    assert "ppoz-actor@{0..3}.service" in text and "ppoz-actor@" in (DEPLOY / "README.md").read_text()


# ---- (c) the example config, through the project's own loader ----


@pytest.mark.parametrize("component", CONFIGS)
def test_example_config_loads_for_every_component(component):
    load(CONFIGS[component], EXAMPLE_CONFIG)


def test_example_config_binds_to_loopback_only():
    broker = load(BrokerConfig, EXAMPLE_CONFIG)
    learner = load(LearnerConfig, EXAMPLE_CONFIG)
    gateway = load(GatewayConfig, EXAMPLE_CONFIG)
    for endpoint in (broker.frontend, broker.backend, learner.weights_bind):
        assert endpoint.startswith("tcp://127.0.0.1:"), endpoint
    assert gateway.host == "127.0.0.1"


def test_example_config_is_consistent_across_components():
    broker, actor = load(BrokerConfig, EXAMPLE_CONFIG), load(ActorConfig, EXAMPLE_CONFIG)
    learner, gateway = load(LearnerConfig, EXAMPLE_CONFIG), load(GatewayConfig, EXAMPLE_CONFIG)
    assert actor.broker.rsplit(":", 1)[1] == broker.backend.rsplit(":", 1)[1]
    assert gateway.broker.rsplit(":", 1)[1] == broker.frontend.rsplit(":", 1)[1]
    assert actor.weights.rsplit(":", 1)[1] == learner.weights_bind.rsplit(":", 1)[1]
    assert actor.policy == learner.policy and actor.policy.model  # one [policy] table: the same function on both sides
    assert actor.retrieval == broker.retrieval  # one [retrieval] table: the history the broker keeps is the one the actor expects
    assert actor.store == learner.store == broker.store and broker.store.redis_url  # one [store] table: the Redis all three meet in
    assert broker.max_stream_backlog <= 0 or broker.max_stream_backlog > learner.rollout_batch * (1 + learner.checkpoint_every)


# ---- (d) the units' command lines, through the real `ppoz` parser ----


@pytest.mark.parametrize("name", SERVICES)
def test_exec_start_options_are_accepted_by_the_cli(name, capsys):
    argv = exec_start(name)
    try:
        args = build_parser().parse_args(argv[1:])
    except SystemExit:
        pytest.fail(f"{name}: `ppoz {' '.join(argv[1:])}` rejected:\n{capsys.readouterr().err}")
    component = SERVICES[name]
    assert args.command == component
    assert args.config == env_file()["PPOZ_CONFIG"]
    # The flags on top of the example config make a valid configuration (the device, for one).
    cfg = load(CONFIGS[component], EXAMPLE_CONFIG, args)
    if component == "actor":
        assert cfg.device == "cuda:3" and cfg.name == "actor-gpu-host-7-3"
    if component == "learner":
        assert cfg.resume is True

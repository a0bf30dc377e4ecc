"""Every TOML block of README.md and docs/*.md is a config the project's own loader takes: each table it has,
loaded as its component loads it, with no ConfigError; and an LLM judge named in one is sent to its own
provider's endpoint (issue 41: `judge_model = "qwen-plus"` with the default provider went to OpenAI's).

The blocks name files of a farm's hosts (/etc/ppoz/keys/..., allow-list folders): each is made, under a
temporary folder, before the block is loaded, so that the loader's checks of them pass as on those hosts.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^([ \t]*)```toml\n(.*?)^\1```", re.M | re.S)
HOST_FILES = "/etc/ppoz/"  # where the docs keep a host's keys and allow-lists
CONFIG_MODULES = (  # each registers the tables of its component
    "actor_node.config",
    "broker.config",
    "gateway.config",
    "learner_node.config",
    "rewards.config",
    "dataset_driver.config",
    "ppoz.up",
)
# A judge model's family and the provider that serves it (a judge with its own judge_base_url is not checked).
JUDGE_FAMILIES = {"qwen": "dashscope", "gpt-": "openai", "gemini": "gemini", "claude": "claude"}


def blocks() -> list:
    found = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for n, match in enumerate(BLOCK.finditer(doc.read_text())):
            found.append(pytest.param(textwrap.dedent(match.group(2)), id=f"{doc.name}-{n + 1}"))
    return found


def with_host_files(text: str, folder: Path) -> str:
    """`text` with the docs' host folder moved to `folder`, and each key pair and allow-list it names made there."""
    from common.security import generate_keypair

    text = text.replace(HOST_FILES, f"{folder}/")
    for name in re.findall(rf'"{re.escape(str(folder))}/([^"]+)"', text):
        path = folder / name
        if path.suffix in (".key", ".key_secret"):
            if not path.exists():
                generate_keypair(path.parent, path.stem)
        else:
            path.mkdir(parents=True, exist_ok=True)
    return text


def sections() -> dict[str, type]:
    """Table name -> the config class that reads it, every component's registered."""
    import importlib

    from common.config import SECTIONS

    for module in CONFIG_MODULES:
        importlib.import_module(module)
    return SECTIONS


def test_the_docs_have_toml_blocks() -> None:
    assert len(blocks()) >= 7  # the pattern finds them: README's, farm.md's, security.md's, train.md's, client.md's


@pytest.mark.parametrize("text", blocks())
def test_a_toml_block_of_the_docs_loads_and_its_judge_goes_to_its_provider(text: str, tmp_path: Path) -> None:
    from common.config import load, read_toml

    config = tmp_path / "config.toml"
    config.write_text(with_host_files(text, tmp_path))
    tables = read_toml(config)
    known = sections()
    # A block that shows one component's keys may leave out the model and the Redis: stand-ins for them, as `ppoz up`
    # validates with one for the Redis it starts itself (and `--model` gives the model).
    stand_in = {
        **({} if "model" in tables.get("policy", {}) else {"policy.model": "a-model"}),
        **({} if "redis_url" in tables.get("store", {}) else {"store.redis_url": "redis://stand-in"}),
    }
    for name, table in tables.items():
        if not isinstance(table, dict):
            continue
        assert name in known, f"[{name}] is no component's table"
        loaded: object = load(known[name], config, stand_in)
        judge, provider = getattr(loaded, "judge_model", ""), getattr(loaded, "judge_provider", "")
        if judge and not getattr(loaded, "judge_base_url", ""):
            family = next((f for f in JUDGE_FAMILIES if judge.lower().startswith(f)), None)
            assert family is None or JUDGE_FAMILIES[family] == provider, (
                f"[{name}] judge_model = {judge!r} goes to judge_provider = {provider!r}; {judge!r} is {JUDGE_FAMILIES[family]}'s"
            )

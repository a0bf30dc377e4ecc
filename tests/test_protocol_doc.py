"""docs/protocol.md stays true: every worked example encodes to exactly the hex shown under it."""

import json
import re
from pathlib import Path

import msgpack

from common import protocol as p

DOC = Path(__file__).resolve().parent.parent / "docs" / "protocol.md"
EXAMPLE = re.compile(r"```json\n(.*?)\n```\n```hex\n(.*?)\n```", re.S)


def examples():
    return [(json.loads(j), bytes.fromhex(h.replace("\n", " "))) for j, h in EXAMPLE.findall(DOC.read_text(encoding="utf-8"))]


def test_doc_has_an_example_of_every_client_operation_and_error_reply():
    ops = {body["op"] for body, _ in examples()}
    assert {"attach", "detach", "ask", "step", "generate", "feedback", "ping"} <= ops
    assert any("error" in body for body, _ in examples())


def test_every_example_encodes_byte_for_byte():
    found = examples()
    assert len(found) >= 10
    for body, data in found:
        assert p.encode(body) == data, body
        assert msgpack.unpackb(data, raw=False) == body


def test_every_request_example_passes_the_brokers_checks():
    for body, _ in examples():
        if "error" in body or "status" in body:
            continue  # a reply
        op, rid = p.check_header(body)
        assert op in p.CLIENT_OPS and rid
        if "obs" in body:
            p.check_obs(body, p.Limits())
        if op == p.OP_GENERATE:
            p.check_generate(body, p.Limits())


def test_doc_lists_every_error_code_and_operation():
    text = DOC.read_text(encoding="utf-8")
    for code in p.ERROR_CODES:
        assert f"| `{code}` |" in text, code
    for op in p.CLIENT_OPS | p.ACTOR_OPS | {p.OP_SCORE}:
        assert f"| `{op}` |" in text, op

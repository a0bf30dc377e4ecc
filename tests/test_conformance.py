"""The conformance vectors agree with docs/protocol.md and with the Python side, byte for byte."""

from __future__ import annotations

import json

import msgpack

from common import protocol as p
from conformance.generate import OUT, vectors


def test_the_vector_files_are_the_documents_examples():
    expected = vectors()
    assert len(expected) >= 10
    on_disk = {f.stem for f in OUT.glob("*.msgpack")}
    assert on_disk == set(expected), "run `python conformance/generate.py`"
    for name, (text, data) in expected.items():
        assert (OUT / f"{name}.msgpack").read_bytes() == data, name
        assert json.loads((OUT / f"{name}.json").read_text(encoding="utf-8")) == json.loads(text), name


def test_python_encodes_and_decodes_every_vector_byte_for_byte():
    for wire in sorted(OUT.glob("*.msgpack")):
        body = json.loads(wire.with_suffix(".json").read_text(encoding="utf-8"))
        data = wire.read_bytes()
        assert p.encode(body) == data, wire.name
        decoded = p.decode(data)
        assert decoded == body and list(decoded) == list(body), wire.name  # same keys, same order
        assert msgpack.unpackb(data, raw=False) == body


def test_the_python_clients_generate_requests_are_the_vectors_byte_for_byte():
    """What Client.generate sends (client/retry.py builds the fields) for the two documented generate requests."""
    from client.retry import build_request, generate_fields

    plain = generate_fields("qa-3", "Q: 2 + 3 = ? Answer with a number.\nA:", None, 16, 1.0, 0.9, ["\n"], 7, None)
    chat = generate_fields(
        "qa-3",
        None,
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}],
        8,
        0.0,
        1.0,
        None,
        None,
        20.0,
    )
    for name, rid, fields in (("generate-request", "g1", plain), ("generate-request-2", "g2", chat)):
        assert p.encode(build_request(p.OP_GENERATE, rid, fields)) == (OUT / f"{name}.msgpack").read_bytes(), name

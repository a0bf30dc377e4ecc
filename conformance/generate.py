"""Write the conformance vectors: every worked example of docs/protocol.md as a pair of files.

    conformance/vectors/NAME.json     the message as JSON (keys in wire order)
    conformance/vectors/NAME.msgpack  its exact bytes on the wire

Every client's tests read them: decoding NAME.msgpack must give NAME.json, and
encoding NAME.json (or building the same message with the client's own API)
must give NAME.msgpack byte for byte. The document is the source; run
`python conformance/generate.py` after changing an example there
(tests/test_conformance.py fails while the two disagree).
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "protocol.md"
OUT = ROOT / "conformance" / "vectors"
EXAMPLE = re.compile(r"```json\n(.*?)\n```\n```hex\n(.*?)\n```", re.S)


def vectors(doc: Path = DOC) -> dict[str, tuple[str, bytes]]:
    """NAME -> (JSON text, wire bytes), named `<op>-request`, `<op>-reply` or `<op>-error` (numbered when repeated)."""
    out: dict[str, tuple[str, bytes]] = {}
    seen: Counter[str] = Counter()
    for text, hexdump in EXAMPLE.findall(doc.read_text(encoding="utf-8")):
        body = json.loads(text)
        kind = "error" if "error" in body else "reply" if "status" in body else "request"
        base = f"{body['op']}-{kind}"
        seen[base] += 1
        name = base if seen[base] == 1 else f"{base}-{seen[base]}"
        out[name] = (json.dumps(body, ensure_ascii=False), bytes.fromhex(hexdump.replace("\n", " ")))
    return out


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    for old in OUT.iterdir():
        old.unlink()
    for name, (text, data) in vectors().items():
        (OUT / f"{name}.json").write_text(text + "\n", encoding="utf-8")
        (OUT / f"{name}.msgpack").write_bytes(data)
    print(f"wrote {len(vectors())} vectors to {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

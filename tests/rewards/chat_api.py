"""A stand-in for a remote judge: a local HTTP server speaking the chat-completions API (loopback, random port).

`answer(request_json, n)` decides each reply (n counts requests from 1): a string (the assistant's
message), or (status, seconds to wait first, message or error text). The server records every request
(body, and headers with lower-case names) and the most requests it held at once.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Answer = str | tuple[int, float, str]


class ChatServer:
    def __init__(self, answer: Callable[[dict[str, Any], int], Answer]) -> None:
        self.answer = answer
        self.requests: list[tuple[dict[str, Any], dict[str, str]]] = []
        self.in_flight = 0
        self.most_in_flight = 0
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.requests.append((body, {k.lower(): v for k, v in self.headers.items()}))
                    n = len(server.requests)
                    server.in_flight += 1
                    server.most_in_flight = max(server.most_in_flight, server.in_flight)
                try:
                    if self.path.rstrip("/") != "/v1/chat/completions":
                        return self._send(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})
                    got = server.answer(body, n)
                    status, wait, text = (200, 0.0, got) if isinstance(got, str) else got
                    time.sleep(wait)
                    if status != 200:
                        return self._send(status, {"error": {"message": text, "type": "server_error"}})
                    self._send(
                        200,
                        {
                            "id": f"chatcmpl-{n}",
                            "object": "chat.completion",
                            "created": int(time.time()),
                            "model": body["model"],
                            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                        },
                    )
                finally:
                    with server.lock:
                        server.in_flight -= 1

            def _send(self, status: int, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.send_header("retry-after-ms", "20")  # the client's back-off, kept short here
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (its timeout)
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"


@contextmanager
def chat_server(answer: Callable[[dict[str, Any], int], Answer]) -> Iterator[ChatServer]:
    server = ChatServer(answer)
    thread = threading.Thread(target=server.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.httpd.shutdown()
        server.httpd.server_close()
        thread.join(10)

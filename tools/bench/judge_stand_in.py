"""A stand-in for a remote LLM judge: a local HTTP server speaking the chat-completions API (loopback, random port).

`ppoz bench drivers` scores responses against it, and the tests of the judge use it too, so there
is one stand-in. `answer(request_json, n)` decides each reply (n counts requests from 1): a string
(the assistant's message), or (status, seconds to wait first, message or error text);
`scoring(latency_s)` is the judge a benchmark wants: every reply after `latency_s`, ending with
`Score: 1`. The server records every request (body, and headers with lower-case names) and the most
requests it held at once.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger(__name__)

Answer = str | tuple[int, float, str]


def scoring(latency_s: float, reply: str = "The response answers the question. Score: 1") -> Callable[[dict[str, Any], int], Answer]:
    """An answer that replies `reply` (a verdict ending in `Score: N`) after `latency_s`, like a remote LLM."""
    if latency_s < 0:
        raise ValueError(f"`latency_s` must be >= 0, got {latency_s}")
    return lambda body, n: (200, latency_s, reply)


class _Server(ThreadingHTTPServer):
    # socketserver's listen backlog is 5: with more judge requests than that connecting at once, the
    # kernel drops the extra SYNs and the client resends them a second later, a latency the stand-in
    # would add and a real judge's endpoint does not.
    request_queue_size = 1024
    daemon_threads = True


def completion(n: int, body: dict[str, Any], text: str) -> dict[str, Any]:
    """A chat-completions reply holding `text`, as the API writes one."""
    return {
        "id": f"chatcmpl-{n}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body["model"],
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }


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
                        reply = (404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})
                    else:
                        got = server.answer(body, n)
                        status, wait, text = (200, 0.0, got) if isinstance(got, str) else got
                        time.sleep(wait)
                        reply = (
                            (status, {"error": {"message": text, "type": "server_error"}})
                            if status != 200
                            else (200, completion(n, body, text))
                        )
                finally:
                    # no longer in flight before the reply goes out: a client that sends its next request as soon as it
                    # reads this reply must not find this one still counted (2 in flight at concurrency 1, on a loaded machine)
                    with server.lock:
                        server.in_flight -= 1
                self._send(*reply)

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

        self.httpd = _Server(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"


@contextmanager
def chat_server(answer: Callable[[dict[str, Any], int], Answer]) -> Iterator[ChatServer]:
    server = ChatServer(answer)
    thread = threading.Thread(target=server.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    log.debug("chat-completions stand-in at %s", server.base_url)
    try:
        yield server
    finally:
        server.httpd.shutdown()
        server.httpd.server_close()
        thread.join(10)

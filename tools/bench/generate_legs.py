"""The legs of `ppoz bench generate` (tools/bench/generate.py): the same requests through transformers'
`model.generate` one at a time and as a static batch, its `generate_batch`, PPOZ's engine with and without its
LoRA fold, and a real broker and actor; each returns the tokens asked for, its wall time and latencies."""

import threading
import time
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Request:
    text: str  # what a client sends
    prompt_tokens: int
    max_new_tokens: int
    arrival: float  # seconds after the leg starts
    temperature: float = 0.0
    seed: int = 0


@dataclass
class LegRun:
    seconds: float
    outputs: list[list[int]]  # per request: the response tokens it asked for
    latencies_ms: list[float]
    texts: list[str] | None = None  # what a client read (ppoz_broker); else decoded from `outputs`
    decode: dict[str, int] | None = None  # the engine's decode step during this run: captures, eager buckets, replays

    @property
    def tokens(self) -> int:
        return sum(len(o) for o in self.outputs)


def asked(response: list[int], budget: int, eos: int) -> list[int]:
    """The response tokens a request asked for: up to its budget, through its end-of-sequence token."""
    response = response[:budget]
    return response[: response.index(eos) + 1] if eos in response else response


def wait_until(start: float, at: float) -> None:
    delay = start + at - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


def hf_settings(request_list: list[Request], tokenizer: Any) -> dict[str, Any]:
    sampled = request_list[0].temperature > 0
    settings: dict[str, Any] = {"do_sample": sampled, "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    if sampled:  # pure sampling at the temperature, as the engine's requests ask (generate's default top_k is 50)
        settings.update(temperature=request_list[0].temperature, top_k=0, top_p=1.0)
    return settings


def one_at_a_time(model: Any, tokenizer: Any, requests: list[Request]) -> LegRun:
    device = next(model.parameters()).device
    outputs, latencies = [], []
    start = time.perf_counter()
    for r in requests:
        wait_until(start, r.arrival)
        ids = tokenizer(r.text, return_tensors="pt").to(device)
        torch.manual_seed(r.seed)
        out = model.generate(**ids, max_new_tokens=r.max_new_tokens, **hf_settings([r], tokenizer))
        outputs.append(asked(out[0, ids["input_ids"].shape[1] :].tolist(), r.max_new_tokens, tokenizer.eos_token_id))
        latencies.append((time.perf_counter() - start - r.arrival) * 1000)
    return LegRun(time.perf_counter() - start, outputs, latencies)


def static_batch(model: Any, tokenizer: Any, requests: list[Request]) -> LegRun:
    device = next(model.parameters()).device
    start = time.perf_counter()
    wait_until(start, max(r.arrival for r in requests))
    tokenizer.padding_side = "left"
    batch = tokenizer([r.text for r in requests], return_tensors="pt", padding=True).to(device)
    torch.manual_seed(0)
    out = model.generate(**batch, max_new_tokens=max(r.max_new_tokens for r in requests), **hf_settings(requests, tokenizer))
    width = batch["input_ids"].shape[1]
    outputs = [asked(out[b, width:].tolist(), r.max_new_tokens, tokenizer.eos_token_id) for b, r in enumerate(requests)]
    done = time.perf_counter() - start
    return LegRun(done, outputs, [(done - r.arrival) * 1000 for r in requests])


def generate_batch(model: Any, tokenizer: Any, requests: list[Request]) -> LegRun:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    # sized to the work (its default reserves most of the free memory and pads each step's masks to 8,192 tokens)
    page = 64
    blocks = sum(-(-(r.prompt_tokens + r.max_new_tokens) // page) for r in requests) + len(requests)
    paged = ContinuousBatchingConfig(page_size=page, num_blocks=blocks, max_batch_tokens=2048, max_requests_per_batch=32)
    start = time.perf_counter()
    wait_until(start, max(r.arrival for r in requests))
    inputs = [tokenizer(r.text)["input_ids"] for r in requests]
    config = GenerationConfig(max_new_tokens=max(r.max_new_tokens for r in requests), **hf_settings(requests, tokenizer))
    torch.manual_seed(0)
    # warmup captures CUDA graphs: on a CPU it only costs (about 9 s a call here), so it is off
    results = model.generate_batch(
        inputs=inputs, generation_config=config, continuous_batching_config=paged, progress_bar=False, warmup=device_type(model) == "cuda"
    )
    ordered = sorted(results.values(), key=lambda g: int(str(g.request_id).rsplit("_", 1)[-1]))
    outputs = [asked(list(g.generated_tokens), r.max_new_tokens, tokenizer.eos_token_id) for g, r in zip(ordered, requests)]
    done = time.perf_counter() - start
    return LegRun(done, outputs, [(done - r.arrival) * 1000 for r in requests])


def device_type(model: Any) -> str:
    return next(model.parameters()).device.type


def engine_job(i: int, r: Request) -> dict[str, Any]:
    sampling = {"max_new_tokens": r.max_new_tokens, "temperature": r.temperature, "seed": r.seed}
    return {"job": i, "task_id": f"r{i}", "deadline_ms": 3_600_000, "obs": {"prompt": r.text, "sampling": sampling}}


_engines: dict[tuple[int, int, int, bool], Any] = {}


def ppoz_engine(model: Any, tokenizer: Any, requests: list[Request], rows: int, fold_lora: bool = True) -> LegRun:
    """The engine's leg. One engine per model and settings, kept across runs as an actor keeps it: on a GPU its
    first run captures the decode step's graphs (actor_node/decode_step.py), the later ones replay them."""
    from actor_node.generation_engine import GenerationEngine

    longest = max(r.prompt_tokens + r.max_new_tokens for r in requests)
    key = (id(model), rows, longest, fold_lora)
    for other in [k for k in _engines if k[:3] != key[:3]]:  # another case's engines: their KV slots freed
        del _engines[other]
    if key not in _engines:
        _engines[key] = GenerationEngine(model, tokenizer, max_rows=rows, max_positions=longest + 8, fold_lora=fold_lora)
    engine = _engines[key]
    step = engine.decode_step
    before = (len(step.graphs), len(step.eager), step.replays) if step is not None else (0, 0, 0)
    try:
        run = _drive_engine(engine, tokenizer, requests)
    finally:
        if engine.active:  # a failed run: the model's own weights back (a finished one restored them as it drained)
            engine.reset()
    step = engine.decode_step
    if step is not None:
        run.decode = {
            "captured": len(step.graphs) - before[0],
            "eager_buckets": len(step.eager) - before[1],
            "replays": step.replays - before[2],
            "capturing": int(step.capture),  # 0: a capture failed, and the step runs eagerly from then on
        }
    return run


def _drive_engine(engine: Any, tokenizer: Any, requests: list[Request]) -> LegRun:
    outputs: list[list[int]] = [[] for _ in requests]
    latencies = [0.0] * len(requests)
    pending = list(enumerate(requests))
    start = time.perf_counter()
    while pending or engine.active:
        now = time.perf_counter() - start
        arrived = [(i, r) for i, r in pending[: engine.free] if r.arrival <= now]
        if arrived:
            pending = pending[len(arrived) :]
            engine.add([engine_job(i, r) for i, r in arrived])
        if not engine.active:
            wait_until(start, pending[0][1].arrival)
            continue
        for job, answer in engine.step():
            if isinstance(answer, Exception):
                raise answer
            i = job["job"]
            outputs[i] = asked(answer.response_ids, requests[i].max_new_tokens, tokenizer.eos_token_id)
            latencies[i] = (time.perf_counter() - start - requests[i].arrival) * 1000
    return LegRun(time.perf_counter() - start, outputs, latencies)


def ppoz_broker(model_dir: str, device: str, tokenizer: Any, requests: list[Request], rows: int) -> LegRun:
    """The same requests from concurrent clients through a real broker and one actor. A client reads the
    text and the token count, not the tokens: its outputs are compared by text."""
    from actor_node.config import ActorConfig
    from actor_node.main import run_actor
    from broker.config import BrokerConfig
    from broker.server import Broker
    from client import Client
    from common.redis_server import EmbeddedRedis, connect
    from common.shared_settings import PolicySpec, StoreSettings

    outputs: list[list[int]] = [[] for _ in requests]
    texts = [""] * len(requests)
    latencies = [0.0] * len(requests)
    answered = [0.0] * len(requests)  # when each answer came, from the start (its feedback is not timed)
    longest = max(r.prompt_tokens + r.max_new_tokens for r in requests)
    with EmbeddedRedis() as redis_server:
        broker = Broker(
            BrokerConfig(
                frontend="tcp://127.0.0.1:*", backend="tcp://127.0.0.1:*", store=StoreSettings(redis_url=redis_server.url), segment_len=1
            ),
            connect(redis_server.url),
        )
        broker.start()
        threading.Thread(target=broker.run, name="broker", daemon=True).start()
        stop = threading.Event()
        actor_cfg = ActorConfig(
            broker=broker.backend_endpoint,
            policy=PolicySpec(model=model_dir),
            device=device,
            credits=rows,
            max_generate_rows=rows,
            max_generate_positions=longest + 8,
            prefix_cache_mb=0,  # every prompt is new: the cache would only cost
        )
        actor = threading.Thread(target=run_actor, args=(actor_cfg, stop), name="actor", daemon=True)
        actor.start()
        with Client(broker.frontend_endpoint, deadline=600, attempt_timeout=600) as probe:
            end = time.monotonic() + 300
            while not probe.status()["actors"]:
                if time.monotonic() > end:
                    raise SystemExit("ppoz bench generate: the actor did not start within 300 s")
                time.sleep(0.1)
        clients = [Client(broker.frontend_endpoint, deadline=600, attempt_timeout=600) for _ in requests]
        tasks = [c.attach() for c in clients]
        barrier = threading.Barrier(len(requests) + 1)
        started = [0.0]

        def one(i: int, r: Request) -> None:
            barrier.wait()
            wait_until(started[0], r.arrival)
            reply = clients[i].generate(tasks[i], r.text, max_new_tokens=r.max_new_tokens, temperature=r.temperature, seed=r.seed)
            answered[i] = time.perf_counter() - started[0]
            latencies[i] = (answered[i] - r.arrival) * 1000
            outputs[i] = [0] * int(reply["n_tokens"])  # counted; compared by text
            texts[i] = reply["text"]
            clients[i].feedback(tasks[i], 0.0, done=True)

        threads = [threading.Thread(target=one, args=(i, r)) for i, r in enumerate(requests)]
        for t in threads:
            t.start()
        started[0] = time.perf_counter()
        barrier.wait()
        for t in threads:
            t.join()
        elapsed = max(answered)
        for c in clients:
            c.close()
        stop.set()
        actor.join(30)
        broker.stop()
    return LegRun(elapsed, outputs, latencies, texts)

"""The generation engine's decode step at fixed shapes, so that a GPU can replay it as one CUDA graph.

An eager decode step of a transformers model launches every kernel from Python: about
1.4k for a 28-layer model, each costing the host a few microseconds while the GPU
waits (docs/benchmarks.md, "The three tasks on a GPU": 44 ms a step of which the GPU
was busy 3.8 ms). A CUDA graph records the kernels of one forward once and launches
them all with one call; it needs every tensor's shape and address fixed. So the step
runs at bucketed shapes:

- rows: the running rows padded up to a bucket (1, 2, 4, 8, then multiples of 8,
  vLLM's batch sizes for its graphs, at most `max_rows`); padding rows are
  placeholders, as rows still prefilling are: they write their KV to the slot cache's
  sink column and attend to position 0 only (AttentionMasks).
- attention width: the positions read, rounded up to a multiple of a step that grows
  with the width (32 up to 256, then four steps per doubling: at most a quarter more
  than needed past 128), at most the cache's capacity. The keys past a row's own
  length are masked, so a wider read changes nothing but the work.

Its inputs live in one device buffer that each step overwrites with one host-to-device
copy (from pinned memory on a GPU): token ids, positions, which rows are real, the
sampling settings and uniform numbers `sampling.sample` needs, and which rows decode.
The step's output is the logits of every bucket row (float32, through the LM head and
the model's logit post-processing). On a GPU each (rows, width) bucket is captured on
first use, after two eager warm-up runs, into one shared memory pool, its logits copied
into one output buffer all graphs share, and a first replay is checked against the
eager logits before the graph serves; on a CPU the same function runs eagerly at the
same shapes, which is what the test suite checks.

What a replay assumes: every weight it reads is changed in place (load_state_dict,
the LoRA fold and restore, a 16-bit head's float32 copy: `scoring.refresh_float32_head`
before each replay) and the slot cache is never reallocated. Anything that replaces a
parameter tensor must call `forget()`.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from actor_node.kv_slots import SlotCache
from models import scoring
from models.kv_cache import cache_kwargs

log = logging.getLogger(__name__)

MIN_WIDTH_STEP = 32
INPUTS = ("ids", "positions", "real", "temperature", "top_p", "top_k", "uniform", "picked")
# picked: in its first k rows, the slots of the k rows that decode (the rest are placeholders), in their order


def row_bucket(rows: int, max_rows: int) -> int:
    """The rows a step runs for `rows` running ones: 1, 2, 4, 8, then the next multiple of 8, at most max_rows."""
    if rows <= 8:
        bucket = 1 << max(0, rows - 1).bit_length()
    else:
        bucket = -(-rows // 8) * 8
    return min(bucket, max_rows)


def width_bucket(width: int, capacity: int) -> int:
    """The positions a step reads when its longest row needs `width`: a multiple of 32 up to 256, then of an
    eighth of the next power of two (at most 1/4 more than needed past 128), at most `capacity`."""
    step = max(MIN_WIDTH_STEP, 1 << max(0, (width - 1).bit_length() - 3))
    return min(-(-width // step) * step, capacity)


class AttentionMasks:
    """The 4D masks a forward over the slot cache needs, in the form the decoder takes them.

    A query at position q of a row may attend to keys at positions [0, q] of its slot
    (and only (q - window, q] in a sliding-window layer); a placeholder (padding, a row
    still prefilling during a decode step) attends to position 0 of its slot only, so
    its softmax stays finite, and its output is dropped. Models whose layers mix full
    and sliding attention (`config.layer_types`) take one mask per layer type. Raises
    ValueError, naming why, for a model whose attention takes no such mask."""

    def __init__(self, model: Any) -> None:
        config = model.config
        impl = getattr(config, "_attn_implementation", "eager")
        if impl not in ("sdpa", "eager"):  # flash and flex kernels take no 4D mask: they would attend across rows' padding
            raise ValueError(f"generate needs attn_implementation sdpa or eager, this model runs {impl}")
        self.use_bool, self.dtype = scoring.mask_format(model)
        window = getattr(config, "sliding_window", None)
        layer_types = getattr(config, "layer_types", None)
        if layer_types:
            unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
            if unknown:
                raise ValueError(f"generate cannot serve layers of type {', '.join(unknown)} ({type(model).__name__})")
            self.windows: dict[str, int | None] | None = {
                kind: window if kind == "sliding_attention" else None for kind in set(layer_types)
            }
            self.window = None
        else:
            self.windows = None
            self.window = int(window) if window and getattr(config, "use_sliding_window", True) else None

    def build(self, query_positions: torch.Tensor, real: torch.Tensor, width: int) -> Any:
        """query_positions [B, q] (absolute positions), real [B, q] bool (False: a placeholder) -> the mask(s)."""
        keys = torch.arange(width, device=query_positions.device)[None, None, :]
        q = query_positions[:, :, None]
        causal = keys <= q
        placeholder = (~real)[:, :, None] & (keys == 0)
        real3 = real[:, :, None]

        def one(window: int | None) -> torch.Tensor:
            allowed = causal if window is None else causal & (keys > q - window)
            allowed = (allowed & real3) | placeholder
            return scoring.as_attention_mask(allowed[:, None], self.use_bool, self.dtype)

        if self.windows is None:
            return one(self.window)
        return {kind: one(window) for kind, window in self.windows.items()}


def run_decoder(
    decoder: Any, kv: SlotCache, masks: AttentionMasks, ids: torch.Tensor, positions: torch.Tensor, real: torch.Tensor, width: int
) -> torch.Tensor:
    """The decoder's last hidden states [B, q] for tokens `ids` at `positions` (device tensors [B, q]; `real` False for
    a placeholder) over the slots `kv` was planned for, reading positions [0, width): prefill and decode alike."""
    mask = masks.build(positions, real, width)
    return decoder(input_ids=ids, attention_mask=mask, position_ids=positions, **cache_kwargs(decoder, kv)).last_hidden_state


class DecodeStep:
    """One decode forward of rows 0..n-1 (padded to a bucket): their next-token logits. Not thread-safe."""

    def __init__(self, engine: Any, capture: bool) -> None:
        self.decoder, self.head, self.post = engine.decoder, engine.head, engine.post
        self.kv: SlotCache = engine.kv
        self.masks: AttentionMasks = engine.masks
        self.capacity: int = engine.capacity
        self.max_rows: int = engine.max_rows
        self.device: torch.device = engine.device
        self.capture = capture and self.device.type == "cuda"
        pinned = self.device.type == "cuda"
        # float64 holds every token id, position and setting exactly; one copy carries them all. Row-major, so
        # the first `rows` rows are one contiguous block: the copy from pinned memory is then truly asynchronous.
        self.staging = torch.zeros(self.max_rows, len(INPUTS), dtype=torch.float64, pin_memory=pinned)
        self.inputs = torch.zeros(self.max_rows, len(INPUTS), dtype=torch.float64, device=self.device)
        self.slot_index = torch.arange(self.max_rows, device=self.device)[:, None]
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.eager: set[tuple[int, int]] = set()  # buckets whose capture ran out of memory: run eagerly
        self.out: torch.Tensor | None = None  # [max_rows, vocab] float32: every graph writes its logits here
        self.pool: Any = None
        self.stream: Any = None
        self.replays = 0

    def forget(self) -> None:
        """Drop every captured graph (a parameter tensor was replaced, or a step failed part-way)."""
        self.graphs.clear()

    def run(self, host_inputs: torch.Tensor, width: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """host_inputs [n, len(INPUTS)] float64 (row i: slot i, in INPUTS' order); `width` the positions the
        longest real row reads. The logits of the bucket's rows [B >= n, vocab] and the bucket's inputs on
        the device by name ([B] each)."""
        n = host_inputs.shape[0]
        rows, width = row_bucket(n, self.max_rows), width_bucket(width, self.capacity)
        self.staging[:n] = host_inputs
        self.staging[n:rows] = 0  # placeholders: token 0 at position 0, not real, greedy
        self.inputs[:rows].copy_(self.staging[:rows], non_blocking=True)
        if self.capture and (rows, width) not in self.eager:
            with torch.cuda.device(self.device):  # graphs are captured and replayed on the model's own GPU
                logits = self._replay(rows, width)
        else:
            logits = self._forward(rows, width)
        return logits, {name: self.inputs[:rows, i] for i, name in enumerate(INPUTS)}

    def _forward(self, rows: int, width: int) -> torch.Tensor:
        """The step at (rows, width), from the device inputs alone: what a graph records."""
        ids = self.inputs[:rows, 0, None].long()
        positions = self.inputs[:rows, 1, None].long()
        real = self.inputs[:rows, 2, None] > 0
        writes = torch.where(real, positions, self.capacity)  # placeholders write to the sink column
        self.kv.plan_fixed(rows, self.slot_index[:rows], writes, width)
        hidden = run_decoder(self.decoder, self.kv, self.masks, ids, positions, real, width)
        return self.post(scoring.head_logits(self.head, hidden[:, 0]))

    def _replay(self, rows: int, width: int) -> torch.Tensor:
        scoring.refresh_float32_head(self.head)  # new weights since the capture: the kept copy refreshed in place
        key = (rows, width)
        if key not in self.graphs:
            try:
                self.graphs[key] = self._captured(rows, width)
            except torch.cuda.OutOfMemoryError as e:  # this bucket runs eagerly; the others are still captured
                log.warning("no memory to capture the decode step at %d rows x %d positions (%s); that shape runs eagerly", rows, width, e)
                self.eager.add(key)
                return self._forward(rows, width)
            except Exception as e:  # noqa: BLE001 - a model whose forward cannot be captured still serves, eagerly
                why = f"{type(e).__name__}: {e}"
                log.warning("cannot capture the decode step at %d rows x %d positions (%s); decoding eagerly", rows, width, why)
                self.capture = False
                self.graphs.clear()
                return self._forward(rows, width)
        self.graphs[key].replay()
        self.replays += 1
        assert self.out is not None  # made by the first capture
        return self.out[:rows]

    def _captured(self, rows: int, width: int) -> torch.cuda.CUDAGraph:
        """Two eager runs on the capture stream (lazy initialisation, allocator warm-up), then one recorded, then one
        replay checked against the eager logits. Every run writes the same KV at the same positions, so the extra
        runs change nothing. Each graph's own logits are an intermediate of the shared pool, copied into `out`."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
            self.stream = torch.cuda.Stream(self.device)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for _ in range(2):
                eager = self._forward(rows, width)
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        if self.out is None:
            self.out = torch.empty(self.max_rows, eager.shape[-1], dtype=torch.float32, device=self.device)
        out = self.out
        graph = torch.cuda.CUDAGraph()
        # thread_local: a snapshot fetched in another thread (actor_node/weight_follower.py) may copy to the GPU meanwhile
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
            out[:rows].copy_(self._forward(rows, width))
        graph.replay()
        gap = float((out[:rows] - eager.float()).abs().max())
        if not gap <= 1e-3 * max(1.0, float(eager.abs().max())):  # an empty or wrong capture must never serve
            raise RuntimeError(f"a replay of the captured step differs from the eager step by {gap:g}")
        log.info("decode step captured at %d rows x %d positions (%d graphs)", rows, width, len(self.graphs) + 1)
        return graph

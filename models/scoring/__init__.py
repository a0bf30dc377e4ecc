"""Candidate-action scoring: the one function the actor samples from and the learner trains.

score(a | s) = sum over the action's tokens of log p(token | prompt + question +
the action's earlier tokens). The first action token is predicted from the last
context position. Log-probabilities come from a log-softmax over the whole
vocabulary, in float32.

Three ways to compute the same numbers (`PATHS`):

- `packed`: the whole batch in two passes: every context once, then every
  candidate packed behind its context in one row. A 4D attention mask lets
  each candidate see the context and its own earlier tokens only; position ids
  restart after the context for every candidate. The LM head runs only at the
  scored positions. Memory grows with context + candidates, not context x candidates.
- `kv_batch`: the context's KV once, then all candidates of the observation in
  one batched pass over that cache (for models that take no 4D mask).
- `per_candidate`: one full forward of context + candidate per candidate (the
  reference; also the last resort).

`select_path` checks the paths against the model's own `model(input_ids).logits`
on the loaded model and takes the first that matches (actor and learner alike). Nothing here switches autograd on or off: the
actor calls these under `torch.inference_mode()`, the learner with gradients.

The parts: `observation.py` (text to token ids, length checks), `lm_head.py` (the decoder and LM head, logits in
float32), `paths.py` (the three paths, and from summed log-probabilities to a policy), `path_check.py`
(`select_path`). Callers import this package, `from models import scoring`: what they use is named here.
"""

from models.scoring.lm_head import (
    LogitTransform,
    head_logits,
    in_chunks,
    model_parts,
    positions_at_once,
    refresh_float32_head,
    token_logprobs,
)
from models.scoring.observation import (
    BOUNDARY_CHARS,
    ScoringError,
    Tokenized,
    check_length,
    longest_token_chars,
    position_limit,
    tokenize_observation,
)
from models.scoring.path_check import (
    FLOAT32_TOLERANCE,
    NATIVE_ULPS,
    PATHS,
    float32_probe,
    keep_layers,
    probe_items,
    reference_scores,
    select_path,
    sliding_window,
)
from models.scoring.paths import (
    SCORERS,
    as_attention_mask,
    mask_format,
    normalise,
    policy_logprobs,
    score,
    score_kv_batch,
    score_packed,
    score_packed_kv,
    score_packed_one_pass,
    score_per_candidate,
)

__all__ = [
    "BOUNDARY_CHARS",
    "FLOAT32_TOLERANCE",
    "NATIVE_ULPS",
    "PATHS",
    "SCORERS",
    "LogitTransform",
    "ScoringError",
    "Tokenized",
    "as_attention_mask",
    "check_length",
    "float32_probe",
    "head_logits",
    "keep_layers",
    "in_chunks",
    "longest_token_chars",
    "mask_format",
    "model_parts",
    "normalise",
    "policy_logprobs",
    "position_limit",
    "positions_at_once",
    "probe_items",
    "reference_scores",
    "refresh_float32_head",
    "score",
    "score_kv_batch",
    "score_packed",
    "score_packed_kv",
    "score_packed_one_pass",
    "score_per_candidate",
    "select_path",
    "sliding_window",
    "token_logprobs",
    "tokenize_observation",
]

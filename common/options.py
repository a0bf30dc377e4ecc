"""Names of the choices configs are validated against, importable without torch."""

SCORING_PATHS = ("packed", "kv_batch", "per_candidate")
NORMALISATIONS = ("token", "word", "sum")
DTYPE_NAMES = ("float32", "bfloat16", "float16")
# How the learner's policy loss treats stale samples (learner_node/ppo.py, docs/design.md).
OBJECTIVES = ("decoupled", "ppo")

"""Names of the choices configs are validated against, importable without torch."""

SCORING_PATHS = ("packed", "kv_batch", "per_candidate")
NORMALISATIONS = ("token", "word", "sum")
DTYPE_NAMES = ("float32", "bfloat16", "float16")
# How the learner's policy loss treats stale samples (learner_node/core_algos.py, docs/design.md).
OBJECTIVES = ("decoupled", "ppo")
KL_ESTIMATORS = ("k1", "k2", "k3")  # generation: per-token KL to the reference (learner_node/core_algos.py)
LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
ADVANTAGE_ESTIMATORS = ("gae", "grpo", "rloo")  # generation: token values with a critic, or group-relative (core_algos)
# The policy losses a config may name: learner_node/core_algos.py's POLICY_LOSSES (tests/learner_node/test_loss_settings.py
# checks they agree).
POLICY_LOSSES = ("clipped", "dual-clip")

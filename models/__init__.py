"""The model code: scoring a policy's candidates and responses, the policy and value model, the KV cache and the tiny
models tests and demos build. Below the services; above common (the contracts between processes)."""

"""Reliability tools: the ledger every fault test ends with, `ppoz fuzz` (the broker front end's and the HTTP
gateway's fuzzer), `ppoz soak` (many emulators against a whole stack for minutes) and `ppoz bench farm` (the
stack on six network namespaces, links cut and Redis killed)."""

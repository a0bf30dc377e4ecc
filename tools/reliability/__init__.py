"""Reliability tools: the fuzzer for the broker front end and the HTTP gateway (`python -m tools.reliability.fuzz`)."""

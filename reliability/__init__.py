"""Reliability tools: the fuzzer for the broker front end and the HTTP gateway (`python -m reliability.fuzz`)."""

"""The tools around the product: benchmarks (`ppoz bench`), the protocol fuzzer, the soak and the farm, on one
harness (tools/harness.py). Nothing in the product imports them; the command line dispatches to them."""

"""The benchmark harness by question: named system configurations (systems/*.json), questions that choose systems,
a baseline, metrics and a workload (questions/*.json), `run` and `report` (harness.py; `expert-pack bench`,
docs/BENCHMARKS.md). machine.py holds the machine-level pieces: page cache, bandwidths, the RAM cap, servers."""

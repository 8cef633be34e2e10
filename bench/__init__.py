"""rivulet's benchmarks. Every module here is a command, run as ``python -m bench.NAME`` from the
repository root and named by what it measures (serving: online streaming; offline: throughput
against HF generate; targets: the engine against its targets and llama.cpp; worker_step: the model
runner's step alone; ...); each prints a table and can append a JSON record to bench/results/.
What they share (starting engines, workloads, the streaming client, metrics, records, report
tables and plots, bench models, the llama.cpp peer) is the library in bench/lib/.
"""

"""rivulet's benchmarks: online streaming (serving.py), offline throughput (offline.py) and
before/after sweeps with tables and plots (sweep.py). Pure pieces (metrics, workloads,
records) are importable and unit-tested; the scripts are thin command lines around them.
"""

"""What the bench commands share: engines started and torn down (launch), the clients and workloads
that drive them (backends, workloads, serving, offline, hf_baseline), what is measured and kept
(metrics, probes, records), sweeps and their tables, plots and docs (sweeps, sweep_runner, report,
plots, writeup, targets_table), bench.targets's rounds (targets_rounds), bench models and the
llama.cpp peer (gguf_models, llama_cpp), and the model runner's timing batches (worker_batches).
Nothing here is run as a script.
"""

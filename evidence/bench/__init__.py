"""Stage bench: speed and robustness. Reads a model package (model/ by default, or a random one it writes
itself) or a running draft server; times drafts, decode steps and kernels against transformers, llama.cpp
and vLLM, soaks the server, and checks a GPU (gpu_check.py, run by evidence/gpu_check.sh); prints tables
and writes JSON reports (--json)."""

"""kgen's benchmark scripts and what only they use; not part of the wheel (pyproject's packages: kgen only).

Run a script from the repository root, as a module or as a file with the root on the path:

    python -m benchmarks.static_perf [--doc docs/performance.md]
    PYTHONPATH=. python benchmarks/static_perf.py

Scripts share code through this package's modules, never through each other or `sys.path`:
flashinfer_geometry.py and vllm_geometry.py restate those libraries' launch geometry from their sources,
nvcc.py builds their kernels, tables.py formats the tables and writes them into the docs, gpu.py finds a
CUDA torch for the measuring scripts. kgen's own models (kgen/perf) and measuring code (kgen/bench, shared
with `kgen selftest`) stay in kgen.
"""

"""The static performance model (model.py): SASS, occupancy and bytes in flight, no GPU needed.
Used by benchmarks/static_perf.py, benchmarks/gpu_decode.py and their tests."""

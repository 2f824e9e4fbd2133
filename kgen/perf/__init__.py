"""The static performance models: model.py (decode: SASS, occupancy and bytes in flight) and
prefill_model.py (tensor-core prefill tiles), no GPU needed. Used by benchmarks/static_perf.py,
benchmarks/static_prefill.py, benchmarks/gpu_decode.py and their tests."""

"""Measured figures on one GPU: kgen's decode and prefill kernels timed against torch SDPA and
FlashInfer over the same paged cache (benchmarks/gpu_decode.py and benchmarks/gpu_prefill.py, and the
timing steps of `kgen selftest`). torch and FlashInfer are imported only inside the functions that
need them; each function takes the torch module it works with."""

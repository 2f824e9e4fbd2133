"""kgen's static performance models, no GPU needed: sass.py (cuobjdump), model.py (the SASS reader, the
device table, the decode model: occupancy and bytes in flight), prefill_model.py (tensor-core prefill
tiles), mla_model.py (MLA decode) and report.py (a kernel's figures, estimated with kgen's launch plan).
Used by `kgen perf`, `kgen verify --source` and the benchmark scripts; what those compare against
(FlashInfer's and vLLM's restated geometry) lives in the benchmarks package, outside the wheel."""

"""Number and cache formats as data: dtypes.py (one row per element type: bits, quantization,
minimum arch, C type and header) and cache.py (a spec's KV-cache format as an object: array
names, shapes, strides, canonical views, scale shapes, the template constants)."""

"""FlashInfer-Bench interop: its JSON documents (schema.py), Definitions to kgen specs and back and kgen's
kernel as a Solution (convert.py), verification reports as Traces (trace.py). docs/interop.md §6."""

"""Hand-written (untrusted) kernel sources, `kgen verify --source` (docs/verification.md §6.1):
the source policy (source_policy.py) over the preprocessed text (preprocess.py, cxx_text.py,
definitions.py; launch_state.py: no memory between launches, no clock), the parameter list against the ABI (signature.py), and the kernel built from
such a source (handwritten.py). No family imports these."""

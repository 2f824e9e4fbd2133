"""The attention family: paged decode and paged prefill over one host side (common.py: argument
rows, call binding, template context), one float64 reference (reference.py) and the cases of each
kind (decode_cases.py, prefill_cases.py)."""

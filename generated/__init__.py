"""Kernels written by `kgen build`: `from generated.<name> import kernel`."""

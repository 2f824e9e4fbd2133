"""kgen: specialized paged-attention kernels from YAML specs."""

from .version import __version__

__all__ = ["__version__"]

"""The cache kinds: cache_write (write.py) and copy_blocks (copy.py), with their cases."""

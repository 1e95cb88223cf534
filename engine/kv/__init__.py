"""KV cache management: the block pool and block manager, block hashes, the pool
tensor, KV groups and formats, the second (host) tier."""

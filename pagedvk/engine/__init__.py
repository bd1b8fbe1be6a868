"""Layer 4, serving-side state over the ops: the paged block manager (blocks: allocation, prefix sharing, forks)
and the device-resident KV cache that uses it (cache.KVCache)."""

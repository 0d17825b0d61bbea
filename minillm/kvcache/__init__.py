"""Chapter 04 (kv-cache): prefill/decode with a contiguous KV cache, and static batching.

`cache` (ContiguousKVCache: keys and values kept per layer), `generate` (prefill, decode_step, the cached loop and
static batching, each equal token for token to chapter 03's naive loop), `bench` (the chapter's measurements) and
`tour`.
"""

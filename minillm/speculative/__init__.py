"""Chapter 08 (speculative-decoding): draft γ tokens cheaply, verify them in one target forward, stay exact.

`sampling` (the acceptance rule of speculative sampling: `residual_distribution`, `accept_or_resample`, greedy
`accept_greedy`, and the naive twin `sample_from_target`) and `generate` (`generate_speculative` with a draft model,
`generate_prompt_lookup` with n-gram drafts copied from the sequence, both on chapter 04's contiguous caches rolled
back with `truncate`), `bench` (speed-up against the target alone beside the cost model, prompt lookup, a
chi-square test of the sampled distribution, Hugging Face assisted generation on the same weights) and `tour`
(the chapter's tour rows). Inside chapter 06's continuous-batching engine:
`engine` (`SpeculativeLLM`: per-request drafts verified in one ragged step, rolled back with
`BlockManager.truncate`), `verify_cache` (the "verify" attention backend, batching the verify steps' short queries)
and `engine_bench` (throughput with and without speculation from low load to high: where it stops paying). Still
to come: the distilled draft of chapter 11, and the graded exercises.
"""

"""Chapter 08 (speculative-decoding): draft γ tokens cheaply, verify them in one target forward, stay exact.

`sampling` (the acceptance rule of speculative sampling: `residual_distribution`, `accept_or_resample`, greedy
`accept_greedy`, and the naive twin `sample_from_target`) and `generate` (`generate_speculative` with a draft model,
`generate_prompt_lookup` with n-gram drafts copied from the sequence, both on chapter 04's contiguous caches rolled
back with `truncate`). Still to come: the chapter's benchmark, tour entry, text, notebook and exercises.
"""

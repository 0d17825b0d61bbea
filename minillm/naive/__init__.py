"""Chapter 03 (naive-inference): the naive generate loop every later chapter is checked against, and its metrics.

`generate` (the loop: recompute the whole sequence for every new token), `bench` (TTFT, TPOT, ITL, tokens/s for
any registered generator), `roofline` (the memory-bandwidth bound on decode speed) and `tour`. Sampling and the
metric definitions themselves are shared by every chapter and live in `minillm.core.sampling` / `core.metrics`.
"""

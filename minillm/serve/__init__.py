"""Chapter 15: serving — the engine behind an OpenAI-compatible streaming HTTP API, load-tested.

Modules:
- `protocol`: the OpenAI wire format — request bodies checked field by field, chunks and responses, SSE framing.
- `async_engine`: chapter 06's `EngineCore` on its own thread, driven from an asyncio event loop, with admission
  bounded by requests and tokens.
- `engine_process`: the same core in a process of its own (what `minillm serve` runs): plain messages over a pipe,
  a dead engine ending every request with an error; `build_engine`, each chapter's technique a switch.
- `metrics`: `/metrics` in Prometheus' format (prometheus-client): outcomes, tokens, TTFT/ITL/E2E histograms,
  the engine's queues and KV blocks.
- `dashboard`: the live page at `/dashboard` and the JSON it polls.
- `app`: the FastAPI routes, uvicorn, draining on SIGTERM, an in-process `ServerThread`.
- `cli`: `minillm serve` with each chapter's technique a flag, and `ServerProcess`, the server in a child process
  for benchmarks.
- `loadgen`: `minillm bench-serve`, the load generator (workloads, Poisson/gamma arrivals or a fixed concurrency,
  TTFT/TPOT/ITL/E2E, throughput, goodput in vLLM's and DistServe's senses).
- `plots`: latency CDFs and the throughput-latency frontier with SLO lines.
- `bench`: the chapter's benchmark (`python -m minillm.serve.bench`): serving against the offline engine, for
  each engine core placement, and latency against load.
- `peer`: the same load against llama.cpp's `llama-server` on the same weights (optional, never in CI).
- `tour`: the chapter's tour rows.
"""

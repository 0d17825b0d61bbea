"""The measurement kit every chapter benchmark is built from (it imports only core, tokenizer and gpt).

- `models.load_model(name)`: a shipped checkpoint, or a seeded stand-in of its shape, labelled
- `workload`: `make_workload` (the one generator), `workload(preset, n, seed, rate)`, `eval_prompts(lengths)`
- `driver.drive(engine, workload)`: feeds requests to any engine over time, per-request token timestamps
- `check.same_tokens(reference, *candidates)`: same tokens as the baseline, id by id
- `cli`: the options every benchmark's command line shares (`bench_parser`, `start`, `write_report`), and
  `cpu_description()`, the CPU a timing was taken on, and `pick_size`, a benchmark's named workload size
Side-by-side timings go through `minillm.core.timing.compare`.
"""

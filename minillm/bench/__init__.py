"""The measurement kit every chapter benchmark is built from (it imports only core, tokenizer and gpt).

- `models.load_model(name)`: a shipped checkpoint, or a seeded stand-in of its shape, labelled
- `workload`: `make_workload` (the one generator), `workload(preset, n, seed, rate)`, `eval_prompts(lengths)`
- `driver.drive(engine, workload)`: feeds requests to any engine over time, per-request token timestamps;
  `engine_tokens(engine, prompts, params)`, every prompt through an engine's `generate` at once
- `check.same_tokens(reference, *candidates)`: same tokens as the baseline, id by id
- `agreement`: teacher-forced greedy agreement, two models' argmax (`teacher_forced_agreement`) or one model's
  against a given continuation (`greedy_agreement`), chapters 09-11
- `hf_compare.hf_comparison(model, prompt, n, generate_fn)`: batch-1 tok/s against Hugging Face `generate`,
  chapters 04 and 13
- `cli`: the options every benchmark's command line shares (`bench_parser`, `add_bench_options`, `start`,
  `write_report`): `--device`, `--threads`, `--json`, `--seed`, `--quick`, `--size`; `cpu_description()`, the CPU
  a timing was taken on, and `pick_size`, a benchmark's named workload size
- `tables.markdown_table(header, rows, align)`: the Markdown table every report is printed and quoted in
Side-by-side timings go through `minillm.core.timing.compare`. A chapter's benchmark imports this kit and its own
and lower chapters' code, never another chapter's benchmark (tests/test_bench_kit.py): a measurement two chapters
share lives here.
"""

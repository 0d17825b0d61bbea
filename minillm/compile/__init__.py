"""Chapter 13 (compilation and graphs): the decode step with fixed shapes, compiled or captured, and in C++.

- `decode`: `StaticDecoder` (modes "eager", "compile" through `torch.compile`, "cuda-graph" through
  `torch.cuda.CUDAGraph`; batch 1 or a static batch), the `decode_fn` chapter 04's `generate` takes, with its
  recompilation count
- `cpu_gemv`: the chapter's C++ extension for the CPU (`torch.utils.cpp_extension`, AVX2 + FMA; `load_cpu_ext`), a
  GEMV with fused bias, `FastLinear` and `fast_cpu_model`, which sends every few-row matrix-vector product of a
  decode step through it
- `fused_step`: `FusedCPUDecoder`, the whole batch-1 decode step as one C++ call (a `decode_fn` too)
- `fused_speculative`: chapter 08's speculative decoding on fused steps: the draft's fused step proposes, the
  target's fused `verify` scores γ+1 tokens in one C++ call (`generate_speculative_fused`), or prompt lookup proposes
  (`generate_prompt_lookup_fused`)
- `mirror`: the two C++ loops in PyTorch, in the same order (`gemv_blocked`, `decode_step_by_hand`): the
  chapter's graded exercises
- `cpu_paged`: the engine's decode attention in C++ through the block tables, attention backend "selective-cpp"
- `fused_engine`: `FusedEngineModel`, chapter 06's engine with each short step (decodes, verify rows, short
  prompt chunks) one C++ call over the paged pools, and its benchmark against `fast_cpu_model`
  (`python -m minillm.compile.fused_engine`)
- `bench`: batch-1 decode tok/s of each path against the eager generator, the compile time, and the fraction of the
  weight-streaming bound measured in the same run, and against Hugging Face (`python -m minillm.compile.bench`)
- `sweep`: where `torch.compile` wins and loses on the CPU: decode at batch 1 and 8 and a prefill, on one and two
  threads, each checked against eager, with the profiles behind it (`python -m minillm.compile.sweep`)
- `llamacpp_build`: llama.cpp built from a pinned source distribution, and `base` converted to its GGUF (shared
  with chapter 15's `llama-server` side by side)
- `llamacpp`: the side-by-side with llama.cpp on the same weights (`python -m minillm.compile.llamacpp`; builds
  llama.cpp from source, never run by the tests or the tour)
- `onnx_peer`: the second CPU peer: the generator's step exported to ONNX (`export_onnx`) and run by ONNX Runtime
  (`OnnxDecoder`), side by side with eager and the fused step (`python -m minillm.compile.onnx_peer`)
- `aot`: the decode step ahead of time: `export_decode_step` (torch.export + AOTInductor, one `.pt2` file),
  `AOTDecoder` (loads it and generates in a fresh process without the model), and `cold_start`, process start to
  first token for eager, compile (cold and warm cache) and the package (`python -m minillm.compile.aot`)
- `tour`: the chapter's rows (compiled decode, the fastest decode against the bound and HF, the engine on it)

The text is `chapters/13-compilation.md`, the lab `notebooks/13-compilation.ipynb`.
"""

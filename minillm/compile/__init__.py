"""Chapter 13 (compilation and graphs): the decode step with fixed shapes, compiled or captured, and a C++ GEMV.

- `decode`: `StaticDecoder` (modes "eager", "compile" through `torch.compile`, "cuda-graph" through
  `torch.cuda.CUDAGraph`), the `decode_fn` chapter 04's `generate` takes, with its recompilation count
- `cpu_gemv`: a C++ GEMV with fused bias for the CPU (`torch.utils.cpp_extension`, AVX2 + FMA), `FastLinear` and
  `fast_cpu_model`, which sends every few-row matrix-vector product of a decode step through it
- `bench`: batch-1 decode tok/s of each mode against the eager generator, the compile time, and the fraction of the
  weight-streaming bound measured in the same run, and against Hugging Face (`python -m minillm.compile.bench`)
- `tour`: the chapter's rows (compiled decode, the fastest decode against the bound and HF, the engine on it)

The text is `chapters/13-compilation.md`, the lab `notebooks/13-compilation.ipynb`.
"""

"""Chapter 13 (compilation and graphs), under construction: the decode step with fixed shapes, compiled or captured.

- `decode`: `StaticDecoder` (modes "eager", "compile" through `torch.compile`, "cuda-graph" through
  `torch.cuda.CUDAGraph`), the `decode_fn` chapter 04's `generate` takes, with its recompilation count
- `cpu_gemv`: a C++ GEMV with fused bias for the CPU (`torch.utils.cpp_extension`, AVX2 + FMA), `FastLinear` and
  `fast_cpu_model`, which sends every few-row matrix-vector product of a decode step through it
- `bench`: batch-1 decode tok/s of each mode against the eager generator, the compile time, and the fraction of the
  weight-streaming bound measured in the same run (`python -m minillm.compile.bench`)
"""

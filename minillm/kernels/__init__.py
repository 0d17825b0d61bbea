"""Chapter 12: hand-written CUDA kernels for the operations minillm's inference spends its time in.

Each kernel comes as a ladder of versions (a .cu file under `csrc/` lists them in its header), beside a naive
PyTorch twin and a CPU mirror of its algorithm, so every step is checked against the one before it:
row softmax, fused layernorm, fused bias + GELU, causal FlashAttention-style attention, paged-attention decode
over chapter 05's block pools, int8 weight-only GEMV, and the KV-cache write by slot mapping.
What it leaves out: backward passes, tensor cores beyond `wmma` (attention v4; no `mma.sync` PTX, no Hopper
`wgmma` or TMA); the model still runs eager PyTorch, and nothing here is wired into the engine. The exercises are the
mirrors' `online_merge`, `attend_tile`, `warp_tree_sum` and `paged_gather`, and one kernel in CUDA C++, softmax.cu's
`softmax_v2_kernel` (graded through the emulator on any CPU, and on the GPU where there is one).

- `naive`: the naive PyTorch twin of each kernel (plain torch ops, fp32 math), the reference for every test
- `mirror`: a pure-PyTorch mirror of each kernel's algorithm (online softmax over tiles, FlashAttention tiles,
  block-table walking, lane-strided partial sums, slot scatter), runnable and tested on the CPU
- `build`: `load_kernels` (JIT build for the running GPU, cached) and `compile_sources_with_nvcc` (each .cu alone,
  registers and spills from ptxas)
- `ops`: the Python entry points (`softmax(x, version=4)`, ...), checking their arguments before any build
- `emulator`: the kernels' own .cu code compiled with the host C++ compiler and run on the CPU, every CUDA thread a
  fiber (`csrc/emu/`), so each version is checked everywhere, GPU or not
- `bench`: times every version against the naive op and PyTorch's own, beside the device's copy bandwidth and
  matmul rate (`python -m minillm.kernels.bench --json FILE.json`)
- `tour`: the chapter's rows: each mirror against its naive twin everywhere, each version timed on a GPU
"""

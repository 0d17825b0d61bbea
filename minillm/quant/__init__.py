"""Chapter 09 (quantization): store weights (and activations, and the KV cache) as small integers with scales, and
measure what it costs in quality and what it buys in memory and speed, always against the fp32 model.

- `quantize` the pure functions: symmetric (absmax) and asymmetric (zero-point) maps and their inverses, per-tensor,
  per-channel and group-wise, int8 and int4, `pack_int4` / `unpack_int4`
- `linear` `QuantConfig`, `QuantLinear` (weight-only int8/int4 de-quantized on the fly, or W8A8), the tied
  embedding/head, and `quantize_model(model, config)` returning a `QuantizedGPT`
- `w8a8` int8 activations with dynamic per-token scales, the int8 x int8 -> int32 matmul (`torch._int_mm` or its
  exact float64 twin), and LLM.int8's mixed-precision outlier decomposition
- `gptq` GPTQ: column-by-column rounding with the error pushed onto the columns not yet rounded (Cholesky form of
  the inverse Hessian), its least-squares twin `gptq_reference`, and `gptq_quantize_model` calibrated on training text
- `outliers` activation outlier statistics, function-preserving planted outliers, SmoothQuant (`smooth_model`)
- `kv_cache` KV-cache int8: codes + one scale per token and head inside chapter 04's contiguous cache and chapter
  05's paged cache (the engine backend "paged-int8"), with a fake-quant fp32 twin
- `qat` quantization-aware training: fake quantization with the straight-through estimator, a short fine-tune
- `checkpoint` quantized models as one safetensors file, the mode in its metadata (`save_quantized`, `load_quantized`)
- `bench` every method on `base` against fp32: bytes, perplexity, greedy agreement, KL from fp32, identical
  continuations, decode tok/s, the engine, the outlier study; `tour` its rows

The text is `chapters/09-quantization.md`, the lab `notebooks/09-quantization.ipynb`; the exercises are the maps and
the packing (`quantize`), GPTQ's column loop (`gptq`) and the straight-through estimator (`qat`).
"""

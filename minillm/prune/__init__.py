"""Chapter 10 (pruning): remove weights, measure what it costs in quality, and find out when zeros buy time.

- `masks` the pure functions: magnitude masks (per matrix), Wanda's score |W|·‖X‖ and its per-row mask, N:M masks
  (2:4), `is_nm_sparse`; the graded exercises are `magnitude_mask`, `wanda_score` and `nm_mask`
- `unstructured` `prune_model(model, method, sparsity, calibration, pattern)`: every block linear masked, block by
  block on calibration activations that went through the blocks already pruned; `weight_sparsity`
- `semi_structured` what each storage format costs (dense, bitmask, CSR, 2:4) and, on a CUDA GPU of compute
  capability 8.0+, PyTorch's 2:4 sparse tensors (`SemiStructuredLinear`, `layer_speed`)
- `structured` MLP neurons scored ‖h_j‖·‖W_proj[:, j]‖ and physically removed (`prune_mlp`), the recovery fine-tune
  (`recover`), attention heads scored and masked (`head_scores`, `mask_heads`)
- `checkpoint` pruned models as one safetensors file, their MLP widths and pattern in its metadata
- `bench` every method on `base` against dense: perplexity, bytes, agreement, KL from dense, identical continuations,
  decode tok/s, the engine; `tour` its rows

The text is `chapters/10-pruning.md`, the lab `notebooks/10-pruning.ipynb`.
"""

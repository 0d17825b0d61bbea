"""Chapter 14: parallelism over `torch.distributed` (gloo on the CPU, NCCL on CUDA), launched by torchrun.

- `group`: process groups the standard way (`init_rank`, from torchrun's environment or a loopback port),
  `run_ranks` (spawn N ranks on the process layer, run a function on each, collect the results), `free_port`
- `tensor`: Megatron tensor parallelism as a transform (`shard_model`) built from `column_split`, `row_split` and
  `row_parallel_forward` (the exercises): column- and row-parallel linears, the
  vocabulary-parallel embedding and head, `Comm` (every collective counted, with its bytes), the formulas;
  Megatron sequence parallelism (`shard_model(..., sequence_parallel=True)`, `sequence_parallel_logits`)
- `library`: the same plan through PyTorch's `parallelize_module` (DTensor) on a DeviceMesh, `CommDebugMode` counts
- `pipeline`: forward-only GPipe (`PipelineStage`, `run_gpipe`, per-stage events, the bubble and its formula)
- `context`: ring attention over sequence chunks (`ring_attention`, `merge_attention` in log-sum-exp form, an
  exercise)
- `executor`: `TensorParallelExecutor`, chapter 06's executor contract over t ranks (rank 0 plans and samples)
- `generate`: the torchrun entry point (`torchrun --nproc-per-node 2 -m minillm.parallel.generate`)
- `checks`: the rank functions the tests, the tour and the notebook run (`parallel_suite`: all of them on one group)
- `plots`: `plot_timeline`, the pipeline's measured events stage by stage
- `bench`: decode and prefill against world size, time in collectives, one all-reduce's latency, link costs from
  the formulas, the bubble figure
- `tour`: the chapter's tour rows
"""

from minillm.parallel.group import init_rank, run_ranks
from minillm.parallel.tensor import Comm, collectives_per_forward, shard_model

__all__ = ["Comm", "collectives_per_forward", "init_rank", "run_ranks", "shard_model"]

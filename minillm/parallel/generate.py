"""Greedy generation on t tensor-parallel ranks, launched by torchrun: how this chapter runs on real devices.

    torchrun --nproc-per-node 2 -m minillm.parallel.generate --prompt "def main(" --max-new-tokens 32 --check
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint host0:29500 \\
             -m minillm.parallel.generate --device cuda --prompt "def main("      # on each of two machines

Every rank loads the same checkpoint, joins the group from torchrun's environment (`init_rank()`: gloo on the CPU,
NCCL with `--device cuda`, each rank on GPU LOCAL_RANK), shards the model (`shard_model`) and runs chapter 04's
greedy loop on its shard. This is SPMD: every rank gathers the same logits, so every rank picks the same token and
no rank has to tell the others. Rank 0 prints the text; `--check` also runs the whole model in rank 0's process
and says whether the tokens are the same.

`generate_on_rank` is the part a rank runs once its group is up; the tests call it through `run_ranks`.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
import torch.distributed as dist

from minillm.bench.models import load_model
from minillm.core.sampling import SamplingParams
from minillm.kvcache.generate import generate_ids
from minillm.parallel.group import backend_for, init_rank
from minillm.parallel.tensor import shard_model


def generate_on_rank(rank: int, world_size: int, model_name: str, prompt: str, max_new_tokens: int,
                     device: str = "cpu", check: bool = False) -> dict[str, Any]:
    """This rank's share of one greedy generation (the group must be up): its tokens, text, collectives, and with
    `check` (rank 0 only) the one-process tokens."""
    if not isinstance(prompt, str):
        raise TypeError(f"prompt must be a str (the text to continue), got {type(prompt).__name__} {prompt!r}")
    loaded = load_model(model_name, "cpu")  # every rank reads the whole checkpoint, but only its shard goes to the
    ids = loaded.tokenizer.encode(prompt)   # device: a model too big for one GPU fits t of them
    if not ids:
        raise ValueError("the prompt encodes to no tokens: give a non-empty --prompt")
    params = SamplingParams.greedy(max_new_tokens, ignore_eos=True)
    shard = shard_model(loaded.model, rank, world_size).to(device)
    tokens = generate_ids(shard, ids, params)
    out = {"tokens": tokens, "text": loaded.tokenizer.decode(tokens), "label": loaded.label,
           "collectives": dict(shard.comm.calls), "heads_per_rank": shard.config.n_head}
    if check and rank == 0:
        out["one_process"] = generate_ids(loaded.model.to(device), ids, params)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="torchrun --nproc-per-node N -m minillm.parallel.generate",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", default="base", help="shipped checkpoint or preset (default base)")
    p.add_argument("--prompt", default="def main(", help="the prompt text")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: gloo; cuda: NCCL, one GPU per rank (GPU LOCAL_RANK)")
    p.add_argument("--check", action="store_true", help="also run the whole model on rank 0 and compare tokens")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.max_new_tokens < 1:
        raise SystemExit(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    device = "cpu"
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda needs a CUDA GPU; this machine has none (use --device cpu)")
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        torch.cuda.set_device(device)
    try:
        rank, world_size = init_rank(backend=backend_for(device))
    except ValueError as e:  # not launched by torchrun
        raise SystemExit(str(e)) from None
    try:
        out = generate_on_rank(rank, world_size, args.model, args.prompt, args.max_new_tokens, device, args.check)
        if rank == 0:
            per_forward = {op: n // args.max_new_tokens for op, n in out["collectives"].items()}  # one per token
            print(f"{world_size} ranks ({dist.get_backend()}), model {out['label']}, {out['heads_per_rank']} heads "
                  f"per rank, collectives per forward: {per_forward}")
            print(args.prompt + out["text"])
            if args.check:
                same = out["tokens"] == out["one_process"]
                print(f"same tokens as one process: {same}")
                return 0 if same else 1
        return 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    raise SystemExit(main())

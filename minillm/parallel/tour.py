"""Tour entry for chapter 14: tensor, sequence, pipeline and context parallelism on two gloo ranks, against one process.

Checks: the tensor-parallel shards' logits equal the model's (and PyTorch's `parallelize_module` plan equals the
hand-written shards), with exactly the collectives and bytes of the formula; the tensor-parallel engine gives the
one-process engine's greedy tokens; Megatron sequence parallelism gives the same logits and moves the same bytes;
GPipe's logits equal the model's (and `ScheduleGPipe`'s), its measured bubble is the formula's; pipelined decode
gives every sequence its own greedy tokens; ring attention equals full causal attention. Measured: collectives per
decoded token, the decode speed-up of 2 ranks over 1 (on this machine a slow-down: see the chapter), the bubble,
the throughput of two sequences in flight through two stages over one.

Every rank is a spawned process with one torch thread, on the CPU (gloo), whatever the tour's device.
"""

from __future__ import annotations

import torch

from minillm.bench.models import load_model
from minillm.core.attention import attention
from minillm.core.formats import model_to_bytes
from minillm.core.rows import Row, TourContext
from minillm.core.sampling import SamplingParams
from minillm.engine import LLM, EngineConfig
from minillm.kvcache.generate import generate_ids
from minillm.parallel.bench import run_all
from minillm.parallel.checks import parallel_suite
from minillm.parallel.group import run_ranks
from minillm.parallel.pipeline import bubble_fraction, measured_bubble
from minillm.parallel.tensor import all_reduce_bytes, collectives_per_forward, ring_traffic_per_rank

TITLE = "parallelism on two ranks"
WORLD = 2
BUBBLE_M = 4  # micro-batches of the bubble experiment


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def run(ctx: TourContext) -> list[Row]:
    loaded = load_model("base", "cpu", ctx.seed)
    model, label, tok = loaded.model, loaded.label, loaded.tokenizer
    cfg = model.config
    L, C, V = cfg.n_layer, cfg.n_embd, cfg.vocab_size
    g = torch.Generator().manual_seed(ctx.seed)
    idx = torch.randint(0, V, (2, 16), generator=g)  # (B, T): T divisible by the ranks (sequence parallelism)
    pp_idx = torch.randint(0, V, (4, 12), generator=g)  # 4 sequences: 2 micro-batches of 2; and 4 decodes
    T_ring = 128 if ctx.quick else 512
    qkv = tuple(torch.randn(1, cfg.n_head, T_ring, cfg.head_size, generator=g) for _ in range(3))
    results = run_ranks(parallel_suite, WORLD, model_to_bytes(model), idx, pp_idx, qkv, BUBBLE_M, 0.05)
    with torch.no_grad():
        want, want_pp = model(idx), model(pp_idx)
    rows, dev = [], "cpu"

    # tensor parallelism: logits, collectives, bytes, and PyTorch's own plan
    tp = [r["tp"] for r in results]
    lib = [r["library"] for r in results]
    diff = max(_max_diff(r["logits"], want) for r in tp)
    lib_diff = max(max(_max_diff(r["library"], want), _max_diff(r["library"], r["hand"])) for r in lib)
    formula = collectives_per_forward(L)
    counted = all(r["calls"] == formula and r["bytes"]["all_reduce"] == all_reduce_bytes(idx.numel(), C, L)
                  for r in tp)
    per_token = sum(formula.values())
    rows.append(Row("14", f"tensor parallel, world size {WORLD}", "one process (GPT.forward)",
                    "shard_model: column/row-parallel linears, vocabulary-parallel embedding and head",
                    f"logits max |diff| {diff:.1e} (tolerance 1e-4); PyTorch parallelize_module plan {lib_diff:.1e}; "
                    f"collectives and bytes per forward == formula (1 + 2L = {formula['all_reduce']} all-reduces "
                    f"+ 1 all-gather): {counted}; {label}", diff <= 1e-4 and lib_diff <= 1e-4 and counted,
                    "collectives per token", per_token, "", dev,
                    {"model": label, "formula": formula, "calls": tp[0]["calls"], "bytes": tp[0]["bytes"],
                     "heads_per_rank": tp[0]["n_head"]}))

    # the engine on two ranks, and the decode speed on this machine
    prompts = [tok.encode(t) for t in ("def main(", "The quick brown", "import os\nimport sys\n")]
    params = SamplingParams.greedy(8 if ctx.quick else 16, ignore_eos=True)
    here = [o.output_token_ids for o in LLM(model, tok, EngineConfig(num_blocks=64)).generate(prompts, params)]
    with LLM(model, tok, EngineConfig(num_blocks=64, tensor_parallel_size=WORLD)) as engine:
        there = [o.output_token_ids for o in engine.generate(prompts, params)]
    bench = run_all(model, "quick" if ctx.quick else "tour", ctx.seed, world_sizes=(1, WORLD))
    one, two = bench["rows"]
    lat = bench["latency"]
    rows.append(Row("14", f"tensor-parallel decode, {WORLD} ranks (gloo, loopback)", "1 rank, same loop",
                    f"LLM(EngineConfig(tensor_parallel_size={WORLD})) and shard_model decode",
                    f"engine tokens == one-process engine: {there == here}; decode tokens equal: "
                    f"{two['same_tokens']}; {one['decode_ms']:.1f} -> {two['decode_ms']:.1f} ms/token, "
                    f"{100 * two['comm_share']:.0f}% in collectives (one gloo all-reduce of {C * 4 / 1e3:.1f} KB: "
                    f"{lat['seconds'][C] * 1e6:.0f} us; a TCP round trip: {lat['tcp_round_trip_s'] * 1e6:.0f} us); "
                    f"{label}", there == here and two["same_tokens"], "speed-up", one["decode_ms"] / two["decode_ms"],
                    "x", dev, {"model": label, "bench": bench}))

    # sequence parallelism: same logits, the all-reduce's bytes
    sp = [r["sp"] for r in results]
    sp_diff = max(_max_diff(r["logits"], want) for r in sp)
    message = idx.numel() * C * 4
    moved = sp[0]["bytes"]["reduce_scatter_seq"] * (WORLD - 1) / WORLD + sp[0]["bytes"]["all_gather_seq"] * (WORLD - 1)
    ratio = moved / (ring_traffic_per_rank(message, WORLD) * (1 + 2 * L))
    rows.append(Row("14", f"sequence parallelism, world size {WORLD}", "tensor parallelism (all-reduce form)",
                    "Megatron-SP: reduce-scatter + all-gather along the sequence",
                    f"logits max |diff| {sp_diff:.1e}; ring bytes per rank {moved / 1e3:.0f} KB vs the all-reduces' "
                    f"{moved / ratio / 1e3:.0f} KB; {label}", sp_diff <= 1e-4 and abs(ratio - 1) < 1e-9,
                    "bytes vs all-reduce form", ratio, "x", dev, {"model": label, "calls": sp[0]["calls"]}))

    # pipeline: logits, the bubble, and sequences in flight
    pp_diff = _max_diff(results[-1]["pp"]["logits"], want_pp)
    lib_pp = _max_diff(results[-1]["pp_library"], want_pp)
    events = [e for r in results for e in r["bubble"]]
    measured, formula_b = measured_bubble(events, WORLD), bubble_fraction(WORLD, BUBBLE_M)
    rows.append(Row("14", f"pipeline bubble, {WORLD} stages, {BUBBLE_M} micro-batches (GPipe)",
                    "formula (p - 1) / (m + p - 1)", "run_gpipe, every step a fixed 50 ms of work",
                    f"GPipe logits max |diff| {pp_diff:.1e} (ScheduleGPipe {lib_pp:.1e}); measured idle "
                    f"{100 * measured:.1f}% vs formula {100 * formula_b:.1f}%",
                    pp_diff <= 1e-4 and lib_pp <= 1e-4 and abs(measured - formula_b) < 0.08, "bubble", 100 * measured,
                    "%", dev, {"formula": formula_b, "events": [vars(e) for e in events]}))
    want_tokens = [generate_ids(model, p, SamplingParams.greedy(6, ignore_eos=True)) for p in pp_idx.tolist()]
    same_pp = results[0]["pp_decode"]["tokens"] == want_tokens
    by = {(r["stages"], r["in_flight"]): r for r in bench["pipeline"]}
    single, full = by[(WORLD, 1)], by[(WORLD, WORLD)]
    rows.append(Row("14", f"pipelined decode, {WORLD} stages", "1 sequence in flight",
                    f"{WORLD} sequences in flight",
                    f"every sequence's greedy tokens == generate_ids: {same_pp}; {single['tok_s']:.0f} -> "
                    f"{full['tok_s']:.0f} tok/s overall while one sequence's ms/token goes {single['ms_per_token']:.1f}"
                    f" -> {full['ms_per_token']:.1f}; {label}", same_pp, "throughput", full["tok_s"] / single["tok_s"],
                    "x", dev, {"model": label, "pipeline": bench["pipeline"]}))

    # context parallelism: ring attention
    ring = torch.cat([r["ring"] for r in results], dim=2)
    ring_diff = _max_diff(ring, attention(*qkv, is_causal=True))
    rows.append(Row("14", f"ring attention, world size {WORLD}", "full causal attention (one process)",
                    "ring_attention: K/V blocks passed around the ranks, online-softmax merge",
                    f"{T_ring} tokens, {cfg.n_head} heads: max |diff| {ring_diff:.1e} (tolerance 1e-5); each rank "
                    f"holds {T_ring // WORLD} queries and 2 K/V blocks of {T_ring // WORLD}", ring_diff <= 1e-5,
                    "max |ring - full|", ring_diff, "", dev, {"T": T_ring}))
    return rows

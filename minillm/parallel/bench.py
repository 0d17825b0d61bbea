"""Chapter 14's benchmark: tensor-parallel decode and prefill against world size, communication split out.

Each world size t runs as t spawned ranks (gloo on loopback, one torch thread per rank), every rank the same greedy
loop of chapter 04 on its shard (SPMD: the gathered logits are identical on every rank, so every rank picks the
same token). Reported per t: ms per decoded token (the generation's time less its prefill, over its new_tokens - 1
decode steps; median of repeats after a warm-up), tokens/s, ms per prompt of `prompt_len` tokens, the share of the
generation's time inside collectives (`Comm.seconds`), collectives and bytes per token, and whether the tokens
equal the model's in this process. The same table computes, from the chapter's formulas, what the
collectives of one decoded token would cost on NVLink and on PCIe for this model and for GPT-2 124M. With
`--bubble-figure` it also runs GPipe's bubble experiment on 2 and 4 stages, draws the timelines and records the
measured idle share beside the formula's. `quotes(report)` turns a saved report into the tables and numbers chapter
14's text shows (`minillm.course.results`).

This is no interconnect benchmark: the ranks share one machine's cores and memory, and gloo moves each message
through loopback TCP. On a machine with fewer cores than ranks, ranks take turns, and more ranks cost time.

    python -m minillm.parallel.bench [--model base] [--world-sizes 1,2,4] [--quick] [--json FILE] [--bubble-figure PNG]
"""

from __future__ import annotations

import argparse
import multiprocessing
import socket
import statistics
import time
from typing import Any

import torch

from minillm.bench.cli import bench_parser, pick_size, start, write_report
from minillm.bench.models import load_model
from minillm.bench.tables import markdown_table
from minillm.core.config import (check_float, check_int, check_tensor_elements, GPTConfig, reads_report,
                                 short_repr)
from minillm.core.formats import model_from_bytes, model_to_bytes
from minillm.core.io import atomic_save_figure, check_output_file
from minillm.core.sampling import SamplingParams
from minillm.core.timing import check_repeats
from minillm.kvcache.generate import generate_ids
from minillm.parallel.checks import pp_bubble
from minillm.parallel.group import LOOPBACK, run_ranks
from minillm.parallel.pipeline import PipelineStage, bubble_fraction, measured_bubble, pipelined_decode
from minillm.parallel.plots import plot_timeline
from minillm.parallel.tensor import check_divisible, collectives_per_forward, ring_traffic_per_rank, shard_model

SIZES = {
    "quick": dict(new_tokens=16, prompt_len=64, repeats=3),  # the tests and --quick: seconds per world size
    "tour": dict(new_tokens=32, prompt_len=64, repeats=3),  # the tour's rows
    "full": dict(new_tokens=48, prompt_len=128, repeats=5),  # python -m minillm.parallel.bench
}
# The bubble experiment of --bubble-figure: m micro-batches, each step a sleep of known length instead of compute.
BUBBLE_M = 4
BUBBLE_WORK_S = 0.05

# Links, per direction, for the cost estimate (bytes/s). NVLink 4 on H100 SXM: 900 GB/s bidirectional (NVIDIA's
# H100 datasheet); PCIe 4.0 x16: 16 GT/s x 16 lanes with 128b/130b coding, about 31.5 GB/s (PCI-SIG).
LINKS = {"NVLink 4 (H100)": 450e9, "PCIe 4.0 x16": 31.5e9}
GPT2_124M = GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)


def rank_timing(rank: int, world_size: int, model_bytes: bytes, prompt: list[int], new_tokens: int,
                repeats: int) -> dict[str, Any]:
    """One rank's measurements (module-level: `run_ranks` imports it in each spawned rank)."""
    shard = shard_model(model_from_bytes(model_bytes), rank, world_size)
    params = SamplingParams.greedy(new_tokens, ignore_eos=True)
    idx = torch.tensor([prompt])
    tokens = generate_ids(shard, prompt, params)  # warm-up, and the tokens to compare
    decode, prefill, comm_share = [], [], []
    for _ in range(repeats):
        start = time.perf_counter()
        with torch.no_grad():
            shard.logits(shard.hidden(idx, torch.arange(len(prompt)))[:, -1])
        prefill.append(time.perf_counter() - start)
        shard.comm.reset()
        start = time.perf_counter()
        generate_ids(shard, prompt, params)
        elapsed = time.perf_counter() - start
        # the generation is one prefill and new_tokens - 1 decode steps: the decode share, per token
        decode.append(max(elapsed - prefill[-1], 0.0) / (new_tokens - 1))
        comm_share.append(shard.comm.seconds / elapsed)
    shard.comm.reset()
    with torch.no_grad():  # one decode-sized forward, to count what one token sends
        shard.logits(shard.hidden(idx[:, :1], torch.arange(1)))
    return {"tokens": tokens, "decode_s": statistics.median(decode), "prefill_s": statistics.median(prefill),
            "comm_share": statistics.median(comm_share), "calls": dict(shard.comm.calls),
            "bytes": dict(shard.comm.bytes)}


def rank_collective_latency(rank: int, world_size: int, sizes: list[int], repeats: int) -> dict[int, float]:
    """Median seconds of one all-reduce of n float32 values, for each n in `sizes` (module-level for
    `run_ranks`): the fixed cost per collective that decode pays 1 + 2 L times per token."""
    import torch.distributed as dist

    out = {}
    for n in sizes:
        x = torch.ones(n)
        for _ in range(3):  # warm-up: the first calls set up gloo's connections
            dist.all_reduce(x)
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - start)
        out[n] = statistics.median(times)
    return out


def _echo(port: int, n_bytes: int, count: int) -> None:
    """The far end of `tcp_round_trip`: read n_bytes, send them back, `count` times (module-level for spawn)."""
    with socket.create_connection((LOOPBACK, port)) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(count):
            conn.sendall(_recv_exactly(conn, n_bytes))


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the echo process closed the connection")
        buf += chunk
    return bytes(buf)


def tcp_round_trip(n_bytes: int, repeats: int = 200) -> float:
    """Median seconds for n_bytes to go to another process over loopback TCP and back, with plain sockets: what
    the operating system charges, to set beside a gloo collective of the same bytes."""
    n_bytes, repeats = check_int("n_bytes", n_bytes), check_repeats("repeats", repeats)
    check_tensor_elements("n_bytes", (n_bytes,))  # one message buffer
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind((LOOPBACK, 0))
        server.listen(1)
        server.settimeout(60)
        echo = multiprocessing.get_context("spawn").Process(target=_echo, args=(server.getsockname()[1], n_bytes,
                                                                                 repeats + 10), daemon=True)
        echo.start()
        try:
            conn, _ = server.accept()
            with conn:
                conn.settimeout(60)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                msg, times = b"x" * n_bytes, []
                for i in range(repeats + 10):
                    start = time.perf_counter()
                    conn.sendall(msg)
                    _recv_exactly(conn, n_bytes)
                    if i >= 10:  # the first round trips warm up
                        times.append(time.perf_counter() - start)
        finally:
            echo.join(timeout=10)
            if echo.is_alive():
                echo.kill()
    return statistics.median(times)


def rank_pipeline(rank: int, world_size: int, model_bytes: bytes, prompts: list[list[int]], new_tokens: int
                  ) -> dict[str, Any]:
    """One stage of the pipelined decode (module-level for `run_ranks`): a warm-up, then one timed run."""
    stage = PipelineStage(model_from_bytes(model_bytes), rank, world_size)
    pipelined_decode(stage, prompts, 2)
    start = time.perf_counter()
    tokens, _ = pipelined_decode(stage, prompts, new_tokens)
    return {"seconds": time.perf_counter() - start, "tokens": tokens}


def pipeline_rows(model, prompt: list[int], new_tokens: int, stages: int) -> list[dict[str, Any]]:
    """Decode with 1 stage, then `stages` stages with 1 and with `stages` sequences in flight: tokens/s overall and
    ms per token of one sequence (the latency), from rank 0's wall time."""
    data = model_to_bytes(model)
    rows = []
    for p, in_flight in ((1, 1), (1, stages), (stages, 1), (stages, stages)):
        prompts = [prompt] * in_flight
        r0 = run_ranks(rank_pipeline, p, data, prompts, new_tokens)[0]
        rows.append({"stages": p, "in_flight": in_flight, "tok_s": in_flight * new_tokens / r0["seconds"],
                     "ms_per_token": r0["seconds"] / new_tokens * 1e3})
    return rows


def link_estimate(config: GPTConfig, t: int, element_bytes: int = 2) -> dict[str, float]:
    """Microseconds of link time per decoded token (bandwidth term only) for t ranks: (1 + 2L) all-reduces of
    C values, ring traffic 2 (t - 1) / t of each, plus the head's all-gather of V/t values from each rank."""
    if not isinstance(config, GPTConfig):
        raise TypeError(f"config must be a GPTConfig, got {type(config).__name__}")
    t = check_int("t", t)
    element_bytes = check_int("element_bytes", element_bytes)
    if element_bytes not in (1, 2, 4, 8):
        raise ValueError(f"element_bytes must be a dtype's size in bytes (1, 2, 4 or 8), got "
                         f"{short_repr(element_bytes)}")
    message = config.n_embd * element_bytes
    reduce_bytes = (1 + 2 * config.n_layer) * ring_traffic_per_rank(message, t)
    gather_bytes = (t - 1) * config.vocab_size // t * element_bytes
    return {name: (reduce_bytes + gather_bytes) / bw * 1e6 for name, bw in LINKS.items()}


def run_all(model, size: str = "full", seed: int = 0, world_sizes: tuple[int, ...] = (1, 2, 4)) -> dict[str, Any]:
    sizes = pick_size(SIZES, size)
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, model.config.vocab_size, (sizes["prompt_len"],), generator=g).tolist()
    data = model_to_bytes(model)
    rows = []
    reference = generate_ids(model, prompt, SamplingParams.greedy(sizes["new_tokens"], ignore_eos=True))  # 1 process
    for t in world_sizes:
        results = run_ranks(rank_timing, t, data, prompt, sizes["new_tokens"], sizes["repeats"])
        r0 = results[0]
        rows.append({"world_size": t, "decode_ms": r0["decode_s"] * 1e3, "tok_s": 1 / r0["decode_s"],
                     "prefill_ms": r0["prefill_s"] * 1e3, "comm_share": r0["comm_share"],
                     "collectives_per_token": r0["calls"], "bytes_per_token": r0["bytes"],
                     "same_tokens": all(r["tokens"] == reference for r in results),
                     "formula": collectives_per_forward(model.config.n_layer)})
    pipeline = pipeline_rows(model, prompt, sizes["new_tokens"], 2) if model.config.n_layer >= 2 else []
    latency = {}
    if max(world_sizes) > 1:  # what one gloo all-reduce costs here, for a decode-sized and a prefill-sized message
        t = 2 if 2 in world_sizes else max(world_sizes)
        C = model.config.n_embd
        latency = {"world_size": t, "seconds": run_ranks(rank_collective_latency, t, [C, sizes["prompt_len"] * C],
                                                         20)[0], "tcp_round_trip_s": tcp_round_trip(4 * C)}
    return {"model": model.config.to_dict(), "sizes": sizes, "rows": rows, "pipeline": pipeline, "latency": latency,
            "links": {name: {t: link_estimate(model.config, t)[name] for t in (2, 4, 8)} for name in LINKS},
            "links_gpt2_124m": {name: {t: link_estimate(GPT2_124M, t)[name] for t in (2, 4, 8)} for name in LINKS},
            "published": "gpt-fast, Llama-2-7B on A100s: 104.9 / 168.8 / 254.0 / 328.4 tok/s at TP 1 / 2 / 4 / 8"}


@reads_report
def decode_table(report: dict[str, Any]) -> str:
    """The decode rows as a Markdown table: per world size, ms per decoded token, tokens/s, the speed-up over the
    first world size, the prompt's prefill, the share of time in collectives, all-reduces per token (and the
    formula's), and whether every rank's tokens equal the model's in one process."""
    prompt_len = report["sizes"]["prompt_len"]
    base = report["rows"][0]["decode_ms"]
    rows = [[str(r["world_size"]), f"{r['decode_ms']:.2f}", f"{r['tok_s']:.0f}", f"{base / r['decode_ms']:.2f}x",
             f"{r['prefill_ms']:.1f}", f"{100 * r['comm_share']:.0f}%",
             f"{r['collectives_per_token'].get('all_reduce', 0)} (formula {r['formula']['all_reduce']})",
             "yes" if r["same_tokens"] else "NO"] for r in report["rows"]]
    return markdown_table(["ranks", "ms/token", "tok/s", "speed-up", f"prefill ms ({prompt_len} tokens)",
                           "time in collectives", "all-reduces/token", "same tokens"], rows, "l" * 8)


@reads_report
def pipeline_table(report: dict[str, Any]) -> str:
    """The pipelined decode rows (`pipeline_rows`) as a Markdown table."""
    return markdown_table(["stages", "sequences in flight", "tokens/s (all)", "ms per token of one sequence"],
                          [[str(r["stages"]), str(r["in_flight"]), f"{r['tok_s']:.0f}", f"{r['ms_per_token']:.1f}"]
                           for r in report.get("pipeline", [])], "llll")


@reads_report
def links_table(report: dict[str, Any]) -> str:
    """The link-time estimates of the report (`link_estimate`, microseconds per decoded token) as a Markdown table,
    one row per model and link, one column per world size. (Read back from JSON, the world sizes are strings.)"""
    by_t = next(iter(report["links"].values()))
    this = f"`{report['model_label']}`" if "model_label" in report else "this model"
    rows = [[label, name, *(f"{v:.3f} µs" for v in us.values())]
            for label, links in ((this, report["links"]), ("GPT-2 124M", report["links_gpt2_124m"]))
            for name, us in links.items()]
    return markdown_table(["model", "link", *(f"t = {t}" for t in by_t)], rows, "l" * (len(by_t) + 2))


def _latency_us(report: dict[str, Any]) -> list[tuple[int, float]]:
    """(message bytes, microseconds) of each all-reduce size timed, smallest first (JSON keys are strings)."""
    return sorted((4 * int(n), s * 1e6) for n, s in report["latency"]["seconds"].items())


@reads_report
def format_table(report: dict[str, Any]) -> str:
    lines = [decode_table(report), "pipeline parallelism, greedy decode (every sequence its own batch of 1):",
             pipeline_table(report)]
    if report.get("latency"):
        lat = report["latency"]
        lines += [f"one gloo all-reduce on loopback, {lat['world_size']} ranks (median of 20): " + ", ".join(
            f"{n / 1e3:.1f} KB: {us:.0f} us" for n, us in _latency_us(report)),
                  f"a plain TCP round trip of the decode-sized message between two processes: "
                  f"{lat['tcp_round_trip_s'] * 1e6:.0f} us", ""]
    if report.get("bubble"):
        b = report["bubble"]
        lines += [f"GPipe bubble, {b['micro_batches']} micro-batches of {b['work_s'] * 1e3:.0f} ms each: " + ", ".join(
            f"p={p}: {100 * f:.1f}% idle (formula {100 * b['formula'][p]:.1f}%)" for p, f in b["measured"].items()),
                  ""]
    lines += ["link time per decoded token, bandwidth term only, fp16 messages:", links_table(report),
              f"published: {report['published']}"]
    return "\n".join(lines)


def _times(x: float) -> str:
    return f"{x:.2f}x"


@reads_report
def quotes(report: dict[str, Any]) -> dict[str, str]:
    """What chapter 14's text quotes from a full run's report (`minillm.course.results`): the tables "decode",
    "pipeline" and "links", and single values: the machine ("cpu", "date"); per world size t of the decode rows
    "speedup_t" (the first world size's ms/token over t's), "slowdown_t" (its inverse), "comm_share_t",
    "decode_ms_t" and "collective_us_t" (the time in collectives per decoded token over the collectives of one
    token: roughly what each cost inside the generation); one all-reduce's time at the smallest (decode) and
    largest (prefill) message ("allreduce_decode", "allreduce_prefill", with their sizes "..._kb") and the TCP
    round trip of the decode message ("tcp_round_trip"); the pipelined decode's rows as "pp_tok_s_S_F" and
    "pp_ms_S_F" (S stages, F sequences in flight) and the throughput gain of F = S over F = 1 on S stages
    ("pp_gain"); and with the bubble experiment, "bubble_p" and "bubble_formula_p" per number of stages p."""
    out = {"decode": decode_table(report), "pipeline": pipeline_table(report), "links": links_table(report),
           "cpu": report["cpu"], "date": report["date"]}
    base = report["rows"][0]["decode_ms"]
    for r in report["rows"]:
        t = r["world_size"]
        out[f"speedup_{t}"] = _times(base / r["decode_ms"])
        out[f"slowdown_{t}"] = f"{r['decode_ms'] / base:.1f}"
        out[f"comm_share_{t}"] = f"{100 * r['comm_share']:.0f}%"
        out[f"decode_ms_{t}"] = f"{r['decode_ms']:.2f}"
        calls = sum(r["collectives_per_token"].values())
        if calls:  # the time in collectives per decoded token, spread over its collectives
            out[f"collective_us_{t}"] = f"{r['comm_share'] * r['decode_ms'] * 1e3 / calls:.0f} µs"
    if report.get("latency"):
        (small, small_us), *_, (large, large_us) = _latency_us(report)
        out |= {"allreduce_decode": f"{small_us:.0f} µs", "allreduce_decode_kb": f"{small / 1e3:.1f} KB",
                "allreduce_prefill": f"{large_us:.0f} µs", "allreduce_prefill_kb": f"{large / 1e3:.0f} KB",
                "tcp_round_trip": f"{report['latency']['tcp_round_trip_s'] * 1e6:.0f} µs"}
    rows = {(r["stages"], r["in_flight"]): r for r in report.get("pipeline", [])}
    for (s, f), r in rows.items():
        out[f"pp_tok_s_{s}_{f}"] = f"{r['tok_s']:.0f}"
        out[f"pp_ms_{s}_{f}"] = f"{r['ms_per_token']:.1f}"
    if rows:
        stages = max(s for s, _ in rows)
        out["pp_gain"] = _times(rows[stages, stages]["tok_s"] / rows[stages, 1]["tok_s"])
    for p, f in (report.get("bubble") or {}).get("measured", {}).items():
        out[f"bubble_p{p}"] = f"{100 * f:.1f}%"
        out[f"bubble_formula_p{p}"] = f"{100 * report['bubble']['formula'][p]:.1f}%"
    return out


def bubble_figure(path: str, stages: tuple[int, ...] = (2, 4), m: int = BUBBLE_M,
                  work_s: float = BUBBLE_WORK_S) -> dict[int, float]:
    """Run the bubble experiment (every step `work_s` of known work, m micro-batches) for each number of stages,
    draw the timelines one above the other into `path` (PNG, written atomically); the measured bubble per p. Every
    argument is checked before the ranks start (a bad path named after a minute of runs would lose them)."""
    if path is None:
        raise TypeError("path must be the PNG file to write, got None")
    check_output_file(path, "path", (".png",))
    if not isinstance(stages, tuple) or not stages:
        raise TypeError(f"stages must be a non-empty tuple of stage counts, got {short_repr(stages)}")
    stages = tuple(check_int(f"stages[{i}]", p, 2) for i, p in enumerate(stages))
    m = check_int("m", m)
    work_s = check_float("work_s", work_s, 0.0, 10.0, include_minimum=False)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(stages), 1, figsize=(9, 2.3 * len(stages)), squeeze=False)
    measured = {}
    for ax, p in zip(axes[:, 0], stages):
        events = [e for rank_events in run_ranks(pp_bubble, p, m, work_s) for e in rank_events]
        plot_timeline(events, m=m, ax=ax)
        measured[p] = measured_bubble(events, p)
    fig.tight_layout()
    atomic_save_figure(fig, path, dpi=110)
    plt.close(fig)
    return measured


def build_parser() -> argparse.ArgumentParser:
    """The kit's shared options (`minillm.bench.cli`; ranks run on the CPU here) and this benchmark's own."""
    p = bench_parser("python -m minillm.parallel.bench", __doc__.split("\n")[0], sizes=SIZES,
                     quick_help="16 tokens after a 64-token prompt, 3 repeats", devices=("cpu",))
    p.add_argument("--model", default="base", help="shipped checkpoint or preset (default base)")
    p.add_argument("--world-sizes", default="1,2,4", help="comma-separated numbers of ranks (default 1,2,4)")
    p.add_argument("--bubble-figure", metavar="PNG", default=None,
                   help="also draw the GPipe timelines of 2 and 4 stages (50 ms of known work per step) into PNG")
    return p


def main(argv: list[str] | None = None) -> int:
    args = start(build_parser(), argv)
    try:
        world_sizes = tuple(int(x) for x in args.world_sizes.split(","))
    except ValueError:
        raise SystemExit(f"--world-sizes must be comma-separated ints, got {args.world_sizes!r}") from None
    figure = check_output_file(args.bubble_figure, "--bubble-figure", (".png",))
    if any(t < 1 for t in world_sizes):
        raise SystemExit(f"--world-sizes must be positive ints, got {args.world_sizes!r}")
    try:
        loaded = load_model(args.model, seed=args.seed)
        for t in world_sizes:  # before any rank starts: a size the model cannot be split into
            check_divisible(loaded.model.config, t)
    except ValueError as e:
        raise SystemExit(f"python -m minillm.parallel.bench: {e}") from None
    start_s = time.perf_counter()
    report = run_all(loaded.model, args.size, args.seed, world_sizes)
    report["model_label"] = loaded.label
    if figure is not None:
        measured = bubble_figure(str(figure), m=BUBBLE_M, work_s=BUBBLE_WORK_S)
        report["bubble"] = {"micro_batches": BUBBLE_M, "work_s": BUBBLE_WORK_S, "measured": measured,
                            "formula": {p: bubble_fraction(p, BUBBLE_M) for p in measured}, "figure": str(figure)}
    report["wall_s"] = time.perf_counter() - start_s
    print(f"model {loaded.label}; one torch thread per rank; gloo on loopback")
    print(format_table(report))
    if figure is not None:
        print(f"bubble figure written to {figure}")
    write_report(args.json, report)
    return 0 if all(r["same_tokens"] for r in report["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())

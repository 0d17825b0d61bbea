"""Tour entry for chapter 07: disaggregated prefill and decode against the colocated engine of chapter 06.

One prefill-heavy online workload (long prompts arriving while earlier requests decode) is served three ways:
colocated without chunking, colocated with chunked prefill, and disaggregated (two worker processes). Checks:
the three produce identical greedy tokens, and every KV hand-off carries exactly 2·L·nh·hs·T·bytes. Measured:
decode ITL p99, TTFT, and the transfer (bytes, milliseconds).
"""

from __future__ import annotations

import math

import torch

from minillm.bench.models import load_model
from minillm.bench.workload import workload
from minillm.core.rows import Row, TourContext
from minillm.disagg.bench import check_results, run_policies

TITLE = "disaggregated prefill and decode"


def run(ctx: TourContext) -> list[Row]:
    n, rate, plen, olen = (6, 4.0, "uniform:96:128", 12) if ctx.quick else (12, 3.0, "uniform:160:224", 24)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core per engine: the colocated engine and each worker get the same share
    try:
        loaded = load_model("base", ctx.device, ctx.seed)
        model, name, V = loaded.model, loaded.label, loaded.model.config.vocab_size
        work = workload("prefill-heavy", n, ctx.seed, rate, V, prompt_len=plen, output_len=olen)
        warm = workload("prefill-heavy", 2, ctx.seed + 1, math.inf, V, prompt_len=plen, output_len=4)
        res = run_policies(model, work, warmup=warm, block_size=16, num_blocks=256, max_num_seqs=16,
                           chunk=64, device=str(ctx.device))
    finally:
        torch.set_num_threads(threads)
    dis = res["disaggregated"]
    check = check_results(res, work, model.config)
    same, exact = check["identical"], check["exact_transfers"]
    s_co, s_ch, s_dis = (res[p].summary() for p in ("colocated", "chunked", "disaggregated"))
    dev = str(ctx.device)
    details = {"model": name, "workload": dict(n=n, rate=rate, prompt_len=plen, output_len=olen),
               "colocated": s_co, "chunked": s_ch, "disaggregated": s_dis, "torch_threads_per_engine": 1}
    ms = lambda x: f"{x:.0f} ms"  # noqa: E731
    return [
        Row("07", "disaggregated prefill/decode (2 processes)", "colocated LLM (ch06)", "DisaggregatedLLM",
            f"identical greedy ids, {same}/{n} (colocated = chunked = disaggregated)", same == n,
            "decode ITL p99 colocated/disagg", s_co["itl_p99_ms"] / s_dis["itl_p99_ms"], "x", dev,
            {**details, "itl_p99_ms": {"colocated": s_co["itl_p99_ms"], "chunked": s_ch["itl_p99_ms"],
                                       "disaggregated": s_dis["itl_p99_ms"]}}),
        Row("07", "KV hand-off prefill -> decode", "KV formula 2*L*nh*hs*T*4 B", "pack_kv bytes on the pipe",
            f"bytes == formula, {exact}/{len(dis.transfers)} hand-offs; "
            f"{s_dis['kv_bytes_per_request'] / 1e6:.2f} MB/request", exact == len(dis.transfers) == n,
            "transfer p50", s_dis["transfer_p50_ms"], "ms", dev, details),
        Row("07", "chunked prefill (Sarathi) for comparison", "colocated, unchunked", "colocated, chunk 64",
            f"ITL p99 {ms(s_co['itl_p99_ms'])} -> {ms(s_ch['itl_p99_ms'])}", same == n,
            "decode ITL p99 colocated/chunked", s_co["itl_p99_ms"] / s_ch["itl_p99_ms"], "x", dev, details),
        Row("07", "TTFT under disaggregation", "colocated LLM (ch06)", "DisaggregatedLLM",
            f"TTFT p50 {ms(s_co['ttft_p50_ms'])} colocated, {ms(s_ch['ttft_p50_ms'])} chunked, "
            f"{ms(s_dis['ttft_p50_ms'])} disaggregated", same == n,
            "TTFT p99 colocated/disagg", s_co["ttft_p99_ms"] / s_dis["ttft_p99_ms"], "x", dev, details),
    ]

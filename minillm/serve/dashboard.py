"""A live view of the engine at `/dashboard`: one static page (no build step) polling `/dashboard/state`.

What it shows, refreshed every half second: the requests running, waiting and swapped; the KV block pool as a grid,
one cell per block coloured by the request holding it (chapter 05's picture, live), blocks shared by several
sequences outlined, free blocks that still hold a cached prefix shaded; tokens per second; requests by outcome; and
the TTFT, ITL and E2E histograms. Every number on it comes from the same registry `/metrics` renders, so the two
always agree (a browser test checks it).
"""

from __future__ import annotations

from typing import Any

from minillm.serve.metrics import OUTCOMES, parse_metrics


def _histogram(values: dict[str, float], name: str) -> dict[str, Any]:
    """Bucket upper bounds, cumulative counts, count and sum of histogram `name`, from parsed /metrics values."""
    prefix = f'{name}_bucket{{le="'
    buckets = [(key[len(prefix):-2], int(v)) for key, v in values.items() if key.startswith(prefix)]
    return {"le": [le for le, _ in buckets], "cumulative": [c for _, c in buckets],
            "count": int(values[f"{name}_count"]), "sum": values[f"{name}_sum"]}


def dashboard_state(server: Any) -> dict[str, Any]:
    """The JSON the page polls: the engine's last snapshot, the admission queue and the metrics."""
    if not all(hasattr(server, a) for a in ("engine", "metrics", "options", "status")):  # app imports this module
        raise TypeError(f"server must be a minillm serve.app.Server, got {type(server).__name__}")
    snap = server.engine.snapshot
    values = parse_metrics(server.metrics.render().decode())  # the very numbers /metrics shows
    return {
        "status": "failed" if server.engine.error is not None else server.status,
        "model": server.options.model_name,
        "time": snap.time,
        "running": snap.running, "waiting": snap.waiting, "swapped": snap.swapped,
        "queued_requests": server.engine.queued_requests, "queued_tokens": server.engine.queued_tokens,
        "num_blocks": snap.num_blocks, "num_free_blocks": snap.num_free_blocks,
        "blocks": snap.owners, "shared": snap.shared, "cached": snap.cached,
        "num_steps": snap.num_steps, "num_preemptions": snap.num_preemptions,
        "prefix_cache_hits": snap.prefix_cache_hits,
        "requests": {o: values[f'minillm_requests_total{{outcome="{o}"}}'] for o in OUTCOMES},
        "prompt_tokens": values["minillm_prompt_tokens_total"],
        "generation_tokens": values["minillm_generation_tokens_total"],
        "ttft": _histogram(values, "minillm_time_to_first_token_seconds"),
        "itl": _histogram(values, "minillm_inter_token_latency_seconds"),
        "e2e": _histogram(values, "minillm_e2e_request_latency_seconds"),
    }


DASHBOARD_HTML = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>minillm engine</title>
<link rel="icon" href="data:,">
<style>
 body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
 h1 { font-size: 1.3em; margin: 0 0 .4em; }
 .cards { display: flex; gap: 1em; flex-wrap: wrap; margin-bottom: 1em; }
 .card { border: 1px solid #ccc; border-radius: 6px; padding: .5em .9em; min-width: 7em; }
 .card b { display: block; font-size: 1.6em; }
 #pool { display: grid; grid-template-columns: repeat(32, 16px); gap: 2px; margin: .5em 0 1em; }
 #pool div { width: 16px; height: 16px; background: #eee; box-sizing: border-box; }
 #pool div.shared { border: 2px solid #000; }
 #pool div.cached { background: repeating-linear-gradient(45deg, #ddd, #ddd 3px, #fff 3px, #fff 6px); }
 .hists { display: flex; gap: 2em; flex-wrap: wrap; }
 .hist { display: flex; align-items: flex-end; height: 90px; gap: 1px; border-bottom: 1px solid #999; }
 .hist div { width: 9px; background: #4a7bd0; }
 .axis { display: flex; justify-content: space-between; font-size: .75em; color: #666; }
 table { border-collapse: collapse; } td { padding: 0 .8em 0 0; }
 small { color: #666; }
</style></head>
<body>
<h1>minillm engine <small id="model"></small> <small id="status"></small></h1>
<div class="cards">
 <div class="card">running<b id="running">-</b></div>
 <div class="card">waiting<b id="waiting">-</b></div>
 <div class="card">swapped<b id="swapped">-</b></div>
 <div class="card">KV blocks used<b id="used">-</b></div>
 <div class="card">tokens/s<b id="tps">-</b></div>
 <div class="card">generated tokens<b id="gen">-</b></div>
 <div class="card">prefix-cache hits<b id="hits">-</b></div>
</div>
<div>KV block pool <small>(one cell per block, coloured by the request holding it; outlined: shared;
 striped: free but holding a cached prefix)</small></div>
<div id="pool"></div>
<div class="hists">
 <div><div>TTFT <small id="ttft-mean"></small></div><div class="hist" id="ttft"></div>
  <div class="axis" id="ttft-axis"></div></div>
 <div><div>ITL <small id="itl-mean"></small></div><div class="hist" id="itl"></div>
  <div class="axis" id="itl-axis"></div></div>
 <div><div>E2E <small id="e2e-mean"></small></div><div class="hist" id="e2e"></div>
  <div class="axis" id="e2e-axis"></div></div>
 <div><div>requests by outcome</div><table id="outcomes"></table></div>
</div>
<script>
let last = null;
function colour(owner) {
  // Consecutive requests (req-0, req-1, ...) a golden angle apart on the colour wheel, so neighbours never look
  // alike (a plain string hash put req-0, req-3 and req-6 within 6 degrees of each other); other names hashed.
  const m = /(\\d+)(?:\\.(\\d+))?/.exec(owner);
  let h = 0;
  if (m) h = Number(m[1]) * 137.508 + Number(m[2] || 0) * 29;
  else for (const c of owner) h = (Math.imul(h ^ c.charCodeAt(0), 16777619) >>> 0);
  return `hsl(${Math.round(h % 360)}, 65%, ${m && Number(m[1]) % 2 ? 45 : 60}%)`;
}
function drawHist(id, h) {
  const el = document.getElementById(id);
  const per = h.cumulative.map((c, i) => c - (i ? h.cumulative[i - 1] : 0));
  const top = Math.max(1, ...per);
  el.innerHTML = per.map((c, i) =>
    `<div title="le ${h.le[i]}: ${c}" style="height:${Math.round(88 * c / top)}px"></div>`).join("");
  document.getElementById(id + "-mean").textContent =
    h.count ? `mean ${(1000 * h.sum / h.count).toFixed(1)} ms, n=${h.count}` : "";
  const secs = le => Number(le) < 1 ? `${+(1000 * le).toFixed(1)} ms` : `${+le} s`;  // bucket bounds, log-spaced
  if (h.le.length > 1)
    document.getElementById(id + "-axis").innerHTML =
      `<span>${secs(h.le[0])}</span><span>${secs(h.le.at(-2))}+</span>`;
}
async function refresh() {
  try {
    // "state" beside this page: /dashboard/state (a bare relative "state" would resolve to /state)
    const r = await fetch(location.pathname.replace(/[/]+$/, "") + "/state", {cache: "no-store"});
    if (!r.ok) throw new Error(`state: HTTP ${r.status}`);
    const s = await r.json();
    for (const k of ["running", "waiting", "swapped"]) document.getElementById(k).textContent = s[k];
    document.getElementById("model").textContent = s.model;
    document.getElementById("status").textContent = s.status;
    document.getElementById("used").textContent = `${s.num_blocks - s.num_free_blocks}/${s.num_blocks}`;
    document.getElementById("gen").textContent = s.generation_tokens;
    document.getElementById("hits").textContent = s.prefix_cache_hits;
    const now = performance.now();
    if (last) {
      const tps = (s.generation_tokens - last.tokens) / ((now - last.t) / 1000);
      document.getElementById("tps").textContent = tps.toFixed(0);
    }
    last = {tokens: s.generation_tokens, t: now};
    const pool = document.getElementById("pool");
    if (pool.children.length !== s.blocks.length)
      pool.innerHTML = s.blocks.map(() => "<div></div>").join("");
    s.blocks.forEach((owner, i) => {
      const cell = pool.children[i];
      cell.className = (s.shared[i] ? "shared " : "") + (s.cached[i] ? "cached" : "");
      cell.style.background = owner ? colour(owner) : "";
      cell.title = owner ? `block ${i}: ${owner}` : `block ${i}: free`;
      cell.dataset.owner = owner || "";
    });
    for (const h of ["ttft", "itl", "e2e"]) drawHist(h, s[h]);
    document.getElementById("outcomes").innerHTML = Object.entries(s.requests)
      .map(([k, v]) => `<tr><td>${k}</td><td id="outcome-${k}">${v}</td></tr>`).join("");
    document.body.dataset.updated = String(Date.now());
  } catch (e) { document.getElementById("status").textContent = "unreachable"; console.error(e); }
}
// One poll at a time, the next 0.5 s after the last one ends: a slow answer never lands after a newer one.
(async function poll() { await refresh(); setTimeout(poll, 500); })();
</script>
</body></html>
"""

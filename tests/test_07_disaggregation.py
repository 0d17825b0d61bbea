"""Chapter 07: disaggregated prefill and decode.

In-process (graded, no subprocess): the KV hand-off pack/unpack against the KV the model computed, the payload's
exact byte count, the decode side's admission, and a prefill core handing off to a decode core in one process.
Across processes (one shared engine, plus one per failure test): identical outputs to the colocated engine and to
the naive loop, bytes sent == the formula per request, stop strings, bad input, a worker killed mid-run failing its
requests with a clear error, and no process left behind.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from helpers import context_model
from minillm import GPT, GPTConfig
from minillm.disagg import (
    DisaggConfig,
    DisaggregatedLLM,
    KVHeader,
    WorkerDiedError,
    admit_handoffs,
    kv_bytes,
    pack_kv,
    payload_from_bytes,
    payload_to_bytes,
    unpack_kv,
)
from minillm.core.formats import model_from_bytes, model_to_bytes
from minillm.disagg.decode_worker import DecodeCore
from minillm.disagg.messages import DecodeTokens, FirstTokens, KVHandoff, PrefillRequest, WorkerInit
from minillm.disagg.prefill_worker import PrefillCore
from minillm.naive.generate import generate_naive_ids
from minillm.paged import BlockManager, PagedBatch, PagedKVCache
from minillm.core.sampling import SamplingParams

BS = 4  # block size: small, so prompts span several blocks and end in a partly filled one


def tiny_model(seed: int = 0, vocab_size: int = 512) -> GPT:
    # context-sensitive (tests/helpers.py): a hand-off that loses or misplaces K/V changes the tokens
    return context_model("tiny", seed=seed, vocab_size=vocab_size)


class RecordingCache:
    """A contiguous reference cache for one sequence: keeps each layer's K and V as the model produced them."""

    def __init__(self):
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def attend(self, layer_idx, q, k, v):
        self.k[layer_idx], self.v[layer_idx] = k, v  # (1, nh, T, hs)
        T = q.shape[2]
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def paged_prefill(model: GPT, prompt: list[int], num_blocks: int = 16, skip: int = 0):
    """Run `prompt` into a fresh paged pool (after `skip` dummy blocks, so the table is not 0, 1, 2...)."""
    bm = BlockManager(num_blocks, BS)
    cache = PagedKVCache(model.config, num_blocks, BS, dtype=next(model.parameters()).dtype)
    if skip:
        bm.allocate("dummy", [0] * (skip * BS))
    bm.allocate("r", prompt)
    pb = PagedBatch.build(bm, [("r", 0, len(prompt))])
    cache.set_batch(pb)
    with torch.no_grad():
        model(torch.tensor([prompt]), pb.positions(), cache=cache)
    return bm, cache


# ------------------------------------------------------------------------------------------ graded, in-process


@pytest.mark.graded(points=2, exercise="pack_kv")
def test_pack_kv_equals_the_models_kv():
    model = tiny_model()
    prompt = [5, 17, 99, 3, 250, 42, 7]  # 7 tokens: two blocks of 4, the second one 3/4 full
    bm, cache = paged_prefill(model, prompt, skip=3)
    payload = pack_kv(cache.k_pools, cache.v_pools, bm.block_table("r"), len(prompt))
    ref = RecordingCache()
    with torch.no_grad():
        model(torch.tensor([prompt]), cache=ref)
    L, nh, hs = model.config.n_layer, model.config.n_head, model.config.head_size
    assert payload.shape == (L, 2, len(prompt), nh, hs)
    for layer in range(L):
        torch.testing.assert_close(payload[layer, 0], ref.k[layer][0].transpose(0, 1), atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(payload[layer, 1], ref.v[layer][0].transpose(0, 1), atol=1e-6, rtol=1e-5)


@pytest.mark.graded(points=2, exercise="pack_kv")
def test_pack_kv_worked_example():
    # bs=4, block_table=[7, 2], T=6: tokens 0..3 from block 7, tokens 4..5 from slots 0..1 of block 2.
    nb, nh, hs = 8, 1, 1
    k = torch.arange(nb * BS, dtype=torch.float32).view(nb, BS, nh, hs)  # slot s holds the value s
    v = -k
    payload = pack_kv([k], [v], [7, 2], 6)
    expected = torch.tensor([28.0, 29, 30, 31, 8, 9])
    assert torch.equal(payload[0, 0].flatten(), expected)
    assert torch.equal(payload[0, 1].flatten(), -expected)


@pytest.mark.graded(points=3, exercise=("unpack_kv", "pack_kv"))
@pytest.mark.parametrize("num_tokens", [1, 3, 4, 5, 12])
def test_unpack_kv_round_trip_into_another_table(num_tokens):
    gen = torch.Generator().manual_seed(num_tokens)
    L, nb, nh, hs = 2, 6, 2, 3
    src_k = [torch.randn(nb, BS, nh, hs, generator=gen) for _ in range(L)]
    src_v = [torch.randn(nb, BS, nh, hs, generator=gen) for _ in range(L)]
    payload = pack_kv(src_k, src_v, [4, 0, 5], num_tokens)
    dst_k = [torch.full((nb, BS, nh, hs), 7.0) for _ in range(L)]
    dst_v = [torch.full((nb, BS, nh, hs), 7.0) for _ in range(L)]
    table = [2, 5, 1]
    unpack_kv(payload, dst_k, dst_v, table)
    assert torch.equal(pack_kv(dst_k, dst_v, table, num_tokens), payload)
    # Slots past the last token, and blocks not in the table, are untouched.
    used = {(table[t // BS], t % BS) for t in range(num_tokens)}
    for b in range(nb):
        for s in range(BS):
            if (b, s) not in used:
                assert bool((dst_k[0][b, s] == 7.0).all()) and bool((dst_v[1][b, s] == 7.0).all()), (b, s)


@pytest.mark.graded(points=1, exercise="pack_kv")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_payload_bytes_equal_the_kv_formula(dtype):
    model = tiny_model().to(dtype)
    prompt = list(range(1, 11))  # 10 tokens = 2.5 blocks: exact token count, not whole blocks
    bm, cache = paged_prefill(model, prompt)
    payload = pack_kv(cache.k_pools, cache.v_pools, bm.block_table("r"), len(prompt))
    header, data = payload_to_bytes(payload)
    cfg = model.config
    element = torch.empty((), dtype=dtype).element_size()
    assert len(data) == 2 * cfg.n_layer * cfg.n_head * cfg.head_size * len(prompt) * element
    assert len(data) == kv_bytes(cfg, len(prompt), dtype) == header.nbytes
    assert torch.equal(payload_from_bytes(header, data), payload)


@pytest.mark.graded(points=3, exercise="admit_handoffs")
def test_admit_handoffs_worked_example_and_limits():
    assert admit_handoffs([9, 12, 1], num_free_blocks=10, num_reserved_blocks=3, num_running=1, max_num_seqs=4,
                          block_size=4) == 3
    assert admit_handoffs([9, 12, 1], 10, 3, 1, 3, 4) == 2  # the batch limit
    assert admit_handoffs([9, 40, 1], 10, 3, 1, 8, 4) == 1  # FCFS: the second does not fit, the third waits too
    assert admit_handoffs([8], 2, 0, 0, 8, 4) == 1  # exactly fits
    assert admit_handoffs([9], 2, 0, 0, 8, 4) == 0
    assert admit_handoffs([], 10, 0, 0, 8, 4) == 0
    assert admit_handoffs([1, 1], 10, 0, 5, 5, 4) == 0  # the batch is full


def _init(role: str, model: GPT, eos_id=None) -> WorkerInit:
    return WorkerInit(role=role, model=b"", model_sha256="", device="cpu", num_blocks=64,
                      block_size=BS, max_num_seqs=8, max_num_batched_tokens=64, eos_id=eos_id, heartbeat_s=0.5,
                      num_threads=0)


def run_cores_in_process(model: GPT, prompts: list[list[int]], params: list[SamplingParams]) -> dict[str, list[int]]:
    """The prefill and decode cores wired together by hand, no processes: the hand-off path alone."""
    prefill, decode = PrefillCore(model, _init("prefill", model)), DecodeCore(model, _init("decode", model))
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    for i, (p, sp) in enumerate(zip(prompts, params)):
        prefill.handle(PrefillRequest(str(i), p, sp))
    while prefill.has_work() or decode.has_work():
        if prefill.has_work():
            for dest, msg in prefill.step():
                if isinstance(msg, FirstTokens):
                    for rid, tok, _ in msg.items:
                        out[rid].append(tok)
                else:
                    assert dest == "peer" and isinstance(msg, KVHandoff)
                    decode.handle(msg)
        if decode.has_work():
            for _, msg in decode.step():
                assert isinstance(msg, DecodeTokens)
                for rid, tok, _ in msg.items:
                    out[rid].append(tok)
    assert decode.blocks.num_free_blocks == 64 and prefill.blocks.num_free_blocks == 64  # nothing leaked
    return out


@pytest.mark.graded(points=2, exercise=("pack_kv", "unpack_kv", "admit_handoffs"))
def test_in_process_handoff_matches_naive_greedy_and_seeded():
    model = tiny_model()
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], list(range(20, 50)), [3] * 4]
    params = [SamplingParams.greedy(9), SamplingParams.greedy(1), SamplingParams(max_new_tokens=7, seed=11),
              SamplingParams(max_new_tokens=6, temperature=0.8, top_k=20, seed=3)]
    got = run_cores_in_process(model, prompts, params)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        assert got[str(i)] == generate_naive_ids(model, p, sp), i


@pytest.mark.graded(points=1, exercise=("pack_kv", "unpack_kv", "admit_handoffs"))
def test_in_process_handoff_stops_at_the_context_window():
    model = tiny_model()  # block_size 64
    prompt = list(range(1, 61))
    got = run_cores_in_process(model, [prompt], [SamplingParams.greedy(50)])
    assert got["0"] == generate_naive_ids(model, prompt, SamplingParams.greedy(50))
    assert len(got["0"]) == 64 - 60 + 1


# ------------------------------------------------------------------------------------------ in-process checks


def test_model_bytes_round_trip_gives_identical_logits():
    model = tiny_model(3)
    weights = model_to_bytes(model)
    assert isinstance(weights, bytes) and weights[:8] != b"\x80\x04\x95"  # safetensors, not a pickle
    clone = model_from_bytes(weights)
    idx = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(model(idx), clone(idx))
    assert clone.lm_head.weight is clone.transformer.wte.weight  # still tied


def test_bad_inputs_to_the_transfer_functions():
    k = [torch.zeros(4, BS, 2, 3)]
    with pytest.raises(ValueError, match="block_table has 1 blocks"):
        pack_kv(k, k, [0], 5)
    with pytest.raises(ValueError, match="block id 9"):
        pack_kv(k, k, [9], 2)
    with pytest.raises(ValueError, match="num_tokens must be a positive int"):
        pack_kv(k, k, [0], 0)
    with pytest.raises(ValueError, match="one K and one V pool per layer"):
        pack_kv(k, [], [0], 1)
    with pytest.raises(ValueError, match="payload dtype torch.float64"):
        unpack_kv(torch.zeros(1, 2, 1, 2, 3, dtype=torch.float64), k, k, [0])
    with pytest.raises(ValueError, match="needs 48"):
        payload_from_bytes(KVHeader("float32", (1, 2, 1, 2, 3)), b"\x00" * 47)
    with pytest.raises(ValueError, match="unsupported KV dtype 'int8'"):
        KVHeader("int8", (1, 2, 1, 2, 3))


def test_config_validation_names_the_bad_value():
    with pytest.raises(ValueError, match="num_blocks must be positive, got 0"):
        DisaggConfig(num_blocks=0)
    with pytest.raises(TypeError, match="block_size must be an int"):
        DisaggConfig(block_size=2.0)
    with pytest.raises(ValueError, match="liveness_timeout_s=1.0 must exceed two heartbeats"):
        DisaggConfig(heartbeat_s=0.5, liveness_timeout_s=1.0)
    with pytest.raises(TypeError, match="DisaggregatedLLM needs a minillm GPT"):
        DisaggregatedLLM("gpt2")


# ------------------------------------------------------------------------------------------ across processes


def engine_config(**kw) -> DisaggConfig:
    return DisaggConfig(**{**dict(num_blocks=64, block_size=BS, max_num_seqs=8, max_num_batched_tokens=64,
                                  device="cpu", heartbeat_s=0.25, liveness_timeout_s=20.0,
                                  startup_timeout_s=900.0), **kw})


@pytest.fixture(scope="module")
def _engines():
    """Module cache: one model, one tokenizer, one engine, rebuilt only if a test broke it (the crash test)."""
    import minillm

    cache = {"tok": minillm.load_tokenizer(), "model": tiny_model(vocab_size=4096), "llm": None}
    yield cache
    if cache["llm"] is not None:
        cache["llm"].close()
        assert not cache["llm"].prefill.process.is_alive() and not cache["llm"].decode.process.is_alive()


@pytest.fixture
def shared(_engines):
    """(model, tokenizer, engine): the module's running engine, shared across tests (spawning costs seconds)."""
    llm = _engines["llm"]
    if llm is None or llm.closed or llm._broken is not None:
        if llm is not None:
            llm.close()
        llm = _engines["llm"] = DisaggregatedLLM(_engines["model"], _engines["tok"], engine_config())
    return _engines["model"], _engines["tok"], llm


PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], list(range(20, 50)), [3] * 4, list(range(100, 113))]


def test_greedy_identical_to_colocated_engine_and_naive(shared):
    from minillm.engine import LLM, EngineConfig

    model, tok, llm = shared
    params = SamplingParams.greedy(12, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    colocated = LLM(model, tok, EngineConfig(num_blocks=64, block_size=BS, max_num_seqs=8,
                                             max_num_batched_tokens=64, device="cpu")).generate(PROMPTS, params)
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in colocated]
    assert [o.finish_reason for o in outs] == [o.finish_reason for o in colocated] == ["length"] * len(PROMPTS)
    for p, o in zip(PROMPTS, outs):
        assert o.output_token_ids == generate_naive_ids(model, p, params)
        assert o.prompt_token_ids == p and len(o.token_times) == 12


def test_bytes_sent_per_request_equal_the_formula(shared):
    model, _, llm = shared
    before = len(llm.transfers)
    outs = llm.generate(PROMPTS, SamplingParams.greedy(3, ignore_eos=True))
    sent = {t.request_id: t.nbytes for t in llm.transfers[before:]}
    assert len(sent) == len(PROMPTS)  # one hand-off per request
    cfg = model.config
    for p, o in zip(PROMPTS, outs):
        assert sent[o.request_id] == 2 * cfg.n_layer * cfg.n_head * cfg.head_size * len(p) * 4
    for t in llm.transfers[before:]:
        assert t.sent_time <= t.received_time <= t.unpacked_time
    # The point of it all: the decode worker's steps never contain a prompt token.
    decode_steps = [s for s in llm.timeline if s.role == "decode" and s.num_tokens]
    assert decode_steps and all(s.kind == "decode" and s.num_tokens == len(s.request_ids) <= 8 for s in decode_steps)
    assert all(s.kind == "prefill" for s in llm.timeline if s.role == "prefill")


def test_seeded_sampling_identical_to_naive(shared):
    model, _, llm = shared
    params = [SamplingParams(max_new_tokens=8, seed=s, ignore_eos=True) for s in range(len(PROMPTS))]
    outs = llm.generate(PROMPTS, params)
    for p, sp, o in zip(PROMPTS, params, outs):
        assert o.output_token_ids == generate_naive_ids(model, p, sp)


def test_stop_string_and_first_token_finish(shared):
    model, tok, llm = shared
    free = llm.generate([[5, 6, 7]], SamplingParams.greedy(10, ignore_eos=True))[0]
    stop = tok.decode(free.output_token_ids[3:4])
    params = SamplingParams.greedy(10, ignore_eos=True, stop=(stop,))
    out = llm.generate([[5, 6, 7]], params)[0]
    ref = generate_naive_ids(model, [5, 6, 7], params, tokenizer=tok)
    assert out.output_token_ids == ref and out.finish_reason == "stop"
    assert stop not in out.text
    one = llm.generate([[5, 6, 7]], SamplingParams.greedy(1))[0]  # finished by the prefill worker alone
    assert one.output_token_ids == free.output_token_ids[:1] and one.finish_reason == "length"
    none = llm.generate([[5, 6, 7]], SamplingParams.greedy(0))[0]
    assert none.output_token_ids == [] and none.finished
    again = llm.generate([[5, 6, 7]], SamplingParams.greedy(10, ignore_eos=True))[0]  # the abort left no debris
    assert again.output_token_ids == free.output_token_ids


def test_bad_requests_name_the_bad_value(shared):
    _, _, llm = shared
    with pytest.raises(ValueError, match="n=2"):
        llm.add_request([1, 2], SamplingParams(n=2))
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        llm.add_request([], SamplingParams.greedy(2))
    with pytest.raises(ValueError, match=r"prompt_ids\[1\] = 5000 is outside"):
        llm.add_request([1, 5000], SamplingParams.greedy(2))
    with pytest.raises(ValueError, match="65 tokens, more than the context window"):
        llm.add_request([1] * 65, SamplingParams.greedy(2))
    with pytest.raises(TypeError, match="prompt must be a str or a list"):
        llm.add_request(3.5)
    with pytest.raises(ValueError, match="got 1 SamplingParams for 2 prompts"):
        llm.generate([[1], [2]], [SamplingParams.greedy(2)])
    with pytest.raises(ValueError, match=r"prompts\[1\]: prompt_ids is empty"):
        llm.generate([[1, 2], []], SamplingParams.greedy(2))  # rejected before the first prompt is sent
    assert not llm.has_unfinished()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_workers_match_naive_on_cuda():
    model = tiny_model().to("cuda")
    with DisaggregatedLLM(model, None, engine_config(device="cuda")) as llm:
        outs = llm.generate(PROMPTS, SamplingParams.greedy(8, ignore_eos=True))
        assert llm.devices == {"prefill": "cuda", "decode": "cuda"}
    for p, o in zip(PROMPTS, outs):
        assert o.output_token_ids == generate_naive_ids(model, p, SamplingParams.greedy(8, ignore_eos=True))


def test_decode_worker_death_fails_its_requests_within_the_timeout(shared):
    _, _, llm = shared  # breaks the shared engine: the `shared` fixture builds a new one for any later test
    procs = [h.process for h in llm._handles]
    llm._inject_crash("decode", after_steps=3)
    t0 = time.monotonic()
    with pytest.raises(WorkerDiedError,
                       match=r"decode worker \(pid \d+\) exited with code 17.*failed: \['req-\d+', 'req-\d+'\]"):
        llm.generate([[1, 2, 3], [4, 5, 6, 7, 8]], SamplingParams.greedy(40, ignore_eos=True))
    assert time.monotonic() - t0 < 30  # a bound on the failure path, not a speed claim: it must not hang
    with pytest.raises(WorkerDiedError, match="unusable"):
        llm.add_request([1, 2], SamplingParams.greedy(2))
    with llm:  # the context manager's exit stops the survivor
        pass
    assert not any(p.is_alive() for p in procs)


def test_prefill_worker_killed_mid_run_fails_pending_requests_and_finalizer_stops_the_rest():
    model = tiny_model()
    llm = DisaggregatedLLM(model, None, engine_config(liveness_timeout_s=5.0))
    assert llm._finalizer.atexit  # the same guard runs at interpreter exit (the next test checks it for real)
    procs = [h.process for h in llm._handles]
    ids = [llm.add_request([i + 1] * 10, SamplingParams.greedy(30, ignore_eos=True)) for i in range(4)]
    os.kill(llm.prefill.process.pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"prefill worker \(pid \d+\) was killed by signal 9") as info:
        while llm.has_unfinished():
            llm.step()
    assert time.monotonic() - t0 < 30
    assert all(rid in str(info.value) for rid in ids)
    assert not llm.has_unfinished()
    del llm, info
    gc.collect()  # the weakref.finalize guard stops the decode worker with nobody calling close()
    for p in procs:
        p.join(10)
    assert not any(p.is_alive() for p in procs)


@pytest.mark.slow
def test_interpreter_exit_without_close_leaves_no_worker(tmp_path):
    script = tmp_path / "leak.py"
    script.write_text(textwrap.dedent("""
        import torch
        from minillm import GPT, GPTConfig
        from minillm.disagg import DisaggConfig, DisaggregatedLLM
        if __name__ == "__main__":
            llm = DisaggregatedLLM(GPT(GPTConfig.from_name("tiny")), None, DisaggConfig(device="cpu", block_size=4,
                                   num_blocks=32, max_num_seqs=4, max_num_batched_tokens=64, startup_timeout_s=900))
            print(" ".join(str(p) for p in llm.worker_pids.values()), flush=True)
            # no close(): the finalizer registered with atexit must stop both workers
    """))
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=1200)
    assert res.returncode == 0, res.stderr
    pids = [int(p) for p in res.stdout.split()]
    assert len(pids) == 2
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        # A zombie would be reaped by init; only a live process is a leak.
        with open(f"/proc/{pid}/stat") as f:
            assert f.read().split()[2] == "Z", f"worker {pid} outlived its parent"


def test_check_results_counts_agreement_and_exact_handoffs():
    """The bench's correctness line: catches one request whose ids differ and one hand-off of the wrong size."""
    from types import SimpleNamespace

    from minillm.disagg.bench import check_results
    from minillm.disagg.kv_transfer import kv_bytes
    from minillm.bench.workload import make_workload

    cfg = GPTConfig.from_name("tiny")
    wl = make_workload(3, prompt_len_dist="uniform:4:9", output_len_dist="fixed:2", seed=0, vocab_size=cfg.vocab_size)
    out = lambda ids: SimpleNamespace(output_token_ids=ids)  # noqa: E731
    colocated = SimpleNamespace(outputs={r.request_id: out([1, 2]) for r in wl}, transfers=[])
    disagg_outputs = {r.request_id: out([1, 2]) for r in wl}
    disagg_outputs[wl[2].request_id] = out([1, 3])  # one request disagrees
    transfers = [SimpleNamespace(request_id=r.request_id, nbytes=kv_bytes(cfg, len(r.prompt_token_ids))) for r in wl]
    transfers[0].nbytes += 4  # one hand-off carries 4 bytes too many
    res = {"colocated": colocated, "disaggregated": SimpleNamespace(outputs=disagg_outputs, transfers=transfers)}
    assert check_results(res, wl, cfg) == {"identical": 2, "requests": 3, "exact_transfers": 2, "transfers": 3}

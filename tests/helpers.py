"""Test helpers shared by chapters 04-07: a model whose next token depends on its context, and a poisoned request.

Why a special model: at GPT-2's init (std 0.02) a tiny random GPT barely looks at its context. Its residual stream
is dominated by the current token's embedding, so its argmax is (almost) a function of the last token alone:
replacing the whole context changed chapter 04's old test model's argmax 0 times in 120, the default tiny models'
0-5 times in 48-240. With such a model "the cached path gives the naive path's tokens" cannot fail: a wrong decode
position, a corrupted K/V block or an inverted mask leave the tokens unchanged. `context_model` re-draws the weights
large enough that attention is sharp and its output, the position embedding and the MLP all weigh as much as the
token's own embedding; `context_sensitivity` measures the result, and tests/test_reliability_engine.py fails if
replacing the context changes the argmax in fewer than half the cases.
"""

from __future__ import annotations

import copy
import math
import multiprocessing
import os
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch

import minillm
from minillm import GPT, GPTConfig
from minillm.core.sampling import SamplingParams
from minillm.engine import sampler as engine_sampler
from minillm.serve.loadgen import RequestRecord

# The scales `context_model` draws its weights with (std of a normal; the projections' divided by sqrt(n_embd), so
# the picture is the same at any width), chosen by measuring `context_sensitivity` (85-95% of contexts change the
# argmax for the presets tests 04-07 use) and the cached-vs-full-forward logit error (<= 5e-6: the logits are O(5),
# so the 1e-5 tolerances of chapter 04 still hold and near-ties are rare).
EMBED_STD = 0.25  # token embedding (and the tied output head): small beside what attention brings in
POS_STD = 0.25  # position embedding: a decode at the wrong position changes the next token
ATTN_GAIN = 1.13  # q, k, v projections (std = gain / sqrt(C)): sharp attention
ATTN_PROJ_GAIN = 5.66  # attention output (std = gain / sqrt(C)): what the context says outweighs the token itself


def context_model(config: GPTConfig | str = "tiny", seed: int = 0, device: torch.device | str = "cpu",
                  **overrides) -> GPT:
    """A GPT (preset name or config, with overrides) whose argmax depends strongly on its context; seeded."""
    cfg = GPTConfig.from_name(config, **overrides) if isinstance(config, str) else config
    if not isinstance(cfg, GPTConfig):
        raise TypeError(f"config must be a preset name or a GPTConfig, got {type(config).__name__}")
    if isinstance(config, GPTConfig) and overrides:
        cfg = GPTConfig(**{**cfg.to_dict(), **overrides})
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = GPT(cfg)
    C = cfg.n_embd

    def draw(t: torch.Tensor, std: float) -> None:
        t.copy_(torch.randn(t.shape, generator=g) * std)

    with torch.no_grad():
        draw(model.transformer.wte.weight, EMBED_STD)
        draw(model.transformer.wpe.weight, POS_STD)
        for block in model.transformer.h:
            draw(block.attn.c_attn.weight, ATTN_GAIN / math.sqrt(C))
            draw(block.attn.c_proj.weight, ATTN_PROJ_GAIN / math.sqrt(C))
            draw(block.mlp.c_fc.weight, 1.0 / math.sqrt(C))
            draw(block.mlp.c_proj.weight, 1.0 / math.sqrt(4 * C))
    return model.to(device).eval()


@torch.no_grad()
def noisy_copy(model: GPT, noise: float, seed: int) -> GPT:
    """The model with every weight perturbed by `noise` times its own std: a draft that agrees with it part of the
    time (greedy acceptance about 0.3 at noise 0.1 on context models), for speculative decoding's tests."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise * p.std())
    return draft


def context_sensitivity(model: GPT, num_cases: int = 100, seed: int = 0, max_len: int = 30) -> float:
    """The fraction of random prompts whose next-token argmax changes when every token but the last is replaced.

    Same length, same last token, same positions: only the context differs, so a model that ignores it scores 0.
    """
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    changed = 0
    for _ in range(num_cases):
        T = int(torch.randint(2, min(max_len, cfg.block_size) + 1, (1,), generator=g))
        a = torch.randint(0, cfg.vocab_size, (1, T), generator=g)  # (1, T)
        b = torch.randint(0, cfg.vocab_size, (1, T), generator=g)  # (1, T)
        b[0, -1] = a[0, -1]
        la, lb = model(a.to(model.device)), model(b.to(model.device))  # (1, T, V) each
        changed += int(la[0, -1].argmax() != lb[0, -1].argmax())
    return changed / num_cases


def random_prompts(n: int, vocab: int, lengths, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


@dataclass
class PoisonedParams(SamplingParams):
    """Valid SamplingParams whose sampling raises: a stand-in for any failure inside one request's sampling.

    `poison_in` names the process where it raises ("any", or a worker's process name such as
    "minillm-decode-worker"). It pickles by reference, so a spawned worker that can import this module (tests/ is
    on the parent's sys.path, which spawn copies) raises there too.
    """

    poison_in: str = "any"

    @property
    def is_greedy(self) -> bool:
        if self.poison_in in ("any", multiprocessing.current_process().name):
            raise RuntimeError(f"poisoned request: sampling raises in {multiprocessing.current_process().name}")
        return self.temperature == 0.0


class EngineDriver:
    """Drives an engine's `step`, checking the scheduler's and block manager's invariants after every step, and keeps
    each request's streamed deltas, final output ids and final `RequestOutput`. A chapter's tests subclass it and add
    their own checks of the step just run in `after_step(schedule)`."""

    def __init__(self, llm):
        self.llm = llm
        self.final: dict[str, list[int]] = {}
        self.outputs: dict[str, object] = {}
        self.streamed: dict[str, list[int]] = {}

    def after_step(self, schedule) -> None:
        """Called after every step with the engine's last schedule (None or empty when nothing ran)."""

    def step(self) -> None:
        for out in self.llm.step():
            got = self.streamed.setdefault(out.request_id, [])
            got += out.new_token_ids
            assert out.output_token_ids == got  # the deltas add up to the cumulative output
            if out.finished:
                assert out.request_id not in self.final, "finished twice"
                self.final[out.request_id] = out.output_token_ids
                self.outputs[out.request_id] = out
        self.llm.scheduler.check_invariants()
        self.llm.block_manager.check_invariants()
        self.after_step(self.llm.last_schedule)

    def run(self, max_steps: int = 5000) -> None:
        for _ in range(max_steps):
            if not self.llm.has_unfinished():
                break
            self.step()
        self.step()  # hand out pending outputs (aborts) of the last step
        assert not self.llm.has_unfinished(), "engine made no progress"
        assert self.llm.block_manager.num_free_blocks == self.llm.config.num_blocks  # idle: every block free (I9)


def assert_every_generator_agrees(model, vocab_size: int = 256, disaggregated: bool = False) -> None:
    """Greedy tokens of `model` (any module with GPT's interface: quantized, pruned) are the naive loop's through the
    KV cache, static batching, the paged cache and chapter 06's engine: its own tokens, not another model's.

    `disaggregated`: also through chapter 07's two worker processes, which receive the model as bytes
    (`minillm.core.formats`) and rebuild it by its format: the same tokens prove the same model arrived."""
    from minillm.core.sampling import SamplingParams
    from minillm.engine.config import EngineConfig
    from minillm.engine.llm import LLM
    from minillm.kvcache.generate import generate_ids, generate_static_batch
    from minillm.naive.generate import generate_naive_ids
    from minillm.paged.generate import paged_generate

    prompts = [[t % vocab_size for t in p] for p in ([5, 17, 99, 3], [200, 1, 1, 42, 7, 9, 11], [64])]
    params = SamplingParams.greedy(10, ignore_eos=True)
    naive = [generate_naive_ids(model, p, params) for p in prompts]
    assert [generate_ids(model, p, params) for p in prompts] == naive
    assert generate_static_batch(model, prompts, params) == naive
    assert [paged_generate(model, p, params, block_size=4).token_ids[0] for p in prompts] == naive
    llm = LLM(model, None, EngineConfig(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=16))
    assert [o.output_token_ids for o in llm.generate(prompts, params)] == naive
    if disaggregated:
        from minillm.disagg import DisaggConfig, DisaggregatedLLM

        config = DisaggConfig(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=16, device="cpu",
                              num_threads=1, heartbeat_s=0.25, liveness_timeout_s=60.0, startup_timeout_s=300.0)
        with DisaggregatedLLM(model, None, config) as dis:
            assert [o.output_token_ids for o in dis.generate(prompts, params)] == naive


MINILLM_DIR = str(Path(minillm.__file__).resolve().parent)


def assert_refused_by_minillm(call, err: type[BaseException], match: str) -> None:
    """`call()` raises `err` matching `match`, from minillm's own code (a clear message), not deep inside torch or
    Python: the hostile tables' contract."""
    with pytest.raises(err, match=match) as info:
        call()
    raised_in = str(Path(str(info.traceback[-1].path)).resolve())
    assert raised_in.startswith(MINILLM_DIR), f"raised from {raised_in}: {info.value}"


def hand_record(ttft: float, gaps: list[float], success: bool = True, tokens: int | None = None) -> RequestRecord:
    """A hand-built record: sent at t = 1, first text at 1 + ttft, then one chunk after each gap."""
    chunks = [1.0 + ttft]
    for gap in gaps:
        chunks.append(chunks[-1] + gap)
    return RequestRecord(0, 10, len(chunks), scheduled_s=1.0, send_s=1.0, chunk_s=chunks, done_s=chunks[-1],
                         text="x" * len(chunks), output_tokens=len(chunks) if tokens is None else tokens,
                         success=success, error=None if success else "500")


def poison_sampler(monkeypatch, seed: int, message: str) -> None:
    """Make the engine's sampler raise RuntimeError(message) for every request sampled with `seed` (a request that
    fails alone), and sample every other request as before."""
    real = engine_sampler.sample_next

    def sampler(logits, params, generator=None, processors=None):
        if params.seed == seed:
            raise RuntimeError(message)
        return real(logits, params, generator, processors)

    monkeypatch.setattr(engine_sampler, "sample_next", sampler)


def long_stream_in_background(url: str, max_tokens: int) -> tuple[threading.Thread, dict]:
    """POST a greedy streamed completion of `max_tokens` (end-of-text ignored) to `url` + "/v1/completions" from a
    thread, started; (the thread, a dict that gets the response under "r" when it ends)."""
    body = {"model": "base", "prompt": "def main(", "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(r=httpx.post(url + "/v1/completions", json=body,
                                                                        timeout=120)))
    thread.start()
    return thread, result


def special_files(tmp_path: Path, suffix: str) -> list[Path]:
    """A FIFO and, as root, a private character device like /dev/null (c 1 3), both under tmp_path: never a real node
    (a hostile run's save onto '/dev/null' as root once replaced the machine's /dev/null with a regular file)."""
    nodes = [tmp_path / f"fifo{suffix}"]
    os.mkfifo(nodes[0])
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        nodes.append(tmp_path / f"null{suffix}")
        os.mknod(nodes[1], 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    return nodes


class LyingInt(int):
    """An int whose comparisons always answer "in range": `0 <= x < n` and `x <= n` hold and `x > n` does not,
    whatever it holds. A range check that compares it as given is fooled; one that reads the plain int it holds
    (`int.__index__(x)`) is not."""

    def __lt__(self, other):
        return True

    def __le__(self, other):
        return True

    def __ge__(self, other):
        return True

    def __gt__(self, other):
        return False


class LyingFloat(float):
    """A float that says it is neither below nor above anything: `x < lo` and `x > hi` are False whatever it holds,
    so a check written `if x < lo or x > hi: raise` on the caller's object lets LyingFloat(1e9) through a bound of
    1e4; one that reads the plain float it holds (`float.__float__(x)`) does not."""

    def __lt__(self, other):
        return False

    def __gt__(self, other):
        return False

    def __le__(self, other):
        return True

    def __ge__(self, other):
        return True


class AgreeingInt(int):
    """An int equal to everything: `x == 4` and `x in (4, 8)` hold whatever it holds."""

    def __eq__(self, other):
        return True

    __hash__ = int.__hash__

"""Generation with a KV cache: prefill the prompt once, then decode one token per forward; and static batching.

What it adds over chapter 03's naive loop (which recomputes the whole sequence for every new token): `prefill`
runs the prompt through the model in one forward and fills a `ContiguousKVCache`; `decode_step` feeds only the
newest token, whose queries attend over the cached keys and values. `generate` streams tokens like
`generate_naive` and runs the same request lifecycle (`minillm.core.stopping.start_request`, `sample_next`,
`RequestState.accept`), so equal logits give equal tokens.
`generate_static_batch` runs several prompts of different lengths as one left-padded batch. What it still leaves
out: the batch is fixed until its longest request finishes (finished rows keep computing; chapter 06's
continuous batching replaces them), every row reserves its worst-case cache up front (chapter 05 pages it), and
nothing can run past the model's context window (block_size), because the learned position embedding stops there.

    prompt  p0 p1 p2 p3 ──prefill (1 forward, T=4)──▶ cache K/V[0..3], logits[3] ─▶ t4
    decode  t4          ──forward (T=1, pos 4)─────▶ cache K/V[4],    logits    ─▶ t5
    decode  t5          ──forward (T=1, pos 5)─────▶ cache K/V[5],    logits    ─▶ t6 ...
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn as nn

from minillm.core.config import check_float_tensor, check_instance, check_int, check_tensor_elements, tensor_kind
from minillm.core.model import GPT, require_model
from minillm.core.sampling import SamplingParams, sample_next
from minillm.core.stopping import RequestState, check_eos_id, start_request
from minillm.kvcache.cache import ContiguousKVCache
from minillm.naive.generate import collect, generate_naive

# A decode step: (model, cache, token (1,), positions (1,)) -> logits (1, V). `decode_step` is the eager one.
DecodeFn = Callable[[GPT, ContiguousKVCache, torch.Tensor, torch.Tensor], torch.Tensor]
PrefillFn = Callable[[GPT, ContiguousKVCache, torch.Tensor, torch.Tensor], torch.Tensor]  # the prompt (1, T), (T,)


def _check_step_args(model: Any, cache: Any, name: str, ids: Any, positions: Any = None) -> None:
    """The arguments of one step (`prefill`, `decode_step`) by type: model a torch module (a GPT), cache a
    `ContiguousKVCache`, ids (named `name`) a tensor, positions a tensor or None; a TypeError naming the one that
    is not, before an attribute of it is read. isinstance tests only: cheap enough for every decode step."""
    check_instance("model", model, nn.Module, "a minillm GPT (a torch module)")
    check_instance("cache", cache, ContiguousKVCache, "a ContiguousKVCache")
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{name} must be a tensor of token ids, got {tensor_kind(ids)}")
    if positions is not None and not isinstance(positions, torch.Tensor):
        raise TypeError(f"positions must be a tensor of positions or None, got {tensor_kind(positions)}")


@torch.inference_mode()
def prefill(model: GPT, cache: ContiguousKVCache, idx: torch.Tensor, positions: torch.Tensor | None = None
            ) -> torch.Tensor:
    """Run the prompt idx (B, T) through the model in one forward, filling the cache; logits of the last slot (B, V).

    `positions` default to the cache's own (slot minus each row's left padding), which is 0..T-1 without padding.
    Unchecked (`model.hidden`): the caller validated the prompt; only the last row goes through the output head.
    """
    _check_step_args(model, cache, "idx", idx, positions)  # types only: a None fails here, by name
    if idx.dim() != 2 or idx.size(0) != cache.batch_size:
        raise ValueError(f"idx must have shape (batch_size={cache.batch_size}, T), got {tuple(idx.shape)}")
    if positions is None:
        positions = cache.positions(idx.size(1))  # (B, T)
    h = model.hidden(idx, positions, cache)  # (B, T, C)
    return model.logits(h[:, -1])  # (B, C) -> (B, V)


@torch.inference_mode()
def decode_step(model: GPT, cache: ContiguousKVCache, tokens: torch.Tensor, positions: torch.Tensor | None = None
                ) -> torch.Tensor:
    """Feed one new token per row, tokens (B,) or (B, 1); the cache supplies everything before it. Logits (B, V)."""
    _check_step_args(model, cache, "tokens", tokens, positions)  # isinstance tests, no host sync
    idx = tokens.view(-1, 1)  # (B,) -> (B, 1)
    if idx.size(0) != cache.batch_size:
        raise ValueError(f"tokens must hold one id per row (batch_size={cache.batch_size}), got {tuple(tokens.shape)}")
    if positions is None:
        positions = cache.positions(1)  # (B, 1)
    h = model.hidden(idx, positions, cache)  # (B, 1, C): no checks, no host sync (chapter 13 can capture it)
    return model.logits(h[:, -1])  # (B, C) -> (B, V)


def generate(
    model: GPT,
    prompt_ids: Any,
    params: SamplingParams,
    tokenizer: Any = None,
    eos_id: int | None = None,
    kv_cache: bool | ContiguousKVCache = True,
    truncate: bool = False,
    kv_dtype: torch.dtype = torch.float32,
    decode_fn: DecodeFn | None = None,
    prefill_fn: PrefillFn | None = None,
) -> Iterator[int]:
    """Stream generated token ids, prefill + decode with a KV cache; `kv_cache=False` runs chapter 03's naive loop.

    Same contract as `generate_naive`: the same request lifecycle (`start_request`: prompt checks, window cap, one
    generator seeded from `params.seed`, the stop rules), the same `sample_next`, and the finish reason as the
    generator's return value (`minillm.naive.generate.collect` gets it). So greedy and seeded runs give the naive
    loop's tokens whenever the logits agree. Pass a `ContiguousKVCache` (batch_size 1) as `kv_cache` to reuse its
    memory across calls; it is reset here. Otherwise a cache is allocated in `kv_dtype` (a setting of its own,
    never read off the weights). `decode_fn(model, cache, token, positions) -> logits (1, V)` replaces `decode_step`
    for every token after the first: chapter 13 (compilation) passes a compiled or graph-captured step over a
    static-shape cache here. `prefill_fn(model, cache, ids (1, T), positions (T,)) -> logits (1, V)` replaces
    `prefill` for the prompt (chapter 13's fused step scores a short prompt in its own C++ call); what it returns and
    the cache it leaves are checked (`check_prefill_result`).
    """
    if kv_cache is False:
        return generate_naive(model, prompt_ids, params, tokenizer=tokenizer, eos_id=eos_id, truncate=truncate)
    if not (kv_cache is True or isinstance(kv_cache, ContiguousKVCache)):
        raise TypeError(f"kv_cache must be True, False or a ContiguousKVCache, got {type(kv_cache).__name__}")
    cfg = require_model(model, "generate")
    check_eos_id(eos_id, cfg.vocab_size)
    state = start_request(cfg, prompt_ids, params, tokenizer, eos_id, device=model.device, truncate=truncate)
    if params.n != 1:
        raise ValueError(f"generate streams one sequence; n={params.n} parallel samples need chapter 05's paged cache")
    # The last sampled token is never fed back: prompt_len + max_new - 1 slots hold everything attended to.
    max_len = max(len(state.prompt_ids) + state.params.max_new_tokens - 1, 1)
    cache = kv_cache if isinstance(kv_cache, ContiguousKVCache) else None
    if cache is not None and (cache.batch_size != 1 or cache.max_len < max_len):
        raise ValueError(f"kv_cache must have batch_size 1 and max_len >= {max_len}, "
                         f"got batch_size={cache.batch_size}, max_len={cache.max_len}")
    if cache is not None:
        # subtle: a cache built for another config (e.g. a head-pruned model's) fails inside attend with torch's
        # shape error; its shape is known here, on the host
        got = (cache.config.n_layer, cache.config.n_head, cache.config.head_size)
        want = (cfg.n_layer, cfg.n_head, cfg.head_size)
        if got != want:
            raise ValueError(f"kv_cache was built for n_layer, n_head, head_size = {got}, but the model has {want}: "
                             "build the cache from model.config")
    # Everything is checked before the first token, so a bad argument fails at the call, not at the first next().
    for name, fn in (("decode_fn", decode_fn), ("prefill_fn", prefill_fn)):
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be callable (model, cache, ids, positions) -> logits, got {fn!r}")
    return _cached_stream(model, state, cache, max_len, kv_dtype, decode_fn or decode_step, prefill_fn or prefill)


def _cached_stream(model: GPT, state: RequestState, cache: ContiguousKVCache | None, max_len: int,
                   kv_dtype: torch.dtype, decode_fn: DecodeFn, prefill_fn: PrefillFn) -> Iterator[int]:
    if state.finished:  # max_new_tokens == 0
        return state.finish_reason
    device = model.device
    if cache is None:
        cache = ContiguousKVCache(model.config, 1, max_len, device=device, dtype=kv_dtype)
    cache.reset()
    ids, params, generator = state.prompt_ids, state.params, state.generator
    T = len(ids)
    # Positions as views of one arange: no per-step tensor construction in the decode loop.
    all_positions = torch.arange(max_len + 1, device=device)  # (max_len+1,)
    idx = torch.tensor([ids], dtype=torch.long, device=device)  # (1, T)
    logits = prefill_fn(model, cache, idx, all_positions[:T])  # (1, V)
    check_prefill_result(logits, cache, T, model.config.vocab_size)
    pos = T
    while True:
        token = sample_next(logits, params, generator)  # (1,)
        token_id = int(token)  # subtle: the one host sync per step, needed anyway to stream the id out
        yield token_id
        if state.accept([token_id]):
            return state.finish_reason
        logits = decode_fn(model, cache, token, all_positions[pos:pos + 1])  # (1, V)
        pos += 1


def check_prefill_result(logits: Any, cache: ContiguousKVCache, T: int, vocab_size: int) -> None:
    """What a `prefill_fn` must leave: logits, a float tensor (1, vocab_size), and the cache holding the prompt's T
    tokens; a TypeError / ValueError naming prefill_fn otherwise. subtle: a prefill_fn that returns the right logits
    without writing the cache decodes every later token against an empty past: wrong tokens, without an error."""
    check_float_tensor("prefill_fn's result (logits)", logits, ndim=2)
    if tuple(logits.shape) != (1, vocab_size):
        raise ValueError(f"prefill_fn must return logits (1, vocab_size={vocab_size}), got {tuple(logits.shape)}")
    if cache.length != T:
        raise ValueError(f"prefill_fn must write the prompt's {T} tokens' K/V to the cache, but the cache holds "
                         f"{cache.length} after it")


def generate_ids(model: GPT, prompt_ids: Any, params: SamplingParams, tokenizer: Any = None,
                 eos_id: int | None = None, kv_cache: bool | ContiguousKVCache = True, truncate: bool = False,
                 kv_dtype: torch.dtype = torch.float32, decode_fn: DecodeFn | None = None,
                 prefill_fn: PrefillFn | None = None) -> list[int]:
    """`generate`, collected into a list of the new token ids."""
    return collect(generate(model, prompt_ids, params, tokenizer, eos_id, kv_cache, truncate, kv_dtype,
                            decode_fn, prefill_fn))[0]


# ----- static batching ------------------------------------------------------------------------------------------


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad prompts into one (B, T_max) batch; returns (idx, pad_lens (B,)).

    Left padding lines every row's last prompt token up in the last column, so one prefill ends every row at the
    same slot and every decode step writes all rows at the same slot. Example: [[5, 6, 7], [9]] ->
    idx [[5, 6, 7], [0, 0, 9]], pad_lens [0, 2].
    """
    check_int("pad_id", pad_id, 0)  # a token id: 1.5 would be read as 1, -1 is no token
    # BEGIN SOLUTION
    T_max = max(len(p) for p in prompts)
    idx = torch.full((len(prompts), T_max), pad_id, dtype=torch.long)  # (B, T_max)
    pad_lens = torch.tensor([T_max - len(p) for p in prompts], dtype=torch.long)  # (B,)
    for row, p in enumerate(prompts):
        idx[row, T_max - len(p):] = torch.tensor(p, dtype=torch.long)
    return idx, pad_lens
    # END SOLUTION


def static_positions(pad_lens: torch.Tensor, start: int, num_new: int) -> torch.Tensor:
    """(B, num_new) positions of slots start..start+num_new-1: slot - pad, so each prompt starts at position 0.

    Padding slots get position 0 (any valid position would do: no real token ever attends to them). Example:
    pad_lens [0, 2], start 0, num_new 3 -> [[0, 1, 2], [0, 0, 0]]; then start 3, num_new 1 -> [[3], [1]].
    """
    if not isinstance(pad_lens, torch.Tensor):
        raise TypeError(f"pad_lens must be a (B,) tensor of padding counts, got {tensor_kind(pad_lens)}")
    if pad_lens.dim() != 1 or pad_lens.is_floating_point() or pad_lens.dtype == torch.bool:
        raise TypeError(f"pad_lens must be a (B,) integer tensor, got {pad_lens.dtype} {tuple(pad_lens.shape)}")
    check_int("start", start, 0), check_int("num_new", num_new, 0)
    check_tensor_elements("pad_lens x num_new", (max(pad_lens.numel(), 1), num_new))  # before the allocator
    # BEGIN SOLUTION
    slots = torch.arange(start, start + num_new, device=pad_lens.device)  # (T,)
    return (slots.unsqueeze(0) - pad_lens.unsqueeze(1)).clamp(min=0)  # (1, T) - (B, 1) -> (B, T)
    # END SOLUTION


def generate_static_batch(
    model: GPT,
    prompts: Sequence[Any],
    params: SamplingParams | Sequence[SamplingParams],
    tokenizer: Any = None,
    eos_id: int | None = None,
    on_token: Callable[[int, int], None] | None = None,
    kv_dtype: torch.dtype = torch.float32,
) -> list[list[int]]:
    """Generate for several prompts as ONE left-padded batch (static batching); returns each row's new token ids.

    Each row gets its own `SamplingParams` (one for all, or a list) and its own `RequestState` from
    `start_request` (generator seeded from its seed, stop rules, window cap), and positions that start at 0, so a row gets the tokens it would get from
    `generate` alone (exactly for greedy on our test prompts; the logits agree to float rounding, see the
    chapter). The batch runs until its longest request stops: finished rows keep occupying their slot and
    computing, the waste chapter 06's continuous batching removes. `on_token(row, token_id)` is called as each
    token is produced (for timing metrics). The cache is allocated in `kv_dtype`.
    """
    cfg = require_model(model, "generate_static_batch")
    check_eos_id(eos_id, cfg.vocab_size)
    if isinstance(prompts, (str, bytes, torch.Tensor)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError(f"prompts must be a non-empty list of token-id lists, got {type(prompts).__name__}")
    B = len(prompts)
    if isinstance(params, SamplingParams):
        params_list = [params] * B
    else:
        params_list = list(params)
        if len(params_list) != B:
            raise ValueError(f"params must be one SamplingParams or a list of {B} (one per prompt), "
                             f"got a list of {len(params_list)}")
    device = model.device
    states: list[RequestState] = []
    for i, (prompt, p) in enumerate(zip(prompts, params_list)):
        if not isinstance(p, SamplingParams):
            raise TypeError(f"params[{i}] must be a SamplingParams, got {type(p).__name__}")
        if p.n != 1:
            raise ValueError(f"params[{i}] has n={p.n}; static batching runs one sample per prompt")
        try:
            states.append(start_request(cfg, prompt, p, tokenizer, eos_id, device=device))
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"prompts[{i}]: {exc}") from None
    outputs: list[list[int]] = [s.output_ids for s in states]  # each row's accepted tokens (the states' lists)
    active = [not s.finished for s in states]
    if not any(active):
        return [list(o) for o in outputs]
    idx, pad_lens = left_pad([s.prompt_ids for s in states])  # (B, T_max), (B,)
    T_max = idx.size(1)
    max_len = T_max + max(s.params.max_new_tokens for s in states) - 1  # slots; padding included
    cache = ContiguousKVCache(cfg, B, max_len, device=device, dtype=kv_dtype)
    cache.reset(pad_lens)
    pad_lens = pad_lens.to(device)
    all_greedy = all(p.is_greedy for p in params_list)
    logits = prefill(model, cache, idx.to(device), static_positions(pad_lens, 0, T_max))  # (B, V)
    slot = T_max
    while True:
        if all_greedy:
            tokens = sample_next(logits, params_list[0])  # (B,): argmax is row-wise, one call serves all
        else:
            # Row by row: each request draws from its own generator exactly once per token, as when alone.
            tokens = torch.cat([sample_next(logits[i:i + 1], states[i].params, states[i].generator)
                                for i in range(B)])
        for i, t in enumerate(tokens.tolist()):
            if not active[i]:
                continue  # a finished row still runs through the model (static batching); its tokens are dropped
            finished = states[i].accept([t])
            if on_token is not None:
                on_token(i, t)
            if finished:
                active[i] = False
        if not any(active):
            return [list(o) for o in outputs]
        # subtle: a finished short row keeps advancing and could run past the window; its position is clamped
        # (its output is dropped anyway). Active rows never reach the clamp: start_request capped them.
        positions = static_positions(pad_lens, slot, 1).clamp(max=cfg.block_size - 1)  # (B, 1)
        logits = decode_step(model, cache, tokens, positions)  # (B, V)
        slot += 1


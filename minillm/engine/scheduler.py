"""Iteration-level scheduling (Orca): every engine step decides afresh which requests run and how many tokens each.

What it adds over chapter 04's static batch: requests join the batch the step after they arrive and leave it the
step they finish, so a short request never waits for the longest one in its batch (Yu et al., Orca, OSDI 2022,
§3.2 "iteration-level scheduling"). Admission is by free KV blocks (chapter 05's `BlockManager`), a token budget
per step and a batch limit; when blocks run out the most recently admitted request is preempted, by recomputation
or by swapping its blocks to CPU memory; long prompts are split into chunks that share a step with the running
decodes (Agrawal et al., SARATHI, arXiv:2308.16369; Sarathi-Serve's "stall-free batching", OSDI 2024).
What it leaves out: priorities other than arrival order, and any cost model (it never guesses step times).

Invariants (checked by `check_invariants`, relied on by the engine and the tests):
  I1. Every unfinished request is in exactly one of `waiting`, `running`, `swapped`; finished ones in none. (A
      parallel sample, n > 1, enters through `add_forked` once its sample 0 has its first token; until then the
      engine holds it outside the scheduler, holding no blocks.)
  I2. A WAITING request holds no blocks and has num_computed_tokens == 0; a SWAPPED one holds no pool blocks
      (its KV is in the swap space); a RUNNING one holds blocks for num_block_tokens >= num_computed_tokens.
  I3. len(running) <= max_num_seqs at every moment.
  I4. One step's scheduled tokens sum to <= max_num_batched_tokens, and every scheduled request gets >= 1 token.
  I5. Admission is first come, first served: the head of `waiting` blocks everyone behind it (no overtaking, so a
      big request is never starved by a stream of small ones). Swapped requests come back before waiting ones.
  I6. Decodes are scheduled before prompt chunks (stall-free batching): a long prompt can delay a decode by at
      most one chunk's worth of compute, never by its whole prefill.
  I7. Preemption victims are taken from the tail of `running` (the latest admitted); a step that preempted admits
      nobody (it would only thrash: the admitted request would be the next victim).
  I8. A request that finishes frees its blocks in the same `update` call; an aborted one at once.
  I9. When no request is unfinished, every block of the pool is free (the tests assert it after every workload).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from minillm.core.config import CheckedFields, check_float, check_int, plain_int, short_repr
from minillm.engine.config import EngineConfig
from minillm.engine.request import Request, RequestStatus


@dataclass
class ScheduledRequest(CheckedFields):
    request: Request
    num_new_tokens: int  # feed all_token_ids[start : start + num_new_tokens] this step
    start: int  # request.num_computed_tokens when scheduled (the position of the first new token)

    def __post_init__(self) -> None:
        """The scheduler builds these; one built by hand is checked here (a TypeError / ValueError naming the
        field), not when a step reads it."""
        self.check_fields()
        self.check_span(self.num_new_tokens)
        self._checked = True  # its fields are fixed from here (CheckedFields)

    FIXED = ("request", "num_new_tokens", "start", "draft_token_ids", "draft_probs")

    def check_fields(self) -> None:
        """request an engine Request, num_new_tokens and start ints >= 0 (kept as the plain ints)."""
        if not isinstance(self.request, Request):
            raise TypeError(f"request must be an engine Request, got {type(self.request).__name__}")
        self.num_new_tokens = check_int("num_new_tokens", self.num_new_tokens, 0)
        self.start = check_int("start", self.start, 0)

    def check_span(self, known: int) -> None:
        """The `known` tokens this entry feeds from the request (positions start .. start + known - 1) are tokens
        the request holds: a start past them would feed an empty or short slice, and the step would compute
        positions no token is at."""
        if type(known) is not int or known < 0:  # a cheap test first: every entry of every step comes here
            known = check_int("known", known, 0)  # the TypeError / ValueError naming it (an int subclass passes)
        if self.start + known > self.request.num_tokens:
            raise ValueError(f"start={self.start} with {known} known tokens to feed runs past the request's "
                             f"{self.request.num_tokens} tokens (start + tokens <= {self.request.num_tokens})")

    @property
    def samples(self) -> bool:
        """True when this step reaches the last known token, so its logits give the next output token."""
        return self.start + self.num_new_tokens == self.request.num_tokens

    def fed_tokens(self) -> list[int]:
        """The token ids this entry feeds, one per position start .. start + num_new_tokens - 1."""
        return self.request.token_slice(self.start, self.start + self.num_new_tokens)

    def sample_rows(self) -> range:
        """Which of this entry's rows (0 .. num_new_tokens - 1) go through the output head: its last, if it samples.
        Chapter 08's verify entry overrides it to sample the last known token's row and every draft's."""
        n = self.num_new_tokens
        return range(n - 1, n) if self.samples else range(0)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)  # decodes first, then prompt chunks
    preempted: list[Request] = field(default_factory=list)  # requests preempted in this step
    cow_pairs: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) block copies before the forward
    # Swaps are step data too, decided here and carried out by the executor before the forward (swap-outs first:
    # a victim's blocks may go to another request in this same step). Keys are request ids.
    swap_out: list[tuple[str, list[int]]] = field(default_factory=list)  # (request id, its pool blocks) -> host
    swap_in: list[tuple[str, list[int]]] = field(default_factory=list)  # (request id, its new pool blocks) <- host
    swap_discard: list[str] = field(default_factory=list)  # host copies to drop (a swapped request was aborted)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        """Nothing to run: no forward and no bytes to move."""
        return not (self.scheduled or self.swap_out or self.swap_in or self.swap_discard)


def check_request_id(request_id: object) -> str:
    """An engine request's id, as the plain str it holds; a TypeError naming request_id otherwise (an id of another
    type can match no request, so the call would do nothing without a word)."""
    if not isinstance(request_id, str):
        raise TypeError(f"request_id must be a str, got {type(request_id).__name__} {short_repr(request_id)}")
    return str.__str__(request_id)


def check_new_request(name: str, request: object, prefilled: bool = False) -> Request:
    """`request` if it is an engine Request that is WAITING with nothing computed (what the queues take in; a
    `prefilled` arrival has its prompt computed elsewhere); a TypeError / ValueError naming `name` otherwise."""
    if not isinstance(request, Request):
        raise TypeError(f"{name} must be an engine Request, got {type(request).__name__} {short_repr(request)}")
    if request.status is not RequestStatus.WAITING or (request.num_computed_tokens != 0 and not prefilled):
        raise ValueError(f"{name} {request.request_id!r} must be a new request (WAITING"
                         f"{'' if prefilled else ', nothing computed'}), got status {request.status.name} with "
                         f"{request.num_computed_tokens} computed tokens")
    return request


def check_step_output(out: object) -> None:
    """`out` a SchedulerOutput whose scheduled entries are ScheduledRequests (a TypeError naming it otherwise): what
    a sampler and `Scheduler.update` read."""
    if not isinstance(out, SchedulerOutput):
        raise TypeError(f"out must be the step's SchedulerOutput, got {type(out).__name__}")
    if not isinstance(out.scheduled, list) or not all(isinstance(s, ScheduledRequest) for s in out.scheduled):
        raise TypeError("out.scheduled must be a list of ScheduledRequest entries (the scheduler's), got "
                        f"{short_repr(out.scheduled)}")


def check_sampled_token(name: str, token: object, vocab_size: int | None) -> int:
    """A sampled token: a plain int id in [0, vocab_size) (any id >= 0 when the vocabulary is unknown); a TypeError /
    ValueError naming it otherwise (2.7, '3' or True would be appended as another token, and an id past the
    vocabulary is the next step's IndexError in the embedding)."""
    plain = plain_int(token)  # a Python or numpy int as the plain int it holds; None for 2.7, '3', True
    if plain is None:
        raise TypeError(f"{name} must be a token id (an int), got {type(token).__name__} {short_repr(token)}")
    token = plain
    if token < 0 or (vocab_size is not None and token >= vocab_size):
        raise ValueError(f"{name} = {token} is outside the vocabulary [0, {vocab_size if vocab_size else 'V'})")
    return token


def check_sample_entry(i: int, entry: ScheduledRequest, token: Any, check: Callable[[Any, str], Any]) -> Any:
    """sampled[i] against its entry, before `update` changes anything: a token (checked by `check`, which names it)
    exactly where the entry samples, None where it does not (a prompt chunk short of the prompt's end) or where the
    request failed in its sampling; anything goes for a request aborted since the step was scheduled (`update`
    skips it). A ValueError naming sampled[i] otherwise: a token for a chunk would be appended as output, and a
    missing one would leave a running request without its next token."""
    if type(i) is not int or not isinstance(entry, ScheduledRequest) or not callable(check):  # one cheap test
        _refuse_entry_args(i, entry, check)
    if entry.request.is_finished:  # aborted since the step was scheduled
        return None
    if token is None:
        if entry.samples and not entry.request.state.finished:
            raise ValueError(f"sampled[{i}] is None, but entry {i} ({entry.request.request_id!r}) samples and its "
                             "request did not fail: its next token is due")
        return None
    if not entry.samples:
        raise ValueError(f"sampled[{i}] = {short_repr(token)}, but entry {i} ({entry.request.request_id!r}) does not "
                         "sample (a prompt chunk short of the prompt's end): give None")
    return check(token, f"sampled[{i}]")


def _refuse_entry_args(i: object, entry: object, check: object) -> None:
    """The TypeError naming whichever of `check_sample_entry`'s arguments is not what it takes."""
    if type(i) is not int:
        raise TypeError(f"i must be the entry's index (an int), got {type(i).__name__} {short_repr(i)}")
    if not isinstance(entry, ScheduledRequest):
        raise TypeError(f"entry must be a ScheduledRequest (the step's entry {i}), got {type(entry).__name__} "
                        f"{short_repr(entry)}")
    raise TypeError(f"check must be a function (token, name) -> token, got {type(check).__name__}")


def check_sampled(out: SchedulerOutput, sampled: object) -> None:
    """`out` the step's SchedulerOutput and `sampled` a list with one entry per scheduled request of it; a
    TypeError / ValueError naming the one that is not."""
    check_step_output(out)
    if not isinstance(sampled, list):
        raise TypeError(f"sampled must be a list (one entry per scheduled request), got {type(sampled).__name__}")
    if len(sampled) != len(out.scheduled):
        raise ValueError(f"sampled has {len(sampled)} entries for the step's {len(out.scheduled)} scheduled requests")


def check_update_args(out: object, sampled: object, now: object) -> None:
    """`Scheduler.update`'s arguments (and chapter 08's override's): a TypeError / ValueError naming the one that is
    not the step's SchedulerOutput, a list with one entry per scheduled request, or a finite time in seconds."""
    check_sampled(out, sampled)  # type: ignore[arg-type]
    check_float("now", now)


class Scheduler:
    """Queues plus one decision per step. It moves requests between queues and blocks; it never touches tensors.

    Swapping is bookkeeping here too: the scheduler counts the host blocks a swapped request holds
    (`num_swap_blocks_used`, at most `config.num_swap_blocks`) and writes what to copy into the step's
    `SchedulerOutput.swap_out` / `swap_in` / `swap_discard`; the executor moves the bytes.
    """

    def __init__(self, config: EngineConfig, block_manager):
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        if not hasattr(block_manager, "num_free_blocks"):  # duck-typed: the course's probes pass a stand-in
            raise TypeError(f"block_manager must be a BlockManager (chapter 05), got {type(block_manager).__name__}")
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order = priority order (head first)
        self.swapped: deque[Request] = deque()
        self.num_preemptions = 0
        self.num_swap_blocks_used = 0  # host blocks held by SWAPPED requests (== sum of their num_swapped_blocks)
        self.num_swap_outs = 0
        self.num_swap_ins = 0
        self._discards: list[str] = []  # host copies of aborted swapped requests, dropped with the next step
        # Admission leaves this many blocks free for running decodes that will cross a block boundary soon, so a
        # fresh admission is not the next step's victim (vLLM's watermark). Ignored when nothing runs (see below).
        self.watermark_blocks = max(1, config.num_blocks // 100)
        self.vocab_size: int | None = None  # the model's, when known (the LLM sets it): sampled tokens are its ids
        self._awaiting: SchedulerOutput | None = None  # the last schedule()'s output, until its update

    # ---------------------------------------------------------------- queue management

    def add(self, request: Request) -> None:
        self.waiting.append(check_new_request("request", request))

    def add_swapped(self, request: Request, num_blocks: int) -> None:
        """Queue a request whose KV already sits in host memory under its id (chapter 07's prefilled arrivals):
        it is admitted like a swapped request, in order. Not bounded by the swap capacity: it is an arrival, not
        a victim."""
        check_new_request("request", request, prefilled=True)
        num_blocks = check_int("num_blocks", num_blocks)
        most = self._blocks_for(request.max_kv_tokens)  # more could never have been computed for it
        if num_blocks > most:
            raise ValueError(f"num_blocks={num_blocks} is more than request {request.request_id!r} can hold: {most} "
                             f"blocks of {self.config.block_size} for its {request.max_kv_tokens} KV tokens at most")
        request.status = RequestStatus.SWAPPED
        request.num_swapped_blocks = num_blocks
        self.num_swap_blocks_used += num_blocks
        self.swapped.append(request)

    def add_forked(self, requests: list[Request]) -> None:
        """Parallel samples (n > 1) just forked from their sample 0 (`LLM._fork_held`): each shares the prompt's
        blocks (`BlockManager.fork`), has the prompt computed (num_computed_tokens == num_block_tokens == prompt
        length) and its first token accepted, so its next step is a decode. They join `running` at the tail, as
        the latest admitted (I7: the first victims if blocks run short; their first decode copies the shared last
        block, a `cow_pairs` entry).

        The batch limit still holds (I3). Samples beyond `max_num_seqs` give their shared blocks back (only ref
        counts drop) and wait at the head of `waiting`, in index order, as if preempted by recomputation the
        moment they were born (I2: no blocks, nothing computed): they are admitted by the usual rules (I5, ahead of
        every later arrival) and recompute prompt + first token in one prefill, whose logits give their second
        token with their own generator, no extra draw. That is not counted as a preemption.
        """
        if not isinstance(requests, list) or not all(isinstance(r, Request) for r in requests):
            raise TypeError(f"requests must be a list of engine Requests, got {short_repr(requests)}")
        overflow: list[Request] = []
        for req in requests:
            assert req.status is RequestStatus.WAITING and not req.is_finished, req
            assert req.num_computed_tokens == req.num_block_tokens == req.num_prompt_tokens, req
            if len(self.running) < self.config.max_num_seqs:
                req.status = RequestStatus.RUNNING
                self.running.append(req)
            else:
                self.block_manager.free(req.request_id)
                req.num_computed_tokens = req.num_block_tokens = 0
                overflow.append(req)
        self.waiting.extendleft(reversed(overflow))  # ahead of everyone waiting, in index order

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def abort(self, request_id: str) -> Request | None:
        """Remove a request from whichever queue holds it and free what it holds (I8). None if unknown/finished; a
        TypeError for an id that is not a str (no request could have it)."""
        request_id = check_request_id(request_id)
        for queue in (self.waiting, self.running, self.swapped):
            for req in queue:
                if req.request_id == request_id:
                    queue.remove(req)
                    self._release(req)
                    req.status = RequestStatus.FINISHED_ABORTED
                    req.finish_reason = "abort"
                    return req
        return None

    def _release(self, req: Request) -> None:
        """Give back everything `req` holds: its pool blocks if running, its host copy if swapped (the executor
        drops the bytes with the next step: `SchedulerOutput.swap_discard`)."""
        if req.status is RequestStatus.RUNNING:
            self.block_manager.free(req.request_id)
        elif req.status is RequestStatus.SWAPPED:
            self.num_swap_blocks_used -= req.num_swapped_blocks
            req.num_swapped_blocks = 0
            self._discards.append(req.request_id)
        req.num_block_tokens = 0

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.config.block_size)  # ceil

    # ---------------------------------------------------------------- admission and preemption

    def _can_admit(self, req: Request, budget: int, num_tokens: int) -> bool:
        """May `req` (needing blocks for `num_tokens` tokens) join the running batch in this step?

        Three limits, all of which must hold (Orca §3.2 + vLLM's block-based admission):
          - the batch limit: fewer than max_num_seqs requests running (I3);
          - the token budget: without chunked prefill the request's whole uncomputed part must fit what is left
            of this step's budget; with chunking any budget left is enough (the prompt goes in chunks);
          - the KV pool: free blocks for `num_tokens`, plus the watermark unless nothing is running (if nothing
            runs, waiting for the watermark could wait forever: a request that fits the pool must be admitted).
        """
        # BEGIN SOLUTION
        if len(self.running) >= self.config.max_num_seqs or budget <= 0:
            return False
        if not self.config.enable_chunked_prefill and req.num_tokens - req.num_computed_tokens > budget:
            return False
        needed = self._blocks_for(num_tokens)
        if self.running:
            needed += self.watermark_blocks
        return self.block_manager.num_free_blocks >= needed
        # END SOLUTION

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        """Take `victim` out of the running batch and free its blocks (I7).

        Swap: its blocks go to host memory (`out.swap_out`: the executor copies them before this step's forward)
        and it keeps its progress. Recompute (or swap space full): drop its KV; it goes back to the *front* of
        `waiting` and recomputes prompt + outputs so far as one long prefill, whose last logits give exactly the
        token the next decode would have (same generator, no extra draw).
        """
        self.num_preemptions += 1
        victim.num_preemptions += 1
        n_blocks = self._blocks_for(victim.num_block_tokens)
        swap_fits = self.num_swap_blocks_used + n_blocks <= self.config.num_swap_blocks
        if self.config.preemption_mode == "swap" and swap_fits:
            table = self.block_manager.block_table(victim.request_id)
            assert len(table) == n_blocks, (table, n_blocks)
            out.swap_out.append((victim.request_id, table))  # copied before anything reuses these blocks
            self.block_manager.free(victim.request_id)
            victim.status = RequestStatus.SWAPPED
            victim.num_swapped_blocks = n_blocks
            self.num_swap_blocks_used += n_blocks
            self.num_swap_outs += 1
            self.swapped.append(victim)
            return
        self.block_manager.free(victim.request_id)
        victim.num_computed_tokens = 0
        victim.num_block_tokens = 0
        victim.status = RequestStatus.WAITING
        self.waiting.appendleft(victim)  # I5: a victim keeps its place ahead of everyone who arrived later

    def _ensure_slots(self, req: Request, upto: int, out: SchedulerOutput) -> None:
        """Give `req` block slots for its first `upto` tokens (a decode appends one slot, maybe one new block)."""
        tokens = req.all_token_ids
        while req.num_block_tokens < upto:
            pairs = self.block_manager.append_slot(req.request_id, tokens[req.num_block_tokens])
            if pairs:
                out.cow_pairs.extend(pairs)
            req.num_block_tokens += 1

    # ---------------------------------------------------------------- one step

    def schedule(self) -> SchedulerOutput:
        """Decide this step's batch: running decodes, then running prompt chunks, then admissions.

        1. Decodes (I6). Each running request with one uncomputed token gets one token, after making sure it has
           a slot; if the pool is out of blocks, preempt from the tail of `running` until it has one (or it is
           itself the tail, and goes). The budget always covers them: max_num_batched_tokens >= max_num_seqs.
        2. Running prompts (chunked prefill in progress): the next chunk, as big as the budget left allows.
        3. Unless step 1 preempted (I7): bring back swapped requests, then admit from the head of `waiting` while
           `_can_admit` says yes (I5), allocating blocks for the whole known sequence at once and scheduling its
           first chunk (or, without chunking, all of it).
        """
        out = SchedulerOutput(swap_discard=self._discards)
        self._discards = []
        # BEGIN SOLUTION
        cfg, bm = self.config, self.block_manager
        budget = cfg.max_num_batched_tokens

        # 1. decodes, in priority order
        i = 0
        while i < len(self.running):
            req = self.running[i]
            if req.is_prefill:
                i += 1
                continue
            while req.num_block_tokens < req.num_tokens and not bm.can_append(req.request_id):
                victim = self.running.pop()  # I7: the latest admitted; never one already scheduled (they are < i)
                self._preempt(victim, out)
                out.preempted.append(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break  # req was the tail and preempted itself: nothing behind it is left
            self._ensure_slots(req, req.num_tokens, out)
            out.scheduled.append(ScheduledRequest(req, 1, req.num_computed_tokens))
            budget -= 1
            i += 1

        # 2. prompt chunks of running requests (blocks were allocated at admission: no preemption needed)
        for req in self.running:
            if budget <= 0:
                break
            if req.is_prefill:
                n = req.num_uncomputed_tokens
                if cfg.enable_chunked_prefill:
                    n = min(n, budget)
                elif n > budget:
                    continue
                out.scheduled.append(ScheduledRequest(req, n, req.num_computed_tokens))
                budget -= n

        # 3. admissions: swapped first, then waiting, both in order, none after a preemption
        if not out.preempted:
            while self.swapped and budget > 0:
                req = self.swapped[0]
                if not self._can_admit(req, budget, req.num_block_tokens + 1):
                    break
                self.swapped.popleft()
                bm.allocate(req.request_id, req.all_token_ids[: req.num_block_tokens])
                self._swap_in(req, out)
                budget -= self._start(req, budget, out)
            while self.waiting and budget > 0 and not self.swapped:
                req = self.waiting[0]
                if not self._can_admit(req, budget, req.num_tokens):
                    break
                self.waiting.popleft()
                num_cached = bm.allocate(req.request_id, req.all_token_ids) or 0
                req.num_block_tokens = req.num_tokens
                # subtle: keep at least the last token uncomputed, or there would be no logits to sample from
                req.num_computed_tokens = min(int(num_cached), req.num_tokens - 1)
                budget -= self._start(req, budget, out)
        # END SOLUTION
        self._awaiting = out if out.scheduled else None  # the one output `update` takes next
        return out

    def _swap_in(self, req: Request, out: SchedulerOutput) -> None:
        """Its host copy goes into the blocks just allocated for it, in order (`out.swap_in`)."""
        table = self.block_manager.block_table(req.request_id)
        assert len(table) >= req.num_swapped_blocks, (table, req.num_swapped_blocks)
        out.swap_in.append((req.request_id, table[: req.num_swapped_blocks]))
        self.num_swap_blocks_used -= req.num_swapped_blocks
        req.num_swapped_blocks = 0
        self.num_swap_ins += 1

    def _start(self, req: Request, budget: int, out: SchedulerOutput) -> int:
        """Move a just-allocated request into `running` and schedule its first piece of work; return tokens used."""
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        self._ensure_slots(req, req.num_tokens, out)
        n = req.num_uncomputed_tokens
        if self.config.enable_chunked_prefill:
            n = min(n, budget)
        assert 0 < n <= budget, (n, budget)
        out.scheduled.append(ScheduledRequest(req, n, req.num_computed_tokens))
        return n

    # ---------------------------------------------------------------- after the forward

    def update(self, out: SchedulerOutput, sampled: list[int | None], now: float) -> list[Request]:
        """Advance every scheduled request by its tokens, append the sampled ones, finish and free (I8).

        `sampled[i]` is the token drawn for `out.scheduled[i]` (None for a prompt chunk that is not the last).
        Returns the requests that finished in this step. out must be the step's SchedulerOutput, sampled a list
        of one entry per scheduled request and now a time in seconds (a TypeError / ValueError naming them).
        """
        check_update_args(out, sampled, now)
        sampled = self.claim(out, sampled, lambda i, s, token: check_sample_entry(
            i, s, token, lambda t, name: check_sampled_token(name, t, self.vocab_size)))
        return self._advance(out, sampled, now)

    def claim(self, out: SchedulerOutput, sampled: list, check: Callable[[int, ScheduledRequest, Any], Any]
              ) -> list:
        """Take `out` for its update and check `sampled` against it (`check(i, entry, token)` returns the token as
        the update reads it): a step is updated once, by the scheduler whose last `schedule()` returned it. A stale
        output (updated already) or another scheduler's would advance requests by tokens they never computed; a
        ValueError says so before anything changes (an output with no entries changes nothing). Only when every
        token passes is `out` taken: a refused update can be retried with the right tokens."""
        check_sampled(out, sampled)
        if not callable(check):
            raise TypeError(f"check must be a function (i, entry, token) -> token, got {type(check).__name__}")
        if out.scheduled and out is not self._awaiting:
            raise ValueError("out is not the SchedulerOutput this scheduler's last schedule() returned (already "
                             "updated, or another scheduler's): each step is updated once, by its own scheduler")
        sampled = [check(i, s, token) for i, (s, token) in enumerate(zip(out.scheduled, sampled))]
        if out.scheduled:  # an empty output takes nothing: the step in flight keeps its claim
            self._awaiting = None
        return sampled

    def _advance(self, out: SchedulerOutput, sampled: list[int | None], now: float) -> list[Request]:
        """The body of `update` on checked arguments (chapter 08's update passes its plain entries here)."""
        finished: list[Request] = []
        for s, tok in zip(out.scheduled, sampled):
            req = s.request
            if req.is_finished:  # aborted since the step was scheduled: nothing to advance
                continue
            assert req.num_computed_tokens == s.start
            req.num_computed_tokens += s.num_new_tokens
            if tok is None and req.state.finished:  # its sampling failed (ModelRunner.sample): it alone ends here
                req.finish()
                self.block_manager.free(req.request_id)
                req.num_block_tokens = 0
                finished.append(req)
                continue
            if tok is None:
                assert not s.samples
                continue
            # The one stop rule of every loop (`RequestState.accept`): eos, stop strings, max tokens, the window.
            if req.accept([int(tok)], now):
                self.block_manager.free(req.request_id)
                req.num_block_tokens = 0
                finished.append(req)
        if finished:
            done = {id(r) for r in finished}
            self.running = [r for r in self.running if id(r) not in done]
        return finished

    # ---------------------------------------------------------------- checks

    def check_invariants(self) -> None:
        """Assert I1-I3 and I9 (cheap; the tests call it after every step)."""
        ids = [r.request_id for q in (self.waiting, self.running, self.swapped) for r in q]
        assert len(ids) == len(set(ids)), "a request is in two queues (I1)"
        assert len(self.running) <= self.config.max_num_seqs, "batch limit exceeded (I3)"
        for r in self.waiting:
            assert r.status is RequestStatus.WAITING and r.num_computed_tokens == 0 and r.num_block_tokens == 0, r
        for r in self.running:
            assert r.status is RequestStatus.RUNNING and r.num_block_tokens >= r.num_computed_tokens, r
        for r in self.swapped:
            assert r.status is RequestStatus.SWAPPED and r.num_swapped_blocks > 0 and r.num_block_tokens > 0, r
        assert self.num_swap_blocks_used == sum(r.num_swapped_blocks for r in self.swapped), "swap blocks leaked"
        if not self.has_unfinished():
            assert self.block_manager.num_free_blocks == self.config.num_blocks, "blocks leaked while idle (I9)"

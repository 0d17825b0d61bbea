"""Planted wrong solutions: each is a plausible mistake in one exercise, and the grader must take points off for it.

A grader whose tests pass for wrong code teaches the wrong thing (chapter 01's trainer-vs-trainer test passed a
right-to-left `merge`; chapter 05's tests passed an `allocate` that skips the `_on_take` hook). For every planted
mistake below, the student folder holds the reference solution of every exercise of the chapter except one small
edit inside one solution region; grading it must cost points, and only in tests that say they grade that exercise.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from minillm.course.assignment import (CHAPTER_FILES, REPO_ROOT, grade, graded_tests, is_c_source, markers,
                                       write_assignment)


@dataclass(frozen=True)
class Plant:
    chapter: str
    name: str  # what the mistake is
    file: str  # from the repository root
    exercise: str  # the function whose solution region is edited
    old: str  # text inside that region (exactly once)
    new: str

    @property
    def id(self) -> str:
        return f"{self.chapter}-{self.name}"


PLANTS = (
    # 01 tokenization
    Plant("01", "merge-right-to-left", "minillm/tokenizer/basics.py", "merge",
          "    i, n = 0, len(ids)\n    while i < n:\n        if i + 1 < n and ids[i] == a and ids[i + 1] == b:\n"
          "            out.append(new_id)\n            i += 2\n        else:\n            out.append(ids[i])\n"
          "            i += 1\n    return out\n",
          "    i = len(ids) - 1\n    while i >= 0:\n        if i >= 1 and ids[i - 1] == a and ids[i] == b:\n"
          "            out.append(new_id)\n            i -= 2\n        else:\n            out.append(ids[i])\n"
          "            i -= 1\n    return out[::-1]\n"),
    Plant("01", "pair-counts-ignore-weight", "minillm/tokenizer/basics.py", "get_pair_counts",
          "counts.get(pair, 0) + weight", "counts.get(pair, 0) + 1"),
    Plant("01", "encode-first-pair-not-lowest-rank", "minillm/tokenizer/encode.py", "encode_chunk",
          "(best_rank is None or rank < best_rank)", "best_rank is None"),
    # 02 gpt
    Plant("02", "attention-unscaled", "minillm/core/attention.py", "attention_ref",
          " / math.sqrt(hs)", ""),
    Plant("02", "attention-mask-ignored", "minillm/core/attention.py", "attention_ref",
          "if mask is not None:", "if False:"),
    # 03 naive inference
    Plant("03", "top-k-drops-ties", "minillm/core/sampling.py", "top_k_filter",
          'return logits.masked_fill(logits < kth, float("-inf"))',
          'keep = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, torch.topk(logits, k, dim=-1).indices, True)\n'
          '    return logits.masked_fill(~keep, float("-inf"))'),
    Plant("03", "top-p-inclusive-mass", "minillm/core/sampling.py", "top_p_filter",
          "mass_before = torch.cumsum(probs, dim=-1) - probs", "mass_before = torch.cumsum(probs, dim=-1)"),
    Plant("03", "tpot-divides-by-n", "minillm/core/metrics.py", "tpot",
          "return (self.e2e - self.ttft) / (n - 1)", "return (self.e2e - self.ttft) / n"),
    Plant("03", "itl-counts-the-first-token", "minillm/core/metrics.py", "itl",
          "zip(self.token_times, self.token_times[1:])", "zip([self.arrival] + self.token_times, self.token_times)"),
    # 04 kv cache
    Plant("04", "chunk-without-offset-mask", "minillm/kvcache/cache.py", "attend",
          "return attention(q, keys, values, mask=causal_mask(T, end, device=q.device))",
          "return attention(q, keys, values)"),
    Plant("04", "padding-query-sees-nothing", "minillm/kvcache/cache.py", "attention_mask",
          "mask |= (slots.unsqueeze(0) == q_slots.unsqueeze(1)).unsqueeze(0)", "pass"),
    Plant("04", "right-padding", "minillm/kvcache/generate.py", "left_pad",
          "idx[row, T_max - len(p):]", "idx[row, :len(p)]"),
    Plant("04", "positions-not-clamped", "minillm/kvcache/generate.py", "static_positions",
          ".clamp(min=0)", ""),
    # 05 paged attention
    Plant("05", "allocate-skips-on-take", "minillm/paged/block_allocator.py", "allocate",
          "        self._on_take(block)\n", ""),
    Plant("05", "slot-forgets-block-size", "minillm/paged/block_manager.py", "compute_slot_mapping",
          "block_table[p // block_size] * block_size + p % block_size", "block_table[p // block_size] + p % block_size"),
    Plant("05", "copy-on-write-never-copies", "minillm/paged/block_manager.py", "_copy_on_write",
          "if self.allocator.ref_count(src) == 1:", "if True:"),
    Plant("05", "write-kv-block-offset-swapped", "minillm/paged/paged_cache.py", "write_kv",
          "pool.view(nb * bs, nh, hs).index_copy_(0, slot_mapping, x.to(pool.dtype))",
          "pool[slot_mapping % nb, slot_mapping // nb] = x.to(pool.dtype)"),
    # 06 continuous batching
    Plant("06", "admission-without-watermark", "minillm/engine/scheduler.py", "_can_admit",
          "needed += self.watermark_blocks", "needed += 0"),
    Plant("06", "chunk-ignores-budget", "minillm/engine/scheduler.py", "schedule",
          "n = min(n, budget)", "n = n"),
    # 07 disaggregation
    Plant("07", "pack-kv-interleaves-blocks", "minillm/disagg/kv_transfer.py", "pack_kv",
          "k = k_pool[idx].reshape(need * bs, nh, hs)[:num_tokens]",
          "k = k_pool[idx].transpose(0, 1).reshape(need * bs, nh, hs)[:num_tokens]"),
    Plant("07", "unpack-kv-swaps-k-and-v", "minillm/disagg/kv_transfer.py", "unpack_kv",
          "k_pool[blocks, offsets] = payload[layer, 0]", "k_pool[blocks, offsets] = payload[layer, 1]"),
    Plant("07", "admission-overtakes", "minillm/disagg/decode_worker.py", "admit_handoffs",
          "        if need > available:\n            break\n", "        if need > available:\n            continue\n"),
    # 08 speculative decoding
    Plant("08", "residual-q-minus-p", "minillm/speculative/sampling.py", "residual_distribution",
          "r = (p - q).clamp(min=0)", "r = (q - p).clamp(min=0)"),
    Plant("08", "accept-with-q-over-p", "minillm/speculative/sampling.py", "acceptance_probability",
          "(p_x / q_x).clamp(max=1.0)", "(q_x / p_x).clamp(max=1.0)"),
    Plant("08", "bonus-from-the-last-draft-row", "minillm/speculative/sampling.py", "accept_or_resample",
          "torch.multinomial(p[gamma], 1, generator=generator)",
          "torch.multinomial(p[gamma - 1], 1, generator=generator)"),
    Plant("08", "resample-from-p", "minillm/speculative/sampling.py", "accept_or_resample",
          "resid = residual_distribution(p[i], q[i])", "resid = p[i]"),
    Plant("08", "greedy-without-the-bonus", "minillm/speculative/sampling.py", "accept_greedy",
          "    out.append(best[len(out)])", "    if len(out) < len(tokens):\n        out.append(best[len(out)])"),
    # 09 quantization
    Plant("09", "zero-point-subtracted", "minillm/quant/quantize.py", "quantize_asymmetric",
          "torch.round(x / scale) + zero.to(x.dtype)", "torch.round(x / scale) - zero.to(x.dtype)"),
    Plant("09", "nibbles-swapped-in-pack", "minillm/quant/quantize.py", "pack_int4",
          "return (low | (high << 4)).to(torch.uint8)", "return (high | (low << 4)).to(torch.uint8)"),
    Plant("09", "gptq-error-not-scaled-by-u-ii", "minillm/quant/gptq.py", "gptq_quantize",
          "err = (W[:, i] - w_hat[:, 0]) / U[i, i]", "err = W[:, i] - w_hat[:, 0]"),
    Plant("09", "ste-without-detach", "minillm/quant/qat.py", "fake_quantize",
          "return w + (w_hat - w).detach()", "return w + (w_hat - w)"),
    # 10 pruning
    Plant("10", "magnitude-signed-not-absolute", "minillm/prune/masks.py", "magnitude_mask",
          "lowest_k_mask(weight.detach().abs().flatten(), k)", "lowest_k_mask(weight.detach().flatten(), k)"),
    Plant("10", "wanda-squared-norm", "minillm/prune/masks.py", "wanda_score",
          "input_norm.to(weight.dtype)[None, :]", "input_norm.to(weight.dtype)[None, :] ** 2"),
    Plant("10", "nm-groups-down-the-columns", "minillm/prune/masks.py", "nm_mask",
          "groups = scores.detach().reshape(out, cols // m, m)",
          "groups = scores.detach().t().reshape(out, cols // m, m)"),
    Plant("10", "nm-keeps-the-smallest", "minillm/prune/masks.py", "nm_mask",
          "keep = lowest_k_mask(groups, m - n)", "keep = ~lowest_k_mask(groups, n)"),
    # 11 distillation
    Plant("11", "kd-without-t-squared", "minillm/distill/losses.py", "kd_loss",
          "return (temperature ** 2 * kl.mean()).to(dtype)", "return kl.mean().to(dtype)"),
    Plant("11", "forward-kl-weighted-by-the-student", "minillm/distill/losses.py", "kd_loss",
          "kl = (log_p.exp() * (log_p - log_q)).sum(dim=-1)", "kl = (log_q.exp() * (log_q - log_p)).sum(dim=-1)"),
    Plant("11", "teacher-not-softened", "minillm/distill/losses.py", "kd_loss",
          "log_p = F.log_softmax(teacher_logits.reshape(-1, V) / temperature, dim=-1)",
          "log_p = F.log_softmax(teacher_logits.reshape(-1, V), dim=-1)"),
    # 12 cuda kernels (the CPU mirrors of their algorithms)
    Plant("12", "merge-without-rescaling-the-second-sum", "minillm/kernels/mirror.py", "online_merge",
          "s2 * torch.exp(m2 - safe)", "s2"),
    Plant("12", "output-not-rescaled", "minillm/kernels/mirror.py", "attend_tile",
          "o = o * alpha.unsqueeze(-1) + ", "o = o + "),
    Plant("12", "sum-not-rescaled", "minillm/kernels/mirror.py", "attend_tile",
          "l = l * alpha + p.sum(dim=-1)", "l = l + p.sum(dim=-1)"),
    Plant("12", "shuffle-stops-one-step-early", "minillm/kernels/mirror.py", "warp_tree_sum",
          "for offset in (16, 8, 4, 2, 1):", "for offset in (16, 8, 4, 2):"),
    Plant("12", "gather-offset-from-the-block-index", "minillm/kernels/mirror.py", "paged_gather",
          "slots = blocks * bs + j % bs", "slots = blocks * bs + blocks % bs"),
    # 12 cuda kernels (the kernel in CUDA C++, compiled by the emulator)
    Plant("12", "v2-sum-tree-without-barrier", "minillm/kernels/csrc/softmax.cu", "softmax_v2_kernel",
          "        if (tid < stride) buf[tid] += buf[tid + stride];\n        __syncthreads();\n",
          "        if (tid < stride) buf[tid] += buf[tid + stride];\n"),
    Plant("12", "v2-each-thread-its-own-max", "minillm/kernels/csrc/softmax.cu", "softmax_v2_kernel",
          "    m = buf[0];\n", "    m = buf[tid];\n"),
    # 13 compilation (the PyTorch mirrors of its C++ loops)
    Plant("13", "gemv-tail-columns-dropped", "minillm/compile/mirror.py", "gemv_blocked",
          "        sums = sums + (x[:, None, k8:] * block[None, :, k8:]).sum(-1)  # the K % LANES tail\n", ""),
    Plant("13", "gemv-bias-of-the-first-block", "minillm/compile/mirror.py", "gemv_blocked",
          "sums = sums + b[n0:n0 + ROWS]", "sums = sums + b[:block.shape[0]]"),
    Plant("13", "step-attends-without-itself", "minillm/compile/mirror.py", "decode_step_by_hand",
          "k[layer][0, :, :slot + 1], v[layer][0, :, :slot + 1]", "k[layer][0, :, :slot], v[layer][0, :, :slot]"),
    Plant("13", "step-scores-unscaled", "minillm/compile/mirror.py", "decode_step_by_hand",
          " / math.sqrt(hs)  # (nh, slot+1)", "  # (nh, slot+1)"),
    Plant("13", "step-mlp-without-residual", "minillm/compile/mirror.py", "decode_step_by_hand",
          "x = x + block.mlp.c_proj.weight @ f", "x = block.mlp.c_proj.weight @ f"),
    # 14 parallelism
    Plant("14", "column-split-slices-the-input-features", "minillm/parallel/tensor.py", "column_split",
          "return weight[rows], None", "return weight[:, rows], None"),
    Plant("14", "column-split-keeps-the-whole-bias", "minillm/parallel/tensor.py", "column_split",
          "None if bias is None else bias[rows]", "None if bias is None else bias"),
    Plant("14", "row-split-slices-the-output-features", "minillm/parallel/tensor.py", "row_split",
          "return weight[:, cols]", "return weight[cols]"),
    Plant("14", "bias-added-before-the-sum", "minillm/parallel/tensor.py", "row_parallel_forward",
          "y = F.linear(x, weight)  #", "y = F.linear(x, weight, bias)  #"),
    Plant("14", "partial-sums-never-reduced", "minillm/parallel/tensor.py", "row_parallel_forward",
          "y = reduce(y)  #", "y = y  #"),
    Plant("14", "merge-keeps-the-larger-lse", "minillm/parallel/context.py", "merge_attention",
          "lse = torch.logaddexp(lse_a, lse_b)", "lse = torch.maximum(lse_a, lse_b)"),
    Plant("14", "merge-weights-not-stabilized", "minillm/parallel/context.py", "merge_attention",
          "w_a, w_b = torch.exp(lse_a - safe).unsqueeze(-1), torch.exp(lse_b - safe).unsqueeze(-1)",
          "w_a, w_b = (torch.exp(lse_a) / torch.exp(safe)).unsqueeze(-1), "
          "(torch.exp(lse_b) / torch.exp(safe)).unsqueeze(-1)"),
    # 15 serving
    Plant("15", "event-ends-with-one-newline", "minillm/serve/protocol.py", "sse_event",
          r'return f"data: {payload}\n\n".encode("utf-8")', r'return f"data: {payload}\n".encode("utf-8")'),
    Plant("15", "event-pretty-printed-over-lines", "minillm/serve/protocol.py", "sse_event",
          'json.dumps(data, separators=(",", ":"), ensure_ascii=False)', "json.dumps(data, indent=1)"),
    Plant("15", "empty-stop-string-accepted", "minillm/serve/protocol.py", "parse_stop",
          'if not isinstance(s, str) or s == "":', "if not isinstance(s, str):"),
    Plant("15", "stop-list-unbounded", "minillm/serve/protocol.py", "parse_stop",
          "if len(value) > MAX_STOP_STRINGS:", "if False:"),
    Plant("15", "percentile-nearest-rank", "minillm/serve/loadgen.py", "percentile",
          "return a + (b - a) * t if t < 0.5 else b - (b - a) * (1.0 - t)", "return a if t < 0.5 else b"),
    Plant("15", "percentile-rank-over-n", "minillm/serve/loadgen.py", "percentile",
          "h = (q / 100.0) * (len(xs) - 1)", "h = min((q / 100.0) * len(xs), len(xs) - 1)"),
    Plant("15", "goodput-counts-failed-requests", "minillm/serve/loadgen.py", "goodput",
          "        if not rec.success:\n            continue\n", ""),
    Plant("15", "goodput-one-token-misses-tpot", "minillm/serve/loadgen.py", "goodput",
          "tpot is not None and tpot > slo.tpot_s", "(tpot is None or tpot > slo.tpot_s)"),)


def planted_source(plant: Plant) -> str:
    """The reference file with `old` replaced by `new`, checked to lie inside the exercise's solution region."""
    source = (REPO_ROOT / plant.file).read_text(encoding="utf-8")
    begin_marker, end_marker = markers(plant.file)
    def_at = source.index(f"{plant.exercise}(" if is_c_source(plant.file) else f"def {plant.exercise}(")
    begin = source.index(begin_marker, def_at)
    end = source.index(end_marker, begin)
    region = source[begin:end]
    assert region.count(plant.old) == 1, f"{plant.id}: the planted text must occur once in {plant.exercise}'s region"
    return source[:begin] + region.replace(plant.old, plant.new) + source[end:]


def test_every_chapter_has_planted_mistakes_and_they_edit_real_solution_text():
    assert {p.chapter for p in PLANTS} == set(CHAPTER_FILES)
    for plant in PLANTS:
        assert plant.file in CHAPTER_FILES[plant.chapter]
        assert planted_source(plant) != (REPO_ROOT / plant.file).read_text(encoding="utf-8")


@pytest.mark.slow
@pytest.mark.parametrize("plant", PLANTS, ids=lambda p: p.id)
def test_planted_wrong_solution_loses_points(plant, tmp_path):
    student = write_assignment(plant.chapter, tmp_path / "student")
    for rel in CHAPTER_FILES[plant.chapter]:  # the chapter solved with the reference ...
        (student / rel).write_text((REPO_ROOT / rel).read_text(encoding="utf-8"), encoding="utf-8")
    (student / plant.file).write_text(planted_source(plant), encoding="utf-8")  # ... except for one mistake
    report = grade(plant.chapter, student, out_dir=tmp_path / "grade")
    lost = [t for t in report.tests if not t.passed]
    assert report.max_score == sum(t.points for t in graded_tests(plant.chapter))
    assert lost, f"{plant.id}: the wrong solution still scores {report.score}/{report.max_score}"
    exercises = {t.function: t.exercises for t in graded_tests(plant.chapter)}
    for t in lost:  # only tests that grade the planted exercise may fail
        assert plant.exercise in exercises[t.name], (plant.id, t.name, t.output[-1500:])
    # The verdict outside the child: the exercise's probe, on inputs drawn for this grading, sees the mistake too
    # (so the points are lost even to a submission that forges every pytest report); no other probe does.
    assert report.probes[plant.exercise] is not None, f"{plant.id}: the probe of {plant.exercise} did not see it"
    assert [e for e, problem in report.probes.items() if problem is not None] == [plant.exercise], report.probes
    print(f"{plant.id}: loses {report.max_score - report.score} of {report.max_score} points "
          f"({', '.join(t.name for t in lost)})")

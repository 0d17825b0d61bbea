"""The course manifest: for every chapter, where its code, exercises, test, notebook, text and tour entry live.

This table is the one place that maps a chapter to its files. The tour runner, `minillm assignment` / `minillm grade`,
the GPU report and the tests all read it; nothing else spells the map out. A chapter's room is one package
(`minillm/<package>/`), holding its code, its `bench.py` (the chapter's benchmark, built on `minillm.bench`) and its
`tour.py` (the chapter's rows of the tour). Chapters that are planned but not written yet are listed with
`built=False`, so every tool knows the whole course and says plainly which parts are still to come.

The import layers follow the chapters: a module may import from its own package and from the layers below it,
never from a layer above (`tests/test_framework.py` parses every import to hold this). Bottom to top:

    minillm.core        what every chapter shares: config, model, attention, sampling, stopping, checkpoints,
                        Hugging Face interop, timing, metrics, the results row, io, device, the default corpus
    minillm.tokenizer   01 ... minillm.gpt 02           (the model's own code is in core: every chapter runs it)
    minillm.bench       the measurement kit: load_model, workload presets, the over-time driver, same-tokens check
    minillm.naive 03 -> kvcache 04 -> paged 05 -> engine 06 -> disagg 07 -> chapters 08-15 in order
    minillm.course      cli, tour runner, assignment and grading, notebook runner, GPU report
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Chapter:
    number: str  # "01" .. "15"
    slug: str  # fixed by the curriculum, used in every file name: "kv-cache"
    title: str  # the technique in a few words
    package: str  # the chapter's room, e.g. "minillm.kvcache"
    exercises: tuple[str, ...] = ()  # files (from the repository root) whose BEGIN/END SOLUTION regions are graded
    built: bool = True  # False: planned in the curriculum, not written yet

    @property
    def name(self) -> str:
        """"04-kv-cache": the stem of the chapter's text and notebook."""
        return f"{self.number}-{self.slug}"

    @property
    def text(self) -> str:
        return f"chapters/{self.name}.md"

    @property
    def notebook(self) -> str:
        return f"notebooks/{self.name}.ipynb"

    @property
    def test_file(self) -> str:
        return f"tests/test_{self.number}_{self.slug.replace('-', '_')}.py"

    @property
    def tour(self) -> str:
        """The module with the chapter's tour entry: `TITLE` and `run(ctx) -> list[Row]`."""
        return f"{self.package}.tour"

    @property
    def package_dir(self) -> str:
        return self.package.replace(".", "/")


CHAPTERS: tuple[Chapter, ...] = (
    Chapter("01", "tokenization", "byte-level BPE", "minillm.tokenizer",
            ("minillm/tokenizer/basics.py", "minillm/tokenizer/encode.py")),
    Chapter("02", "gpt", "the GPT model, training, checkpoints", "minillm.gpt",
            ("minillm/core/attention.py",)),
    Chapter("03", "naive-inference", "sampling, the naive loop, metrics, roofline", "minillm.naive",
            ("minillm/core/sampling.py", "minillm/core/metrics.py")),
    Chapter("04", "kv-cache", "KV cache and static batching", "minillm.kvcache",
            ("minillm/kvcache/cache.py", "minillm/kvcache/generate.py")),
    Chapter("05", "paged-attention", "paged KV cache and prefix sharing", "minillm.paged",
            ("minillm/paged/block_allocator.py", "minillm/paged/block_manager.py", "minillm/paged/paged_cache.py")),
    Chapter("06", "continuous-batching", "continuous batching", "minillm.engine",
            ("minillm/engine/scheduler.py",)),
    Chapter("07", "disaggregation", "disaggregated prefill/decode", "minillm.disagg",
            ("minillm/disagg/kv_transfer.py", "minillm/disagg/decode_worker.py")),
    Chapter("08", "speculative-decoding", "speculative decoding", "minillm.speculative",
            ("minillm/speculative/sampling.py",)),
    Chapter("09", "quantization", "quantization", "minillm.quant",
            ("minillm/quant/quantize.py", "minillm/quant/gptq.py", "minillm/quant/qat.py")),
    Chapter("10", "pruning", "pruning", "minillm.prune", ("minillm/prune/masks.py",)),
    Chapter("11", "distillation", "distillation", "minillm.distill", ("minillm/distill/losses.py",)),
    Chapter("12", "cuda-kernels", "hand-written CUDA kernels", "minillm.kernels",
            ("minillm/kernels/mirror.py", "minillm/kernels/csrc/softmax.cu")),
    Chapter("13", "compilation", "compilation and CUDA graphs", "minillm.compile", ("minillm/compile/mirror.py",)),
    Chapter("14", "parallelism", "tensor, pipeline and sequence parallelism", "minillm.parallel",
            ("minillm/parallel/tensor.py", "minillm/parallel/context.py")),
    Chapter("15", "serving", "an OpenAI-compatible server", "minillm.serve",
            ("minillm/serve/protocol.py", "minillm/serve/loadgen.py")),
)

# Import layers, bottom to top (see the module docstring). A chapter's layer is its package.
LAYERS: tuple[str, ...] = (
    "minillm.core",
    "minillm.tokenizer",
    "minillm.gpt",
    "minillm.bench",
    *(c.package for c in CHAPTERS if c.number >= "03"),
    "minillm.course",
)


def normalize(chapter: str | int) -> str:
    """"4", 4, "04" -> "04"; anything else is a ValueError naming it."""
    text = str(chapter).strip()
    if isinstance(chapter, bool) or not text.isdigit() or not 1 <= int(text) <= 99:
        raise ValueError(f"chapter must be a number like 1 or 01, got {chapter!r}")
    return f"{int(text):02d}"


def get(chapter: str | int) -> Chapter:
    """The manifest entry of one chapter (built or not); an unknown number is a ValueError listing the known ones."""
    nn = normalize(chapter)
    for c in CHAPTERS:
        if c.number == nn:
            return c
    raise ValueError(f"there is no chapter {nn}; the course has chapters {[c.number for c in CHAPTERS]}")


def built() -> tuple[Chapter, ...]:
    """The chapters that exist, in order."""
    return tuple(c for c in CHAPTERS if c.built)

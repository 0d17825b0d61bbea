"""Chapter 01: a byte-level BPE tokenizer written from scratch, with tiktoken parity.

Modules, one idea each: `patterns` (pre-tokenization regexes), `basics` (pair counting and merging),
`train` (naive and incremental trainers), `encode` (one chunk under a rank table), `special` (special-token
rules), `formats` (files), `bpe` (the Tokenizer), `gpt2` (finding real GPT-2 ranks offline), `default`
(the shipped tokenizer), `commands` (the `minillm tokenizer ...` CLI), `parity` (id-for-id checks against
tiktoken), `bench` (encode MB/s, ordinary and adversarial text) and `tour` (the chapter's rows of the tour).
"""

from minillm.tokenizer.basics import get_pair_counts, merge
from minillm.tokenizer.bpe import Tokenizer
from minillm.tokenizer.default import DEFAULT_TOKENIZER_PATH, build_default_tokenizer, load_tokenizer
from minillm.tokenizer.encode import encode_chunk
from minillm.tokenizer.patterns import GPT2_SPLIT_PATTERN, GPT4_SPLIT_PATTERN
from minillm.tokenizer.train import Merge, TrainResult, train_bpe, train_bpe_naive

__all__ = [
    "DEFAULT_TOKENIZER_PATH", "GPT2_SPLIT_PATTERN", "GPT4_SPLIT_PATTERN", "Merge", "Tokenizer", "TrainResult",
    "build_default_tokenizer", "encode_chunk", "get_pair_counts", "load_tokenizer", "merge", "train_bpe",
    "train_bpe_naive",
]

"""What every chapter shares: the bottom layer of minillm, importing nothing from the chapters above it.

    config       GPTConfig and its presets, check_int            model       GPT (hidden states + logits for rows)
    attention    attention and its reference twin                sampling    SamplingParams, sample_next
    stopping     prompt validation, StopChecker, RequestState    checkpoint  safetensors checkpoints, load strictly
    hf           Hugging Face GPT-2 layout, both directions      weights     strict state-dict loading
    timing       interleaved medians, compare                    metrics     TTFT, TPOT, ITL, throughput
    rows         the tour's results row and table                io          atomic writes
    device       --device auto|cpu|cuda                          corpus      the default corpus (stdlib sources)
    detokenize   IncrementalText: a growing output's text, whole characters, O(1) decode per token
    formats      a model (plain, quantized, pruned) as safetensors bytes and back, by its format's name
"""

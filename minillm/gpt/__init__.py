"""Chapter 02 (gpt): training the model, its data pipeline, perplexity, and the checkpoints minillm ships.

The model itself lives in `minillm.core.model`, because every later chapter runs it; this package holds what
chapter 02 adds around it: `dataset` (token windows from the corpus), `train` / `train_state` (a resumable
training loop), `eval` (perplexity), `pretrained` (the shipped "base" and "draft" checkpoints with their tokenizer,
and chapter 11's two students of draft's shape),
`plots` (the attention-map figure of the notebook), `finetune` (the few-step fine-tune later chapters use: QAT in
chapter 09, recovery after pruning in chapter 10) and `tour` (the chapter's rows of the tour).
"""

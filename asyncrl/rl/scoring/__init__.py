"""Scoring a batch of sequences with a causal LM, below both the trainer and the scorer: the
micro-batches (``batch.py``), the forward of their layout (``forward.py``), the log-probs of their
completion tokens through the fused output layer or full logits (``logprobs.py``,
``chunked_head.py``, ``tokens.py``). The trainer's loss and a teacher's answers read the same
numbers because they are computed by the same code."""

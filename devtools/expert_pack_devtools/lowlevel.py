"""The low-level llama.cpp calls the tooling shares, through llama-cpp-python's public API only (the `llama_*`
functions and structs of `llama_cpp`): back-end start-up with llama.cpp's log quiet, and filling a `llama_batch`."""
from __future__ import annotations

import logging


def backend_init_quiet() -> None:
    """llama_backend_init, with llama.cpp's log at errors only. llama-cpp-python forwards llama.cpp's log to the
    `logging` logger "llama-cpp-python" (the level `Llama(verbose=False)` sets); a log callback of our own would
    replace its callback for the whole process."""
    import llama_cpp as lc
    lc.llama_backend_init()
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)


def fill_batch(batch, tokens, pos0: int = 0, all_logits: bool = False) -> None:
    """Put `tokens` (one sequence, id 0) into a batch from llama_batch_init at positions pos0, pos0 + 1, ...;
    logits for every token with `all_logits`, else for the last one."""
    n = len(tokens)
    for i, t in enumerate(tokens):
        batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, pos0 + i, 1
        batch.seq_id[i][0], batch.logits[i] = 0, all_logits or i == n - 1
    batch.n_tokens = n

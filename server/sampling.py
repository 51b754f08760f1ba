"""A request's sampler: one llama.cpp sampler chain, built in C once per generation, so that no Python runs on the
vocabulary per token.

The chain is llama-cpp-python's own (`Llama._init_sampler`), in its order, with the per-token Python logits
processor it would need for a logit bias replaced by llama.cpp's logit-bias sampler: logit bias (the request's
`logit_bias`, and -inf on the end-of-generation tokens for `ignore_eos`), repetition penalties, the grammar, then
greedy (temperature 0), plain sampling (temperature < 0), or top-k, typical, top-p, min-p, temperature and the
seeded draw. The same seed therefore gives the same tokens as llama-cpp-python's `create_completion`."""
from __future__ import annotations

import ctypes


class Sampler:
    """Owns a llama.cpp sampler chain; `sample(ctx)` draws the next token from the last logits and accepts it."""

    def __init__(self, llm, *, temperature: float, top_p: float, top_k: int, min_p: float, repeat_penalty: float,
                 seed: int, logit_bias: dict[int, float] | None = None, ban: list[int] | tuple = (),
                 grammar: str | None = None):
        import llama_cpp
        self._lib = llama_cpp
        penalty_last_n = llm.last_n_tokens_size
        self.chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
        if not self.chain:
            raise MemoryError("llama_sampler_chain_init failed")
        try:
            bias = dict(logit_bias or {})
            for t in ban:
                bias[int(t)] = float("-inf")
            if bias:
                arr = (llama_cpp.llama_logit_bias * len(bias))(
                    *(llama_cpp.llama_logit_bias(int(t), float(b)) for t, b in bias.items()))
                self._add(llama_cpp.llama_sampler_init_logit_bias(llm.n_vocab(), len(bias), arr))
            self._add(llama_cpp.llama_sampler_init_penalties(llm.n_vocab(), penalty_last_n, repeat_penalty,
                                                                 0.0, 0.0))
            if grammar is not None:
                self._add(llama_cpp.llama_sampler_init_grammar(llm._model.vocab, grammar.encode("utf-8"),
                                                               b"root"))
            if temperature == 0.0:
                self._add(llama_cpp.llama_sampler_init_greedy())
            elif temperature < 0.0:
                self._add(llama_cpp.llama_sampler_init_dist(seed))
            else:
                self._add(llama_cpp.llama_sampler_init_top_k(top_k))
                self._add(llama_cpp.llama_sampler_init_typical(1.0, 1))
                self._add(llama_cpp.llama_sampler_init_top_p(top_p, 1))
                self._add(llama_cpp.llama_sampler_init_min_p(min_p, 1))
                self._add(llama_cpp.llama_sampler_init_temp(temperature))
                self._add(llama_cpp.llama_sampler_init_dist(seed))
        except BaseException:
            self.close()
            raise

    def _add(self, smpl) -> None:
        if not smpl:
            raise ValueError("llama.cpp refused a sampler of this request")  # the grammar is checked before this
        self._lib.llama_sampler_chain_add(self.chain, smpl)  # the chain owns it from here

    def sample(self, ctx, idx: int = -1) -> int:
        """The token drawn from the logits of batch row `idx` (-1: the last row with logits)."""
        return self._lib.llama_sampler_sample(self.chain, ctx, idx)

    def close(self) -> None:
        if self.chain:
            self._lib.llama_sampler_free(self.chain)
            self.chain = None

    def __del__(self):
        self.close()


def piece_reader(llm):
    """A function token -> its text as bytes (special tokens render as nothing), as llama-cpp-python's
    `detokenize`, with one reusable buffer."""
    import llama_cpp
    vocab = llm._model.vocab
    buf = ctypes.create_string_buffer(64)
    to_piece = llama_cpp.llama_token_to_piece

    def piece(token: int) -> bytes:
        nonlocal buf
        n = to_piece(vocab, token, buf, len(buf), 0, False)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = to_piece(vocab, token, buf, len(buf), 0, False)
        return buf.raw[:n]
    return piece

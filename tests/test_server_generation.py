"""serve's token loop (server/engine.py, sampling.py, text_stream.py) against llama-cpp-python's `create_completion`,
which it replaces: the same tokens for the same seed and settings (sampled, greedy, with a logit bias, with
repetition penalties, under a grammar), the same text cut at stop strings; and the incremental text rules on their
own (stop strings across token boundaries, UTF-8 sequences split over tokens)."""
from __future__ import annotations

import pytest

from ggml_expert_pack.server.text_stream import TextStream

PROMPT = b"The expert pack streams"


def stream(pieces: list[bytes], stop: list[str]) -> tuple[str, str]:
    t = TextStream(stop)
    out = []
    for p in pieces:
        out.append(t.push(p))
        if t.stopped_by:
            return "".join(out), t.stopped_by
    out.append(t.finish())
    return "".join(out), t.stopped_by


def test_text_stream_stop_strings_and_utf8():
    assert stream([b"Hel", b"lo ", b"wor", b"ld"], ["lo w"]) == ("Hel", "lo w")
    assert stream([b"aST", b"OPb"], ["TOPb", "STOP"]) == ("a", "STOP")           # the earliest stop wins
    assert stream([b"foo"], ["foobar"]) == ("foo", "")                           # a held-back prefix is flushed
    assert stream([b"abc", b"\xc3", b"\xa9", b"d"], []) == ("abc\u00e9d", "")    # a split UTF-8 sequence
    assert stream([b"abc", b"\xc3"], []) == ("abc", "")                          # an incomplete tail is dropped
    assert stream([b"h\xc3", b"\xa9llo"], ["\u00e9l"]) == ("h", "\u00e9l")         # a stop starting mid-sequence
    t = TextStream(["STOP"])
    assert [t.push(p) for p in (b"a", b"S", b"T", b"x")] == ["a", "", "", "STx"]  # held only while it could match


@pytest.fixture(scope="module")
def llm(synth_model):
    from llama_cpp import Llama
    m = Llama(str(synth_model("qwen3moe")), n_ctx=256, n_threads=2, verbose=False)
    yield m
    m.close()


def reference(llm, n, **kw) -> str:
    """create_completion with the prompt but its last token cached, as serve evaluates it (the last token alone:
    a batch that includes it rounds its logits differently)."""
    prompt = llm.tokenize(PROMPT, add_bos=True)
    llm.reset()
    llm.eval(prompt[:-1])
    return llm.create_completion(prompt, max_tokens=n, **kw)["choices"][0]["text"]


def ours(llm, n, **kw) -> tuple[str, object]:
    from ggml_expert_pack.server.engine import Engine, Result
    eng = Engine(llm, "m")
    r = Result()
    prompt = llm.tokenize(PROMPT, add_bos=True)
    text = "".join(eng.generate(prompt, n, r, **kw))
    assert text == r.text
    return text, r


@pytest.mark.parametrize("settings", [
    dict(temperature=0.0),
    dict(temperature=0.8, seed=7),
    dict(temperature=1.5, seed=11, top_k=0, top_p=1.0, min_p=0.0),
    dict(temperature=0.8, seed=3, repeat_penalty=1.3),
    dict(temperature=-1.0, seed=5),
], ids=["greedy", "sampled", "wide", "penalty", "plain-draw"])
def test_same_tokens_as_create_completion(llm, settings):
    defaults = dict(top_p=0.95, top_k=40, min_p=0.05, repeat_penalty=1.0)
    kw = {**defaults, **settings}
    text, r = ours(llm, 24, **kw)
    assert text == reference(llm, 24, **kw)
    assert r.finish_reason in ("length", "stop") and 0 < r.timings.predicted_n <= 24


def test_logit_bias_and_grammar_as_create_completion(llm):
    import llama_cpp
    banned = llm.tokenize(reference(llm, 4, temperature=0.0).encode(), add_bos=False, special=False)[:1]
    text, _ = ours(llm, 16, temperature=0.0, logit_bias={banned[0]: float("-inf")})
    assert text == reference(llm, 16, temperature=0.0, logit_bias={banned[0]: -1e30})
    assert llm.tokenize(text.encode(), add_bos=False, special=False)[:1] != banned
    grammar = 'root ::= ("yes" | "no") " " [a-z]{1,6}'
    text, _ = ours(llm, 12, temperature=0.8, seed=2, grammar=grammar)
    assert text == reference(llm, 12, temperature=0.8, seed=2,
                             grammar=llama_cpp.LlamaGrammar.from_string(grammar, verbose=False))
    assert text.split(" ")[0] in ("yes", "no")


def test_stop_strings_cut_the_text_as_create_completion(llm):
    full, _ = ours(llm, 32, temperature=0.0)
    stop = full[5:8]
    text, r = ours(llm, 32, temperature=0.0, stop=[stop])
    assert text == full[:full.index(stop)] == reference(llm, 32, temperature=0.0, stop=[stop])
    assert (r.finish_reason, r.stopping_word) == ("stop", stop)


def test_zero_tokens_and_cancel_between_tokens(llm):
    text, r = ours(llm, 0, temperature=0.0)
    assert (text, r.timings.predicted_n) == ("", 0)
    from ggml_expert_pack.server.engine import Cancelled
    calls = []

    def gone():
        calls.append(1)
        return len(calls) > 3
    with pytest.raises(Cancelled):
        ours(llm, 32, temperature=0.0, ignore_eos=True, cancelled=gone)

"""A committed run of speculative tokens ends the request where plain decoding would:
SGLang's finish check applied token by token (``hooks._finish_check_of_new_tokens``).

Every speculative worker of the project (VERICACHE in every mode, SPECACHE) hands its
committed run to SGLang's spec-v2 output path, which calls ``Req.update_finish_state``
once per run; the hook is the one place each run is checked. Here SGLang's own ``Req``
is driven as the output path drives it: once a token at a time (plain decoding, the
reference) and once a run at a time (runs of 1-16 tokens), over real text with random
stop strings, stop regexes, stop tokens, EOS and ``ignore_eos``, and length caps. The
served checks are ``test_vericache_finish``.
"""

from __future__ import annotations

import inspect
import random
from array import array

import pytest

from conftest import real_text_passages
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.sampling.sampling_params import SamplingParams

from sglang_vc.hooks import _finish_check_of_new_tokens


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    """The tokenizer as SGLang's scheduler loads it (its stop-token attributes set)."""
    from sglang.srt.utils.hf_transformers_utils import get_tokenizer

    return get_tokenizer(model_dir)


@pytest.fixture(scope="module")
def token_stream(tokenizer) -> list[int]:
    return [t for text in real_text_passages(6, words=300) for t in tokenizer(text)["input_ids"]]


def _req(tokenizer, **params) -> Req:
    sp = SamplingParams(**params)
    sp.normalize(tokenizer)
    req = Req("r", "", array("i", [1, 2, 3]), sp, eos_token_ids={tokenizer.eos_token_id},
              vocab_size=len(tokenizer))
    req.tokenizer = tokenizer
    return req


def _decode(req: Req, tokens: list[int], runs: list[int], check) -> tuple:
    """Commit ``tokens`` in runs of ``runs`` tokens, checking after each as the output path
    does; (reason, tokens through the stop) once the request finishes."""
    pos = 0
    for n in runs:
        req.output_ids.extend(tokens[pos : pos + n])
        pos += n
        check(req, n)
        if req.finished():
            break
    reason = req.finished_reason.to_json() if req.finished_reason is not None else None
    return reason, list(req.output_ids_through_stop)


def _sglang_check():
    """SGLang's own check, unpatched. The hook may be applied in this process (a server's
    start-up code imported by another test module applies the project's hooks);
    HookRegistry keeps the original under ``__wrapped__``. Looked up at each call, never
    held in a module global: applying the hooks rebinds every module global that holds
    the original (``hook_registry._propagate_patch``)."""
    return inspect.unwrap(Req.update_finish_state)


def _fixed(req, n):
    return _finish_check_of_new_tokens(_sglang_check(), req, n)


def _sglang_alone(req, n):
    return _sglang_check()(req, n)


def _random_case(rng: random.Random, tokenizer, stream: list[int]) -> tuple[dict, list[int], list[int]]:
    """(sampling params, output tokens, run lengths): stop strings cut from the output's own
    text (so they occur) or random characters, 1-8 characters each; sometimes a stop regex,
    stop token ids, an EOS inside the output, ``ignore_eos``, a length cap inside it."""
    start = rng.randrange(len(stream) - 80)
    tokens = stream[start : start + rng.randint(8, 64)]
    if rng.random() < 0.3:
        tokens.insert(rng.randrange(len(tokens)), tokenizer.eos_token_id)
    text = tokenizer.decode(tokens)
    stops = []
    for _ in range(rng.randint(1, 4)):
        n = rng.randint(1, 8)
        if rng.random() < 0.8 and len(text) > n:
            i = rng.randrange(len(text) - n)
            stops.append(text[i : i + n])
        else:
            stops.append("".join(rng.choice(" \n.,etaoinsr") for _ in range(n)))
    params = {"max_new_tokens": rng.choice([len(tokens), rng.randint(1, len(tokens))]), "stop": stops,
              "ignore_eos": rng.random() < 0.2}
    if rng.random() < 0.3:
        params["stop_token_ids"] = [rng.choice(tokens)]
    if rng.random() < 0.25:
        params["stop_regex"] = rng.choice([r"\d", r"[A-Z][a-z]+\.", r"\n\n", r"\bthe\b"])
    runs, left = [], len(tokens)
    while left > 0:
        runs.append(min(left, rng.randint(1, 16)))
        left -= runs[-1]
    return params, tokens, runs


def test_runs_end_where_plain_decoding_ends(tokenizer, token_stream):
    """600 random cases: the finish reason (kind and what matched) and the tokens through
    the stop are plain decoding's, whatever the runs. SGLang's check alone, given the same
    runs, ends elsewhere in some of them (so the cases reach what the hook fixes)."""
    rng = random.Random(78)
    sglang_wrong = 0
    for case in range(600):
        params, tokens, runs = _random_case(rng, tokenizer, token_stream)
        plain = _decode(_req(tokenizer, **params), tokens, [1] * len(tokens), _sglang_alone)
        assert plain[0] is not None  # every case ends (max_new_tokens <= len(tokens))
        spec = _decode(_req(tokenizer, **params), tokens, runs, _fixed)
        assert spec == plain, (case, params, runs, tokenizer.decode(tokens))
        sglang_wrong += _decode(_req(tokenizer, **params), tokens, runs, _sglang_alone) != plain
    assert sglang_wrong >= 10, sglang_wrong


def test_the_dtype_gen_run(tokenizer):
    """The run SGLang's ``test_dtype_gen`` program met (issue 78): ``2003\\n\\n Q`` committed
    at once with stops ``[" ", "\\n"]`` ends at the newline, as plain decoding does."""
    tokens = [34, 32, 32, 35, 198, 198, 256]
    for check, want in ((_fixed, ("\n", 5)), (_sglang_alone, (" ", 7))):
        req = _req(tokenizer, max_new_tokens=64, stop=[" ", "\n"])
        reason, through = _decode(req, tokens, [len(tokens)], check)
        assert (reason["matched"], len(through)) == want


def test_stop_token_before_a_stop_string_in_one_run(tokenizer, token_stream):
    """A stop token met before a stop string in the same run ends the request there
    (SGLang alone looks for stop tokens only when no stop string matched the run)."""
    tokens = token_stream[:12]
    text_after = tokenizer.decode(tokens[6:])
    req = _req(tokenizer, max_new_tokens=64, stop=[text_after[-3:]], stop_token_ids=[tokens[2]])
    reason, through = _decode(req, tokens, [len(tokens)], _fixed)
    assert reason["type"] == "stop" and reason["matched"] == tokens[2] and through == tokens[:3]


class _TerminatedGrammar:
    """A grammar already advanced over the whole run and terminated at its last token (the
    output path truncates a run where its grammar terminates)."""

    finished = False

    def is_terminated(self) -> bool:
        return True


def test_grammar_termination_is_read_at_the_runs_end(tokenizer, token_stream):
    tokens = token_stream[:5]
    req = _req(tokenizer, max_new_tokens=64)
    req.grammar = _TerminatedGrammar()
    reason, through = _decode(req, tokens, [5], _fixed)
    assert reason == {"type": "stop", "matched": tokens[-1]} and through == tokens
    assert req.grammar is not None


def test_nothing_committed_checks_nothing(tokenizer, token_stream):
    """An iteration in which a request only drafted commits 0 tokens: no check (SGLang's
    ``output_ids[-0:]`` would re-read the whole output), a pending abort still applies."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    req = _req(tokenizer, max_new_tokens=64, stop=[tokenizer.decode(token_stream[1:2])])
    req.output_ids.extend(token_stream[:4])
    _fixed(req, 0)
    assert not req.finished()
    req.to_finish = FINISH_ABORT("aborted")
    _fixed(req, 0)
    assert req.finished() and req.finished_reason.to_json()["type"] == "abort"

"""OutputProcessor on hand-written engine-core deltas: n > 1 fan-in, stop strings (also on the last allowed token),
the stopping token kept out of the text, echoes of aborted samples ignored, one finish path, errors, characters
split over several ids, the text of final-only requests decoded once at the finish."""

from __future__ import annotations

from deepinfer_engine.core.sched_output import EngineCoreOutput, TokenLogprobs
from deepinfer_engine.output_processor import OutputProcessor
from deepinfer_engine.sampling_params import SamplingParams


class _Tok:
    """id -> one letter; id 1 (EOS) is special and decodes to '' when special tokens are skipped."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join("" if (t == 1 and skip_special_tokens) else "abcdefghijklmnopqrstuvwxyz"[t % 26] for t in ids)


def _proc(params: SamplingParams, n: int = 1) -> tuple[OutputProcessor, list[str]]:
    p = OutputProcessor(tokenizer=_Tok(), eos_token_ids=(1,))
    children = ["r"] if n == 1 else [f"r#{i}" for i in range(n)]
    p.add_request("r", prompt=None, prompt_token_ids=[3, 4], params=params, child_ids=children)
    return p, children


def _d(rid: str, *toks: int, **kw) -> EngineCoreOutput:
    return EngineCoreOutput(req_id=rid, new_token_ids=toks, **kw)


def test_fan_in_of_n_samples_with_logprobs() -> None:
    sp = SamplingParams(n=2, max_tokens=2, logprobs=0, prompt_logprobs=0)
    p, (a, b) = _proc(sp, n=2)
    lp = TokenLogprobs(token_id=2, logprob=-0.5, rank=1)
    plp = TokenLogprobs(token_id=4, logprob=-1.0, rank=3)
    r = p.process([_d(a, 2, new_logprobs=(lp,), new_prompt_logprobs=(plp,)),
                   _d(b, 3, new_logprobs=(lp,), new_prompt_logprobs=(plp,))])
    (out,) = r.request_outputs
    assert not out.finished and [c.text for c in out.outputs] == ["c", "d"]
    assert out.prompt_logprobs == [None, plp]  # from sample 0 only
    r = p.process([_d(a, 4, new_logprobs=(lp,), finish_reason="length")])
    assert not r.request_outputs[0].finished and p.has_unfinished_requests()
    r = p.process([_d(b, 5, new_logprobs=(lp,), finish_reason="length", num_preemptions=2)])
    out = r.request_outputs[0]
    assert out.finished and [c.token_ids for c in out.outputs] == [[2, 4], [3, 5]]
    assert out.outputs[0].cumulative_logprob == -1.0 and out.metrics.num_preemptions == 2
    assert not p.has_unfinished_requests() and r.reqs_to_abort == []


def test_stop_string_stops_the_sample_and_asks_the_core_to_abort_it() -> None:
    p, (rid,) = _proc(SamplingParams(max_tokens=10, stop=["cd"]))
    p.process([_d(rid, 7)])
    r = p.process([_d(rid, 2)])
    assert r.request_outputs == [] or not r.request_outputs[0].finished
    r = p.process([_d(rid, 3)])
    co = r.request_outputs[0].outputs[0]
    assert (co.finish_reason, co.stop_reason, co.text, co.token_ids) == ("stop", "cd", "h", [7, 2, 3])
    assert r.reqs_to_abort == [rid]
    # the core's abort echo for that sample is ignored: the sample already finished
    assert p.process([EngineCoreOutput(req_id=rid, finish_reason="abort")]).request_outputs == []


def test_stop_string_on_the_last_allowed_token_is_a_stop_not_length() -> None:
    p, (rid,) = _proc(SamplingParams(max_tokens=2, stop=["cd"], include_stop_str_in_output=True))
    p.process([_d(rid, 2)])
    r = p.process([_d(rid, 3, finish_reason="length")])
    co = r.request_outputs[0].outputs[0]
    assert (co.finish_reason, co.stop_reason, co.text) == ("stop", "cd", "cd")
    assert r.reqs_to_abort == []  # the core finished it already


def test_stopping_token_is_kept_in_ids_not_in_text() -> None:
    p, (rid,) = _proc(SamplingParams(max_tokens=5, stop_token_ids=[6], skip_special_tokens=False))
    p.process([_d(rid, 2)])
    r = p.process([_d(rid, 6, finish_reason="stop", stop_reason=6)])
    co = r.request_outputs[0].outputs[0]
    assert (co.token_ids, co.text, co.stop_reason) == ([2, 6], "c", 6)
    p, (rid,) = _proc(SamplingParams(max_tokens=5, skip_special_tokens=False))
    r = p.process([_d(rid, 2), _d(rid, 1, finish_reason="stop")])  # EOS
    assert r.request_outputs[0].outputs[0].text == "c"


def test_errors_and_aborts_take_the_same_finish_path() -> None:
    p, (a, b) = _proc(SamplingParams(n=2, max_tokens=5), n=2)
    p.process([_d(a, 2)])
    r = p.process([EngineCoreOutput(req_id=a, finish_reason="error", error="logits are not finite"),
                   EngineCoreOutput(req_id=b, finish_reason="abort")])
    out = r.request_outputs[0]
    assert out.finished and out.error == "logits are not finite"
    assert [c.finish_reason for c in out.outputs] == ["error", "abort"]
    assert out.metrics.finished_time is not None and not p.has_unfinished_requests()
    # unknown / dropped ids are ignored
    assert p.process([_d("zz", 3)]).request_outputs == []


class _ByteTok:
    """Byte-level stand-in: id -> the UTF-8 bytes below; invalid or incomplete UTF-8 decodes to U+FFFD."""

    PIECES = {2: b"a", 3: "\U0001f600".encode()[:3], 4: "\U0001f600".encode()[3:], 5: b"b", 6: "\u20ac".encode()[:1],
              7: "\u20ac".encode()[1:2], 8: "\u20ac".encode()[2:]}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return b"".join(self.PIECES[t] for t in ids).decode("utf-8", errors="replace")


def test_a_character_split_over_several_ids_reaches_the_text() -> None:
    ids = [2, 3, 4, 5, 6, 7, 8, 2]  # a, 😀 over two ids, b, € over three ids, a
    for per_step in (1, 2, 3, len(ids)):
        p = OutputProcessor(tokenizer=_ByteTok(), eos_token_ids=(1,))
        p.add_request("r", prompt=None, prompt_token_ids=[2], params=SamplingParams(max_tokens=20), child_ids=["r"])
        texts = []
        for i in range(0, len(ids), per_step):
            co = p.process([_d("r", *ids[i : i + per_step])]).request_outputs[0].outputs[0]
            texts.append(co.text)
            assert "\ufffd" not in co.text  # an incomplete character waits for its last bytes
        assert texts[-1] == "a\U0001f600b\u20aca", per_step


def test_final_only_decodes_the_text_once_at_the_finish_and_gets_the_same_text() -> None:
    import random

    rng = random.Random(0)
    finishes = [("length", None), ("stop", None), ("stop", 2), ("abort", None)]  # EOS / a stop id end on an id
    for case in range(24):
        reason, stop_id = finishes[case % len(finishes)]
        ids = [rng.choice(list(_ByteTok.PIECES)) for _ in range(rng.randint(1, 12))]
        if reason == "stop":
            ids.append(1 if stop_id is None else stop_id)
        texts = []
        for final_only in (False, True):
            p = OutputProcessor(tokenizer=_ByteTok(), eos_token_ids=(1,))
            p.add_request("r", prompt=None, prompt_token_ids=[2], params=SamplingParams(max_tokens=20, n=2),
                          child_ids=["r#0", "r#1"], final_only=final_only)
            i, outs = 0, None
            while i < len(ids):
                k = rng.randint(1, 4)
                last = i + k >= len(ids)
                kw = {"finish_reason": reason, "stop_reason": stop_id} if last and reason != "abort" else {}
                outs = p.process([_d(f"r#{j}", *ids[i : i + k], **kw) for j in (0, 1)]).request_outputs
                if not last and final_only:
                    assert [c.text for c in outs[0].outputs] == ["", ""]  # unfinished: no text yet
                i += k
            if reason == "abort":
                outs = p.process([EngineCoreOutput(req_id=f"r#{j}", finish_reason="abort") for j in (0, 1)]
                                 ).request_outputs
            assert outs[0].finished
            texts.append([(c.text, c.token_ids, c.finish_reason) for c in outs[0].outputs])
        assert texts[0] == texts[1], (ids, reason)

"""The bodies of ``POST /translate`` and ``POST /score`` and what a request must pass before it joins a batch: its
schema (with the ranges ``/docs`` shows), the server's limits, and the decode settings the model
accepts; each refusal is a :class:`RequestError` with its HTTP status and one line."""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from mtcli.config import DECODE_RANGES
from mtcli.data.textio import check_unicode
from mtcli.errors import ConfigError, DataError
from mtcli.infer.ensemble import Ensemble
from mtcli.infer.translator import Translator
from mtcli.serve_batching import Limits


def _number(key: str) -> Any:
    """A JSON number (not a string or a boolean) in ``DECODE_RANGES[key]``, its range in the
    schema as JSON Schema's ``minimum``/``maximum`` (on the union, pydantic wrote ``ge``/``le``,
    which /docs and client generators do not read)."""
    low, high = DECODE_RANGES[key]
    return (Annotated[StrictFloat, Field(ge=low, le=high, allow_inf_nan=False)]
            | Annotated[StrictInt, Field(ge=math.ceil(low), le=math.floor(high))])


class TranslateRequest(BaseModel):
    """The body of ``POST /translate``."""

    model_config = ConfigDict(extra="forbid")
    text: list[StrictStr] = Field(description="Lines to translate, one sentence each.")
    beam: StrictInt | None = Field(default=None, description="Beam size (1 = greedy); the run's by default.",
                                   json_schema_extra={"minimum": 1, "maximum": Limits.max_beam})
    length_penalty: _number("length_penalty") | None = Field(
        default=None, description="GNMT length penalty alpha (below 0 favours shorter outputs).")
    sampling: Literal["none", "topk", "topp"] | None = Field(
        default=None, description="Draw the translation instead of searching (the run's decode.topk / topp), "
                                  "or search (none) on a server that samples by default.")
    temperature: _number("temperature") | None = Field(default=None, description="Sampling temperature.")
    seed: StrictInt | None = Field(default=None, description="Sampling seed: the same seed gives the same output.")
    tgt_lang: StrictStr | None = Field(
        default=None, description="The language to translate into, for a model of several (the run's by default).")
    nbest: StrictInt | None = Field(
        default=None, json_schema_extra={"minimum": 1, "maximum": Limits.max_beam}, description="Also answer N hypotheses per line, best first (the beam widens to N), or with "
                                  "sampling N samples per line, in draw order (by score with --engine ctranslate2).")


class Hypothesis(BaseModel):
    """One of a line's n-best hypotheses or samples."""

    text: str
    score: float = Field(description="The length-penalised log-probability the search ranks by.")


class TranslateResponse(BaseModel):
    """The answer of ``POST /translate``: one translation per input line, in order (and with
    ``nbest``, each line's hypotheses)."""

    translations: list[str]
    model: str
    nbest: list[list[Hypothesis]] | None = None


class ScoreRequest(BaseModel):
    """The body of ``POST /score``."""

    model_config = ConfigDict(extra="forbid")
    source: list[StrictStr] = Field(description="Source sentences.")
    target: list[StrictStr] = Field(description="Their target sentences, one for each source, in order.")
    normalize: StrictBool = Field(default=False, description="The mean log-probability a target piece (</s> "
                                                             "counted), not the sum: comparable across lengths.")
    tgt_lang: StrictStr | None = Field(
        default=None, description="The targets' language, for a model of several (the run's by default).")


class ScoreResponse(BaseModel):
    """The answer of ``POST /score``: one score a pair, in order."""

    scores: list[float | None] = Field(description="log p(target | source) of each pair, by teacher forcing; null "
                                                   "where the model cannot produce the target (a piece off its "
                                                   "vocabulary, or more pieces than it produces).")
    model: str


class ErrorAnswer(BaseModel):
    """What every refusal and failure answers: one line saying why (and, for a 500, the id that
    the server log's line with the cause carries)."""

    error: str
    request_id: str | None = None


#: The answers of ``POST /translate`` besides 200, as ``/docs`` lists them.
REFUSALS: dict[int | str, dict[str, Any]] = {status: {"model": ErrorAnswer, "description": why} for status, why in (
    (400, "Malformed JSON."),
    (401, "A missing or wrong API key (a server started with one)."),
    (413, "Too many lines or characters, or a line longer than the model reads."),
    (415, "A body that is not JSON."),
    (422, "A field of the wrong type or out of range, or text that is not valid Unicode."),
    (500, "A failure of the server's own; request_id names the log line with the cause."),
    (503, "Out of memory even for this request alone, the server stopping, or its decoding thread stopped."),
)}


#: The answers of ``POST /score`` besides 200: those of ``/translate``, and one more.
SCORE_REFUSALS: dict[int | str, dict[str, Any]] = {
    **REFUSALS, 501: {"model": ErrorAnswer, "description": "A server of an ensemble (a pair is scored by one model)."}}

class RequestError(Exception):
    """A request the server refuses, with its HTTP status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class InternalError(RequestError):
    """A failure that is the server's, not the request's: a 500 that names its request id (the
    log line with the cause carries the same id)."""

    def __init__(self, request_id: str, doing: str = "translation") -> None:
        super().__init__(500, f"{doing} failed (request id {request_id}; the server log has the cause)")
        self.request_id = request_id


def check_request(body: TranslateRequest, limits: Limits) -> None:
    """Raise :class:`RequestError` when ``body`` asks for more than ``limits`` allow."""
    _check_texts({"text": body.text}, limits)
    for name, value in (("beam", body.beam), ("nbest", body.nbest)):
        if value is not None and not 1 <= value <= limits.max_beam:
            raise RequestError(422, f"{name} must be between 1 and {limits.max_beam}, got {value}")
    _check_unicode([("tgt_lang", body.tgt_lang or "")])


def check_score_request(body: ScoreRequest, limits: Limits) -> None:
    """Raise :class:`RequestError` for a ``POST /score`` body of unequal lists, or over ``limits``
    (the lines of each list, and the characters of both together)."""
    if len(body.source) != len(body.target):
        raise RequestError(422, f"source has {len(body.source)} lines but target {len(body.target)}: one target a "
                                "source")
    _check_texts({"source": body.source, "target": body.target}, limits)
    _check_unicode([("tgt_lang", body.tgt_lang or "")])


def _check_texts(fields: dict[str, list[str]], limits: Limits) -> None:
    """Refuse more lines than ``limits.max_lines`` in a field of ``fields``, a longer line than
    ``max_chars``, more characters in all than ``max_total_chars`` (413), text that is not valid Unicode (422)."""
    for name, lines in fields.items():
        if len(lines) > limits.max_lines:
            raise RequestError(413, f"too many lines: {len(lines)} (at most {limits.max_lines} a request)")
        for i, line in enumerate(lines):
            if len(line) > limits.max_chars:
                raise RequestError(413, f"{name}[{i}] has {len(line)} characters (at most {limits.max_chars})")
    total = sum(len(line) for lines in fields.values() for line in lines)
    if total > limits.max_total_chars:
        raise RequestError(413, f"{total} characters in the request (at most {limits.max_total_chars})")
    _check_unicode([(f"{name}[{i}]", line) for name, lines in fields.items() for i, line in enumerate(lines)])


def _check_unicode(named: list[tuple[str, str]]) -> None:
    """422 naming the first of ``named`` (``(where, text)``) that is not valid Unicode."""
    for where, value in named:
        try:
            check_unicode(value, where)
        except DataError as exc:
            raise RequestError(422, str(exc)) from None


def request_settings(body: TranslateRequest) -> dict[str, Any]:
    """The decode settings ``body`` asks for, as :class:`Translator` takes them (None: the
    server's own)."""
    return {"beam": body.beam, "length_penalty": body.length_penalty, "sampling": body.sampling,
            "temperature": body.temperature, "seed": body.seed, "tgt_lang": body.tgt_lang}


def check_decoding(body: TranslateRequest, translator: Translator) -> None:
    """Raise :class:`RequestError` for settings the translator refuses (a target language the
    model does not produce, a temperature without sampling: 422), or a line that encodes to
    more pieces than the model reads (413): translating it would silently drop its end. Run
    before the request joins a batch, so that it fails alone."""
    if body.sampling not in (None, "none") and translator.decode.shortlist > 0:
        raise RequestError(422, "sampling: this server decodes over a lexical shortlist (its --set decode.shortlist), "
                                "and sampling draws from the whole vocabulary; ask for a beam search instead")
    if body.seed is not None and translator.engine is not None:  # it would be ignored
        raise RequestError(422, "seed: this server decodes with --engine ctranslate2, whose samples cannot be "
                                "seeded; leave seed out (or serve with --engine torch for seeded samples)")
    sampled = (body.sampling or translator.decode.sampling) != "none"
    if body.beam is not None and body.nbest is not None and body.nbest > body.beam and not sampled:
        raise RequestError(422, f"nbest {body.nbest} with beam {body.beam}: nbest must be between 1 and beam "
                                "(a beam search keeps beam hypotheses; leave beam out and it widens to nbest)")
    _check_sources(translator, body.text, "text", **request_settings(body), nbest=body.nbest)


def check_scoring(body: ScoreRequest, translator: Translator) -> None:
    """Raise :class:`RequestError` for a target language the model does not produce (422), or a
    source that encodes to more pieces than the model reads (413: its score would be of the
    source cut short), and a server of an ensemble (501: a pair is scored by one model). Run
    before the request joins a batch, so that it fails alone."""
    if isinstance(translator.bundle.model, Ensemble):
        raise RequestError(501, "this server decodes an ensemble (--ensemble), and a pair is scored by one model: "
                                "send it to a server of one model")
    _check_sources(translator, body.source, "source", tgt_lang=body.tgt_lang)


def _check_sources(translator: Translator, texts: list[str], name: str, **settings: Any) -> None:
    """422 for ``settings`` the translator refuses; 413 naming the first of ``texts`` (the
    field ``name``) that encodes to more pieces than the model reads."""
    try:
        lengths = translator.source_pieces(texts, **settings)
    except ConfigError as exc:
        raise RequestError(422, request_words(str(exc))) from None
    limit = translator.max_source_pieces
    for i, pieces in enumerate(lengths):
        if pieces > limit:
            raise RequestError(413, f"{name}[{i}] encodes to {pieces} pieces (the model reads at most {limit}); "
                                    "split it into sentences")


def request_words(message: str) -> str:
    """``message`` (of a :class:`ConfigError` about decode settings) in the words of a request:
    ``decode.beam_size`` is ``beam``, ``decode.tgt_lang='x'`` is ``tgt_lang 'x'``, and an option
    named in parentheses beside its setting (or a command line's way) is dropped."""
    message = re.sub(r" \((?:--[a-z-]+|on the command line [^)]*)\)", "", message)
    field = {"beam_size": "beam"}
    message = re.sub(r"(?<!--set )decode\.(\w+)=", lambda m: f"{field.get(m[1], m[1])} ", message)
    return re.sub(r"(?<!--set )decode\.(\w+)", lambda m: field.get(m[1], m[1]), message)


__all__ = ["REFUSALS", "SCORE_REFUSALS", "ErrorAnswer", "Hypothesis", "InternalError", "RequestError", "ScoreRequest", "ScoreResponse",
           "TranslateRequest", "TranslateResponse", "check_decoding", "check_request", "check_score_request",
           "check_scoring", "request_settings", "request_words"]

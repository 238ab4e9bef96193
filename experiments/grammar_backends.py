"""Compare structured-output (grammar-constrained decoding) backends: xgrammar, llguidance, outlines-core.

Measures, per backend and tokenizer: tokenizer setup time, grammar compile time (cold and repeated),
per-step bitmask fill time at batch 1 and batch 64, and correctness of random constrained walks checked
by an oracle independent of the backends (``json.loads`` + ``jsonschema`` / ``re.fullmatch``).

Usage::

    python experiments/grammar_backends.py [--backends xgrammar llguidance outlines-core]
        [--tokenizer PATH ...] [--json OUT] [--quick]

The three libraries are optional; they are imported lazily so that a missing one only drops its rows.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

MAX_TOKENS = 200
DEFAULT_TOKENIZERS = [
    "~/.cache/infer/models/smollm2-135m-instruct",
    "~/.cache/infer/models/gemma-3-270m",
]
ALL_BACKENDS = ["xgrammar", "llguidance", "outlines-core"]
# Bytes that close or separate JSON structure; used only by the optional "closing bias" retry walk.
CLOSING_BYTES = set(b'"}],')


# --------------------------------------------------------------------------------------------------
# Grammar suite. Each entry: (name, keyword it exercises, grammar). Keywords feed the coverage table.
# --------------------------------------------------------------------------------------------------


def _obj(props: dict, required: list[str] | None = None, **extra: Any) -> dict:
    schema: dict[str, Any] = {"type": "object", "properties": props}
    schema["required"] = list(props) if required is None else required
    schema.update(extra)
    return schema


JSON_SCHEMAS: list[tuple[str, str, dict]] = [
    ("flat_object", "properties/required", _obj({"name": {"type": "string"}, "age": {"type": "integer"}})),
    ("empty_object", "empty object", {"type": "object", "properties": {}, "additionalProperties": False}),
    ("any_object", "type:object (no props)", {"type": "object"}),
    (
        "nested_object",
        "nested objects",
        _obj({"user": _obj({"id": {"type": "integer"}, "address": _obj({"city": {"type": "string"}})})}),
    ),
    ("string_array", "array items", {"type": "array", "items": {"type": "string"}}),
    (
        "array_min_max",
        "minItems/maxItems",
        {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
    ),
    ("array_min_only", "minItems/maxItems", {"type": "array", "items": {"type": "boolean"}, "minItems": 3}),
    ("string_enum", "enum", {"type": "string", "enum": ["red", "green", "blue"]}),
    ("mixed_enum", "enum", {"enum": ["a", 1, None, True, 2.5]}),
    ("const_string", "const", _obj({"kind": {"const": "event"}, "v": {"type": "integer"}})),
    ("const_number", "const", {"const": 42}),
    ("string_min_max", "minLength/maxLength", {"type": "string", "minLength": 3, "maxLength": 8}),
    ("string_max_only", "minLength/maxLength", _obj({"code": {"type": "string", "maxLength": 4}})),
    ("string_pattern", "pattern", {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}),
    ("string_pattern_obj", "pattern", _obj({"sku": {"type": "string", "pattern": "^[a-z]+_[0-9]{2}$"}})),
    ("format_date", "format:date", {"type": "string", "format": "date"}),
    ("format_date_time", "format:date-time", {"type": "string", "format": "date-time"}),
    ("format_uuid", "format:uuid", {"type": "string", "format": "uuid"}),
    ("format_email", "format:email", {"type": "string", "format": "email"}),
    ("integer_range", "minimum/maximum (integer)", {"type": "integer", "minimum": -5, "maximum": 250}),
    ("integer_min_only", "minimum/maximum (integer)", {"type": "integer", "minimum": 10}),
    ("number_range", "minimum/maximum (number)", {"type": "number", "minimum": 0.5, "maximum": 99.5}),
    (
        "exclusive_range",
        "exclusiveMinimum/Maximum",
        {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
    ),
    ("boolean", "boolean/null", {"type": "boolean"}),
    ("null", "boolean/null", {"type": "null"}),
    ("any_of", "anyOf", {"anyOf": [{"type": "integer"}, _obj({"x": {"type": "string"}})]}),
    ("one_of", "oneOf", {"oneOf": [_obj({"cat": {"const": "meow"}}), _obj({"dog": {"const": "woof"}})]}),
    ("type_list", "type:[..] (union)", {"type": ["string", "null"]}),
    (
        "ref_defs",
        "$ref/$defs",
        {
            "$defs": {"point": _obj({"x": {"type": "number"}, "y": {"type": "number"}})},
            **_obj({"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}}),
        },
    ),
    (
        "recursive_ref",
        "$ref recursive",
        {
            "$defs": {
                "node": _obj(
                    {
                        "v": {"type": "integer"},
                        "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
                    },
                    required=["v"],
                    additionalProperties=False,
                )
            },
            "$ref": "#/$defs/node",
        },
    ),
    (
        "additional_false",
        "additionalProperties:false",
        _obj({"a": {"type": "integer"}, "b": {"type": "string"}}, required=["a"], additionalProperties=False),
    ),
    (
        "additional_schema",
        "additionalProperties:{schema}",
        {"type": "object", "additionalProperties": {"type": "integer"}},
    ),
    (
        "optional_props",
        "properties/required",
        _obj({"a": {"type": "integer"}, "b": {"type": "boolean"}, "c": {"type": "null"}}, required=["b"]),
    ),
    (
        "array_of_objects",
        "array items",
        {
            "type": "array",
            "items": _obj({"id": {"type": "integer"}, "tag": {"type": "string", "maxLength": 5}}),
            "maxItems": 3,
        },
    ),
    (
        "unique_items",
        "uniqueItems",
        {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 3}, "uniqueItems": True},
    ),
    (
        "tuple_prefix",
        "prefixItems",
        {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "items": False},
    ),
    ("multiple_of", "multipleOf", {"type": "integer", "multipleOf": 5}),
    (
        "tool_call",
        "nested objects",
        _obj(
            {
                "name": {"type": "string", "enum": ["get_weather", "search"]},
                "arguments": _obj(
                    {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["C", "F"]}},
                    required=["city"],
                    additionalProperties=False,
                ),
            },
            additionalProperties=False,
        ),
    ),
]

REGEXES: list[tuple[str, str, str]] = [
    ("us_phone", "regex: phone", r"\(\d{3}\) \d{3}-\d{4}"),
    ("intl_phone", "regex: phone", r"\+[1-9]\d{1,3} \d{2,4} \d{4,8}"),
    ("iso_date", "regex: date", r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"),
    ("identifier", "regex: identifier", r"[A-Za-z_][A-Za-z0-9_]{0,15}"),
    ("alternation", "regex: alternation", r"(yes|no|maybe)"),
    ("bounded_repeat", "regex: bounded repeat", r"(ab){2,5}c?"),
    ("hex_color", "regex: char class", r"#[0-9a-fA-F]{6}"),
    ("ipv4", "regex: bounded repeat", r"((25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(25[0-5]|2[0-4]\d|1?\d?\d)"),
    ("semver", "regex: bounded repeat", r"\d{1,3}\.\d{1,3}\.\d{1,3}(-[a-z]{1,8})?"),
    ("time_hhmm", "regex: alternation", r"([01]\d|2[0-3]):[0-5]\d"),
    ("email_simple", "regex: char class", r"[a-z]{1,10}@[a-z]{1,10}\.(com|org|net)"),
    ("word_list", "regex: star", r"[a-z]+( [a-z]+)*"),
]


@dataclass
class Grammar:
    name: str
    keyword: str
    kind: str  # "json" or "regex"
    source: Any  # dict schema or regex string


def grammar_suite(quick: bool) -> list[Grammar]:
    grammars = [Grammar(n, k, "json", s) for n, k, s in JSON_SCHEMAS]
    grammars += [Grammar(n, k, "regex", r) for n, k, r in REGEXES]
    if quick:
        # Quick mode keeps every third grammar: still covers JSON and regex, runs ~3x faster.
        grammars = grammars[::3]
    return grammars


# --------------------------------------------------------------------------------------------------
# Tokenizer helpers (shared by all backends).
# --------------------------------------------------------------------------------------------------


@dataclass
class TokenizerBundle:
    path: str
    hf: Any
    vocab_size: int  # bitmask width in tokens (model vocab, >= tokenizer length)
    eos_id: int
    token_bytes: list[bytes | None]  # None for special tokens, which no grammar may emit
    closing_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))

    @property
    def words(self) -> int:
        return (self.vocab_size + 31) // 32


def _byte_level_decoder() -> dict[str, int]:
    # GPT-2 byte-to-unicode table, inverted: the printable stand-in character -> original byte.
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def token_bytes_table(hf_tokenizer: Any, vocab_size: int) -> list[bytes | None]:
    """Raw bytes of every token, computed from tokenizer.json, so outlines-core gets a vocabulary
    without Vocabulary.from_pretrained (which downloads from the Hub)."""
    spec = json.loads(hf_tokenizer.backend_tokenizer.to_str())
    special = {t["id"] for t in spec["added_tokens"] if t["special"]}
    byte_level = spec["decoder"]["type"] == "ByteLevel"
    inverse = _byte_level_decoder()
    byte_fallback = re.compile(r"<0x([0-9A-Fa-f]{2})>")
    table: list[bytes | None] = [None] * vocab_size
    for token, token_id in hf_tokenizer.get_vocab().items():
        if token_id >= vocab_size or token_id in special:
            continue
        if byte_level:
            table[token_id] = bytes(inverse[ch] for ch in token)
        elif m := byte_fallback.fullmatch(token):
            table[token_id] = bytes([int(m.group(1), 16)])
        else:  # SentencePiece: U+2581 stands for a space
            table[token_id] = token.replace("\u2581", " ").encode()
    return table


def load_tokenizer(path: str) -> TokenizerBundle:
    from transformers import AutoTokenizer

    path = os.path.expanduser(path)
    hf = AutoTokenizer.from_pretrained(path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    model_vocab = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size", 0)
    vocab_size = max(len(hf), model_vocab)
    table = token_bytes_table(hf, vocab_size)
    closing = np.array([bool(b and CLOSING_BYTES & set(b)) for b in table], dtype=bool)
    closing[hf.eos_token_id] = True
    return TokenizerBundle(path, hf, vocab_size, hf.eos_token_id, table, closing)


def allowed_tokens(bitmask_row: np.ndarray, vocab_size: int) -> np.ndarray:
    bits = np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:vocab_size])


# --------------------------------------------------------------------------------------------------
# Backends: one adapter per library, same small interface.
# --------------------------------------------------------------------------------------------------


class CompileError(Exception):
    pass


class XGrammarBackend:
    name = "xgrammar"

    def setup(self, tok: TokenizerBundle) -> None:
        import torch
        import xgrammar

        self.xgr, self.torch = xgrammar, torch
        info = xgrammar.TokenizerInfo.from_huggingface(
            tok.hf, vocab_size=tok.vocab_size, stop_token_ids=[tok.eos_id]
        )
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=2)
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=2)

    def compile(self, g: Grammar) -> Any:
        try:
            if g.kind == "json":
                # Compact output (no free whitespace) in all three backends, so walks stay short.
                return self.compiler.compile_json_schema(json.dumps(g.source), any_whitespace=False)
            return self.compiler.compile_regex(g.source)
        except Exception as e:  # xgrammar raises RuntimeError/ValueError/InvalidJSONError
            raise CompileError(str(e).splitlines()[0][:200]) from e

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def reset(self, m: Any) -> None:
        m.reset()

    def fill(self, m: Any, bitmask: np.ndarray, row: int) -> None:
        m.fill_next_token_bitmask(self.torch.from_numpy(bitmask), row)

    def fill_batch(self, ms: list[Any], bitmask: np.ndarray) -> None:
        self.batch.batch_fill_next_token_bitmask(ms, self.torch.from_numpy(bitmask))

    def advance(self, m: Any, token: int) -> bool:
        return m.accept_token(token)


class LLGuidanceBackend:
    name = "llguidance"

    def setup(self, tok: TokenizerBundle) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.numpy

        self.llg, self.llg_np = llguidance, llguidance.numpy
        self.tokenizer = llguidance.hf.from_tokenizer(tok.hf, n_vocab=tok.vocab_size, eos_token=tok.eos_id)
        self.executor = llguidance.LLExecutor(num_threads=2)

    def compile(self, g: Grammar) -> Any:
        LLMatcher = self.llg.LLMatcher
        if g.kind == "json":
            grammar = LLMatcher.grammar_from_json_schema(g.source, defaults={"whitespace_flexible": False})
        else:
            grammar = LLMatcher.grammar_from_regex(g.source)
        # The constructor never raises on grammar errors; it leaves the matcher in an error state.
        matcher = LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise CompileError(matcher.get_error().splitlines()[0][:200])
        return matcher

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def reset(self, m: Any) -> None:
        m.reset()

    def fill(self, m: Any, bitmask: np.ndarray, row: int) -> None:
        self.llg_np.fill_next_token_bitmask(m, bitmask, row)

    def fill_batch(self, ms: list[Any], bitmask: np.ndarray) -> None:
        self.llg_np.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(ms)], bitmask)

    def advance(self, m: Any, token: int) -> bool:
        return m.consume_token(token)


class OutlinesCoreBackend:
    name = "outlines-core"

    def setup(self, tok: TokenizerBundle) -> None:
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema

        self.oc, self.build_regex = outlines_core, build_regex_from_schema
        self.eos_id = tok.eos_id
        by_bytes: dict[bytes, list[int]] = {}
        for token_id, raw in enumerate(tok.token_bytes):
            if raw is not None and token_id != tok.eos_id:  # EOS must not be a regular vocabulary entry
                by_bytes.setdefault(raw, []).append(token_id)
        self.vocabulary = outlines_core.Vocabulary(tok.eos_id, by_bytes)

    def compile(self, g: Grammar) -> Any:
        try:
            # whitespace_pattern="" gives compact JSON, like the other two backends here.
            regex = (
                self.build_regex(json.dumps(g.source), whitespace_pattern="")
                if g.kind == "json"
                else g.source
            )
            return self.oc.Index(regex, self.vocabulary)
        except Exception as e:
            raise CompileError(str(e).splitlines()[0][:200]) from e

    def matcher(self, compiled: Any) -> Any:
        return self.oc.Guide(compiled)

    def reset(self, m: Any) -> None:
        m.reset()

    def fill(self, m: Any, bitmask: np.ndarray, row: int) -> None:
        view = bitmask[row]
        m.write_mask_into(view.ctypes.data, view.size, 4)

    fill_batch = None  # no batched API

    def advance(self, m: Any, token: int) -> bool:
        # The mask offers EOS in a final state, but Guide.advance(EOS) raises there: treat it as "stop".
        if token == self.eos_id and m.is_finished():
            return True
        try:
            m.advance(token, False)
        except ValueError:
            return False
        return True


BACKENDS = {b.name: b for b in (XGrammarBackend, LLGuidanceBackend, OutlinesCoreBackend)}


# --------------------------------------------------------------------------------------------------
# Oracle: independent of all backends.
# --------------------------------------------------------------------------------------------------

RFC3339 = re.compile(r"\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})")


def _format_checker() -> Any:
    import jsonschema

    checker = jsonschema.FormatChecker()  # a fresh copy, so the library default stays untouched

    # jsonschema only checks date-time when rfc3339-validator is installed; check it here instead.
    @checker.checks("date-time", raises=ValueError)
    def _date_time(value: object) -> bool:
        if not isinstance(value, str):
            return True
        if not RFC3339.fullmatch(value):
            return False
        dt.datetime.fromisoformat(value.upper().replace("Z", "+00:00"))
        return True

    return checker


def make_oracle(g: Grammar) -> Any:
    """Return check(text) -> None on success, or an error string."""
    if g.kind == "regex":
        # re.ASCII: \d and \w mean ASCII here, as in JSON Schema (ECMA-262) patterns; Rust-regex
        # backends treat \d as any Unicode digit, which this oracle reports as not enforced.
        pattern = re.compile(g.source, re.ASCII)
        return lambda text: None if pattern.fullmatch(text) else "no fullmatch"
    import jsonschema

    validator = jsonschema.Draft202012Validator(g.source, format_checker=_format_checker())

    def check(text: str) -> str | None:
        try:
            value = json.loads(text)
        except ValueError as e:
            return f"json: {e}"
        error = jsonschema.exceptions.best_match(validator.iter_errors(value))
        return None if error is None else f"schema: {error.message[:120]}"

    return check


# --------------------------------------------------------------------------------------------------
# Random walks and measurements.
# --------------------------------------------------------------------------------------------------


@dataclass
class Walk:
    tokens: list[int]
    finished: bool  # EOS sampled
    dead_end: bool  # empty mask before EOS: a backend bug
    fill_ns: list[int]
    advance_ns: list[int]
    eos_offered_invalid: int = 0  # steps where EOS was allowed but the prefix failed the oracle


def sample(rng: random.Random, allowed: np.ndarray, tok: TokenizerBundle, bias: bool) -> int:
    if bias and rng.random() < 0.7:
        closing = allowed[tok.closing_ids[allowed]]
        if len(closing):
            return int(closing[rng.randrange(len(closing))])
    return int(allowed[rng.randrange(len(allowed))])


def random_walk(
    backend: Any, matcher: Any, tok: TokenizerBundle, seed: int, bias_after: int | None, check=None
) -> Walk:
    """Drive one matcher with uniformly random allowed tokens; EOS is sampled only when the mask allows it."""
    rng = random.Random(seed)
    bitmask = np.zeros((1, tok.words), dtype=np.int32)
    walk = Walk([], False, False, [], [])
    for step in range(MAX_TOKENS):
        t0 = time.perf_counter_ns()
        backend.fill(matcher, bitmask, 0)
        walk.fill_ns.append(time.perf_counter_ns() - t0)
        allowed = allowed_tokens(bitmask[0], tok.vocab_size)
        if len(allowed) == 0:
            walk.dead_end = True
            break
        eos_allowed = bool((bitmask[0, tok.eos_id // 32] >> (tok.eos_id % 32)) & 1)
        if check is not None and eos_allowed and check(decode(tok, walk.tokens)) is not None:
            walk.eos_offered_invalid += 1
        token = sample(rng, allowed, tok, bias_after is not None and step >= bias_after)
        t0 = time.perf_counter_ns()
        ok = backend.advance(matcher, token)
        walk.advance_ns.append(time.perf_counter_ns() - t0)
        if not ok:
            walk.dead_end = True
            break
        if token == tok.eos_id:
            walk.finished = True
            break
        walk.tokens.append(token)
    return walk


def decode(tok: TokenizerBundle, ids: list[int]) -> str:
    return tok.hf.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def timed(fn, *args) -> tuple[Any, float]:
    t0 = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - t0


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def measure_compile(
    backend: Any, grammars: list[Grammar], words: int
) -> tuple[dict[str, Any], dict[str, dict]]:
    """Compile each grammar twice (second = repeated compile, shows caching) and time the first mask."""
    compiled: dict[str, Any] = {}
    rows: dict[str, dict] = {}
    for g in grammars:
        try:
            first, cold_s = timed(backend.compile, g)
            _, again_s = timed(backend.compile, g)
        except CompileError as e:
            rows[g.name] = {"error": str(e)}
            continue
        matcher = backend.matcher(first)
        bitmask = np.zeros((1, words), dtype=np.int32)
        _, first_mask_s = timed(backend.fill, matcher, bitmask, 0)
        compiled[g.name] = first
        rows[g.name] = {"cold_s": cold_s, "again_s": again_s, "first_mask_s": first_mask_s}
    return compiled, rows


def measure_batch(
    backend: Any,
    tok: TokenizerBundle,
    compiled: list[Any],
    batch: int,
    steps: int,
    parallel: bool,
    raw: bool = False,
) -> dict:
    """Step `batch` independent matchers together; a finished matcher is reset so the batch stays full."""
    matchers = [backend.matcher(compiled[i % len(compiled)]) for i in range(batch)]
    counts = [0] * batch
    rng = random.Random(1234)
    bitmask = np.zeros((batch, tok.words), dtype=np.int32)
    fill_us, advance_us = [], []
    for _ in range(steps):
        t0 = time.perf_counter_ns()
        if parallel:
            backend.fill_batch(matchers, bitmask)
        else:
            for i, m in enumerate(matchers):
                backend.fill(m, bitmask, i)
        fill_us.append((time.perf_counter_ns() - t0) / 1e3)
        for i, m in enumerate(matchers):
            allowed = allowed_tokens(bitmask[i], tok.vocab_size)
            token = sample(rng, allowed, tok, bias=False) if len(allowed) else tok.eos_id
            t0 = time.perf_counter_ns()
            backend.advance(m, token)
            advance_us.append((time.perf_counter_ns() - t0) / 1e3)
            counts[i] += 1
            if token == tok.eos_id or counts[i] >= MAX_TOKENS:
                backend.reset(m)
                counts[i] = 0
    if raw:
        return {"fill_us": fill_us, "advance_us": advance_us}
    return timing_summary(fill_us, advance_us)


def measure_batch1(backend: Any, tok: TokenizerBundle, suite: list[Any], steps: int) -> dict:
    """Batch 1 over every grammar in turn (a single grammar would measure only its own states)."""
    fill_us, advance_us = [], []
    per_grammar = max(steps // 5, 10)
    for compiled in suite:
        one = measure_batch(backend, tok, [compiled], 1, per_grammar, parallel=False, raw=True)
        fill_us += one["fill_us"]
        advance_us += one["advance_us"]
    return timing_summary(fill_us, advance_us)


def timing_summary(fill_us: list[float], advance_us: list[float]) -> dict:
    return {
        "fill_us_median": statistics.median(fill_us),
        "fill_us_p99": percentile(fill_us, 99),
        "advance_us_median": statistics.median(advance_us),
        "advance_us_p99": percentile(advance_us, 99),
    }


def multi_structural_tokens(tok: TokenizerBundle, ids: list[int]) -> list[str]:
    """Sampled tokens that span two or more JSON structural characters (e.g. '"}' or '},')."""
    out = []
    for i in ids:
        raw = tok.token_bytes[i] or b""
        if sum(raw.count(c) for c in b'"{}[],:') >= 2:
            out.append(raw.decode(errors="replace"))
    return out


def check_correctness(
    backend: Any, tok: TokenizerBundle, grammars: list[Grammar], compiled: dict, walks: int
) -> dict:
    results = {}
    for g in grammars:
        if g.name not in compiled:
            continue
        check = make_oracle(g)
        row = {"valid": 0, "invalid": 0, "unfinished": 0, "dead_end": 0, "eos_offered_invalid": 0}
        row.update({"retry_valid": 0, "retry_invalid": 0, "retry_unfinished": 0, "examples": [], "multi": []})
        for seed in range(walks):
            walk = random_walk(backend, backend.matcher(compiled[g.name]), tok, seed, None, check)
            prefix = ""
            if not walk.finished and not walk.dead_end:
                # Retry the unfinished walk with a bias towards closing tokens after step 20.
                walk = random_walk(backend, backend.matcher(compiled[g.name]), tok, seed, 20, check)
                row["unfinished"] += 1
                prefix = "retry_"
            row["eos_offered_invalid"] += walk.eos_offered_invalid
            row["multi"] += multi_structural_tokens(tok, walk.tokens)
            if walk.dead_end:
                row["dead_end"] += 1
                continue
            if not walk.finished:
                row["retry_unfinished"] += 1
                continue
            text = decode(tok, walk.tokens)
            error = check(text)
            row[prefix + ("valid" if error is None else "invalid")] += 1
            if error is not None and len(row["examples"]) < 2:
                row["examples"].append({"text": text[:160], "error": error})
        row["multi"] = sorted(set(row["multi"]))[:8]
        results[g.name] = row
    return results


# --------------------------------------------------------------------------------------------------
# Driver and report.
# --------------------------------------------------------------------------------------------------


def run_backend(name: str, tok: TokenizerBundle, grammars: list[Grammar], args: argparse.Namespace) -> dict:
    backend = BACKENDS[name]()
    _, setup_s = timed(backend.setup, tok)
    log(f"  {name}: setup {setup_s:.2f}s")
    compiled, compile_rows = measure_compile(backend, grammars, tok.words)
    ok = [r for r in compile_rows.values() if "error" not in r]
    log(f"  {name}: compiled {len(ok)}/{len(grammars)}")
    suite = [compiled[g.name] for g in grammars if g.name in compiled]
    steps = 30 if args.quick else 100
    mask = {
        "batch1": measure_batch1(backend, tok, suite, steps),
        "batch64": measure_batch(backend, tok, suite, 64, steps, parallel=False),
    }
    if backend.fill_batch is not None:
        mask["batch64_parallel_api"] = measure_batch(backend, tok, suite, 64, steps, parallel=True)
    log(f"  {name}: mask {json.dumps({k: round(v['fill_us_median']) for k, v in mask.items()})}")
    correctness = check_correctness(backend, tok, grammars, compiled, args.walks)
    return {"setup_s": setup_s, "compile": compile_rows, "mask": mask, "correctness": correctness}


def summarize_compile(rows: dict[str, dict]) -> dict:
    ok = [r for r in rows.values() if "error" not in r]
    summary = {"compiled": len(ok), "failed": len(rows) - len(ok)}
    for key in ("cold_s", "again_s", "first_mask_s"):
        values = [r[key] * 1e3 for r in ok]
        summary[key.replace("_s", "_ms_median")] = statistics.median(values) if values else None
        summary[key.replace("_s", "_ms_max")] = max(values) if values else None
    return summary


def coverage_table(result: dict, grammars: list[Grammar]) -> dict[str, dict]:
    """Per keyword: compile failures (unsupported), grammars whose outputs fail the oracle (not enforced)."""
    table: dict[str, dict] = {}
    for g in grammars:
        entry = table.setdefault(
            g.keyword, {"grammars": 0, "unsupported": [], "not_enforced": [], "unfinished": 0}
        )
        entry["grammars"] += 1
        if "error" in result["compile"][g.name]:
            entry["unsupported"].append(g.name)
            continue
        row = result["correctness"][g.name]
        if row["invalid"] or row["retry_invalid"] or row["dead_end"] or row["eos_offered_invalid"]:
            entry["not_enforced"].append(g.name)
        entry["unfinished"] += row["retry_unfinished"]
    return table


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def md_row(*cells: Any) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def med_max(summary: dict, key: str) -> str:
    return f"{summary[key + '_ms_median']:.2f} / {summary[key + '_ms_max']:.1f}"


def walk_totals(correctness: dict) -> dict[str, int]:
    rows = list(correctness.values())
    return {k: sum(r[k] for r in rows) for k in rows[0] if k not in ("examples", "multi")}


def print_report(report: dict) -> None:
    for tok_path, per_backend in report["results"].items():
        print(f"\n## {os.path.basename(tok_path)}")
        print(md_row("backend", "setup s", "compiled", "cold ms med/max", "again ms med/max", "1st mask ms"))
        print(md_row(*["---"] * 6))
        for name, r in per_backend.items():
            c = r["compile_summary"]
            compiled = f"{c['compiled']}/{c['compiled'] + c['failed']}"
            cells = (med_max(c, "cold"), med_max(c, "again"), med_max(c, "first_mask"))
            print(md_row(name, f"{r['setup_s']:.2f}", compiled, *cells))
        print("\n" + md_row("backend", "mode", "fill us/step med", "p99", "advance us/token med", "p99"))
        print(md_row(*["---"] * 6))
        for name, r in per_backend.items():
            for mode, m in r["mask"].items():
                fill = (f"{m['fill_us_median']:.0f}", f"{m['fill_us_p99']:.0f}")
                print(
                    md_row(name, mode, *fill, f"{m['advance_us_median']:.1f}", f"{m['advance_us_p99']:.1f}")
                )
        print(
            "\n" + md_row("backend", "valid", "invalid", "unfinished", "retry v/i/u", "dead end", "EOS early")
        )
        print(md_row(*["---"] * 7))
        for name, r in per_backend.items():
            t = walk_totals(r["correctness"])
            retry = f"{t['retry_valid']}/{t['retry_invalid']}/{t['retry_unfinished']}"
            cells = (
                t["valid"],
                t["invalid"],
                t["unfinished"],
                retry,
                t["dead_end"],
                t["eos_offered_invalid"],
            )
            print(md_row(name, *cells))
        for name, r in per_backend.items():
            for kw, e in r["coverage"].items():
                if e["unsupported"] or e["not_enforced"]:
                    print(f"- {name}: {kw}: unsupported={e['unsupported']} not_enforced={e['not_enforced']}")


def library_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in (
        "xgrammar",
        "llguidance",
        "outlines-core",
        "apache-tvm-ffi",
        "transformers",
        "torch",
        "jsonschema",
    ):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "missing"
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backends", nargs="+", default=ALL_BACKENDS, choices=ALL_BACKENDS)
    p.add_argument("--tokenizer", nargs="+", default=DEFAULT_TOKENIZERS, help="tokenizer directories")
    p.add_argument("--json", help="write full results here")
    p.add_argument("--quick", action="store_true", help="a third of the suite, fewer steps and walks")
    p.add_argument("--walks", type=int, default=None, help="random walks per grammar (default 5, quick 2)")
    args = p.parse_args(argv)
    if args.walks is None:
        args.walks = 2 if args.quick else 5
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    grammars = grammar_suite(args.quick)
    report: dict[str, Any] = {"versions": library_versions(), "python": sys.version.split()[0], "results": {}}
    report["suite"] = [{"name": g.name, "keyword": g.keyword, "kind": g.kind} for g in grammars]
    for tok_path in args.tokenizer:
        tok = load_tokenizer(tok_path)
        log(f"{tok_path}: vocab {tok.vocab_size}, eos {tok.eos_id}")
        per_backend = report["results"][tok_path] = {}
        for name in args.backends:
            result = run_backend(name, tok, grammars, args)
            result["compile_summary"] = summarize_compile(result["compile"])
            result["coverage"] = coverage_table(result, grammars)
            per_backend[name] = result
    print_report(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)


if __name__ == "__main__":
    main()

"""Grammar backends for structured outputs: llguidance (tandem's) against xgrammar and
outlines-core, on the same tokenizer, schemas and outputs.

    python benchmarks/grammar_backends.py                  # 131072-token BPE (Llama 3 size)
    python benchmarks/grammar_backends.py --vocab 8192 131072 --walks 20

For each case (a small object schema, a nested schema, a regex) and backend:
- compile: median time to compile the spec against the tokenizer, caches off (ms);
- first mask: the first next-token mask of a fresh compile (backends that build lazily pay
  here what others pay at compile), so compile + first mask is the time to the first token;
- mask mean / p99: the time to compute one next-token bitmask (CPU, int32, one bit per
  token) at every position of a valid output walked token by token, EOS included, over
  `--walks` walks (each a fresh matcher of one compiled grammar), in microseconds.
Every walk also checks that each token of the output was allowed by the mask and accepted.
Ratios are against llguidance measured in the same run. xgrammar and outlines-core are
optional: a backend that does not import is reported as skipped. The tokenizer is
`tools.make_model.build_tokenizer(vocab)`, a byte-level BPE trained on the tiny models'
corpus (the benchmark needs no download).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from engine.structured import GrammarCompiler  # noqa: E402
from tools.make_model import build_tokenizer  # noqa: E402

SMALL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 64},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"},
    },
    "required": ["name", "age", "email"],
    "additionalProperties": False,
}
ADDRESS = {
    "type": "object",
    "properties": {
        "street": {"type": "string"},
        "city": {"type": "string"},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
    },
    "required": ["street", "city", "zip"],
    "additionalProperties": False,
}
ITEM = {
    "type": "object",
    "properties": {
        "sku": {"type": "string"},
        "qty": {"type": "integer"},
        "price": {"type": "number"},
        "tags": {"type": "array", "items": {"enum": ["new", "sale", "gift"]}, "maxItems": 3},
    },
    "required": ["sku", "qty", "price"],
    "additionalProperties": False,
}
NESTED_SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": "integer"},
        "customer": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "address": ADDRESS},
            "required": ["name", "address"],
            "additionalProperties": False,
        },
        "items": {"type": "array", "items": ITEM, "minItems": 1},
        "gift": {"type": "boolean"},
        "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    },
    "required": ["order_id", "customer", "items", "gift", "note"],
    "additionalProperties": False,
}
NESTED_VALUE = {
    "order_id": 1042,
    "customer": {
        "name": "Grace Hopper",
        "address": {"street": "12 Harbour Road", "city": "Arlington", "zip": "22201"},
    },
    "items": [
        {"sku": "KB-101", "qty": 2, "price": 49.5, "tags": ["new", "sale"]},
        {"sku": "MS-7", "qty": 1, "price": 19.99},
    ],
    "gift": True,
    "note": "Leave at the front desk, please.",
}
REGEX = r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}Z [A-Z][a-z]+ #[0-9a-f]{6}"

# (name, kind, spec, a valid output): JSON outputs in json.dumps' layout, the one tandem emits.
CASES = [
    (
        "small object",
        "json_schema",
        json.dumps(SMALL_SCHEMA),
        json.dumps({"name": "Ada Lovelace", "age": 36, "email": "ada@example.org"}),
    ),
    ("nested schema", "json_schema", json.dumps(NESTED_SCHEMA), json.dumps(NESTED_VALUE)),
    ("regex", "regex", REGEX, "2024-05-17T09:30:00Z Tuesday #1f2e3d"),
]


class LLGuidance:
    """tandem's own path: engine.structured (llguidance underneath)."""

    name = "llguidance"

    def __init__(self, tok, vocab: int, eos: int) -> None:
        self.compiler = GrammarCompiler(tok, vocab, (eos,))

    def compile(self, kind: str, spec: str):
        self.compiler.clear_cache()
        return self.compiler.compile(kind, spec)

    def matcher(self, compiled):
        return compiled.matcher()

    def fill(self, matcher, bitmask: torch.Tensor) -> None:
        matcher.fill_bitmask(bitmask[0])

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept(token)


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok, vocab: int, eos: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=[eos])

    def compile(self, kind: str, spec: str):
        compiler = self.xgr.GrammarCompiler(self.info, cache_enabled=False)
        if kind == "regex":
            return compiler.compile_regex(spec)
        # The same fixed layout as tandem's (json.dumps' separators, no free whitespace).
        return compiler.compile_json_schema(spec, any_whitespace=False, separators=(", ", ": "))

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher, bitmask: torch.Tensor) -> None:
        matcher.fill_next_token_bitmask(bitmask, 0)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character a BPE token uses for each byte."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tok, vocab: int, eos: int) -> None:
        import outlines_core as oc
        from outlines_core.json_schema import build_regex_from_schema

        self.oc, self.regex_of = oc, build_regex_from_schema
        decoder, special = _byte_decoder(), set(tok.all_special_ids)
        table: dict[bytes, list[int]] = {}
        for token, idx in tok.get_vocab().items():
            if idx in special or any(c not in decoder for c in token):
                continue  # special and added tokens never match grammar text
            table.setdefault(bytes(decoder[c] for c in token), []).append(idx)
        self.vocabulary = oc.Vocabulary(eos, table)
        self.words, self.eos = (vocab + 31) // 32, eos

    def compile(self, kind: str, spec: str):
        pattern = spec if kind == "regex" else self.regex_of(spec, r"[ ]?")
        return self.oc.Index(pattern, self.vocabulary)

    def matcher(self, compiled):
        return self.oc.Guide(compiled)

    def fill(self, matcher, bitmask: torch.Tensor) -> None:
        matcher.write_mask_into(bitmask.data_ptr(), self.words, 4)

    def accept(self, matcher, token: int) -> bool:
        if token == self.eos:  # a final state's EOS ends the walk; Guide has no EOS state
            return matcher.is_finished()
        try:
            matcher.advance(token, return_tokens=False)
        except ValueError:
            return False
        return True


BACKENDS = (LLGuidance, XGrammar, OutlinesCore)


def _allowed(bitmask: torch.Tensor, token: int) -> bool:
    return bool((int(bitmask[0, token // 32]) >> (token % 32)) & 1)


def measure(backend, kind: str, spec: str, tokens: list[int], vocab: int, args) -> dict:
    compile_s, first_s = [], []
    bitmask = torch.zeros((1, (vocab + 31) // 32), dtype=torch.int32)
    backend.compile(kind, spec)  # untimed: one-time set-up inside the library is not a compile
    for _ in range(args.compiles):
        t0 = time.perf_counter()
        compiled = backend.compile(kind, spec)
        t1 = time.perf_counter()
        backend.fill(backend.matcher(compiled), bitmask)
        first_s.append(time.perf_counter() - t1)
        compile_s.append(t1 - t0)
    compiled = backend.compile(kind, spec)
    mask_s = []
    for _ in range(args.walks):
        matcher = backend.matcher(compiled)
        for token in tokens:
            t0 = time.perf_counter()
            backend.fill(matcher, bitmask)
            mask_s.append(time.perf_counter() - t0)
            if not _allowed(bitmask, token) or not backend.accept(matcher, token):
                raise RuntimeError(f"{backend.name} rejected token {token} of a valid output")
    mask_s.sort()
    return {
        "compile_ms": statistics.median(compile_s) * 1e3,
        "first_mask_ms": statistics.median(first_s) * 1e3,
        "mask_mean_us": statistics.fmean(mask_s) * 1e6,
        "mask_p99_us": mask_s[min(len(mask_s) - 1, int(0.99 * len(mask_s)))] * 1e6,
        "tokens": len(tokens),
    }


def _row(case: str, name: str, r: dict, base: dict | None) -> str:
    def ratio(key: str) -> str:
        return "1.00" if base is None else f"{r[key] / base[key]:.2f}"

    return (
        f"| {case} | {name} | {r['compile_ms']:.2f} | {r['first_mask_ms']:.3f} "
        f"| {r['mask_mean_us']:.1f} | {r['mask_p99_us']:.1f} "
        f"| {ratio('compile_ms')} | {ratio('mask_mean_us')} | {ratio('mask_p99_us')} |"
    )


HEADER = (
    "| case | backend | compile ms | first mask ms | mask mean us | mask p99 us "
    "| compile x llg | mask mean x llg | mask p99 x llg |\n"
    "|---|---|---:|---:|---:|---:|---:|---:|---:|"
)


def run_vocab(vocab: int, args) -> None:
    tok = build_tokenizer(vocab, 8192)
    eos = tok.eos_token_id
    backends = []
    for cls in BACKENDS:
        try:
            backends.append(cls(tok, vocab, eos))
        except ImportError as e:
            print(f"{cls.name}: skipped ({e})")
    print(f"\nvocab {vocab} ({len(tok)} tokenizer tokens), {args.walks} walks per case")
    print(HEADER)
    for case, kind, spec, text in CASES:
        tokens = [*tok.encode(text), eos]
        base = None
        for backend in backends:
            r = measure(backend, kind, spec, tokens, vocab, args)
            print(_row(f"{case} ({r['tokens']} tok)", backend.name, r, base))
            base = base or r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, nargs="+", default=[131072])
    ap.add_argument("--walks", type=int, default=20, help="walks of each output per backend")
    ap.add_argument("--compiles", type=int, default=5, help="compiles per case (median)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"load average at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    for vocab in args.vocab:
        run_vocab(vocab, args)
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What a JSON grammar costs per token, xgrammar against llguidance (issue 48: structured outputs).

GPT-2's real vocabulary (50,257 byte-level BPE tokens, with its merges) read from llama.cpp's
`ggml-vocab-gpt-2.gguf` (shipped in llama-cpp-python's source package, found in uv's cache or given
with --vocab) through tformer's GGUF tokenizer reader. For each library:

    setup     (CPU seconds) the tokenizer's information for the library (xgrammar: TokenizerInfo + GrammarCompiler;
              llguidance: LLTokenizer), once per server
    compile   each schema (and the generic JSON object grammar) compiled cold: a fresh compiler
              (xgrammar, its cache off) or a fresh matcher (llguidance), and with the first mask of a
              matcher copied from it (llguidance builds parts of its lexer lazily); wall and CPU seconds
              (the process's, all threads), medians over --repeats
    mask      per token, walking a valid answer's tokens (the compact JSON, `json.dumps(separators=
              (",", ":"))`, tokenized by GPT-2's BPE): the next-token bitmask of the whole vocabulary,
              then the token accepted; median and p90 (wall) over every step of every schema, each
              answer walked by a fresh matcher (xgrammar: from the compiled grammar; llguidance: a
              deep copy of the compiled matcher, which shares its lexer); and the mean CPU time
              of a step (on a busy machine the wall median hides the rare slow steps, the mean
              does not)
    apply     the mask on one row of logits (1, 50,257): tformer's unpack_bitmask + apply_token_mask
              (generation/processors.py), the same for both
    rows      the server's whole per-row choice (serve/sequence.py Sequence.choose) on GPT-2's
              vocabulary, plain against with an xgrammar grammar (serve/grammar.py), greedy and sampled

Both compile JSON with compact separators and no free whitespace (as the server does).

    .venv/bin/python benchmarks/grammar_cost.py [--vocab ggml-vocab-gpt-2.gguf] [--repeats 3]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import time

import torch

SCHEMAS = {
    "person": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                                "age": {"type": "integer", "minimum": 0, "maximum": 150}},
               "required": ["name", "age"], "additionalProperties": False},
    "enum+array": {"type": "object", "properties": {
        "status": {"enum": ["open", "closed", "pending"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4}},
        "required": ["status", "tags"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "order": {"type": "object", "properties": {
            "id": {"type": "integer"}, "items": {"type": "array", "items": {"type": "object", "properties": {
                "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}},
                "required": ["sku", "qty"], "additionalProperties": False}}},
            "required": ["id", "items"], "additionalProperties": False},
        "paid": {"type": "boolean"}}, "required": ["order", "paid"], "additionalProperties": False},
    "tool call": {"anyOf": [{"type": "object", "properties": {
        "name": {"const": f"tool_{i}"}, "arguments": {"type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "days", "unit"], "additionalProperties": False}},
        "required": ["name", "arguments"], "additionalProperties": False} for i in range(4)]},
    "wide": {"type": "object", "properties": {f"field_{i}": {"type": ["string", "number", "null"]}
                                              for i in range(20)},
             "required": [f"field_{i}" for i in range(20)], "additionalProperties": False},
}
ANSWERS = {
    "person": {"name": "Ada Lovelace", "age": 36},
    "enum+array": {"status": "pending", "tags": ["math", "engines", "notes"]},
    "nested": {"order": {"id": 1234, "items": [{"sku": "A-12", "qty": 2}, {"sku": "B-7", "qty": 10}]},
               "paid": True},
    "tool call": {"name": "tool_2", "arguments": {"city": "Paris", "days": 3, "unit": "c"}},
    "wide": {f"field_{i}": (f"value {i}" if i % 3 == 0 else i * 1.5 if i % 3 == 1 else None) for i in range(20)},
}
JSON_OBJECT = "json object"       # the generic grammar of response_format {"type": "json_object"}


def gpt2_tokenizer(path: str | None):
    import gguf

    from tformer.checkpoints.gguf import Metadata
    from tformer.checkpoints.gguf.vocab import read_tokenizer

    path = path or next(iter(sorted(glob.glob(os.path.expanduser(
        "~/.cache/uv/sdists-*/pypi/llama-cpp-python/*/*/src/vendor/llama.cpp/models/ggml-vocab-gpt-2.gguf")))), None)
    if path is None:
        raise SystemExit("ggml-vocab-gpt-2.gguf not found: pass --vocab (llama.cpp's models/ggml-vocab-gpt-2.gguf)")
    return read_tokenizer(Metadata(gguf.GGUFReader(path)).get)


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def cpu_timed(fn):
    """CPU seconds of this process (all its threads): on a busy machine, wall time also counts the waits."""
    t = time.process_time()
    out = fn()
    return out, time.process_time() - t


class XGrammar:
    name = "xgrammar"

    @staticmethod
    def imports():
        import transformers  # noqa: F401  (xgrammar imports it)
        import xgrammar  # noqa: F401

    def __init__(self, tokenizer):
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        self.xgr = xgr
        fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer.hf, eos_token="<|endoftext|>")
        self.info = xgr.TokenizerInfo.from_huggingface(fast, stop_token_ids=[tokenizer.eos_id])

    def compiler(self):
        return self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)

    def compile(self, compiler, schema):        # as serve/grammar.py compiles (any object: not strict)
        return compiler.compile_json_schema({"type": "object"} if schema is None else schema, any_whitespace=False,
                                            separators=(",", ":"), strict_mode=schema is not None)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher, bitmask):
        matcher.fill_next_token_bitmask(bitmask)

    def accept(self, matcher, token):
        return matcher.accept_token(token)

    def done(self, matcher):
        return matcher.is_terminated()


class LLGuidance:
    name = "llguidance"

    @staticmethod
    def imports():
        import llguidance.torch  # noqa: F401

    def __init__(self, tokenizer):
        import llguidance
        import llguidance.torch  # noqa: F401  (fill_next_token_bitmask)

        self.llg = llguidance
        self.tok = llguidance.LLTokenizer(tokenizer.hf.to_str(), eos_token=tokenizer.eos_id)

    def compiler(self):
        return None

    def compile(self, compiler, schema):
        options = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema if schema is not None else {"type": "object"},
                                                              overrides=options)
        matcher = self.llg.LLMatcher(self.tok, grammar)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def matcher(self, compiled):
        return compiled.deep_copy()         # shares the compiled lexer (a new LLMatcher would rebuild it)

    def fill(self, matcher, bitmask):
        self.llg.torch.fill_next_token_bitmask(matcher, bitmask)

    def accept(self, matcher, token):
        return matcher.consume_token(token)

    def done(self, matcher):
        return matcher.is_stopped()


def measure(lib_cls, tokenizer, repeats: int) -> dict:
    from tformer.generation.processors import apply_token_mask, unpack_bitmask

    _, imports = cpu_timed(lib_cls.imports)
    lib, setup = cpu_timed(lambda: lib_cls(tokenizer))
    vocab = tokenizer.vocab_size
    logits = torch.randn(1, vocab)
    bitmask = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32)
    compile_s, first_s = {}, {}
    for name, schema in [*SCHEMAS.items(), (JSON_OBJECT, None)]:
        times, firsts = [], []
        for _ in range(repeats):
            compiler = lib.compiler()
            t0, c0 = time.perf_counter(), time.process_time()
            compiled = lib.compile(compiler, schema)
            times.append((time.perf_counter() - t0, time.process_time() - c0))
            lib.fill(lib.matcher(compiled), bitmask)      # llguidance builds parts of its lexer lazily
            firsts.append((time.perf_counter() - t0, time.process_time() - c0))
        compile_s[name] = [statistics.median(t[i] for t in times) for i in (0, 1)]     # wall, CPU
        first_s[name] = [statistics.median(t[i] for t in firsts) for i in (0, 1)]
    steps, cpu, accepts, applies = [], [], [], []
    for name, schema in [*SCHEMAS.items(), (JSON_OBJECT, None)]:
        answer = ANSWERS.get(name, ANSWERS["nested"])
        tokens = tokenizer.encode(json.dumps(answer, separators=(",", ":"))) + [tokenizer.eos_id]
        compiled = lib.compile(lib.compiler(), schema)
        lib.fill(lib.matcher(compiled), bitmask)              # warm (llguidance: its lexer)
        for _ in range(repeats):
            matcher = lib.matcher(compiled)
            for token in tokens:
                c0 = time.process_time()
                _, t = timed(lambda: lib.fill(matcher, bitmask))
                cpu.append(time.process_time() - c0)
                steps.append(t)
                allowed = unpack_bitmask(bitmask[0], vocab)
                assert bool(allowed[token]), f"{lib.name}: {name}: token {token} is not allowed"
                _, t = timed(lambda: apply_token_mask(logits, allowed[None]))
                applies.append(t)
                ok, t = timed(lambda: lib.accept(matcher, token))
                accepts.append(t)
                assert ok, f"{lib.name}: {name}: token {token} was refused"
            assert lib.done(matcher), f"{lib.name}: {name}: not finished after EOS"
    return {"import_s": imports, "setup_s": setup, "compile_s": compile_s, "first_mask_s": first_s,
            "steps": len(steps), "mask_cpu_mean_us": sum(cpu) / len(cpu) * 1e6,
            "mask_us": statistics.median(steps) * 1e6, "mask_p90_us": sorted(steps)[int(0.9 * len(steps))] * 1e6,
            "accept_us": statistics.median(accepts) * 1e6, "apply_us": statistics.median(applies) * 1e6}


def server_rows(tokenizer, steps: int) -> dict:
    """The server's own cost per row and token (serve/sequence.py Sequence.choose on one row's logits of
    GPT-2's vocabulary), without and with a grammar (serve/grammar.py: xgrammar's mask, unpacked and
    applied, then the token accepted), greedy and sampled; random logits, so the rows write random answers
    of the schema (a row whose answer is complete starts again)."""
    from tformer.serve.grammar import Grammars
    from tformer.serve.sequence import Sampling, Sequence

    vocab = tokenizer.vocab_size
    grammars = Grammars(tokenizer, vocab, {tokenizer.eos_id})
    compiled = grammars.compile(SCHEMAS["person"])
    torch.manual_seed(0)
    logits = torch.randn(steps, vocab) * 3
    out = {}
    for temperature in (0.0, 1.0):
        for grammar in (None, compiled):
            def row():
                return Sequence(0, [0], Sampling(10**6, temperature, seed=0, grammar=grammar), tokenizer,
                                {tokenizer.eos_id}, lambda event: None)
            seq, times = row(), []
            for i in range(steps):
                t = time.perf_counter()
                token = seq.choose(logits[i])
                times.append(time.perf_counter() - t)
                if token == tokenizer.eos_id or (seq.matcher is not None and seq.matcher.finished):
                    seq = row()
            out[f"{'sampled' if temperature else 'greedy'}, {'grammar' if grammar else 'plain'}"] = \
                statistics.median(times) * 1e6
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", help="llama.cpp's ggml-vocab-gpt-2.gguf (default: found in uv's cache)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--libs", default="xgrammar,llguidance")
    parser.add_argument("--steps", type=int, default=400, help="steps of the server-row measurement")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = gpt2_tokenizer(args.vocab)
    print(f"vocabulary: {tokenizer.vocab_size} tokens; torch threads 1")
    results = {}
    for lib_cls in (XGrammar, LLGuidance):
        if lib_cls.name in args.libs.split(","):
            results[lib_cls.name] = r = measure(lib_cls, tokenizer, args.repeats)
            print(f"\n{lib_cls.name}: import {r['import_s']:.1f} s, setup {r['setup_s']:.2f} s; "
                  f"per token ({r['steps']} steps): mask "
                  f"{r['mask_us']:.0f} us (p90 {r['mask_p90_us']:.0f}), accept {r['accept_us']:.0f} us, "
                  f"apply {r['apply_us']:.0f} us")
            for name, s in r["compile_s"].items():
                first = r["first_mask_s"][name]
                print(f"  {name:12s} compile {s[0] * 1e3:7.1f} ms (CPU {s[1] * 1e3:6.1f}), with the first mask "
                      f"{first[0] * 1e3:7.1f} ms (CPU {first[1] * 1e3:6.1f})")
            print(f"  mask: CPU time per step, mean over all {r['steps']} steps: {r['mask_cpu_mean_us']:.0f} us")
    results["server rows"] = rows = server_rows(tokenizer, args.steps)
    print(f"\nthe server's Sequence.choose, one row of {tokenizer.vocab_size} logits, median of {args.steps} steps:")
    for name, us in rows.items():
        print(f"  {name:18s} {us:7.0f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

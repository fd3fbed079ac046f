"""Grammars for structured outputs: a JSON schema (or "any JSON object") compiled by xgrammar for the
served tokenizer, and one matcher per row that says which tokens may come next.

    schema --Grammars.compile (LRU cache, one per schema)--> Compiled --.matcher()--> Matcher (one per row)
    each step:  Matcher.allowed() (V,) bool -> generation.processors.apply_token_mask -> choose -> accept

xgrammar was chosen over llguidance by measurement (benchmarks/grammar_cost.py, docs/SERVING.md): its
per-token mask is several times cheaper, and the compile time it pays more is paid once per schema.

The vocabulary xgrammar sees is the tokenizer's own, token by token, except that every special token
(the tokenizer's pad / bos / eos, added tokens marked special, the unknown token) is blank: xgrammar
never allows a blank token, and the server's text drops them (served.OutputText), so a grammar could
not account for their text. Tokens holding a control character (newline, tab) are blank too: the
answers are compact JSON, where none can appear. The model's EOS tokens are the grammar's stop tokens: allowed only once
the grammar is complete. A model without EOS stops on the tokenizer's EOS token, or (none either)
when the grammar cannot go on."""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict

import torch

from ..generation.processors import unpack_bitmask
from .served import InputError

CACHE_SIZE = 64             # compiled grammars kept (least recently used dropped first)
SEPARATORS = (",", ":")     # compact JSON, no free whitespace: a model cannot pad its answer forever
LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")   # xgrammar's "[hh:mm:ss] file.cc:line: " prefix
# JSON forbids raw control characters in strings, and compact JSON has no whitespace between tokens: a
# token holding one is never needed (xgrammar lets a string with maxLength take a raw tab, which
# json.loads refuses), so the grammars' vocabulary leaves such tokens out
CONTROL = re.compile(rb"[\x00-\x1f]")


class GrammarError(InputError):
    """A schema the grammar library rejects: HTTP 400 with its reason."""


class Matcher:
    """One row's place in its grammar: which tokens may come next, and the tokens taken so far."""

    def __init__(self, compiled, vocab_size: int, stop_free: bool):
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=stop_free)
        self.vocab_size = vocab_size
        self.bitmask = torch.full((1, (vocab_size + 31) // 32), -1, dtype=torch.int32)
        self.failed = False

    def allowed(self, device=None) -> torch.Tensor:
        """(V,) bool: the tokens the grammar allows next (the stop tokens once it is complete)."""
        self.matcher.fill_next_token_bitmask(self.bitmask)
        return unpack_bitmask(self.bitmask[0], self.vocab_size).to(device, non_blocking=True)

    def accept(self, token: int) -> None:
        """Advance past `token`; a token the grammar refuses leaves the matcher failed."""
        if not self.matcher.accept_token(token):
            self.failed = True

    @property
    def complete(self) -> bool:
        """The text so far is a whole answer (the stop token may come next)."""
        return self.matcher.is_completed()

    @property
    def finished(self) -> bool:
        """The grammar is complete and nothing may follow (its stop token was taken, or there is none)."""
        return self.matcher.is_terminated()


class Compiled:
    """A compiled grammar (shared by the rows that use it; each row makes its own Matcher)."""

    def __init__(self, grammar, vocab_size: int, stop_free: bool):
        self.grammar, self.vocab_size, self.stop_free = grammar, vocab_size, stop_free

    def matcher(self) -> Matcher:
        return Matcher(self.grammar, self.vocab_size, self.stop_free)


class Grammars:
    """The served tokenizer as xgrammar sees it (built on first use: it reads the whole vocabulary) and
    the compiled grammars, CACHE_SIZE of them, keyed by the schema's canonical JSON. Thread-safe:
    handlers compile on worker threads."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: set[int]):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        stops = sorted(stop_ids) or ([tokenizer.eos_id] if tokenizer.eos_id is not None else [])
        self.stop_ids = [i for i in stops if i < vocab_size]
        self.compiler = None
        self.cache: OrderedDict[str, Compiled] = OrderedDict()
        self.lock = threading.Lock()

    def compile(self, schema: dict | None, param: str = "response_format") -> Compiled:
        """schema: a JSON schema, or None for any JSON object. GrammarError (naming `param`, the request's
        field) when xgrammar rejects it."""
        key = "object" if schema is None else json.dumps(schema, sort_keys=True)
        with self.lock:
            if key in self.cache:
                self.cache.move_to_end(key)
                return self.cache[key]
            compiler = self.compiler = self.compiler or self._compiler()
        try:     # any JSON object: the schema {"type": "object"} with any properties (not strict)
            grammar = compiler.compile_json_schema({"type": "object"} if schema is None else schema,
                                                   any_whitespace=False, separators=SEPARATORS,
                                                   strict_mode=schema is not None)
        except Exception as e:        # xgrammar raises RuntimeError / ValueError with its reason
            raise GrammarError(f"the JSON schema cannot be used: {reason(e)}", param) from None
        compiled = Compiled(grammar, self.vocab_size, stop_free=not self.stop_ids)
        start = compiled.matcher()
        if start.complete:                                    # {"anyOf": []}: nothing but the empty answer
            raise GrammarError("the JSON schema admits no value", param)
        if not bool(start.allowed().any()):                   # a char vocabulary without "{", say
            raise GrammarError("the model's vocabulary has no token that can start this answer", param)
        with self.lock:
            self.cache[key] = compiled
            while len(self.cache) > CACHE_SIZE:
                self.cache.popitem(last=False)
        return compiled

    def _compiler(self):
        try:
            import xgrammar as xgr
        except ImportError:
            raise InputError("structured outputs need xgrammar, which is not installed (pip install "
                             "'tformer[serve]')", "response_format") from None
        vocab, vocab_type, prefix_space = token_strings(self.tokenizer, self.vocab_size, self.stop_ids)
        info = xgr.TokenizerInfo(vocab, vocab_type, vocab_size=self.vocab_size, stop_token_ids=self.stop_ids or None,
                                 add_prefix_space=prefix_space)
        return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)    # our LRU is the cache


def token_strings(tokenizer, vocab_size: int, stop_ids: list[int]):
    """Every token id's string as its vocabulary writes it (special tokens blank), and how xgrammar
    reads those strings (byte-level, byte fallback or raw, and the prefix space), which xgrammar
    detects from the Hugging Face tokenizer."""
    import xgrammar as xgr
    from tokenizers import Tokenizer as HFTokenizer
    from transformers import PreTrainedTokenizerFast

    hf = tokenizer.hf
    fast = PreTrainedTokenizerFast(tokenizer_object=HFTokenizer.from_str(hf.to_str()))
    detected = xgr.TokenizerInfo.from_huggingface(fast, vocab_size=vocab_size, stop_token_ids=stop_ids or [0])
    special = set(tokenizer.special_ids) | {i for i, t in hf.get_added_tokens_decoder().items() if t.special}
    unk = getattr(hf.model, "unk_token", None)
    if unk is not None and hf.token_to_id(unk) is not None:
        special.add(hf.token_to_id(unk))
    text = detected.decoded_vocab          # each token's bytes
    vocab = [""] * vocab_size
    for token, i in hf.get_vocab(with_added_tokens=True).items():
        if i < vocab_size and i not in special and not CONTROL.search(text[i]):
            vocab[i] = token
    return vocab, detected.vocab_type, detected.add_prefix_space


def reason(e: Exception) -> str:
    """The library's message on one line, without its source location."""
    lines = [LOCATION.sub("", line).strip() for line in str(e).splitlines()]
    return next((line for line in lines if line), type(e).__name__)

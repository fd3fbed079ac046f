"""The tokenizer in a GGUF file: tformer's byte-level BPE <-> llama.cpp's "gpt2" tokenizer model.

A byte-level BPE tokenizer (`Tokenizer.train_bpe`, GPT-2's, Llama 3's) is written as llama.cpp's
converter writes one: the tokens in id order in their byte-level spelling ("Ġthe"), a type per token
(control for special tokens, user-defined for other added tokens, unused for the "[PAD<i>]" rows that
fill the model's vocabulary past the tokenizer's), the merges as "a b", and `tokenizer.ggml.pre`, the
name under which llama.cpp (src/llama-vocab.cpp) keeps the pre-tokenizer: the one whose regex is the
tokenizer's, else the tokenizer is refused (llama.cpp would split the text differently).

Refused, each with the reason (ConfigError):
  char       llama.cpp has no character-level model: written as BPE or SentencePiece, a character
             outside the alphabet would become byte tokens or be dropped, where tformer gives <unk>.
  wordpiece  and any other model, normaliser or decoder llama.cpp's gpt2 tokenizer does not apply.
  a vocabulary without all 256 byte symbols: llama.cpp drops bytes it has no token for (and needs
             the newline byte to load at all).

Reading builds the same `tokenizers` pipeline back (BPE, the pre-tokenizer `pre` names, ByteLevel
decoder, the special tokens), so encode / decode give what the tokenizer that was written gave.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ...data.tokenizers import Tokenizer
from ...errors import CheckpointError, ConfigError

NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5        # gguf.TokenType
GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> (the pre-tokenizer regex of its tokenizer.json, ignore_merges as llama.cpp applies it)
PRE = {"gpt-2": (GPT2_REGEX, False), "llama-bpe": (LLAMA3_REGEX, True)}
CHAR_REFUSAL = ("a character tokenizer (kind 'char') cannot be written to GGUF: llama.cpp has no character-level "
                "tokenizer, and as byte-level BPE or SentencePiece a character outside its alphabet would become "
                "bytes or be dropped where tformer gives <unk> (write the model alone: tokenizer=None, "
                "`export-gguf --no-tokenizer`; or train with --tokenizer bpe)")


@dataclass
class Vocab:
    tokens: list[str]
    types: list[int]
    merges: list[str]
    pre: str


def gguf_vocab(tokenizer: Tokenizer, vocab_size: int) -> Vocab:
    """The GGUF form of `tokenizer` for a model with `vocab_size` rows, or ConfigError saying why not."""
    from tokenizers import pre_tokenizers

    kind = getattr(tokenizer, "kind", "file")
    if kind == "char":
        raise ConfigError(CHAR_REFUSAL)
    data = json.loads(tokenizer.to_str())
    model = data.get("model") or {}
    if model.get("type") != "BPE":
        raise ConfigError(f"a {kind} tokenizer ({model.get('type')}) cannot be written to GGUF: tformer writes "
                          "byte-level BPE, llama.cpp's gpt2 tokenizer model")
    for part, allowed in (("normalizer", (None,)), ("decoder", ("ByteLevel",))):
        kind_of = (data.get(part) or {}).get("type")
        if kind_of not in allowed:
            raise ConfigError(f"the tokenizer's {part} {kind_of} is not what llama.cpp's byte-level BPE applies "
                              f"(needs {allowed[0] or 'none'})")
    odd = [k for k in ("dropout", "continuing_subword_prefix", "end_of_word_suffix", "byte_fallback") if model.get(k)]
    if odd:
        raise ConfigError(f"the tokenizer's BPE sets {', '.join(odd)}, which llama.cpp's BPE does not support")
    pre = pre_name(data.get("pre_tokenizer"), bool(model.get("ignore_merges")))
    vocab = tokenizer.hf.get_vocab(with_added_tokens=True)
    if max(vocab.values()) >= vocab_size:
        raise ConfigError(f"the tokenizer has ids up to {max(vocab.values())}, past the model's vocab_size "
                          f"{vocab_size}")
    missing = [b for b in pre_tokenizers.ByteLevel.alphabet() if b not in vocab]
    if missing:
        raise ConfigError(f"the tokenizer lacks {len(missing)} of the 256 byte tokens (e.g. {missing[0]!r}); "
                          "llama.cpp would drop those bytes")
    added = tokenizer.hf.get_added_tokens_decoder()
    by_id = {i: t for t, i in vocab.items()}
    tokens, types = [], []
    for i in range(vocab_size):        # holes and rows past the tokenizer: "[PAD<i>]", as llama.cpp's converter
        tokens.append(by_id.get(i, f"[PAD{i}]"))
        types.append(UNUSED if i not in by_id else
                     (CONTROL if added[i].special else USER_DEFINED) if i in added else NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return Vocab(tokens, types, merges, pre)


def pre_name(pre: dict | None, ignore_merges: bool) -> str:
    """llama.cpp's name for a byte-level pre-tokenizer: ByteLevel with its own (GPT-2) regex, or a
    regex Split followed by ByteLevel without one (Llama 3). ConfigError when llama.cpp has none."""
    pre = pre or {}
    parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    regex = None
    if len(parts) == 1 and parts[0].get("type") == "ByteLevel" and parts[0].get("use_regex", True):
        regex, level = GPT2_REGEX, parts[0]
    elif (len(parts) == 2 and parts[0].get("type") == "Split" and parts[1].get("type") == "ByteLevel"
          and not parts[1].get("use_regex", True) and parts[0].get("behavior") == "Isolated"
          and not parts[0].get("invert")):
        regex, level = (parts[0].get("pattern") or {}).get("Regex"), parts[1]
    if regex is None:
        raise ConfigError(f"the tokenizer's pre-tokenizer ({json.dumps(pre)[:120]}) is not byte-level BPE's; "
                          "llama.cpp could not split text the same way")
    if level.get("add_prefix_space"):
        raise ConfigError("the tokenizer adds a prefix space (ByteLevel add_prefix_space=true), which llama.cpp's "
                          "byte-level BPE does not")
    for name, (known, ignores) in PRE.items():
        if regex == known and ignores == ignore_merges:
            return name
    raise ConfigError(f"llama.cpp has no pre-tokenizer with this tokenizer's regex {regex[:60]!r}... and "
                      f"ignore_merges={ignore_merges} (tformer writes {', '.join(PRE)})")


def write_vocab(writer, vocab: Vocab | None, bos: int | None, eos: int | None, pad: int | None) -> None:
    """The tokenizer keys; without a tokenizer, model "none" (llama.cpp then runs on token ids, sized by
    {arch}.vocab_size). The special-token ids are written either way: they are part of the model's config."""
    if vocab is None:
        writer.add_tokenizer_model("none")
    else:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(vocab.pre)
        writer.add_token_list(vocab.tokens)
        writer.add_token_types(vocab.types)
        writer.add_token_merges(vocab.merges)
        writer.add_add_bos_token(False)          # tformer encodes text without adding <bos>
    for add, token in ((writer.add_bos_token_id, bos), (writer.add_eos_token_id, eos),
                       (writer.add_pad_token_id, pad)):
        if token is not None:
            add(token)


def read_tokenizer(get) -> Tokenizer | None:
    """The file's tokenizer as a tformer Tokenizer; None when it has none ("none"/"no_vocab");
    ConfigError naming what tformer cannot read back (a SentencePiece "llama" tokenizer, say)."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    model = get("tokenizer.ggml.model", "none")
    if model in ("none", "no_vocab"):
        return None
    if model != "gpt2":
        raise ConfigError(f"tokenizer.ggml.model={model!r} is not read (tformer reads byte-level BPE, 'gpt2')")
    pre = get("tokenizer.ggml.pre", "default")
    if pre not in PRE:
        raise ConfigError(f"tokenizer.ggml.pre={pre!r} is not read (tformer reads {', '.join(PRE)})")
    tokens = get("tokenizer.ggml.tokens")
    types = get("tokenizer.ggml.token_type", [NORMAL] * len(tokens))
    merges = [tuple(m.split(" ")) for m in get("tokenizer.ggml.merges", [])]
    if len(types) != len(tokens) or any(len(m) != 2 for m in merges):
        raise CheckpointError("the tokenizer's token types or merges are malformed")
    regex, ignore_merges = PRE[pre]
    vocab = {t: i for i, (t, kind) in enumerate(zip(tokens, types)) if kind != UNUSED}
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    hf.pre_tokenizer = (pre_tokenizers.ByteLevel(add_prefix_space=False) if regex == GPT2_REGEX else
                        pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]))
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t, kind in zip(tokens, types) if kind == CONTROL])
    hf.add_tokens([AddedToken(t, special=False, normalized=False) for t, kind in zip(tokens, types)
                   if kind == USER_DEFINED])
    return Tokenizer(hf, "bpe")

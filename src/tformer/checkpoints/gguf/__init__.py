"""GGUF in and out: the single-file format of llama.cpp (and of ollama, LM Studio, transformers'
GGUF loader), for decoders of the two shapes llama.cpp has architectures for.

    tformer.to_gguf(model, "lm.gguf", tokenizer=tok, type="q8_0")   # then: llama-cli -m lm.gguf
    model, tokenizer, chat_template = tformer.from_gguf("lm.gguf")   # a Decoder in eval mode

The path goes through the Hugging Face layout, as llama.cpp's own converter does: a decoder the gpt2 or
llama family of tformer.checkpoints.hf represents exactly becomes that family's tensors (`hf_state_dict`),
then llama.cpp's names and layouts (names.py: GPT-2's Conv1D transposed back, Llama's q/k rows
reordered for llama.cpp's rope); the tokenizer is written as llama.cpp's byte-level BPE (vocab.py).
Reading is the same path backwards, strict: every tensor the metadata implies must be there with its
shape, nothing else may be, and a configuration tformer cannot run exactly is refused by name.

Tensor types (`type`): f32; f16; bf16 (rounded to 8 significant bits as torch's .bfloat16() rounds); q8_0
(blocks of 32 weights, one f16 scale each). As llama.cpp's converter does, 1-D tensors, norms, biases and
GPT-2's position table stay f32, and q8_0 falls back to f16 for a matrix whose rows are not a multiple of
32 long. Reading takes F32, F16, BF16 and Q8_0 (dequantised to fp32); any other type (Q4_K, ...) is
refused by name.

Writing is atomic: the file is written hidden next to `path` and renamed into place; on an error
nothing is left. Needs the `gguf` package (`pip install 'tformer[gguf]'`), imported on first use.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from torch import nn

from ...errors import CheckpointError, ConfigError
from ..files import atomic_file
from ..format import load_state, unique_state_dict
from ..hf import FAMILIES, hf_state_dict, keymap
from .names import ARCHS, from_gguf_layout, gguf_arch, gguf_name, gguf_shape, hf_config, to_gguf_layout, write_hparams
from .vocab import gguf_vocab, read_tokenizer, write_vocab

log = logging.getLogger(__name__)
TYPES = {"f32": 0, "f16": 1, "bf16": 32, "q8_0": 7}   # --type -> general.file_type (gguf.LlamaFileType)
READABLE = ("F32", "F16", "BF16", "Q8_0")
REQUIRED = object()


def require_gguf():
    try:
        import gguf
    except ImportError:
        raise ConfigError("GGUF files need the gguf package (pip install 'tformer[gguf]')") from None
    return gguf


def to_gguf(model: nn.Module, path: str | os.PathLike, tokenizer=None, chat_template: str | None = None,
            type: str = "f32") -> Path:
    """Write a GPT-2- or Llama-shaped Decoder (with its byte-level BPE `tokenizer` and `chat_template`
    when given) as the GGUF file `path`, replacing an existing file. ConfigError, before anything is
    written, for a model or tokenizer llama.cpp cannot represent."""
    gguf = require_gguf()
    if type not in TYPES:
        raise ConfigError(f"type={type!r} is not a GGUF type tformer writes; choose one of {', '.join(TYPES)}")
    cfg = getattr(model, "cfg", None)
    if getattr(model, "kind", None) != "decoder" or cfg is None:
        raise ConfigError(f"cannot export a {model.__class__.__name__} (kind {getattr(model, 'kind', None)!r}) to "
                          "GGUF: llama.cpp runs decoders, GPT-2 or Llama shaped")
    try:
        family, hf_state = hf_state_dict(model)
    except ConfigError as e:
        raise ConfigError(f"cannot export to GGUF, which takes the gpt2 or llama layout: {e}") from None
    arch = gguf_arch(family, cfg)
    vocab = gguf_vocab(tokenizer, cfg.vocab_size) if tokenizer is not None else None
    if cfg.activation == "gelu":
        log.warning("llama.cpp's gpt2 computes GELU by its tanh approximation; this model uses exact GELU "
                    "(tformer reads the file back exactly, each GELU output differs by at most 5e-4)")
    tensors = []
    for hf_name, t in hf_state.items():
        name = gguf_name(arch, hf_name)
        tensors.append((name, *_encode(gguf, name, to_gguf_layout(arch, hf_name, t.float(), cfg).numpy(), type)))
    path = Path(path)
    with atomic_file(path) as tmp:
        writer = gguf.GGUFWriter(tmp, arch.name)
        try:
            writer.add_type("model")
            writer.add_name(path.stem)
            writer.add_file_type(TYPES[type])
            writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
            write_hparams(writer, arch, cfg)
            write_vocab(writer, vocab, *(_role(cfg, tokenizer, r) for r in ("bos", "eos", "pad")))
            if chat_template:
                writer.add_chat_template(chat_template)
            for name, data, qtype in tensors:
                writer.add_tensor(name, data, raw_dtype=qtype)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
        finally:
            writer.close()
    return path


def _role(cfg, tokenizer, role: str) -> int | None:
    """The model's own special-token id, else the tokenizer's."""
    own = getattr(cfg, f"{role}_token_id")
    return own if own is not None else getattr(tokenizer, f"{role}_id", None)


def _encode(gguf, name: str, data, type: str):
    """(array, GGML type) of one tensor, by llama.cpp's converter's rules (prepare_tensors)."""
    q = gguf.GGMLQuantizationType
    keep = (data.ndim < 2 or not name.endswith(".weight") or name.endswith("_norm.weight")
            or name == "position_embd.weight")
    if type == "f32" or keep:
        return data, q.F32
    qtype = {"f16": q.F16, "bf16": q.BF16}.get(type, q.Q8_0)
    try:
        return gguf.quants.quantize(data, qtype), qtype
    except gguf.QuantError:            # rows not a multiple of the 32-weight block
        return gguf.quants.quantize(data, q.F16), q.F16


def from_gguf(path: str | os.PathLike) -> tuple[nn.Module, object, str | None]:
    """(model, tokenizer or None, chat template or None) of a gpt2 or llama GGUF file. The model is a
    Decoder in eval mode with fp32 weights. CheckpointError for a file that is not GGUF, is damaged,
    or whose tensors do not match its metadata; ConfigError for what tformer cannot represent. A
    tokenizer tformer cannot read (SentencePiece, say) is left out with a warning."""
    gguf = require_gguf()
    path = Path(path)
    reader = _open(gguf, path)
    try:
        return _read(gguf, reader)
    except (CheckpointError, ConfigError) as e:
        raise type(e)(f"{path}: {e}") from None


def _read(gguf, reader) -> tuple[nn.Module, object, str | None]:
    get = Metadata(reader).get
    arch_name = get("general.architecture")
    if arch_name not in ARCHS:
        raise ConfigError(f"general.architecture={arch_name!r} is not supported (tformer reads {', '.join(ARCHS)})")
    if get("general.type", "model") != "model":
        raise ConfigError(f"general.type={get('general.type')!r}: not a model (a LoRA adapter?)")
    arch, family = ARCHS[arch_name], FAMILIES[arch_name]
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise CheckpointError("no token_embd.weight tensor")
    if "rope_freqs.weight" in tensors:
        raise ConfigError("rope_freqs.weight: per-dimension rope frequency factors (Llama 3.1's rope scaling) "
                          "are not supported")
    hf = hf_config(arch, get, _shape(tensors["token_embd.weight"])[0], tied="output.weight" not in tensors)
    hf.update({f"{role}_token_id": get(f"tokenizer.ggml.{key}_token_id", None)
               for role, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"))})
    cfg = family.config_from_hf(hf)
    model = family.build(cfg)
    rules = family.rules(cfg)
    expected = {gguf_name(arch, k): (k, gguf_shape(arch, k, v.shape))
                for k, v in keymap.to_hf(rules, unique_state_dict(model), cfg).items()}
    _check(arch_name, expected, tensors)
    hf_state = {}
    for name, (hf_name, shape) in expected.items():
        t = tensors[name]
        data = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).astype("float32")  # a copy
        hf_state[hf_name] = from_gguf_layout(arch, hf_name, torch.from_numpy(data), cfg)
    load_state(model, keymap.to_ours(rules, hf_state), f"{arch_name} tensors")
    try:
        tokenizer = read_tokenizer(get)
    except ConfigError as e:
        log.warning("tokenizer not imported: %s", e)
        tokenizer = None
    return model.eval(), tokenizer, get("tokenizer.chat_template", None)


def _open(gguf, path: Path):
    if not path.is_file():
        raise CheckpointError(f"{path} {'is a directory' if path.is_dir() else 'does not exist'} "
                              "(expected a .gguf file)")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError / IndexError / numpy errors on damaged files
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise CheckpointError(f"{path} is not a GGUF file (it does not start with the GGUF magic)") from None
        raise CheckpointError(f"{path} is a damaged GGUF file, truncated or corrupt "
                              f"({type(e).__name__}: {e})") from None


def _shape(t) -> tuple[int, ...]:
    """PyTorch's order of a tensor's shape (ggml lists the row length first)."""
    return tuple(int(n) for n in reversed(t.shape.tolist()))


def _check(arch: str, expected: dict, tensors: dict) -> None:
    from ..format import key_mismatch

    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"tensors do not match a {arch} with the file's metadata: "
                              f"{key_mismatch(missing, unexpected, 'tensor(s) ')}")
    for name, (_, shape) in expected.items():
        t = tensors[name]
        if _shape(t) != shape:
            raise CheckpointError(f"tensor {name} has shape {_shape(t)}, the metadata implies {shape}")
        if t.tensor_type.name not in READABLE:
            raise CheckpointError(f"tensor {name} is {t.tensor_type.name}; tformer reads "
                                  f"{', '.join(READABLE)} tensors")


class Metadata:
    """The file's key/value metadata; a missing required key or an unreadable value is a CheckpointError."""

    def __init__(self, reader):
        self.fields = reader.fields

    def get(self, key: str, default=REQUIRED):
        import numpy as np

        field = self.fields.get(key)
        if field is None:
            if default is REQUIRED:
                raise CheckpointError(f"metadata {key} is missing")
            return default
        try:
            value = field.contents()
        except Exception as e:
            raise CheckpointError(f"metadata {key} cannot be read ({e})") from None
        if isinstance(value, float) and field.types[0].name == "FLOAT32":
            value = float(str(np.float32(value)))          # 1e-05, not 9.999999747378752e-06
        return value


__all__ = ["to_gguf", "from_gguf", "TYPES"]

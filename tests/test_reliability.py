"""Every malformed input gets one clear line and exit code 2, and nothing the user had changes.

A table of bad inputs across the commands (missing / empty / binary / non-UTF-8 files, wrong
columns, corrupt or truncated checkpoints, checkpoints of the wrong kind, unwritable outputs, bad
numbers for every numeric flag). For each row the test checks, against the invariant of the
issue rather than any message text the code produced:
  - exit code 2 (a user error; 1 would mean an internal error escaped),
  - stderr is exactly one line starting with `error:` and no traceback,
  - the row's key word (the file or flag at fault) appears in that line,
  - every file and directory in the workspace (inputs, existing runs) is byte-identical afterwards.
The CLI runs in-process (`tformer.cli.main`) for speed; a few rows also run as real subprocesses.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tformer
from tformer.cli import build_parser, main
from tformer.errors import CheckpointError

LINE = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer.\n"
CHARS = "abcdefghij"


# --- the workspace: inputs and trained runs, shared by every row --------------------------------
@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ws")
    d = root / "data"
    d.mkdir()
    (d / "lm.txt").write_text(LINE * 40, encoding="utf-8")
    rows = [("good fine great " * (i % 3 + 1), "pos") if i % 2 else ("bad awful poor " * (i % 3 + 1), "neg")
            for i in range(40)]
    (d / "cls.csv").write_text("text,label\n" + "".join(f"{t.strip()},{y}\n" for t, y in rows), encoding="utf-8")
    (d / "wrong_cols.csv").write_text("sentence,sentiment\n" + "".join(f"{t.strip()},{y}\n" for t, y in rows),
                                      encoding="utf-8")
    # Pairs: a letter-spelling "translation" (digits -> letters), easy and self-contained.
    pairs = [(" ".join(str(i)), " ".join(CHARS[int(c)] for c in str(i))) for i in range(100, 160)]
    (d / "pairs.tsv").write_text("".join(f"{s}\t{t}\n" for s, t in pairs), encoding="utf-8")
    (d / "no_tab.tsv").write_text("".join(f"{s} {t}\n" for s, t in pairs), encoding="utf-8")
    (d / "empty.txt").write_bytes(b"")
    (d / "blank.csv").write_bytes(b"\n\n")
    (d / "binary.bin").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)))
    (d / "latin1.txt").write_bytes(LINE.encode() * 3 + "café crème\n".encode("latin-1"))
    (d / "latin1.tsv").write_bytes("un\tone\ndeux\ttwo\ncafé\tcoffee\n".encode("latin-1"))
    (d / "empty_dir").mkdir()
    return root


def train(ws: Path, name: str, *extra: str) -> Path:
    out = ws / "runs" / name
    argv = ["train", "--preset", "tiny", "--max-steps", "2", "--batch-size", "4", "--out", str(out),
            "--no-progress", "--warmup", "1", "--eval-every", "1000", *extra]
    assert main(argv) == 0, f"training the fixture {name} failed"
    return out


@pytest.fixture(scope="module")
def lm(ws) -> Path:
    return train(ws, "lm", "--data", str(ws / "data/lm.txt"), "--context", "16")


@pytest.fixture(scope="module")
def clf(ws) -> Path:
    return train(ws, "clf", "--task", "classify", "--data", str(ws / "data/cls.csv"))


@pytest.fixture(scope="module")
def mt(ws) -> Path:
    return train(ws, "mt", "--task", "translate", "--data", str(ws / "data/pairs.tsv"))


@pytest.fixture(scope="module")
def broken(ws, lm) -> Path:
    """Damaged copies of the LM checkpoint, a Hugging Face directory and its damaged copies."""
    b = ws / "broken"
    ckpt = tformer.checkpoints.format.resolve(lm)
    for name in ("corrupt_config", "truncated", "no_tokenizer_file", "no_checksums"):
        shutil.copytree(ckpt, b / name)
    config = json.loads((b / "no_checksums/config.json").read_text())
    (b / "no_checksums/config.json").write_text(json.dumps({**config, "files": {}}))
    (b / "corrupt_config/config.json").write_text('{"format": "tformer", "architecture": "Deco', encoding="utf-8")
    weights = b / "truncated/model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    (b / "no_tokenizer_file/tokenizer.json").unlink()
    model = tformer.load(lm)
    tformer.save(model, b / "api_saved")           # saved from Python without a tokenizer
    assert main(["export-hf", str(lm), str(b / "hf")]) == 0
    for name in ("hf_corrupt_config", "hf_truncated", "hf_pickle"):
        shutil.copytree(b / "hf", b / name)
    (b / "hf_corrupt_config/config.json").write_bytes(b"{\"model_type\": \"gpt2\", \"n_embd\": ")
    hf_weights = b / "hf_truncated/model.safetensors"
    hf_weights.write_bytes(hf_weights.read_bytes()[:100])
    # A pickle that would run code when unpickled without weights_only: it must be refused, not run.
    (b / "hf_pickle/model.safetensors").unlink()
    torch.save({"x": _Exploit(str(ws / "PWNED"))}, b / "hf_pickle/pytorch_model.bin")
    return b


class _Exploit:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


# --- the table -----------------------------------------------------------------------------------
# (row id, argv with {placeholders}, key word that must appear in the error line)
# Placeholders: {d} data dir, {lm}/{clf}/{mt} trained runs, {b} broken copies, {ws} workspace.
LONG = "to be or not " * 40  # > 128 characters: longer than the tiny models' context
CASES = [
    # train
    ("train-missing-data", "train --data {d}/missing.txt --max-steps 1 --out {ws}/new", "missing.txt"),
    ("train-empty-data", "train --data {d}/empty.txt --max-steps 1 --out {ws}/new", "empty.txt"),
    ("train-binary-data", "train --data {d}/binary.bin --max-steps 1 --out {ws}/new", "binary.bin"),
    ("train-not-utf8", "train --data {d}/latin1.txt --max-steps 1 --out {ws}/new", "byte"),
    ("train-data-is-dir", "train --data {d}/empty_dir --max-steps 1 --out {ws}/new", "empty_dir"),
    ("train-wrong-columns", "train --task classify --data {d}/wrong_cols.csv --max-steps 1 --out {ws}/new", "label"),
    ("train-empty-table", "train --task classify --data {d}/blank.csv --max-steps 1 --out {ws}/new", "blank.csv"),
    ("train-pairs-not-utf8", "train --task translate --data {d}/latin1.tsv --max-steps 1 --out {ws}/new", "byte"),
    ("train-pairs-no-tab", "train --task translate --data {d}/no_tab.tsv --max-steps 1 --out {ws}/new", "tab"),
    ("train-out-exists", "train --data {d}/lm.txt --max-steps 1 --out {lm}", "--resume"),
    ("train-out-unwritable", "train --data {d}/lm.txt --preset tiny --max-steps 1 --out {d}/lm.txt/run", "lm.txt"),
    ("train-resume-not-run", "train --resume {d}/empty_dir", "empty_dir"),
    ("train-resume-corrupt", "train --resume {b}/corrupt_config", "config.json"),
    ("train-init-wrong-kind", "train --data {d}/lm.txt --init {clf} --max-steps 1 --out {ws}/new", "Decoder"),
    ("train-context-too-long", "train --data {d}/lm.txt --init {lm} --context 4096 --max-steps 1 --out {ws}/new",
     "--context"),
    ("train-init-with-preset", "train --data {d}/lm.txt --init {lm} --preset small --max-steps 1 --out {ws}/new",
     "--preset"),
    ("train-lora-flags-without-rank", "train --data {d}/lm.txt --init {lm} --lora-alpha 32 --max-steps 1 "
     "--out {ws}/new", "--lora-r"),
    ("train-batch-too-big", "train --data {d}/lm.txt --preset tiny --batch-size 100000000 --max-steps 1 "
     "--out {ws}/new", "--batch-size"),
    ("train-unknown-preset", "train --data {d}/lm.txt --preset huge --max-steps 1 --out {ws}/new", "huge"),
    ("train-batch-accum", "train --data {d}/lm.txt --batch-size 6 --grad-accum 4 --max-steps 1 --out {ws}/new",
     "--grad-accum"),
    # generate
    ("generate-missing-model", "generate --model {ws}/nope --prompt hi", "nope"),
    ("generate-model-is-file", "generate --model {d}/lm.txt --prompt hi", "lm.txt"),
    ("generate-empty-dir", "generate --model {d}/empty_dir --prompt hi", "empty_dir"),
    ("generate-corrupt-config", "generate --model {b}/corrupt_config --prompt hi", "config.json"),
    ("generate-truncated-weights", "generate --model {b}/truncated --prompt hi", "model.safetensors"),
    ("generate-no-checksums", "generate --model {b}/no_checksums --prompt hi", "checksum"),
    ("generate-missing-tokenizer-file", "generate --model {b}/no_tokenizer_file --prompt hi", "tokenizer.json"),
    ("generate-no-tokenizer", "generate --model {b}/api_saved --prompt hi", "tokenizer.json"),
    ("generate-hf-dir", "generate --model {b}/hf --prompt hi", "import-hf"),
    ("generate-wrong-kind", "generate --model {clf} --prompt hi", "EncoderClassifier"),
    ("generate-prompt-too-long", ["generate", "--model", "{lm}", "--prompt", LONG], "context"),
    ("generate-too-many-tokens", "generate --model {lm} --prompt hi --max-new-tokens 1000000", "--max-new-tokens"),
    ("generate-beams-too-big", "generate --model {lm} --prompt hi --num-beams 1000000000", "--num-beams"),
    ("generate-negative-tokens", "generate --model {lm} --prompt hi --max-new-tokens -5", "--max-new-tokens"),
    ("generate-prompt-not-utf8", ["generate", "--model", "{lm}", "--prompt", "caf\udce9 au lait"], "byte 3"),
    ("generate-top-p", "generate --model {lm} --prompt hi --top-p 1.5", "--top-p"),
    ("generate-temperature", "generate --model {lm} --prompt hi --temperature -1", "--temperature"),
    ("generate-num-beams", "generate --model {lm} --prompt hi --num-beams 0", "--num-beams"),
    ("generate-beams-with-sampling", "generate --model {lm} --prompt hi --num-beams 2 --top-k 5 --seed 1",
     "--top-k, --seed apply to sampling"),
    # classify / translate / eval
    ("classify-missing-model", "classify --model {ws}/nope good", "nope"),
    ("classify-text-not-utf8", ["classify", "--model", "{clf}", "bon \udcff"], "byte 4"),
    ("classify-wrong-kind", "classify --model {lm} good", "Decoder"),
    ("classify-truncated", "classify --model {b}/truncated good", "model.safetensors"),
    ("translate-beams-too-big", "translate --model {mt} --num-beams 100000000 un", "--num-beams"),
    ("eval-beams-too-big", "eval --model {mt} --num-beams 100000000", "--num-beams"),
    ("translate-wrong-kind", "translate --model {clf} un", "EncoderClassifier"),
    ("translate-corrupt-config", "translate --model {b}/corrupt_config un", "config.json"),
    ("eval-missing-model", "eval --model {ws}/nope", "nope"),
    ("eval-beams-for-a-language-model", "eval --model {lm} --num-beams 4", "--num-beams"),
    ("eval-text-column-for-a-translator", "eval --model {mt} --text-column review", "--text-column"),
    ("eval-binary-data", "eval --model {lm} --data {d}/binary.bin", "binary.bin"),
    ("eval-wrong-columns", "eval --model {clf} --data {d}/wrong_cols.csv", "label"),
    ("eval-pairs-no-tab", "eval --model {mt} --data {d}/no_tab.tsv", "tab"),
    ("eval-hf-dir", "eval --model {b}/hf", "import-hf"),
    ("classify-batch-size", "classify --model {clf} --batch-size 0 good", "--batch-size"),
    ("translate-num-beams", "translate --model {mt} --num-beams -2 un", "--num-beams"),
    ("eval-limit", "eval --model {lm} --limit 0", "--limit"),
    # attention / trace
    ("attention-out-under-file", "attention --model {lm} --text hi --out {d}/lm.txt/attn", "lm.txt"),
    ("attention-truncated", "attention --model {b}/truncated --text hi --out {ws}/attn", "model.safetensors"),
    ("attention-text-too-long", ["attention", "--model", "{lm}", "--text", LONG, "--out", "{ws}/attn"], "context"),
    ("trace-text-not-utf8", ["trace", "--model", "{lm}", "--text", "caf\udce9"], "byte 3"),
    ("trace-head-out-of-range", "trace --model {lm} --text hi --head 99", "--head"),
    # import-hf / export-hf
    ("import-missing-src", "import-hf {ws}/nope {ws}/out", "nope"),
    ("import-tformer-ckpt", "import-hf {lm}/checkpoints/step-0000002 {ws}/out", "tformer checkpoint"),
    ("import-corrupt-config", "import-hf {b}/hf_corrupt_config {ws}/out", "config.json"),
    ("import-truncated-weights", "import-hf {b}/hf_truncated {ws}/out", "model.safetensors"),
    ("import-pickle-bin", "import-hf {b}/hf_pickle {ws}/out", "pytorch_model.bin"),
    ("import-dst-under-file", "import-hf {b}/hf {d}/lm.txt/out", "lm.txt"),
    ("import-dst-is-a-run", "import-hf {b}/hf {lm}", "--force"),
    ("export-missing-src", "export-hf {ws}/nope {ws}/out", "nope"),
    ("export-corrupt-config", "export-hf {b}/corrupt_config {ws}/out", "config.json"),
    ("export-truncated", "export-hf {b}/truncated {ws}/out", "model.safetensors"),
    ("export-dst-under-file", "export-hf {lm} {d}/lm.txt/out", "lm.txt"),
    ("export-dst-is-a-run", "export-hf {lm} {clf}", "--force"),
]
FIXTURES = ("lm", "clf", "mt")


def expand(request, ws: Path, argv) -> list[str]:
    argv = argv.split() if isinstance(argv, str) else argv
    text = " ".join(argv)
    values = {"ws": ws, "d": ws / "data"}
    for name in FIXTURES:
        if "{" + name + "}" in text:
            values[name] = request.getfixturevalue(name)
    if "{b}" in text:
        values["b"] = request.getfixturevalue("broken")
    return [a.format(**values) for a in argv]


def tree(root: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file (and 'dir' for every directory) under root."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            out[os.path.relpath(os.path.join(dirpath, name), root)] = "dir"
        for name in filenames:
            path = os.path.join(dirpath, name)
            out[os.path.relpath(path, root)] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    return out


def run_main(argv: list[str], capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse errors exit from inside parse_args
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def check_one_line_error(rc, err: str, key: str) -> None:
    lines = err.strip("\n").split("\n")
    assert rc == 2, f"exit code {rc} (expected 2), stderr:\n{err}"
    assert len(lines) == 1 and lines[0].startswith("error: "), f"not one `error:` line:\n{err}"
    assert "Traceback" not in err
    assert key in lines[0], f"{key!r} not named in: {lines[0]}"


@pytest.mark.parametrize("row", CASES, ids=[c[0] for c in CASES])
def test_malformed_input_gets_one_line_and_changes_nothing(row, ws, request, capsys):
    _, argv, key = row
    argv = expand(request, ws, argv)
    before = tree(ws)
    rc, _, err = run_main(argv, capsys)
    check_one_line_error(rc, err, key)
    assert "unrecognized arguments" not in err and "arguments are required" not in err  # the row's own error
    assert tree(ws) == before, "the workspace changed"
    assert not (ws / "PWNED").exists(), "a pickle ran code"


# --- every numeric flag of every command refuses non-numbers, NaN and infinity ---------------------
def numeric_flags() -> list[tuple[str, str, str]]:
    """(command, --flag, kind) for every option whose type parses '1' into a number."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    flags = []
    for command, p in sub.choices.items():
        for action in p._actions:
            if action.type is None or not action.option_strings:
                continue
            try:
                value = action.type("1")
            except (argparse.ArgumentTypeError, ValueError, TypeError):
                continue
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                flags.append((command, action.option_strings[-1], type(value).__name__))
    return flags


FLAGS = numeric_flags()


@pytest.fixture(scope="module")
def parser():
    return build_parser()


@pytest.mark.parametrize("command,flag,kind", FLAGS, ids=[f"{c} {f}" for c, f, _ in FLAGS])
def test_every_numeric_flag_refuses_bad_numbers(parser, command, flag, kind, capsys):
    # Parsing only (the error comes from argparse, before any work): a flag that accepted the value
    # would otherwise start that command for real.
    for bad in ("abc", "nan", "inf", "1e999", "") if kind == "float" else ("abc", "1.5", "nan", ""):
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_:
            parser.parse_args([command, f"{flag}={bad}"])
        check_one_line_error(exit_.value.code, capsys.readouterr().err, flag)


def test_every_command_has_numeric_flags_covered():
    # The flags the issue names must be among those checked (a flag typed as plain str would be missed).
    covered = {(c, f) for c, f, _ in FLAGS}
    for pair in [("train", "--max-steps"), ("train", "--lr"), ("train", "--batch-size"),
                 ("generate", "--max-new-tokens"), ("generate", "--top-p"), ("generate", "--temperature")]:
        assert pair in covered


# --- a few rows as real processes: exit status and stderr as a shell sees them ---------------------
SUBPROCESS_ROWS = ["generate-truncated-weights", "train-binary-data", "import-pickle-bin"]


def test_real_processes(ws, request, tmp_path):
    rows = {c[0]: c for c in CASES}
    commands = [(expand(request, ws, rows[name][1]), rows[name][2], None) for name in SUBPROCESS_ROWS]
    # Bytes that are not UTF-8 on stdin (Python hands them over as lone surrogates).
    (tmp_path / "prompt.txt").write_bytes(b"To be\xff or not")
    commands.append((["generate", "--model", str(request.getfixturevalue("lm")), "--prompt", "-"], "byte 5",
                     tmp_path / "prompt.txt"))
    before = tree(ws)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # warnings are not silenced: users would see them too
    procs = []
    for argv, key, stdin in commands:
        with open(stdin or os.devnull, "rb") as f:
            procs.append((key, subprocess.Popen([sys.executable, "-m", "tformer", *argv], env=env, stdin=f, text=True,
                                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)))
    for key, proc in procs:
        _, err = proc.communicate(timeout=120)
        check_one_line_error(proc.returncode, err, key)
    assert tree(ws) == before
    assert not (ws / "PWNED").exists()


def test_internal_error_is_short_and_saves_the_traceback(monkeypatch, capsys):
    """A bug (not a user error): one line naming a file with the full traceback, exit 1; --debug raises."""
    import tformer.cli.trace as trace_cli

    def boom(args):
        raise ZeroDivisionError("deliberate")

    monkeypatch.setattr(trace_cli, "run", boom)  # register() reads `run` when the parser is built
    rc, _, err = run_main(["trace", "--model", "x", "--text", "y"], capsys)
    lines = err.strip().split("\n")
    assert rc == 1 and len(lines) == 1 and lines[0].startswith("error: internal error ZeroDivisionError")
    path = lines[0].split("full traceback in ")[1].split(";")[0]
    saved = Path(path).read_text()
    assert "Traceback" in saved and "deliberate" in saved
    Path(path).unlink()
    with pytest.raises(ZeroDivisionError):
        main(["--debug", "trace", "--model", "x", "--text", "y"])


@pytest.mark.parametrize("error,key", [
    (PermissionError(13, "Permission denied", "/data/out.png"), "/data/out.png: Permission denied"),
    (OSError(28, "No space left on device", "/data/run"), "/data/run: No space left on device"),
    (RuntimeError("[enforce fail] DefaultCPUAllocator: can't allocate memory: you tried to allocate 1e12 bytes"),
     "out of memory"),
])
def test_environment_errors_are_user_errors(monkeypatch, capsys, error, key):
    """The machine refusing (no permission, no space, no memory) is not a bug: one line, exit 2."""
    import tformer.cli.trace as trace_cli

    def refuse(args):
        raise error

    monkeypatch.setattr(trace_cli, "run", refuse)
    rc, _, err = run_main(["trace", "--model", "x", "--text", "y"], capsys)
    check_one_line_error(rc, err, key)


# --- checkpoint integrity ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["model.safetensors", "tokenizer.json"])
def test_one_altered_byte_is_refused_naming_the_file(ws, lm, name, capsys, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tformer.checkpoints.format.resolve(lm), ckpt)
    path = ckpt / name
    data = bytearray(path.read_bytes())
    data[len(data) * 2 // 3] ^= 0x01  # one bit of one byte, deep inside the file (not its header)
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=name):
        tformer.load(ckpt)
    rc, _, err = run_main(["generate", "--model", str(ckpt), "--prompt", "To"], capsys)
    check_one_line_error(rc, err, name)
    rc, _, err = run_main(["export-hf", str(ckpt), str(tmp_path / "hf")], capsys)
    check_one_line_error(rc, err, name)
    assert not (tmp_path / "hf").exists()


def test_resume_refuses_an_altered_checkpoint(ws, lm, capsys, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(lm, run)
    weights = tformer.checkpoints.format.resolve(run) / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0x80
    weights.write_bytes(bytes(data))
    before = tree(run)
    rc, _, err = run_main(["train", "--resume", str(run), "--max-steps", "4"], capsys)
    check_one_line_error(rc, err, "model.safetensors")
    assert tree(run) == before


# --- the public API: the same clear errors as the commands ----------------------------------------
@pytest.mark.parametrize("kind", ["decoder", "encoder", "encoder-decoder"])
def test_models_refuse_inputs_beyond_the_context_or_of_the_wrong_type(kind):
    from tformer.errors import ConfigError

    cfg = tformer.ModelConfig(kind=kind, vocab_size=11, d_model=16, n_heads=2, n_layers=1, d_ff=32, max_seq_len=8,
                              positional="sinusoidal" if kind == "encoder-decoder" else "learned")
    classes = {"decoder": tformer.Decoder, "encoder": tformer.Encoder, "encoder-decoder": tformer.EncoderDecoder}
    model = classes[kind](cfg)

    def call(ids):
        return model(ids, ids) if kind == "encoder-decoder" else model(ids)

    call(torch.zeros(2, 8, dtype=torch.long))  # exactly the context: fine
    with pytest.raises(ConfigError, match="max_seq_len=8"):
        call(torch.zeros(2, 9, dtype=torch.long))
    with pytest.raises(ConfigError, match="integer"):
        call(torch.zeros(2, 4))


def test_checkpoint_file_list_cannot_point_outside_the_checkpoint(tmp_path, lm):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tformer.checkpoints.format.resolve(lm), ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config["files"]["../../etc/passwd"] = "0" * 64
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="not a file name of the checkpoint"):
        tformer.load(ckpt)

"""The trainer: schedule, optimizer groups, gradient accumulation, resume, atomic checkpoints,
Ctrl-C, DDP under torchrun, bad input. Tiny models and a few steps each."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import tformer
from tformer.cli import build_parser, main
from tformer.training.config import TrainConfig
from tformer.training.loop import fit
from tformer.training.optim import lr_at, make_optimizer, param_groups, progress_of

TEXT = ("To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n"
        "The slings and arrows of outrageous fortune,\nOr to take arms against a sea of troubles\n") * 30
SMALL = ["--preset", "tiny", "--context", "32", "--batch-size", "8", "--warmup", "2", "--eval-every", "1000",
         "--no-progress", "--precision", "fp32", "--dropout", "0"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1] / "src")}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("data") / "play.txt"
    path.write_text(TEXT, encoding="utf-8")
    return str(path)


def train(argv: list[str]):
    """`tformer train ARGV` in this process, through the CLI's own argument handling."""
    from tformer.cli.train import prepare

    task, cfg, resume, saved, _ = prepare(build_parser().parse_args(["train", *argv]))
    return fit(task, cfg, resume=resume, args=saved)


def weights(run: str) -> dict[str, torch.Tensor]:
    return tformer.load(run).state_dict()


def test_schedule_shape():
    cfg = TrainConfig(out="x", max_steps=110, lr=1e-3, min_lr_ratio=0.1, warmup=10)
    lrs = [lr_at(cfg, s, progress_of(cfg, s, 0.0, None)) for s in range(110)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)      # linear warm-up
    assert all(a < b for a, b in zip(lrs[:10], lrs[1:10]))
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))                        # then decays
    assert lrs[60] == pytest.approx(1e-4 + 0.5 * 0.9e-3)                          # cosine midpoint
    assert lr_at(cfg, 110, progress_of(cfg, 110, 0.0, None)) == pytest.approx(1e-4)
    timed = TrainConfig(out="x", time_budget=100.0, warmup=10)                    # decay over the clock
    assert progress_of(timed, 50, elapsed=55.0, warm_elapsed=10.0) == pytest.approx(0.5)


def test_no_weight_decay_on_norms_biases_embeddings():
    model = tformer.Decoder(tformer.preset("tiny", vocab_size=20))
    decay, no_decay = param_groups(model, 0.1)
    names = dict(model.named_parameters())
    assert all(names[n].dim() == 2 and "embed" not in n for n in decay["names"])
    assert "stack.embed.token.weight" in no_decay["names"] and any("norm" in n for n in no_decay["names"])
    assert len(decay["names"]) + len(no_decay["names"]) == len(names)


def test_fused_adamw_steps_like_the_loop_over_parameters():
    torch.manual_seed(0)
    model = tformer.Decoder(tformer.preset("tiny", vocab_size=20))
    cfg = TrainConfig(out="unused", lr=1e-2, weight_decay=0.1)
    opt, names = make_optimizer(model, cfg)
    assert opt.defaults["fused"] and len(names) == len(list(model.parameters()))
    reference = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
    start = {n: p.detach().clone() for n, p in reference.items()}
    groups = [{"params": [reference[n] for n in g["names"]], "weight_decay": g["weight_decay"]}
              for g in param_groups(model, 0.1)]
    loop = torch.optim.AdamW(groups, lr=1e-2, betas=(cfg.beta1, cfg.beta2), foreach=False)
    for step in range(3):
        for n, p in model.named_parameters():
            p.grad = torch.randn_like(p, generator=torch.Generator().manual_seed(step))
            reference[n].grad = p.grad.clone()
        opt.step()
        loop.step()
    for n, p in model.named_parameters():
        assert not torch.equal(p.detach(), start[n])
        torch.testing.assert_close(p.detach(), reference[n].detach(), rtol=1e-5, atol=1e-6)


def test_grad_accumulation_equals_full_batch(data, tmp_path):
    a = train(["--data", data, *SMALL, "--max-steps", "3", "--out", str(tmp_path / "a")])
    b = train(["--data", data, *SMALL, "--max-steps", "3", "--grad-accum", "4", "--out", str(tmp_path / "b")])
    wa, wb = weights(a.run_dir), weights(b.run_dir)
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("init", [False, True], ids=["scratch", "init"])
def test_resume_reaches_identical_weights(data, tmp_path, init):
    """6 steps straight == 3 steps, stop, resume, 3 more (dropout on, bf16: everything must match); also for a
    run from --init, whose shape is the checkpoint's (no --preset: resuming it once failed for want of one)."""
    flags = ["--data", data, *SMALL, "--max-steps", "6", "--dropout", "0.1", "--precision", "bf16"]
    if init:
        base = train([*flags, "--max-steps", "2", "--out", str(tmp_path / "base")])
        flags = [f for f in flags if f not in ("--preset", "tiny")] + ["--init", base.checkpoint]
    straight = train([*flags, "--out", str(tmp_path / "straight")])
    half = train([*flags, "--out", str(tmp_path / "split"), "--stop-at", "3"])
    assert half.reason == "stop_at" and half.step == 3
    resumed = train(["--resume", str(tmp_path / "split")])
    assert resumed.step == 6 and resumed.reason == "max_steps"
    ws, wr = weights(straight.run_dir), weights(resumed.run_dir)
    assert all(torch.equal(ws[k], wr[k]) for k in ws)
    steps = [json.loads(line)["step"] for line in open(tmp_path / "split" / "metrics.jsonl")]
    assert steps == sorted(steps) and steps[-1] == 6
    state = json.loads((Path(resumed.checkpoint) / "trainer_state.json").read_text())
    assert state["step"] == 6 and "--stop-at" not in state["command"] and state["args"]["max_steps"] == 6


def test_checkpoints_are_complete_and_pruned(data, tmp_path):
    run = train(["--data", data, *SMALL, "--max-steps", "5", "--save-every", "1", "--keep", "2",
                 "--eval-every", "2", "--out", str(tmp_path / "r")])
    ckpts = sorted(p.name for p in (tmp_path / "r" / "checkpoints").iterdir())
    assert ckpts == ["step-0000004", "step-0000005"]
    names = set(os.listdir(run.checkpoint))
    assert {"config.json", "model.safetensors", "tokenizer.json", "optimizer.safetensors",
            "trainer_state.json", "rng.safetensors"} <= names
    records = [json.loads(line) for line in open(tmp_path / "r" / "metrics.jsonl")]
    vals = [r["val_loss"] for r in records if "val_loss" in r]
    assert len(vals) == 3 and run.best_val_loss == min(vals)      # steps 2, 4 and the final 5
    assert {"step", "train_loss", "lr", "tokens_per_s", "elapsed"} <= set(records[-1])


def test_keep_best_saves_the_lowest_val_loss_and_resume_uses_the_newest(data, tmp_path):
    """--keep-best: RUN/best/ holds the model of the evaluation with the lowest val_loss (the first
    of ties); load(RUN) takes it, while --resume continues from the newest step checkpoint."""
    from tformer.training.rundir import read_trainer_state

    run = tmp_path / "r"
    flags = ["--data", data, *SMALL, "--max-steps", "8", "--lr", "3e-2", "--eval-every", "1", "--keep-best"]
    result = train([*flags, "--out", str(run), "--stop-at", "5"])
    records = [json.loads(line) for line in open(run / "metrics.jsonl")]
    vals = [(r["val_loss"], r["step"]) for r in records if "val_loss" in r]
    best = json.loads((run / "best" / "config.json").read_text())["meta"]["best"]
    assert best["metric"] == "val_loss" and (best["value"], best["step"]) == min(vals)
    assert result.best == best
    assert all(torch.equal(a, b) for a, b in zip(weights(str(run)).values(), weights(str(run / "best")).values()))
    ckpt, state = read_trainer_state(run)
    assert ckpt.name == "step-0000005" and state["step"] == 5
    resumed = train(["--resume", str(run)])
    assert resumed.step == 8
    vals = [(r["val_loss"], r["step"]) for r in map(json.loads, open(run / "metrics.jsonl")) if "val_loss" in r]
    assert [s for _, s in vals] == list(range(1, 9))
    assert (resumed.best["value"], resumed.best["step"]) == min(vals)
    assert json.loads((run / "best" / "config.json").read_text())["meta"]["best"] == resumed.best
    plain = train(["--data", data, *SMALL, "--max-steps", "2", "--out", str(tmp_path / "plain")])
    assert plain.best is None and not (tmp_path / "plain" / "best").exists()  # off by default for lm


def test_ema_is_the_running_average_and_best_keeps_it(data, tmp_path):
    """--ema D: after step s the average is d*avg + (1-d)*weights with d = min(D, (1+s)/(10+s));
    evaluation (and best/) use the average, the step checkpoints the live weights."""
    from safetensors.torch import load_file

    run = tmp_path / "r"
    train(["--data", data, *SMALL, "--max-steps", "3", "--lr", "1e-2", "--ema", "0.2", "--keep-best",
           "--eval-every", "3", "--save-every", "1", "--keep", "5", "--out", str(run)])
    step = {s: run / "checkpoints" / f"step-{s:07d}" for s in (2, 3)}
    ema2, ema3 = (load_file(str(step[s] / "ema.safetensors")) for s in (2, 3))
    live3 = weights(str(step[3]))
    best = weights(str(run / "best"))
    d = min(0.2, (1 + 2) / (10 + 2))  # the update after the third optimizer step (step index 2)
    for name, avg in ema3.items():
        torch.testing.assert_close(avg, d * ema2[name] + (1 - d) * live3[name])
        torch.testing.assert_close(best[name], avg)
    assert any(not torch.equal(best[n], live3[n]) for n in ema3)


def _spawn(argv):
    return subprocess.Popen([sys.executable, "-m", "tformer", "train", *argv], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(ready, timeout: float = 120.0):
    end = time.time() + timeout
    while time.time() < end and not ready():
        time.sleep(0.05)
    assert ready(), "the training process never got going"


def _has_checkpoint(run: Path):
    return lambda: any((p / "config.json").exists() for p in run.glob("checkpoints/step-*"))


def test_sigkill_never_leaves_an_unreadable_latest_checkpoint(data, tmp_path):
    run = tmp_path / "k"
    proc = _spawn(["--data", data, *SMALL, "--max-steps", "100000", "--save-every", "1", "--keep", "2",
                   "--out", str(run)])
    try:
        _wait_for(_has_checkpoint(run))
        for delay in (0.0, 0.13, 0.29):          # land at different points of the write/rename/prune cycle
            time.sleep(delay)
            state = json.loads((tformer.checkpoints.format.resolve(run) / "trainer_state.json").read_text())
            assert state["step"] >= 1
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    model = tformer.load(run)                       # checksums verified
    assert isinstance(model, tformer.Decoder)
    resumed = train(["--resume", str(run), "--max-steps", str(json.loads(
        (tformer.checkpoints.format.resolve(run) / "trainer_state.json").read_text())["step"] + 1)])
    assert resumed.reason == "max_steps"


def test_ctrl_c_saves_and_exits_cleanly(data, tmp_path):
    run = tmp_path / "c"
    proc = _spawn(["--data", data, *SMALL, "--max-steps", "100000", "--save-every", "100000", "--log-every", "1",
                   "--out", str(run)])
    _wait_for(lambda: (run / "metrics.jsonl").exists() and (run / "metrics.jsonl").stat().st_size > 0)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "--resume" in err
    step = json.loads((tformer.checkpoints.format.resolve(run) / "trainer_state.json").read_text())["step"]
    assert step >= 1 and isinstance(tformer.load(run), tformer.Decoder)


@pytest.mark.parametrize("sharding", [[], ["--fsdp"]], ids=["ddp", "fsdp2"])
def test_torchrun_two_processes_match_one(sharding, data, tmp_path):
    flags = ["--data", data, *SMALL, "--max-steps", "3"]
    one = train([*flags, "--out", str(tmp_path / "one")])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "tformer", "train", *flags, *sharding, "--out", str(tmp_path / "two")]
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    w1, w2 = weights(one.run_dir), weights(str(tmp_path / "two"))
    for k in w1:
        torch.testing.assert_close(w1[k], w2[k], rtol=1e-4, atol=1e-5)
    state = json.loads((tformer.checkpoints.format.resolve(tmp_path / "two") / "trainer_state.json").read_text())
    assert state["world_size"] == 2


@pytest.mark.parametrize("case", ["missing", "empty", "binary", "preset", "resume", "context", "out-file",
                                  "existing-run", "zero-steps", "bad-lr", "batch-split"])
def test_bad_input_is_a_one_line_error(case, data, tmp_path, capsys):
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "metrics.jsonl").write_text("keep me\n")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "bin.txt").write_bytes(bytes(range(256)))
    (tmp_path / "file").write_text("a file")
    out = str(tmp_path / "out")
    argv = {
        "missing": ["--data", str(tmp_path / "nope.txt")],
        "empty": ["--data", str(tmp_path / "empty.txt")],
        "binary": ["--data", str(tmp_path / "bin.txt")],
        "preset": ["--data", data, "--preset", "enormous"],
        "resume": ["--resume", str(existing)],
        "context": ["--data", data, "--preset", "tiny", "--context", "100000"],
        "out-file": ["--data", data, "--preset", "tiny", "--context", "32", "--out", str(tmp_path / "file" / "run")],
        "existing-run": ["--data", data, "--preset", "tiny", "--context", "32", "--out", str(existing)],
        "zero-steps": ["--data", data, "--max-steps", "0"],
        "bad-lr": ["--data", data, "--lr", "-1"],
        "batch-split": ["--data", data, "--batch-size", "6", "--grad-accum", "4"],
    }[case]
    if "--out" not in argv:
        argv += ["--out", out]
    with pytest.raises(SystemExit) if case in ("zero-steps", "bad-lr") else _no_raise() as exit_info:
        code = main(["train", *argv, "--max-steps" if case not in ("zero-steps",) else "--seed", "2", "--no-progress"])
    code = exit_info.value.code if case in ("zero-steps", "bad-lr") else code
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err
    assert (existing / "metrics.jsonl").read_text() == "keep me\n"       # nothing overwritten
    assert not Path(out, "checkpoints").exists()


class _no_raise:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def test_generate_is_reproducible(data, tmp_path):
    run = train(["--data", data, *SMALL, "--max-steps", "2", "--out", str(tmp_path / "g")]).run_dir
    cmd = [sys.executable, "-m", "tformer", "generate", "--model", run, "--prompt", "To be",
           "--max-new-tokens", "20", "--seed", "1"]
    first = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=120)
    if "not available yet" in first.stderr:
        pytest.skip("tformer generate is not implemented yet")
    assert first.returncode == 0, first.stderr
    second = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=120)
    assert first.stdout == second.stdout and first.stdout.startswith("To be")


def test_each_option_is_defined_once_and_its_flag_derived():
    """The flags of `tformer train` are the option fields; the --resume rules are read from them."""
    from dataclasses import fields

    from tformer.tasks.classify import ClassifyOptions
    from tformer.training.config import TrainOptions
    from tformer.training.options import CHANGE, ONCE, resume_rule

    assert resume_rule(TrainOptions, ONCE) == {"stop_at", "progress", "device"}
    assert resume_rule(TrainOptions, CHANGE) == {"max_steps", "time_budget", "save_every", "eval_every",
                                                 "log_every", "keep", "skip_nonfinite", "activation_checkpointing"}
    args = vars(build_parser().parse_args(["train", "--out", "x"]))
    assert {f.name for f in fields(ClassifyOptions)} - {"beta1", "beta2"} <= set(args)
    assert all(args[f.name] is None for f in fields(ClassifyOptions) if f.name in args and f.name != "out")


def test_defaults_come_from_the_task_recipe_and_a_flag_overrides_them(data):
    """No flag given: the task's recipe for the data set, then the option field's default. A flag
    given, even one equal to the field's default, wins over the recipe."""
    from dataclasses import fields

    from tformer.cli.train import prepare
    from tformer.tasks.lm import HAMLET, LMOptions

    parse = lambda *argv: build_parser().parse_args(["train", "--max-steps", "1", "--out", "x", *argv])  # noqa: E731
    task, cfg, _, saved, chosen = prepare(parse())
    assert chosen["lr"] == HAMLET["lr"] != LMOptions.lr and cfg.lr == HAMLET["lr"]
    assert cfg.batch_size == HAMLET["batch_size"] and task.cfg.attn_dropout == HAMLET["attn_dropout"]
    assert cfg.weight_decay == HAMLET["weight_decay"] != TrainConfig.weight_decay
    defaults = TrainConfig(out="x", max_steps=1)
    for f in fields(TrainConfig):
        if f.name not in chosen:
            assert getattr(cfg, f.name) == getattr(defaults, f.name), f.name
    task, cfg, _, saved, chosen = prepare(parse("--lr", "1e-3", "--no-keep-best"))  # 1e-3: the field default
    assert cfg.lr == 1e-3 and not cfg.keep_best and "lr" not in chosen and saved["lr"] == 1e-3
    task, cfg, _, saved, chosen = prepare(parse("--data", data))  # not hamlet: the generic defaults
    assert cfg.lr == LMOptions.lr and chosen == {"tokenizer": "char", "vocab_size": 2000, "preset": "small"}


def test_the_translate_recipe_differs_per_data_set_and_its_bible_preset_builds():
    """The recipe is chosen per data set (the Bible gets its own model; other pairs the generic one),
    a flag still wins, and the Bible's preset is a valid encoder-decoder."""
    from tformer import PRESETS, EncoderDecoder, ModelConfig
    from tformer.tasks.translate import TranslateTask
    from tformer.training.config import resolve_options

    bible, chosen = resolve_options(TranslateTask, {"data": "bible-en-es", "out": "x"})
    numbers, _ = resolve_options(TranslateTask, {"data": "numbers-fr-en", "out": "x"})
    own, _ = resolve_options(TranslateTask, {"data": "pairs.tsv", "out": "x", "lr": 5e-4})
    assert chosen["preset"] == bible["preset"] != numbers["preset"] == own["preset"] is None
    assert own["lr"] == 5e-4 and bible["lr"] != TranslateTask.Options.lr
    assert bible["compile"] and not numbers["compile"]
    assert not resolve_options(TranslateTask, {"data": "bible-en-es", "out": "x", "compile": False})[0]["compile"]
    model = EncoderDecoder(ModelConfig(**{**PRESETS[bible["preset"]], "vocab_size": 100}))
    src, tgt = torch.randint(0, 100, (2, 7)), torch.randint(0, 100, (2, 5))
    assert model(src, tgt).shape == (2, 5, 100)


def test_precision_auto_uses_bf16_only_where_the_device_computes_it(monkeypatch):
    """--precision auto (the default) = bf16 autocast on hardware with bf16 units, fp32 elsewhere."""
    from tformer import devices
    from tformer.training.config import TrainConfig

    assert TrainConfig(out="unused").precision == "auto"
    cpu = torch.device("cpu")
    for avx512_bf16, amx, expected in ((True, False, True), (False, True, True), (False, False, False)):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v)
        assert devices.native_bf16(cpu) is expected


def test_compile_without_a_compiler_trains_uncompiled_and_says_so(data, tmp_path, monkeypatch, capsys):
    from tformer.training import loop as trainer
    monkeypatch.setattr(trainer, "cxx_compiler", lambda: None)
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda m, *a, **k: compiled.append(m) or m)
    result = train(["--data", data, *SMALL, "--max-steps", "2", "--compile", "--out", str(tmp_path / "r")])
    assert result.step == 2 and compiled == []
    assert "--compile needs a C++ compiler" in capsys.readouterr().err


def test_compile_marks_the_lengths_that_change_dynamic(data, tmp_path, monkeypatch):
    """Under --compile the batch dimensions that change from step to step (translation's padded lengths)
    are marked dynamic, so the compiler builds one graph for all lengths, not one for the first batch's
    and another for the rest; a language model's fixed windows mark nothing."""
    class Compiled(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, *a, **k):
            return self.model(*a, **k)

    marked = []
    monkeypatch.setattr(torch, "compile", lambda m, *a, **k: Compiled(m))
    monkeypatch.setattr(torch._dynamo, "maybe_mark_dynamic", lambda t, dims: marked.append((tuple(t.shape), dims)))
    fixed = ["--max-steps", "3", "--compile", "--no-progress", "--precision", "fp32", "--eval-every", "1000"]
    train(["--data", data, *SMALL, *fixed, "--out", str(tmp_path / "lm")])
    assert all(dims == [] for _, dims in marked)
    marked.clear()
    train(["--task", "translate", "--preset", "tiny", "--vocab-size", "300", "--batch-size", "4", *fixed,
           "--out", str(tmp_path / "mt")])
    lengths = {shape[1] for shape, dims in marked if dims == [1]}
    assert len(lengths) > 1 and all(dims in ([], [1]) and shape[0] == 4 for shape, dims in marked)


def test_compiled_training_matches_eager(tmp_path):
    """--compile compiles the model and the loss together (one graph for every padded length); it changes
    the speed, not the numbers: the same losses step by step as the eager run, the same weights after."""
    fixed = ["--task", "translate", "--preset", "tiny", "--vocab-size", "300", "--batch-size", "4", "--max-steps", "4",
             "--lr", "1e-2", "--warmup", "1", "--log-every", "1", "--no-progress", "--precision", "fp32",
             "--eval-every", "1000"]
    runs = [train([*fixed, flag, "--out", str(tmp_path / flag.strip("-"))]) for flag in ("--no-compile", "--compile")]
    losses = [[r["train_loss"] for r in run.records if "train_loss" in r] for run in runs]
    assert len(losses[0]) == 4 and losses[0] == pytest.approx(losses[1], rel=1e-4)
    weights = [load_file(Path(run.checkpoint) / "model.safetensors") for run in runs]
    # Adam moves a weight by up to lr (1e-2) a step whatever its gradient's size, so a near-zero gradient that
    # rounds differently in the compiled kernels can move one weight by ~1e-4 (seen on an AVX-512 Zen 4);
    # a wrong gradient moves many by ~lr. A tenth of one step tells the two apart.
    assert all(torch.allclose(weights[0][k], weights[1][k], atol=1e-3) for k in weights[0])


def test_compiled_encoder_decoder_has_no_graph_breaks():
    """With the target length dynamic (translation's padded batches) the whole encoder-decoder traces as
    one graph: no Python decision on a symbolic length (a graph break at every attention layer made the
    Bible's cold compile 1.5x longer)."""
    from tformer.model.config import PRESETS, ModelConfig
    from tformer.model.models import EncoderDecoder

    cfg = ModelConfig(**{**PRESETS["nmt-mini"], "d_model": 32, "d_ff": 64, "n_layers": 1, "n_decoder_layers": 1,
                         "vocab_size": 50, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
                         "decoder_start_token_id": 1})
    model = EncoderDecoder(cfg).train()
    src, tgt = torch.randint(3, 50, (2, 7)), torch.randint(3, 50, (2, 5))
    src_mask = torch.ones(2, 7, dtype=torch.bool)
    for t in (src, tgt, src_mask):
        torch._dynamo.mark_dynamic(t, 1)
    explained = torch._dynamo.explain(lambda s, t, m: model(s, t, m).sum())(src, tgt, src_mask)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1

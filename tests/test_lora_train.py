"""LoRA in training (`tformer train --lora-r`): only the adapters train, each checkpoint holds the adapter
and names its base (checked by checksum), `tformer.load` / generate / export-hf give base + adapter,
--resume reaches the same adapter as an uninterrupted run, torchrun; and LoRA on a frozen int8 base."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import tformer
from tformer.checkpoints.format import load_tokenizer
from tformer.cli import build_parser, main
from tformer.errors import CheckpointError, ConfigError
from tformer.inference.quant import Int8Linear, Int8LoRALinear, quantize_int8
from tformer.model.lora import apply_lora, lora_layers, lora_state_dict, merge
from tformer.training.loop import Trainer

TEXT = ("To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n"
        "The slings and arrows of outrageous fortune,\nOr to take arms against a sea of troubles\n") * 30
SMALL = ["--context", "32", "--batch-size", "8", "--warmup", "2", "--eval-every", "1000",
         "--no-progress", "--precision", "fp32", "--dropout", "0"]
SCRATCH = ["--preset", "tiny", *SMALL]   # a run from scratch; one from --init takes the checkpoint's shape
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1] / "src")}


def run(argv: list[str]):
    """`tformer train ARGV` in this process: (the Trainer, holding the model it trained, FitResult)."""
    from tformer.cli.train import prepare

    task, cfg, resume, saved, _ = prepare(build_parser().parse_args(["train", *argv]))
    trainer = Trainer(task, cfg, args=saved)
    return trainer, trainer.run(resume)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("data") / "play.txt"
    path.write_text(TEXT, encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def base(data, tmp_path_factory) -> Path:
    """A tiny trained language model: the base the LoRA runs start from (--init)."""
    out = tmp_path_factory.mktemp("base") / "run"
    _, result = run(["--data", data, *SCRATCH, "--max-steps", "3", "--out", str(out)])
    return Path(result.checkpoint)


@pytest.fixture(scope="module")
def lora_run(data, base, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora") / "run"
    return run(["--data", data, *SMALL, "--init", str(base), "--lora-r", "4", "--lora-targets", "q,v,o,up,down",
                "--lr", "5e-3", "--max-steps", "20", "--log-every", "1", "--out", str(out)])


def logits(model, ids=torch.arange(1, 20).unsqueeze(0)):
    with torch.no_grad():
        return model.eval()(ids)


def test_only_the_adapters_train_and_the_checkpoint_is_the_adapter(lora_run, base):
    trainer, result = lora_run
    model = trainer.plain
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(".lora." in n for n in trained)
    assert set(trainer.names) == trained                                 # AdamW holds these only
    assert {trainer.names[i] for i in trainer.opt.state_dict()["state"]} == trained
    start = tformer.load(base).state_dict()
    now = model.state_dict()
    assert all(torch.equal(now[k], v) for k, v in start.items())         # the base: bit for bit
    assert any(not torch.equal(v, torch.zeros_like(v)) for k, v in now.items() if k.endswith(".b"))
    losses = [r["train_loss"] for r in result.records if "train_loss" in r]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.05             # it learns
    ckpt = Path(result.checkpoint)
    assert not (ckpt / "model.safetensors").exists()
    adapter = ckpt / "adapter_model.safetensors"
    assert set(load_file(str(adapter))) == set(lora_state_dict(model))
    assert adapter.stat().st_size * 10 < (base / "model.safetensors").stat().st_size
    config = json.loads((ckpt / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["int8"]) == (4, 16, False)
    assert config["target_modules"] == ["q", "v", "o", "up", "down"]
    assert Path(config["base"]) == base.resolve()                        # --init is the base: no copy
    assert config["base_sha256"] == json.loads((base / "config.json").read_text())["files"]["model.safetensors"]
    assert not (Path(result.run_dir) / "base").exists()
    loaded = tformer.load(result.run_dir)                                # base + adapter, transparently
    assert lora_layers(loaded) and torch.equal(logits(loaded), logits(model))
    assert not torch.equal(logits(loaded), logits(tformer.load(base)))


def test_generate_and_export_load_base_plus_adapter(lora_run, tmp_path, capsys):
    _, result = lora_run
    assert main(["generate", "--model", result.run_dir, "--prompt", "To be", "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith("To be")
    assert main(["export-hf", result.run_dir, str(tmp_path / "merged")]) == 0
    merged = tformer.from_hf(tmp_path / "merged")
    torch.testing.assert_close(logits(merged), logits(tformer.load(result.run_dir)), rtol=1e-4, atol=1e-4)
    assert main(["export-hf", result.run_dir, str(tmp_path / "peft"), "--adapter"]) == 0
    assert {p.name for p in (tmp_path / "peft").iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}


def test_resume_reaches_the_same_adapter(data, base, tmp_path):
    """6 steps straight == 3, stop, resume, 3 more: adapter dropout, EMA and keep-best included."""
    flags = ["--data", data, *SMALL, "--init", str(base), "--lora-r", "2", "--lora-dropout", "0.1", "--max-steps",
             "6", "--ema", "0.5", "--keep-best", "--eval-every", "3"]
    _, straight = run([*flags, "--out", str(tmp_path / "straight")])
    _, half = run([*flags, "--out", str(tmp_path / "split"), "--stop-at", "3"])
    assert half.step == 3
    _, resumed = run(["--resume", str(tmp_path / "split")])
    assert resumed.step == 6
    for name in ("checkpoints/step-0000006", "best"):
        a, b = (lora_state_dict(tformer.load(Path(r.run_dir) / name)) for r in (straight, resumed))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ema = load_file(str(Path(resumed.checkpoint) / "ema.safetensors"))
    assert ema and all(".lora." in k for k in ema)                       # the average: adapters only
    assert (tmp_path / "split" / "best" / "adapter_model.safetensors").is_file()


def test_a_changed_or_missing_base_is_refused_by_name(data, tmp_path, capsys):
    base_run = tmp_path / "base"
    _, b = run(["--data", data, *SCRATCH, "--max-steps", "2", "--out", str(base_run)])
    _, r = run(["--data", data, *SMALL, "--init", b.checkpoint, "--lora-r", "2", "--max-steps", "2",
                "--out", str(tmp_path / "lora")])
    want = json.loads((Path(b.checkpoint) / "config.json").read_text())["files"]["model.safetensors"]
    changed = tformer.load(b.checkpoint)
    with torch.no_grad():
        next(changed.parameters()).add_(1.0)
    tformer.save(changed, b.checkpoint, tokenizer=load_tokenizer(b.checkpoint))
    have = json.loads((Path(b.checkpoint) / "config.json").read_text())["files"]["model.safetensors"]
    for argv in (["generate", "--model", r.run_dir, "--prompt", "To"],
                 ["export-hf", r.run_dir, str(tmp_path / "hf")]):
        capsys.readouterr()
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err
        assert str(Path(b.checkpoint).resolve()) in err and want in err and have in err
    assert not (tmp_path / "hf").exists()
    os.rename(base_run, tmp_path / "moved")
    with pytest.raises(CheckpointError, match=f"{want}") as e:
        tformer.load(r.run_dir)
    assert "missing" in str(e.value) and str(Path(b.checkpoint).resolve()) in str(e.value)


@pytest.mark.parametrize("flag", [["--lora-r", "0"], ["--lora-r", "-2"], ["--lora-r", "2", "--lora-targets", "qq"],
                                  ["--lora-int8"]])
def test_bad_lora_flags_are_one_line_errors(flag, data, tmp_path, capsys):
    try:
        code = main(["train", "--data", data, *SCRATCH, "--max-steps", "2", *flag, "--out", str(tmp_path / "o")])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: ") and "\n" not in err and "lora" in err
    assert not (tmp_path / "o" / "checkpoints").exists()


def test_lora_without_init_saves_its_base_once(data, tmp_path):
    """No --init: the freshly built model is the base, written once as RUN/base/ and named relatively."""
    trainer, result = run(["--data", data, *SCRATCH, "--lora-r", "2", "--max-steps", "2", "--save-every", "1",
                           "--out", str(tmp_path / "r")])
    config = json.loads((Path(result.checkpoint) / "adapter_config.json").read_text())
    assert config["base"] == "../../base" and (tmp_path / "r" / "base" / "model.safetensors").is_file()
    os.rename(tmp_path / "r", tmp_path / "moved")                        # the run moves with its base
    assert torch.equal(logits(tformer.load(tmp_path / "moved")), logits(trainer.plain))


# --- LoRA on a frozen int8 base ---------------------------------------------------------------

def tiny_decoder():
    torch.manual_seed(0)
    cfg = tformer.ModelConfig(vocab_size=40, d_model=32, n_heads=4, n_layers=2, max_seq_len=32, dropout=0.0)
    return tformer.Decoder(cfg).eval()


def test_lora_on_an_int8_base_adds_the_adapter_to_the_int8_output():
    ids = torch.randint(0, 40, (2, 9))
    plain = quantize_int8(tiny_decoder())
    model = apply_lora(quantize_int8(tiny_decoder()), r=3, alpha=6, targets=("v", "lm_head"))
    assert isinstance(model.lm_head, Int8LoRALinear) and isinstance(model.lm_head.base, Int8Linear)
    for layer in lora_layers(model).values():
        for a in layer.lora.values():
            torch.nn.init.normal_(a.b)
            assert a.a.dtype == torch.float32
    # one layer by hand: y = Int8Linear(x) + (alpha / r) B A x on the v rows of qkv_proj
    layer = model.stack.layers[0].attn.qkv_proj
    adapter = layer.lora["v"]
    x = torch.randn(5, 32)
    with torch.no_grad():
        want = layer.base(x)
        want[:, adapter.start:adapter.stop] += 2.0 * x @ adapter.a.T @ adapter.b.T
        torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
    # the logits: only the output layer's adapter -> int8 logits + (alpha / r) h Aᵀ Bᵀ
    head_only = apply_lora(quantize_int8(tiny_decoder()), r=3, alpha=6, targets=("lm_head",))
    torch.nn.init.normal_(head_only.lm_head.lora["lm_head"].b)
    a = head_only.lm_head.lora["lm_head"]
    with torch.no_grad():
        hidden = head_only.step(ids, None, head=False, all_logits=True)
        want = plain.step(ids, None, all_logits=True) + 2.0 * hidden @ a.a.T @ a.b.T
        torch.testing.assert_close(head_only.step(ids, None, all_logits=True), want, rtol=1e-4, atol=1e-4)


def test_an_int8_base_trains_its_adapters_only_and_refuses_merging():
    model = apply_lora(quantize_int8(tiny_decoder()), r=4, alpha=8, targets=("q", "v", "o", "lm_head"))
    frozen = {k: v.clone() for k, v in model.state_dict().items() if ".lora." not in k}
    ids = torch.randint(0, 40, (4, 12))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-2)
    model.train()
    losses = []
    for _ in range(20):
        loss = torch.nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        grads = {n for n, p in model.named_parameters() if p.grad is not None}
        assert grads and all(".lora." in n for n in grads)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in frozen.items())
    with pytest.raises(ConfigError, match="int8") as e:
        merge(model)
    assert "\n" not in str(e.value)


def test_lora_int8_run_saves_an_int8_adapter_that_loads_back(lora_run, data, base, tmp_path):
    trainer, result = run(["--data", data, *SMALL, "--init", str(base), "--lora-r", "2", "--lora-int8",
                           "--max-steps", "3", "--out", str(tmp_path / "q")])
    assert json.loads((Path(result.checkpoint) / "adapter_config.json").read_text())["int8"] is True
    loaded = tformer.load(result.run_dir)
    assert isinstance(loaded.stack.layers[0].attn.qkv_proj, Int8LoRALinear)
    assert torch.equal(logits(loaded), logits(trainer.plain))


def test_torchrun_two_processes_match_one(data, base, tmp_path):
    flags = ["--data", data, *SMALL, "--init", str(base), "--lora-r", "2", "--lora-dropout", "0", "--max-steps", "3",
             "--lr", "1e-2"]
    _, one = run([*flags, "--out", str(tmp_path / "one")])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "tformer", "train", *flags, "--out", str(tmp_path / "two")]
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = (lora_state_dict(tformer.load(r)) for r in (one.run_dir, tmp_path / "two"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)

"""Preference tuning (--task dpo): a tiny run learns to prefer the chosen answers (held-out accuracy up,
DPO loss down from log 2), LoRA's reference is the model with its adapters off (step 0 loses exactly
log 2), adapters_off itself, and bad input as one-line errors naming file:line that write no run."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import tformer
from chat_util import NUMBERS, save_base, write_jsonl
from tformer.cli import build_parser, main
from tformer.errors import ConfigError
from tformer.model.config import ModelConfig
from tformer.model.lora import adapters_off, apply_lora, merge
from tformer.model.models import Decoder
from tformer.training.loop import Trainer

FLAGS = ["--batch-size", "8", "--warmup", "0", "--no-progress", "--precision", "fp32", "--log-every", "1",
         "--val-fraction", "0.25", "--dpo-beta", "0.5"]


def pairs(n: int = 40) -> list[dict]:
    """Half plain-text prompts, half chat messages; the chosen answer is always " yes"."""
    out = []
    for i in range(n):
        question = f"what is {NUMBERS[i % 9]} plus {NUMBERS[(i // 9) % 9]}?"
        prompt = question if i % 2 else [{"role": "user", "content": question}]
        out.append({"prompt": prompt, "chosen": " yes", "rejected": " no" if i % 3 else " maybe"})
    return out


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return save_base(tmp_path_factory.mktemp("dpo") / "base")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("data") / "pairs.jsonl", pairs())


def run(argv: list[str]):
    """`tformer train ARGV` in this process: (the Trainer, holding the model it trained, FitResult)."""
    from tformer.cli.train import prepare

    task, cfg, resume, saved, _ = prepare(build_parser().parse_args(["train", *argv]))
    trainer = Trainer(task, cfg, args=saved)
    return trainer, trainer.run(resume)


def evaluations(result) -> list[dict]:
    return [r for r in result.records if "val_accuracy" in r]


def test_a_run_learns_to_prefer_the_chosen_answers(base, data, tmp_path):
    trainer, result = run(["--task", "dpo", "--init", str(base), "--data", str(data), *FLAGS, "--lr", "3e-3",
                           "--max-steps", "30", "--eval-every", "10", "--out", str(tmp_path / "run")])
    first = result.records[0]
    assert first["step"] == 1 and first["train_loss"] == pytest.approx(math.log(2), abs=1e-5)  # policy == reference
    evals = evaluations(result)
    assert [e["step"] for e in evals] == [10, 20, 30]
    last = evals[-1]
    assert last["val_accuracy"] == 1.0                          # every held-out pair: chosen reward > rejected
    assert last["val_loss"] < 0.3 < math.log(2)                  # the DPO loss fell well below log 2
    assert last["val_rewards/margins"] > 0 and last["val_rewards/chosen"] > last["val_rewards/rejected"]
    assert trainer.task.ref is not None                           # full fine-tuning: one frozen copy of --init
    reference = tformer.load(base)
    assert all(torch.equal(a, b) for a, b in zip(trainer.task.ref.state_dict().values(),
                                                   reference.state_dict().values()))
    assert tformer.load(tmp_path / "run").kind == "decoder"


def test_lora_reference_is_the_model_with_adapters_off(base, data, tmp_path):
    trainer, result = run(["--task", "dpo", "--init", str(base), "--data", str(data), *FLAGS, "--lr", "1e-2",
                           "--lora-r", "2", "--lora-targets", "q,v,o", "--max-steps", "20", "--eval-every", "20",
                           "--out", str(tmp_path / "run")])
    assert result.records[0]["train_loss"] == pytest.approx(math.log(2), abs=1e-5)   # B = 0: policy == reference
    assert trainer.task.ref is None                                                 # no second copy
    assert evaluations(result)[-1]["val_accuracy"] > 0.5
    model = trainer.plain.eval()
    ids = torch.arange(3, 20).unsqueeze(0)
    with torch.no_grad():
        base_logits = tformer.load(base).eval()(ids)
        with adapters_off(model):
            off = model(ids)
        on = model(ids)
    torch.testing.assert_close(off, base_logits)                  # the reference: exactly the --init model
    assert not torch.allclose(on, base_logits, atol=1e-4)         # the adapters trained and are back on


def test_adapters_off_sets_adapters_aside_and_refuses_merged_ones():
    torch.manual_seed(0)
    model = Decoder(ModelConfig(kind="decoder", vocab_size=50, d_model=16, n_heads=2, n_layers=1, d_ff=32,
                                max_seq_len=16, dropout=0.0)).eval()
    ids = torch.arange(1, 9).unsqueeze(0)
    plain = model(ids).detach()
    apply_lora(model, r=2, alpha=4, targets=("q", "v", "o"))
    for p in model.parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p)
    adapted = model(ids).detach()
    assert not torch.allclose(adapted, plain)
    with adapters_off(model):
        torch.testing.assert_close(model(ids), plain)
        assert not any(p.requires_grad for p in model.parameters())
    torch.testing.assert_close(model(ids), adapted)
    assert sum(p.requires_grad for p in model.parameters()) == 6   # the adapters are back, still trained
    with pytest.raises(RuntimeError), adapters_off(model):          # put back after an error too
        raise RuntimeError
    torch.testing.assert_close(model(ids), adapted)
    merge(model)
    with pytest.raises(ConfigError, match="merged"), adapters_off(model):
        pass


@pytest.mark.parametrize("bad, message", [
    ('{"prompt": "hi", "chosen": " yes"', "not valid JSON"),
    ({"prompt": "hi", "chosen": " yes"}, "missing rejected"),
    ({"prompt": "hi", "chosen": 3, "rejected": " no"}, "chosen must be a string"),
    ({"prompt": 7, "chosen": " yes", "rejected": " no"}, "prompt must be a string or a list of messages"),
    ({"prompt": [{"role": "bot", "content": "hi"}], "chosen": " yes", "rejected": " no"}, "unknown role 'bot'"),
    ([1, 2], "expected a JSON object"),
], ids=["malformed", "missing", "not-a-string", "bad-prompt", "bad-role", "not-an-object"])
def test_bad_input_is_a_one_line_error_naming_file_and_line(base, tmp_path, capsys, bad, message):
    good = pairs(6)
    data = write_jsonl(tmp_path / "pairs.jsonl", [*good[:3], bad, *good[3:]])
    out = tmp_path / "run"
    code = main(["train", "--task", "dpo", "--init", str(base), "--data", str(data), "--max-steps", "1",
                 "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and not out.exists()
    assert len(err.splitlines()) == 1 and err.startswith(f"error: {data}:4: ") and message in err


def test_dpo_needs_init(data, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--task", "dpo", "--data", str(data), "--max-steps", "1", "--out", str(out),
                 "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--init" in err and len(err.splitlines()) == 1 and not out.exists()

"""Instruction tuning (--task sft): the assistant-only mask against trl's, packed rows against each
conversation alone, the end-of-turn always trained, bad input as one-line errors, a run end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import tformer
from tformer.cli import main
from tformer.data.chat import Example, Renderer, collate, pack, template_reader
from tformer.data.chat_template import DEFAULT_TEMPLATE, ChatTemplate, find_chat_template
from tformer.data.tokenizers import Tokenizer
from tformer.model.config import ModelConfig
from tformer.model.masks import segment_mask
from tformer.model.models import Decoder

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
          "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}"
          "{% else %}{{ m['content'] + '<|im_end|>' }}{% endif %}{{ '\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CONVERSATION = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is two plus two?"},
                {"role": "assistant", "content": "four"}, {"role": "user", "content": "and hello?"},
                {"role": "assistant", "content": "hello world"}]
TEXT = "what is two plus two? four. hello world, be brief. user assistant system " * 20


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    tok = Tokenizer.train_bpe(TEXT, 320)
    tok.hf.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    return tok


def decoder(tok: Tokenizer, positional: str = "rope", max_seq_len: int = 96) -> Decoder:
    torch.manual_seed(0)
    cfg = ModelConfig(kind="decoder", vocab_size=tok.vocab_size, d_model=32, n_heads=4, n_layers=2, d_ff=64,
                      max_seq_len=max_seq_len, positional=positional, pad_token_id=tok.pad_id,
                      bos_token_id=tok.bos_id, eos_token_id=tok.eos_id, dropout=0.0)
    return Decoder(cfg).eval()


def trl_labels(tok: Tokenizer, template: str, row: dict) -> list[int]:
    """trl's SFTTrainer's own preparation of one example (its `labels`: -100 where not trained), on an HF
    tokenizer made from tformer's: assistant_only_loss for conversations ({% generation %} markers),
    completion_only_loss (the default) for prompt-completion."""
    transformers = pytest.importorskip("transformers")
    datasets = pytest.importorskip("datasets")
    trl = pytest.importorskip("trl")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=template_reader(tok), bos_token="<bos>",
                                                eos_token="<eos>", pad_token="<pad>")
    fast.chat_template = template
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=tok.vocab_size, hidden_size=16, num_attention_heads=2, num_key_value_heads=2,
        num_hidden_layers=1, intermediate_size=32, max_position_embeddings=128))
    args = trl.SFTConfig(output_dir="unused", report_to=[], max_length=None, use_cpu=True,
                         assistant_only_loss="messages" in row)
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list([row]),
                             processing_class=fast)
    return trainer.train_dataset[0]["input_ids"], trainer.train_dataset[0]["labels"]


@pytest.mark.parametrize("template, row", [
    (DEFAULT_TEMPLATE, {"messages": CONVERSATION}),
    (CHATML, {"messages": CONVERSATION}),
    (DEFAULT_TEMPLATE, {"prompt": "what is two plus", "completion": " two? four"}),
    (DEFAULT_TEMPLATE, {"prompt": CONVERSATION[:2], "completion": CONVERSATION[2:3]}),
], ids=["default-template", "chatml", "prompt-completion", "conversational-prompt-completion"])
def test_assistant_mask_equals_trls(tokenizer, template, row):
    ids, labels = trl_labels(tokenizer, template, row)
    if "messages" in row:
        example = Example("x:1", messages=row["messages"])
    elif isinstance(row["prompt"], list):
        example = Example("x:1", messages=row["prompt"] + row["completion"], prompt=row["prompt"],
                          completion=row["completion"])
    else:
        example = Example("x:1", prompt=row["prompt"], completion=row["completion"])
    rendered = Renderer(tokenizer, ChatTemplate(template, "<bos>", "<eos>"))(example)
    assert rendered.ids == list(ids)
    assert rendered.trained == [label != -100 for label in labels]
    assert any(rendered.trained) and not all(rendered.trained)


def test_train_on_prompt_trains_every_token(tokenizer):
    rendered = Renderer(tokenizer, ChatTemplate(DEFAULT_TEMPLATE, "<bos>", "<eos>"), train_on_prompt=True)(
        Example("x:1", messages=CONVERSATION))
    assert all(rendered.trained)


@pytest.mark.parametrize("positional", ["rope", "learned"])
def test_a_packed_row_computes_what_each_conversation_computes_alone(tokenizer, positional):
    renderer = Renderer(tokenizer, ChatTemplate(DEFAULT_TEMPLATE, "<bos>", "<eos>"))
    convs = [renderer(Example("x:1", messages=CONVERSATION[i:])) for i in (0, 1, 3)]
    model = decoder(tokenizer, positional, max_seq_len=sum(len(c.ids) for c in convs) + 4)
    batch = collate([convs], tokenizer.pad_id)                                   # one row, three conversations
    assert batch["input_ids"].shape == (1, sum(len(c.ids) for c in convs))
    with torch.no_grad():
        packed = model(batch["input_ids"], segment_mask(batch["segments"]), batch["positions"])[0]
        at = 0
        for c in convs:
            alone = model(torch.tensor([c.ids]))[0]
            torch.testing.assert_close(packed[at:at + len(c.ids)], alone, atol=1e-5, rtol=1e-5)
            at += len(c.ids)


def test_pack_is_best_fit_decreasing_within_the_context():
    rows = pack([5, 9, 3, 6, 1, 4], 10)
    assert sorted(i for row in rows for i in row) == list(range(6))
    assert all(sum([5, 9, 3, 6, 1, 4][i] for i in row) <= 10 for row in rows)
    assert rows == [[1, 4], [3, 5], [0, 2]]


def test_end_of_turn_is_always_trained_even_when_pad_is_eos(tokenizer):
    renderer = Renderer(tokenizer, ChatTemplate(DEFAULT_TEMPLATE, "<bos>", "<eos>"))
    short, long = renderer(Example("x:1", messages=CONVERSATION[1:3])), renderer(Example("x:2", messages=CONVERSATION))
    eos = tokenizer.eos_id
    for r in (short, long):                     # the EOS ending each assistant turn is trained, the others not
        ends = [i for i, t in enumerate(r.ids) if t == eos]
        turns = sum(1 for m in CONVERSATION if m["role"] == "assistant") if r is long else 1
        assert sum(r.trained[i] for i in ends) == turns and r.trained[ends[-1]]
    batch = collate([[short], [long]], pad_id=eos)                               # the short row padded with EOS
    labels = batch["labels"]
    assert (labels == eos).sum() == 1 + 2                                      # predicted: each turn's end
    assert (labels[0, len(short.ids) - 1:] == -100).all()                       # padding is never a label
    row, at = labels[1], len(long.ids) - 2
    assert row[at] == eos and batch["input_ids"][1, at + 1] == eos


# --- the command ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def base(tmp_path_factory, tokenizer) -> Path:
    path = tmp_path_factory.mktemp("sft") / "base"
    tformer.save(decoder(tokenizer, "learned", max_seq_len=64), path, tokenizer=tokenizer)   # GPT-2-shaped
    return path


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines), encoding="utf-8")
    return path


GOOD = [{"messages": [{"role": "user", "content": f"what is {i} plus two?"},
                      {"role": "assistant", "content": f"{i + 2}"}]} for i in range(12)]
REFUSING = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('system messages are not "
            "supported') }}{% endif %}{{ m['content'] + eos_token }}{% endfor %}")


@pytest.mark.parametrize("bad, message", [
    ('{"messages": [', "not valid JSON"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant message"),
    ({"messages": [{"role": "bot", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
     "unknown role 'bot'"),
    ({"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "hi"},
                   {"role": "assistant", "content": "yo"}]}, "system messages are not supported"),
], ids=["malformed", "no-assistant", "unknown-role", "template-refuses"])
def test_bad_input_is_a_one_line_error_naming_file_and_line(base, tmp_path, capsys, bad, message):
    data = write_jsonl(tmp_path / "chats.jsonl", [*GOOD[:3], bad, *GOOD[3:]])
    template = tmp_path / "t.jinja"
    template.write_text(REFUSING)
    out = tmp_path / "run"
    code = main(["train", "--task", "sft", "--init", str(base), "--data", str(data), "--max-steps", "1",
                 "--out", str(out), "--no-progress", "--chat-template", str(template)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and not out.exists()
    assert len(err.splitlines()) == 1 and err.startswith(f"error: {data}:4: ") and message in err


@pytest.mark.parametrize("task", ["lm", "sft", "dpo"])
def test_dropout_flags_reach_the_model_fine_tuned_from_init(tokenizer, tmp_path, task):
    """--dropout / --attn-dropout set the model a run from --init trains (as classify's and tag's); without
    them lm and sft keep the base's dropout, and dpo trains without any (trl's disable_dropout default)."""
    from tformer.cli import build_parser
    from tformer.cli.train import prepare

    base = decoder(tokenizer, "learned", max_seq_len=64)
    tformer.save(Decoder(base.cfg.replace(dropout=0.2)), tmp_path / "base", tokenizer=tokenizer)
    if task == "lm":
        data = tmp_path / "text.txt"
        data.write_text("what is one plus two? three.\n" * 200, encoding="utf-8")
    else:
        row = GOOD[0] if task == "sft" else {"prompt": "what is 1 plus two?", "chosen": "3", "rejected": "4"}
        data = write_jsonl(tmp_path / "data.jsonl", [row] * 8)
    argv = ["train", "--task", task, "--init", str(tmp_path / "base"), "--data", str(data), "--max-steps", "1",
            "--out", str(tmp_path / "run")]
    x = torch.randint(0, 50, (2, 12))
    unset = (0.0, 0.0) if task == "dpo" else (0.2, None)          # None: attention takes --dropout's
    for flags, expected in [([], unset), (["--dropout", "0.3", "--attn-dropout", "0.2"], (0.3, 0.2))]:
        model = prepare(build_parser().parse_args([*argv, *flags])).task.build_model()
        assert (model.cfg.dropout, model.cfg.attn_dropout) == expected
        torch.manual_seed(0)
        with torch.no_grad():
            dropped = not torch.equal(model.train()(x), model.eval()(x))
        assert dropped == (expected[0] > 0)


def test_a_run_carries_its_template_to_load_and_the_server(base, tmp_path, capsys):
    from tformer.checkpoints.format import load_tokenizer
    from tformer.checkpoints.layout import resolve
    from tformer.serve.served import Served

    long = {"messages": [{"role": "user", "content": "two " * 80}, {"role": "assistant", "content": "four"}]}
    data = write_jsonl(tmp_path / "chats.jsonl", [*GOOD, long])
    out = tmp_path / "run"
    assert main(["train", "--task", "sft", "--init", str(base), "--data", str(data), "--max-steps", "3",
                 "--eval-every", "3", "--batch-size", "4", "--out", str(out), "--no-progress",
                 "--val-fraction", "0.2"]) == 0
    err = capsys.readouterr().err
    assert "1 of" in err and "skipped" in err and "--context 64" in err       # the long one, counted
    checkpoint = resolve(out)
    assert (checkpoint / "chat_template.jinja").read_text() == DEFAULT_TEMPLATE
    model = tformer.load(out)
    assert model.kind == "decoder"
    template = find_chat_template(checkpoint)
    messages = [{"role": "user", "content": "what is 3 plus two?"}]
    assert template.render(messages) == "<bos>user\nwhat is 3 plus two?<eos><bos>assistant\n"
    ids = Served(str(out)).chat_ids(messages)               # the server reads <bos>/<eos> back as their ids
    tok = load_tokenizer(out)
    assert ids[0] == tok.bos_id and ids.count(tok.eos_id) == 1
    assert ids == Renderer(tok, template)(Example("x:1", messages=[*messages, {"role": "assistant",
                                                                                "content": "5"}])).ids[:len(ids)]
    transformers = pytest.importorskip("transformers")      # the export carries it: transformers renders the same
    assert main(["export-hf", str(out), str(tmp_path / "hf")]) == 0
    fast = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    exported = fast.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert list(exported["input_ids"] if hasattr(exported, "keys") else exported) == ids

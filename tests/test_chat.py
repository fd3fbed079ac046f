"""`tformer chat`, driven through a pipe: each reply equals greedy generation on the conversation as
transformers renders it with the same chat template; history, /reset, dropping old turns, the exits."""

import signal
import subprocess
import sys

import pytest
import torch

import tformer
from tformer.checkpoints.format import load_tokenizer
from tformer.generation import eos_ids

transformers = pytest.importorskip("transformers")
pytest.importorskip("jinja2")
from serve_util import char_tokenizer, save_tiny  # noqa: E402

TEMPLATE = ("{% for m in messages %}<|start|>{{ m['role'] }}\n{{ m['content'] }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}")
REPLY = 8          # --max-new-tokens: the room kept for each reply
SYSTEM = "be brief."


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A tiny random decoder whose checkpoint carries TEMPLATE, and transformers' tokenizer of it."""
    path = tmp_path_factory.mktemp("chat") / "model"
    tok = char_tokenizer()
    tok.hf.add_special_tokens(["<|start|>", "<|end|>"])
    torch.manual_seed(0)
    cfg = tformer.ModelConfig(kind="decoder", vocab_size=tok.vocab_size, d_model=32, n_heads=4, n_layers=2, d_ff=64,
                              max_seq_len=96, tie_embeddings=False)
    model = tformer.Decoder(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(5)                      # clear-cut greedy choices
    tformer.save(model, path, tokenizer=tok, extra_files={"chat_template.jinja": TEMPLATE.encode()})
    tok.save(path.parent / "tokenizer.json")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path.parent / "tokenizer.json"),
                                                bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
    fast.chat_template = TEMPLATE
    return path, fast


def prompt(fast, messages) -> list[int]:
    ids = fast.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def greedy_reply(path, fast, messages, dtype=None) -> str:
    """The reference: greedy generate() on transformers' rendering (the model in `dtype`), cut at EOS, without
    special tokens."""
    model = tformer.load(path, dtype=dtype)
    ids = prompt(fast, messages)
    eos = eos_ids(model, tokenizer=load_tokenizer(path))
    new = model.generate(torch.tensor([ids]), max_new_tokens=REPLY, eos_token_id=eos)[0, len(ids):].tolist()
    new = new[:next((i for i, t in enumerate(new) if t in eos), len(new))]
    return fast.decode(new, skip_special_tokens=True)


def chat(path, stdin: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tformer", "chat", "--model", str(path), "--greedy",
                           "--max-new-tokens", str(REPLY), *flags],
                          input=stdin, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_replies_are_greedy_generate_with_the_history_until_reset(chat_model, dtype):
    """Also with --dtype bf16: the replies of the model loaded in bf16."""
    path, fast = chat_model
    out = chat(path, "hi\nwho are you?\n/reset\nwho are you?\n/exit\nnever read\n", "--system", SYSTEM,
               "--dtype", dtype)
    assert out.returncode == 0, out.stderr
    system, load_as = [{"role": "system", "content": SYSTEM}], {"fp32": None, "bf16": torch.bfloat16}[dtype]
    first = greedy_reply(path, fast, system + [{"role": "user", "content": "hi"}], load_as)
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": first}]
    second = greedy_reply(path, fast, system + history + [{"role": "user", "content": "who are you?"}], load_as)
    after_reset = greedy_reply(path, fast, system + [{"role": "user", "content": "who are you?"}], load_as)
    assert second != after_reset                               # the history changed the second reply
    assert out.stdout == f"{first}\n{second}\n{after_reset}\n"
    assert "reset" in out.stderr


def test_oldest_turns_are_dropped_the_system_prompt_kept_and_eof_exits(chat_model):
    path, fast = chat_model
    said = ["hello there", "and now?", "tell me more."]
    out = chat(path, "\n".join(said) + "\n", "--system", SYSTEM)     # ends at EOF, no /exit
    assert out.returncode == 0, out.stderr
    system, history, expected = [{"role": "system", "content": SYSTEM}], [], []
    for text in said:
        turn = [{"role": "user", "content": text}]
        while len(prompt(fast, system + history + turn)) > 96 - REPLY:
            history = history[2:]                              # what the command must do, oldest exchange first
        expected.append(greedy_reply(path, fast, system + history + turn))
        history += turn + [{"role": "assistant", "content": expected[-1]}]
    assert len(history) < 2 * len(said)                        # the case under test: something was dropped
    assert out.stdout == "".join(r + "\n" for r in expected)
    assert "dropped" in out.stderr


def test_ctrl_c_exits_130(chat_model):
    path, _ = chat_model
    # A child inherits an ignored SIGINT (pytest-xdist's workers ignore it), and Python then keeps it
    # ignored: give the command the default disposition a terminal gives it.
    proc = subprocess.Popen([sys.executable, "-m", "tformer", "chat", "--model", str(path), "--greedy"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    proc.stdin.write("hi\n")
    proc.stdin.flush()
    assert proc.stdout.read(1)                                 # replying: the command is in its loop
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err


def test_a_model_without_a_chat_template_is_refused(tmp_path):
    path = save_tiny(tmp_path / "plain")
    out = chat(path, "hi\n")
    assert out.returncode == 2 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {path} has no chat template (train it with --task sft")

"""`tformer chat`: a conversation with a chat model in the terminal, each reply streamed as it is written.

    tformer chat --model runs/sft --system "You answer in one sentence."
    > hello
    ...

A line is a message; `/reset` forgets the conversation (the system prompt stays), `/exit` or end of
input (Ctrl-D) ends it with exit status 0, Ctrl-C with 130. Replies go to stdout, notices to stderr.

The prompt is the whole conversation rendered with the checkpoint's chat template and read as the
server reads a chat request (special tokens in the template's text are tokens); replies are decoded
as the server decodes them. Only the data layer's chat pieces are used: no server (fastapi) needed.
When it no longer fits the context less the room kept for the reply (--max-new-tokens, at most half
the context), the oldest turns are dropped; the system prompt never is. Sampling defaults:
tformer.generation.settings.CHAT_DEFAULTS; --greedy or --temperature 0 takes the most likely token.
"""

from __future__ import annotations

import sys

from tformer.cli import COMMANDS
from tformer.cli.common import add_dtype_flag, add_sampling_flags, model_dtype, sampling_options
from tformer.generation.settings import CHAT_DEFAULTS as DEFAULTS


def register(sub) -> None:
    p = sub.add_parser("chat", help=COMMANDS["chat"],
                       description=COMMANDS["chat"] + ". Type a message and press Enter; /reset forgets the "
                                   "conversation, /exit or Ctrl-D ends it.",
                       epilog=f"Sampling defaults: --temperature {DEFAULTS.temperature} --top-k {DEFAULTS.top_k} "
                              f"--top-p {DEFAULTS.top_p}.")
    p.add_argument("--model", required=True, metavar="RUN",
                   help="checkpoint or run directory of a decoder with a chat template (its newest checkpoint)")
    p.add_argument("--system", default=None, metavar="PROMPT",
                   help="system prompt: the first message of the conversation, kept through /reset")
    add_sampling_flags(p, DEFAULTS, f"a reply ends after N tokens (default {DEFAULTS.max_new_tokens}); at most "
                                    "half the context is kept for it")
    p.add_argument("--device", default=None, help="torch device for the model (default: where it loads, the CPU)")
    add_dtype_flag(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from tformer.checkpoints.format import load, load_tokenizer, resolve
    from tformer.data.chat import template_reader
    from tformer.data.chat_template import find_chat_template
    from tformer.errors import TformerError
    from tformer.generation import eos_ids
    from tformer.generation.sampling import make_generator
    from tformer.inference.limits import check_generation

    directory = resolve(args.model)
    model = load(directory, args.device, model_dtype(args.dtype, args.device))
    if model.kind != "decoder":
        raise TformerError(f"{args.model} holds a {type(model).__name__}, which cannot chat (use a decoder with a "
                           f"chat template)")
    template = find_chat_template(directory)
    if template is None:
        raise TformerError(f"{args.model} has no chat template (train it with --task sft, or import a chat model "
                           f"with `tformer import-hf` / `import-gguf`)")
    tokenizer = load_tokenizer(directory)
    device, context = next(model.parameters()).device, model.cfg.max_seq_len
    max_new = DEFAULTS.max_new_tokens if args.max_new_tokens is None else args.max_new_tokens
    room = min(max_new, context // 2)                              # kept free for the reply
    check_generation(model.cfg, 1, context, device)
    options = dict(**sampling_options(args, DEFAULTS), eos_token_id=eos_ids(model, tokenizer=tokenizer))
    # one generator for the whole conversation: a seed gives the same replies to the same messages
    generator = make_generator(args.seed, device) if args.seed is not None else None
    conversation = Conversation(template, template_reader(tokenizer), args.system)
    interactive = sys.stdin.isatty()
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            if interactive:
                print()
            return 0
        message = line.strip()
        if message == "/exit":
            return 0
        if message == "/reset":
            conversation.history.clear()
            print("(conversation reset)", file=sys.stderr)
            continue
        if not message:
            continue
        ids = conversation.prompt(message, context - room)
        if ids is None:
            print(f"error: this message does not fit the model's context of {context} tokens with {room} kept for "
                  f"the reply (write less, or lower --max-new-tokens)", file=sys.stderr)
            continue
        reply = write_reply(model, tokenizer, ids, min(max_new, context - len(ids)), generator, options)
        conversation.answered(message, reply)


class Conversation:
    """The system prompt and the history, rendered with the chat template and read as the server reads
    a chat request (special tokens in the template's text are tokens: data.chat.template_reader)."""

    def __init__(self, template, reader, system: str | None):
        self.template, self.reader = template, reader
        self.system = [{"role": "system", "content": system}] if system else []
        self.history: list[dict] = []

    def prompt(self, message: str, limit: int) -> list[int] | None:
        """The ids of system + history + the user's `message`, at most `limit` tokens: the oldest
        exchanges of the history are dropped until they fit; None if even system + message do not."""
        from tformer.errors import TformerError

        turn = [{"role": "user", "content": message}]
        for start in range(0, len(self.history) + 1, 2):
            try:
                text = self.template.render(self.system + self.history[start:] + turn)
            except ValueError as e:                               # the template refused the conversation
                raise TformerError(f"{e} (start without --system if the template has no system role)") from None
            ids = self.reader.encode(text, add_special_tokens=False).ids
            if len(ids) <= limit:
                if start:
                    print(f"(the oldest {start // 2} exchange(s) no longer fit the context: dropped)", file=sys.stderr)
                del self.history[:start]
                return ids
        return None

    def answered(self, message: str, reply: str) -> None:
        self.history += [{"role": "user", "content": message}, {"role": "assistant", "content": reply}]


class ReplyText:
    """Decodes a reply as the server does (serve.served.OutputText, not imported: the serve package
    needs fastapi): without special tokens of any kind, the template's "<|end|>" included."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def decode(self, ids) -> str:
        return self.tokenizer.hf.decode([i for i in ids if i not in self.tokenizer.special_ids],
                                        skip_special_tokens=True)


def write_reply(model, tokenizer, ids: list[int], max_new_tokens: int, generator, options: dict) -> str:
    """Stream the reply to the prompt `ids` to stdout as it is written, and return its text."""
    import torch

    from tformer.generation import TextStream, stream, text_pieces

    steps = stream(model, torch.tensor([ids], device=next(model.parameters()).device), max_new_tokens=max_new_tokens,
                   generator=generator, **options)
    pieces = []
    for piece in text_pieces(steps, TextStream(ReplyText(tokenizer)), set(options["eos_token_id"])):
        pieces.append(piece)
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    return "".join(pieces)

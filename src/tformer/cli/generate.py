"""`tformer generate`: continue a prompt with a trained model, streaming the text to stdout.

    tformer generate --model runs/shakespeare --prompt "To be, or not" --max-new-tokens 200 --seed 0
    echo "ROMEO:" | tformer generate --model runs/shakespeare --prompt - --stop $'\\n\\n'

Sampling defaults: those of sampled text, tformer.generation.settings.TEXT_DEFAULTS (the LM task's
progress samples use them too; --help shows them); --greedy picks the most likely token each step;
--num-beams N runs beam search. Speculative decoding (the same text as without it when greedy, the
same distribution when sampling; one prompt): --draft-model RUN (a smaller decoder trained with the
same tokenizer) or --prompt-lookup N (drafts copied from the text) proposes --num-draft-tokens K tokens
per step of the model; the share it accepted is printed to stderr at the end.
"""

from __future__ import annotations

import sys

from tformer.cli import COMMANDS
from tformer.cli.args import positive_int
from tformer.cli.common import (
    add_dtype_flag,
    add_sampling_flags,
    apply_only_to,
    model_dtype,
    sampling_given,
    sampling_options,
)
from tformer.generation.settings import TEXT_DEFAULTS as DEFAULTS

MAX_NEW_TOKENS = 100_000  # a sliding window lets a decoder write on forever; a typo should not


def register(sub) -> None:
    p = sub.add_parser("generate", help=COMMANDS["generate"],
                       description=COMMANDS["generate"] + ", streaming the text to stdout",
                       epilog=f"Sampling defaults: --temperature {DEFAULTS.temperature} --top-k {DEFAULTS.top_k} "
                              f"--top-p {DEFAULTS.top_p}.")
    p.add_argument("--model", required=True, metavar="DIR",
                   help="checkpoint directory or run directory (its newest checkpoint); must contain tokenizer.json")
    p.add_argument("--prompt", required=True, metavar="TEXT",
                   help="text to continue; '-' reads it from stdin. For an encoder-decoder model: the source text")
    add_sampling_flags(p, DEFAULTS, f"stop after N new tokens (default {DEFAULTS.max_new_tokens}); a decoder whose "
                                    "context fills up continues from the last half-context of text")
    p.add_argument("--num-beams", type=positive_int, default=DEFAULTS.num_beams, metavar="N",
                   help="beam search with N beams: the most likely continuation, printed at the end; it does not "
                        "sample (--temperature, --top-k, --top-p, --min-p, --seed are errors with it; "
                        "--repetition-penalty applies) (default %(default)s)")
    p.add_argument("--stop", action="append", default=[], metavar="STR",
                   help="stop when the generated text contains STR (not printed); repeatable")
    p.add_argument("--no-echo", action="store_true", help="print only the new text, not the prompt before it")
    p.add_argument("--draft-model", metavar="DIR",
                   help="speculative decoding: a smaller decoder (checkpoint or run directory) with the same tokenizer "
                        "drafts tokens the model checks several at a time")
    p.add_argument("--prompt-lookup", type=positive_int, metavar="N",
                   help="speculative decoding without a draft model: propose the tokens that followed the last N "
                        "tokens where they occurred earlier in the prompt or text (N=2-3 is typical)")
    p.add_argument("--num-draft-tokens", type=positive_int, metavar="K",
                   help="tokens drafted per step with --draft-model or --prompt-lookup (default 4)")
    add_dtype_flag(p)
    p.set_defaults(func=run)


def run(args) -> int:
    import torch

    from tformer.checkpoints.format import load, load_source_tokenizer, load_tokenizer
    from tformer.errors import TformerError
    from tformer.generation import eos_ids, generate, prompt_ids, stream_text
    from tformer.generation.sampling import make_generator

    prompt = args.prompt
    if prompt == "-":
        try:
            prompt = sys.stdin.read()
        except OSError as e:
            raise TformerError(f"--prompt - reads the prompt from stdin, which cannot be read here ({e}); "
                               f"pipe the text in or give it directly") from None
    if args.num_beams > 1 and (given := sampling_given(args)):
        raise TformerError(apply_only_to(given, "sampling", f", which beam search (--num-beams {args.num_beams}) "
                                                            "does not do: drop {it} or use --num-beams 1"))
    dtype = model_dtype(args.dtype)                      # (its warning once, for the model and a draft)
    model = load(args.model, dtype=dtype)
    if model.kind not in ("decoder", "encoder-decoder"):
        raise TformerError(f"{args.model} holds a {type(model).__name__}, which cannot generate text "
                           f"(use a Decoder or EncoderDecoder checkpoint)")
    tokenizer = load_tokenizer(args.model)
    source_tokenizer = load_source_tokenizer(args.model)  # an encoder-decoder whose source has its own vocabulary
    reader = source_tokenizer or tokenizer                # what reads the prompt
    max_new = DEFAULTS.max_new_tokens if args.max_new_tokens is None else args.max_new_tokens
    if max_new > MAX_NEW_TOKENS:
        raise TformerError(f"--max-new-tokens {max_new} is more than {MAX_NEW_TOKENS:,} (ask for less; for more "
                           f"text, run generate again on the end of its output)")
    if model.is_encoder_decoder or args.num_beams > 1:
        # No sliding window here: the target (or every beam) must fit the context.
        used = 1 if model.is_encoder_decoder else max(len(tokenizer.encode(prompt)), 1)
        if args.max_new_tokens is None:
            max_new = max(0, min(max_new, model.cfg.max_seq_len - used))
    options = dict(sampling_options(args, DEFAULTS), do_sample=not args.greedy and args.num_beams == 1,
                   max_new_tokens=max_new, num_beams=args.num_beams,
                   eos_token_id=eos_ids(model, tokenizer=tokenizer), **_speculation(args, tokenizer, dtype))
    # one generator for the whole text: the sliding window's rounds continue its sequence
    generator = make_generator(args.seed, next(model.parameters()).device) if args.seed is not None else None
    from tformer.inference.limits import check_generation
    check_generation(model.cfg, args.num_beams, min(model.cfg.max_seq_len, len(reader.encode(prompt)) + max_new))
    # Build the generator (which checks every argument) before printing anything.
    if args.num_beams > 1:
        ids = torch.tensor([prompt_ids(reader, prompt)])
        pieces = iter([_beam_text(model, tokenizer, ids, args.stop, generator, options, generate)])
    else:
        pieces = stream_text(model, tokenizer, prompt, stop_strings=args.stop, generator=generator,
                             sliding_window=True, source_tokenizer=source_tokenizer, **options)
    out = sys.stdout
    if not args.no_echo and model.kind == "decoder":
        out.write(prompt)
    for piece in pieces:
        out.write(piece)
        out.flush()
    out.write("\n")
    out.flush()
    stats = options.get("speculative_stats")
    if stats is not None:
        sys.stderr.write(f"speculative: {stats.acceptance:.0%} of {stats.proposed} drafted tokens accepted\n")
    return 0


def _speculation(args, tokenizer, dtype) -> dict:
    """generate()'s speculative arguments from the flags: the draft model loaded and checked against
    the model's tokenizer, and the stats to print; {} without --draft-model / --prompt-lookup."""
    from tformer.errors import TformerError
    from tformer.generation import SpeculativeStats

    if args.draft_model is None and args.prompt_lookup is None:
        if args.num_draft_tokens is not None:
            raise TformerError("--num-draft-tokens needs --draft-model RUN or --prompt-lookup N")
        return {}
    if args.draft_model is not None and args.prompt_lookup is not None:
        raise TformerError("give --draft-model or --prompt-lookup, not both")
    draft = None
    if args.draft_model is not None:
        from tformer.checkpoints.format import load_draft

        # generate() checks its context against the text; the draft multiplies in the model's dtype
        draft = load_draft(args.draft_model, tokenizer, dtype=dtype)
    return dict(draft_model=draft, prompt_lookup=args.prompt_lookup, num_draft_tokens=args.num_draft_tokens,
                speculative_stats=SpeculativeStats())


def _beam_text(model, tokenizer, ids, stops, generator, options, generate) -> str:
    """Beam search from the prompt `ids` (1, T), then the best hypothesis's new text (read by
    `tokenizer`), cut before the first stop string."""
    from tformer.generation import TextStream

    seqs = generate(model, ids, stop_strings=stops or None, tokenizer=tokenizer, generator=generator, **options)
    start = 1 if model.is_encoder_decoder else ids.size(1)
    new = seqs[0, start:].tolist()
    ends = [i for i, t in enumerate(new) if t in options["eos_token_id"]]
    new = new[:ends[0]] if ends else new
    text = TextStream(tokenizer, stops)
    return text.push(new) + text.finish()

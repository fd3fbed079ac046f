"""`tformer bench`: speed side by side with Hugging Face and against the machine's limits."""

from tformer.cli import COMMANDS
from tformer.errors import TformerError

NAMES = ("train", "encoder", "decode", "engines")


def register(sub) -> None:
    p = sub.add_parser("bench", help=COMMANDS["bench"], description=COMMANDS["bench"] + (
        ". Prints a table of ratios (tformer speed / peer speed, > 1 = tformer faster) and ceilings "
        "(GEMM GFLOP/s, memory GB/s measured in the same run). The full run takes several minutes."))
    p.add_argument("--quick", action="store_true",
                   help="small shapes and few repeats: checks that everything runs (about a minute), "
                        "not a measurement")
    p.add_argument("--only", nargs="+", choices=NAMES, metavar="NAME",
                   help=f"run only these benchmarks (choose from {', '.join(NAMES)}; default: all)")
    p.add_argument("--json", metavar="PATH", help="also write the full results (every number) as JSON here")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where to run (default: cpu)")
    p.add_argument("--quality-model", metavar="DIR",
                   help="trained language model (run or checkpoint dir) for the int8 perplexity check "
                        "(default: the newest runs/lm-* here; skipped when there is none)")
    p.add_argument("--threads", type=int, metavar="N",
                   help="torch CPU threads (default: torch's choice, usually one per core)")
    p.set_defaults(func=run)


def run(args) -> int:
    import sys

    import torch
    from tqdm import tqdm

    from tformer import bench

    if args.device == "cuda" and not torch.cuda.is_available():
        raise TformerError("--device cuda was given but no CUDA GPU is available (use --device cpu)")
    if args.threads is not None:
        if args.threads < 1:
            raise TformerError(f"--threads {args.threads} must be at least 1")
        torch.set_num_threads(args.threads)
    if args.json:
        import os
        parent = os.path.dirname(os.path.abspath(args.json))
        if not os.path.isdir(parent):
            raise TformerError(f"cannot write --json {args.json}: folder {parent} does not exist (create it first)")
    if args.quality_model:
        from tformer.checkpoints.format import resolve
        resolve(args.quality_model)                # a clear error now, not after minutes of benchmarks
    names = tuple(args.only) if args.only else NAMES
    try:
        import sentence_transformers  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        raise TformerError(f"the peers need {e.name} (pip install 'tformer[bench]')") from None

    bar = tqdm(total=len(names) + 1, desc="bench", file=sys.stderr, unit="bench")

    def progress(name: str) -> None:
        if bar.n or name != "ceilings":
            bar.update(1)
        bar.set_postfix_str(name)

    result = bench.run(names, quick=args.quick, device=args.device, progress=progress,
                       quality_model=args.quality_model)
    bar.update(1)
    bar.close()
    print(bench.format_table(result))
    if args.json:
        bench.write_json(result, args.json)
        print(f"wrote {args.json}")
    return 0

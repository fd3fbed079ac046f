"""LoRA adapters served over the one base model (`tformer serve --model BASE --adapter NAME=RUN ...`),
chosen per request by its `model` field: the base's name (or none) is the base, an adapter's name that
adapter; anything else answers 404 (model_not_found).

An adapter is
- a LoRA run or checkpoint of `tformer train ... --lora-r R` (checkpoints/adapter.py): it names its base by
  path and checksum; one trained on another base (its model.safetensors sha256 is not the served one's) is
  refused at start-up, naming both;
- or a peft adapter directory (adapter_config.json + adapter_model.safetensors, no config.json), trained on
  the Hugging Face form of the served model (checkpoints/hf/lora.py): peft records no checksum, so only its
  module names and shapes are checked.

Each is read with its reader onto the base model (`attach`, `from_peft`), taken off again
(model.lora_batched.take_adapters), and all of them stacked once (stack_adapters): the base stays
unmerged and shared, each adapter's tensors live once, and rows of different adapters share a step.
The base's tokenizer and chat template serve every adapter.
"""

from __future__ import annotations

from pathlib import Path

from ..checkpoints.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, attach, base_dir, read_adapter_config
from ..checkpoints.format import WEIGHTS, read_config, read_safetensors, verify
from ..checkpoints.hf.lora import from_peft
from ..checkpoints.layout import CONFIG
from ..errors import ConfigError, TformerError
from ..model.lora_batched import stack_adapters, take_adapters

KINDS = ("decoder", "encoder-decoder")      # the models whose requests the scheduler decodes


def parse(spec: str) -> tuple[str, str]:
    """'NAME=RUN' -> (NAME, RUN)."""
    name, sep, run = spec.partition("=")
    name, run = name.strip(), run.strip()
    if not sep or not name or not run:
        raise ConfigError(f"--adapter {spec!r}: write NAME=RUN (the adapter's name in the API = a LoRA run, "
                          "checkpoint or peft adapter directory)")
    return name, run


def is_peft_dir(path: Path) -> bool:
    return (path / ADAPTER_CONFIG).is_file() and not (path / CONFIG).is_file()


class Adapters:
    """The names a server answers to: the base (number 0) and its adapters (1..N, in --adapter order)."""

    def __init__(self, base: str):
        self.names = [base]
        self.paths: list[str | None] = [None]
        self.numbers = {base: 0}

    @property
    def base(self) -> str:
        return self.names[0]

    def number(self, model: str | None) -> int | None:
        """The adapter a request's `model` field picks (0: the base; omitted: the base), None if unknown."""
        return 0 if model is None else self.numbers.get(model)

    def load(self, model, directory: Path, specs: list[str]) -> None:
        """Read every --adapter NAME=RUN onto `model` (the base, loaded from `directory`) and stack them."""
        if not specs:
            return
        if model.kind not in KINDS:
            raise ConfigError(f"--adapter: adapters are served for {' and '.join(KINDS)} models; {self.base!r} is "
                              f"of kind {model.kind!r}")
        base_sha = (read_config(directory).get("files") or {}).get(WEIGHTS)
        if base_sha is None:
            base = base_dir(directory, read_adapter_config(directory))
            raise ConfigError(f"--adapter: the served model {directory} is itself a LoRA adapter; serve its base: "
                              f"--model {base} --adapter NAME={directory}")
        taken = []
        for spec in specs:
            name, run = parse(spec)
            if name in self.numbers:
                raise ConfigError(f"--adapter {spec}: the name {name!r} is already taken (by "
                                  f"{'the base model' if name == self.base else 'another adapter'}); choose another")
            try:
                taken.append(read(model, run, directory, base_sha))
            except TformerError as e:
                raise ConfigError(f"--adapter {name}={run}: {e}") from None
            self.numbers[name] = len(self.names)
            self.names.append(name)
            self.paths.append(run)
        stack_adapters(model, taken)


def read(model, run: str, base: Path, base_sha: str) -> dict:
    """The adapter at `run`, checked against the base `model` (read from `base`), as take_adapters gives it."""
    path = Path(run)
    if path.is_dir() and is_peft_dir(path):
        from_peft(model, path)
        return take_adapters(model)
    data = verify(run)                      # a checkpoint or run directory; every file's checksum
    ckpt = Path(data["_dir"])
    if ADAPTER_CONFIG not in data["files"]:
        raise ConfigError(f"{ckpt} is a full model, not a LoRA adapter (one made by `tformer train ... --lora-r R`)")
    config = read_adapter_config(ckpt)
    if config["base_sha256"] != base_sha:
        raise ConfigError(f"the adapter was trained on another base: {base_dir(ckpt, config)} (model.safetensors "
                          f"sha256 {config['base_sha256']}), not on the served model {base} (sha256 {base_sha})")
    if config["int8"]:
        raise ConfigError("the adapter was trained on an int8-quantised base (--lora-int8); the server's base is "
                          "not quantised, so the adapter would compute something else")
    attach(model, config, read_safetensors(ckpt / ADAPTER_WEIGHTS), str(ckpt))
    return take_adapters(model)

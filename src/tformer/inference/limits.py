"""Resource limits checked before work starts: a batch or a cache that cannot fit in memory is a
clear error at once, not an out-of-memory kill (or a frozen machine) minutes later.

The estimates are *lower bounds* — memory the work needs at the very least — compared with the
device's total memory, so a run that could fit is never refused; one that cannot is.
"""

from __future__ import annotations

import os

import torch

from ..devices import device_memory, pick_device
from ..errors import ConfigError
from ..model.config import ModelConfig

GiB = 1 << 30


def training_bytes(cfg: ModelConfig, micro_batch: int, seq_len: int, adapters: str | None = None,
                   frozen_copies: int = 0, layer_activations: bool = True) -> int:
    """At least: the weights (counting only the embedding, query/output projections and feed-forward
    weights), the fp32 logits the loss keeps (decoders), and per layer the bf16 q, k, v and feed-forward
    activations autograd saves (`layer_activations`: some layer has a trained weight). The weights:

        adapters None     every weight trains: fp32 weight + gradient + two AdamW moments, 16 bytes each
        adapters "fp32"   LoRA: the base frozen, 4 bytes a weight (the adapters are small: not counted)
        adapters "int8"   LoRA on an int8 base: 1 byte a projection weight, the embeddings in fp32
        frozen_copies     fp32 copies of the model held beside it (DPO's reference without LoRA), 4 bytes a weight
    """
    layers = cfg.n_layers + (cfg.decoder_layers if cfg.kind == "encoder-decoder" else 0)
    d, d_ff = cfg.d_model, cfg.ffn_dim
    embedding = (cfg.vocab_size + (cfg.src_vocab_size or 0)) * d
    projections = layers * (2 * d * d + 2 * d * d_ff)
    per_weight = {None: (16, 16), "fp32": (4, 4), "int8": (4, 1)}
    if adapters not in per_weight:
        raise ValueError(f"adapters={adapters!r}: expected None, 'fp32' or 'int8'")
    embedding_bytes, projection_bytes = per_weight[adapters]
    weights = embedding * embedding_bytes + projections * projection_bytes
    weights += frozen_copies * 4 * (embedding + projections)
    tokens = micro_batch * seq_len
    logits = tokens * cfg.vocab_size * 4 if cfg.kind != "encoder" else 0
    return weights + logits + (layers * tokens * (3 * d + d_ff) * 2 if layer_activations else 0)


def generation_bytes(cfg: ModelConfig, sequences: int, total_len: int) -> int:
    """At least: the decoder's key/value cache (fp32 keys and values of every layer for every
    position) and one row of logits per sequence."""
    decoder = cfg.stack_config("decoder")
    layers, kv_width = decoder.n_layers, decoder.kv_heads * decoder.head_dim
    return sequences * (layers * 2 * total_len * kv_width * 4 + cfg.vocab_size * 4)


def _refuse(need: int, device, what: str, fix: str) -> None:
    have = device_memory(device)
    if need > have:
        raise ConfigError(f"{what} needs at least {need / GiB:.1f} GiB, more than the {have / GiB:.1f} GiB of "
                          f"{torch.device(device).type} memory ({fix})")


def check_training(cfg: ModelConfig, micro_batch: int, seq_len: int, device, adapters: str | None = None,
                   frozen_copies: int = 0, layer_activations: bool = True) -> None:
    _refuse(training_bytes(cfg, micro_batch, seq_len, adapters, frozen_copies, layer_activations), device,
            f"training with {micro_batch} sequences of {seq_len} tokens per micro-batch",
            "lower --batch-size, raise --grad-accum, or shorten --context / --max-len")


def check_generation(cfg: ModelConfig, sequences: int, total_len: int, device="cpu",
                     fix: str = "lower --num-beams or --max-new-tokens") -> None:
    _refuse(generation_bytes(cfg, sequences, total_len), device,
            f"generating {sequences} sequence(s) of up to {total_len} tokens", fix)


def check_task(task, train_cfg) -> None:
    """Before training: would one micro-batch of `task` under `train_cfg` (a TrainConfig) fit? With --lora-r
    the base is frozen (int8 with --lora-int8). A task says what else it holds: `sequences_per_row` (DPO: a
    pair, chosen and rejected, per row) and `reference_copy` (DPO: a frozen copy of the model as its reference,
    except under LoRA, where the reference is the model with its adapters off)."""
    cfg = getattr(task, "cfg", None)
    if cfg is None:  # a task that keeps no config of its own: its model has one
        cfg = task.build_model().cfg
    seq_len = getattr(task, "context", None) or getattr(task, "max_len", None) or cfg.max_seq_len
    world = int(os.environ.get("WORLD_SIZE", "1"))
    micro = -(-train_cfg.batch_size // (world * train_cfg.grad_accum))  # ceil
    lora = train_cfg.lora_r is not None
    adapters = ("int8" if train_cfg.lora_int8 else "fp32") if lora else None
    # only adapters on the output layers (lm_head, head) leave every layer's activations unsaved
    in_layers = not lora or bool(set(train_cfg.lora_targets.split(",")) - {"lm_head", "head"})
    copies = int(getattr(task, "reference_copy", False) and not lora)
    check_training(cfg, micro * getattr(task, "sequences_per_row", 1), seq_len,
                   pick_device(train_cfg.device, int(os.environ.get("LOCAL_RANK", "0"))),
                   adapters=adapters, frozen_copies=copies, layer_activations=in_layers)

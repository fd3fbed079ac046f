"""The training loop: `fit(task, cfg)` builds (or restores) the model and optimizer, then steps, logs, validates
and saves until a stop condition; it writes through tformer.training.rundir, averages weights with training.ema,
watches for NaN/inf with training.guard and logs the loss and the task's own metrics through training.steplog. The
Task protocol and options: training.config; a run from options: session."""

from __future__ import annotations

import math
import signal
import sys
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..checkpoints.format import read_safetensors
from ..checkpoints.layout import EMA as EMA_FILE
from ..checkpoints.layout import OPTIMIZER, RNG, checkpoint_dir
from ..data.files import micro_batches, varying_dims
from ..devices import cxx_compiler, native_bf16, pick_device
from ..model.layers import checkpoint_activations
from .config import Task, TrainConfig, run_defaults
from .distributed import Dist, full_optimizer_tensors, gather_model, grad_sync, shard_like, wrap
from .ema import EMA
from .guard import NonFiniteError, NumericGuard, stopped
from .lora import model_to_train
from .optim import load_optimizer_tensors, lr_at, make_optimizer, optimizer_tensors, progress_of
from .rundir import FitResult, RunDir, TrainState, read_trainer_state
from .steplog import StepLog, loss_and_metrics, postfix


class Trainer:
    """Builds the model and optimizer, then steps, validates and saves: the loop itself."""

    def __init__(self, task: Task, cfg: TrainConfig, command: list[str] | None = None,
                 args: dict[str, Any] | None = None):
        self.task, self.cfg = task, cfg
        self.command = command if command is not None else list(sys.argv)
        self.args = args or {}             # the options as given, saved for --resume
        self.stop_requested = False        # Ctrl-C: finish this step, save, stop
        self.dist = Dist(cfg.device)
        self.run_dir = RunDir(cfg.out, self.dist)
        self.device: torch.device | None = None
        self.bf16 = False                  # bf16 autocast (--precision, resolved on the device)
        self.state = TrainState()
        self.plain: nn.Module | None = None   # the model itself (what is saved)
        self.model: nn.Module | None = None   # ... as trained: DDP- or FSDP-wrapped under torchrun
        self.train_loss = None             # batch -> (loss, task metrics) on self.model; compiled with --compile
        self.ema: EMA | None = None
        self.guard: NumericGuard | None = None
        self.opt: torch.optim.Optimizer | None = None
        self.names: list[str] = []         # parameter names in optimizer order

    # --- set-up --------------------------------------------------------------------------
    def _build(self, resume: str | None) -> None:
        cfg = self.cfg
        self.device = pick_device(cfg.device, self.dist.local_rank)
        self.bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and native_bf16(self.device))
        torch.manual_seed(cfg.seed)
        opt_saved, ema_saved, ckpt = None, None, None
        if resume:
            ckpt, saved = read_trainer_state(resume)
            opt_saved = (read_safetensors(ckpt / OPTIMIZER), saved["optimizer_groups"], str(ckpt / OPTIMIZER))
            self.state = TrainState(**{k: saved.get(k, v) for k, v in asdict(self.state).items()})
            # best/ on disk is what later evaluations must beat (it may come from after this checkpoint)
            self.state.best = self.run_dir.best_record() if cfg.keep_best else None
            if cfg.ema and (ckpt / EMA_FILE).is_file():
                ema_saved = read_safetensors(ckpt / EMA_FILE)
        self.plain = model_to_train(self.task, cfg, self.run_dir, ckpt).to(self.device)   # with --lora-r: adapters
        checkpoint_activations(self.plain, cfg.activation_checkpointing)
        if cfg.ema:
            self.ema = EMA(self.plain, cfg.ema, ema_saved)
        self.model = wrap(self.plain, self.dist, self.device, cfg.fsdp)
        self.guard = NumericGuard(self.model, self.dist, self.device, cfg.grad_clip, cfg.skip_nonfinite, self._say)
        self.opt, self.names = make_optimizer(self.model, cfg)
        if opt_saved is not None:
            tensors, groups, source = opt_saved
            if cfg.fsdp:
                tensors = shard_like(self.model, tensors, self.device)
            load_optimizer_tensors(self.opt, self.names, tensors, groups, source)
        no_compiler = cfg.compile and self.device.type == "cpu" and cxx_compiler() is None
        if no_compiler:
            self._say("warning: --compile needs a C++ compiler (g++ or clang++, or set CXX); training without it")
        # the loss is compiled with the model: the softmax over the vocabulary and its gradient fuse
        # into a few passes instead of several tensors of (tokens x vocabulary) (BENCHMARKS.md, "torch.compile")
        compiling = cfg.compile and not no_compiler
        self.train_loss = loss_and_metrics(self.task, self.model)
        self.train_loss = torch.compile(self.train_loss) if compiling else self.train_loss
        self.varying = varying_dims([self.task.batch(s, "train") for s in range(4)]) if compiling else {}

    # --- outputs -------------------------------------------------------------------------
    def _say(self, text: str) -> None:
        if self.dist.main:
            from tqdm import tqdm
            tqdm.write(text, file=sys.stderr)

    def _model_to_save(self) -> nn.Module | None:
        """The plain model to write (None on other processes). Under FSDP every process must call
        this: it gathers the shards into a plain copy, as the sharded module holds DTensors."""
        if not self.cfg.fsdp:
            return self.plain if self.dist.main else None
        return gather_model(self.model, self.task.build_model, self.dist.main)

    def _save(self) -> Path:
        cfg, state = self.cfg, self.state
        tensors, groups = optimizer_tensors(self.opt, self.names)
        if cfg.fsdp:
            tensors |= full_optimizer_tensors(self.opt, self.names)
        model = self._model_to_save()
        rng = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng |= {f"cuda{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())}
        files = {OPTIMIZER: tensors, RNG: rng} | ({EMA_FILE: self.ema.tensors()} if self.ema is not None else {})
        trainer_state = {**asdict(state), "train_config": cfg.to_dict(), "args": self.args, "command": self.command,
                         "task": self.task.name, "world_size": self.dist.world, "optimizer_groups": groups,
                         "scheduler": {"kind": "linear warm-up + cosine", "lr": cfg.lr,
                                       "min_lr_ratio": cfg.min_lr_ratio, "warmup": cfg.warmup,
                                       "max_steps": cfg.max_steps, "time_budget": cfg.time_budget,
                                       "warm_elapsed": state.warm_elapsed, "last_lr": self.opt.param_groups[0]["lr"]},
                         "data_position": {"seed": cfg.seed, "next_step": state.step}}
        return self.run_dir.save_step(state.step, model, self.task, trainer_state, files, cfg.keep)

    def _keep_best(self, metrics: dict[str, float]) -> None:
        """--keep-best: write the model to RUN/best/ when this evaluation beats every earlier one on
        the task's `best_metric` (default: lowest val_loss). A tie keeps the earlier model."""
        name, mode = getattr(self.task, "best_metric", ("val_loss", "min"))
        value = metrics.get(name)
        best = self.state.best
        better = value is not None and math.isfinite(value) and (
            best is None or (value > best["value"] if mode == "max" else value < best["value"]))
        if self.dist.world > 1:  # every process must agree (FSDP gathers the weights on all of them)
            better = bool(self.dist.max([float(better)], self.device)[0])
        if not better:
            return
        self.state.best = {"metric": name, "mode": mode, "value": value, "step": self.state.step}
        self.run_dir.save_best(self._model_to_save(), self.task, self.state.best)

    # --- validation ----------------------------------------------------------------------
    def _evaluate(self) -> dict[str, float]:
        if self.ema is None:
            return self._evaluate_now()
        with self.ema.applied():  # score (and keep as best) the averaged weights
            return self._evaluate_now()

    def _evaluate_now(self) -> dict[str, float]:
        eval_model = self.model if self.cfg.fsdp else self.plain
        eval_model.eval()
        with torch.no_grad():
            metrics = self.task.evaluate(eval_model)
            if not math.isfinite(metrics["val_loss"]):  # NaN outputs: sampling from them would fail
                sample = "(none: the model's outputs are not finite)"
            else:
                sample = self.task.sample(eval_model) if (self.dist.main or self.cfg.fsdp) else ""
        eval_model.train()
        if self.state.best_val_loss is None or metrics["val_loss"] < self.state.best_val_loss:
            self.state.best_val_loss = metrics["val_loss"]
        if self.cfg.keep_best:
            self._keep_best(metrics)
        shown = "  ".join(f"{k} {v:.4f}" for k, v in metrics.items())
        self._say(f"step {self.state.step}: {shown}\n--- sample ---\n{sample}\n--------------")
        return metrics

    # --- the loop ------------------------------------------------------------------------
    def _on_sigint(self, signum, frame) -> None:
        if self.stop_requested:  # a second Ctrl-C: stop now, without saving
            raise KeyboardInterrupt
        self.stop_requested = True
        self._say("interrupted: finishing this step and saving a checkpoint (Ctrl-C again to quit at once)")

    def _done(self) -> str | None:
        cfg, state = self.cfg, self.state
        if self.stop_requested:
            return "interrupted"
        if cfg.max_steps is not None and state.step >= cfg.max_steps:
            return "max_steps"
        if cfg.time_budget is not None and state.elapsed >= cfg.time_budget:
            return "time_budget"
        if cfg.stop_at is not None and state.step >= cfg.stop_at:
            return "stop_at"
        return None

    def _step(self, step: int, batch: dict[str, Tensor]) -> tuple[float, dict[str, float]] | None:
        """One optimizer step on the global `batch`: the mean loss and task metrics over its micro-batches,
        or None when the guard skipped it."""
        torch.manual_seed((self.cfg.seed * 1_000_003 + step) * 131 + self.dist.rank)  # dropout = f(seed, step, rank)
        micros = micro_batches(batch, self.dist.rank, self.dist.world, self.cfg.grad_accum)
        loss_sum, metrics = 0.0, {}
        for i, micro in enumerate(micros):
            with grad_sync(self.model, self.dist, self.cfg.fsdp, last=i == len(micros) - 1):
                with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
                    micro = {k: v.to(self.device, non_blocking=True) for k, v in micro.items()}
                    for k in self.varying.keys() & micro.keys():
                        torch._dynamo.maybe_mark_dynamic(micro[k], self.varying[k])
                    loss, extra = self.train_loss(micro)
                    loss = loss / len(micros)
                loss.backward()
            loss_sum += loss.item()
            for name, value in extra.items():
                metrics[name] = metrics.get(name, 0.0) + float(value) / len(micros)
        healthy = self.guard.healthy(loss_sum, self.guard.grad_norm(), step + 1)
        if healthy:
            self.opt.step()
            if self.ema is not None:
                self.ema.update(step)
        self.opt.zero_grad(set_to_none=True)
        return (loss_sum, metrics) if healthy else None

    def run(self, resume: str | None = None) -> FitResult:
        try:
            return self._run(resume)
        except NonFiniteError as e:
            raise self._stop_nonfinite(e) from None
        finally:
            self.dist.close()

    def _run(self, resume: str | None) -> FitResult:
        from tqdm import tqdm

        cfg, task = self.cfg, self.task
        self.run_dir.check(resume=bool(resume))
        self._build(resume)
        state = self.state
        self.run_dir.start_metrics(keep_until=state.step if resume else 0)
        handler = None
        if threading.current_thread() is threading.main_thread():
            handler = signal.signal(signal.SIGINT, self._on_sigint)
        bar = tqdm(total=cfg.max_steps, initial=state.step, unit="step", file=sys.stderr, dynamic_ncols=True,
                   disable=not (cfg.progress and self.dist.main), desc="train")
        start = time.perf_counter() - state.elapsed
        window, last_eval, last_save = StepLog(self.dist, self.device), None, None
        try:
            while (reason := self._done()) is None:
                step = state.step
                lr = lr_at(cfg, step, progress_of(cfg, step, state.elapsed, state.warm_elapsed))
                for g in self.opt.param_groups:
                    g["lr"] = lr
                t_step = time.perf_counter()
                batch = task.batch(step, "train")
                window.add(self._step(step, batch), task.tokens(batch), time.perf_counter() - t_step)
                state.step = step = step + 1
                state.tokens += task.tokens(batch)
                state.elapsed, stop = self.dist.max([time.perf_counter() - start, float(self.stop_requested)],
                                                    self.device)
                self.stop_requested = bool(stop)
                if state.warm_elapsed is None and step >= cfg.warmup:
                    state.warm_elapsed = state.elapsed
                record = None
                if step % cfg.log_every == 0 or self._done():
                    record = window.record(step, lr, state.elapsed)
                    bar.set_postfix(postfix(record))
                    if cfg.max_steps is None and cfg.time_budget:  # ETA from the clock: estimate the total steps
                        bar.total = max(step, int(step * cfg.time_budget / max(state.elapsed, 1e-9)))
                if step % cfg.eval_every == 0 or self._done() not in (None, "interrupted", "stop_at"):
                    record = (record or {"step": step}) | self._evaluate()
                    last_eval = step
                if record is not None:
                    self.run_dir.log(record)
                    if last_eval == step:
                        self.run_dir.plot()
                bar.update(1)
                if step % cfg.save_every == 0 and not self._done():
                    self.guard.check_weights(step)
                    self._save()
                    last_save = step
        finally:
            bar.close()
            if handler is not None:
                signal.signal(signal.SIGINT, handler)
        if last_save != state.step:
            self.guard.check_weights(state.step)
            self._save()
        path = checkpoint_dir(self.run_dir.path, state.step)
        self.run_dir.plot()
        if reason == "interrupted":
            self._say(f"stopped at step {state.step}; checkpoint {path}; continue with "
                      f"`tformer train --resume {self.run_dir.path}`")
        best_dir = str(self.run_dir.best_dir) if state.best is not None else None
        return FitResult(reason, state.step, state.best_val_loss, str(path), state.best, best_dir,
                         str(self.run_dir.path), state.elapsed, state.tokens, self.run_dir.records)

    def _stop_nonfinite(self, e: NonFiniteError) -> NonFiniteError:
        """Save the last good weights if they are not on disk yet (never bad ones); say where to go on."""
        if self.state.step > 0 and not self.run_dir.has_step(self.state.step) and self.guard.weights_finite():
            self._save()
        return stopped(e, self.run_dir.path, self.run_dir.newest_step())


def fit(task: Task, cfg: TrainConfig, resume: str | None = None, command: list[str] | None = None,
        args: dict[str, Any] | None = None) -> FitResult:
    """Train `task` as `cfg` says, continuing from the checkpoint directory `resume` if given; unset out and budget as
    `tformer train` (config.run_defaults). The task built from options, as that command: session.train."""
    cfg = replace(cfg, **run_defaults(vars(cfg), task.name))
    cfg.check()
    return Trainer(task, cfg, command=command, args=args).run(resume)

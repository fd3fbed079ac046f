"""The training loop behind `tformer.train.fit`: distributed set-up, the step, validation,
metrics, checkpoints and resume. See train.py for the Task protocol and the run-directory layout."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import sys
import threading
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .checkpoint import BEST, _aliases, load_state, read_safetensors, save
from .distributed import Dist
from .runs import STATE, _best_record, _record, checkpoint_dir, read_trainer_state
from .errors import CheckpointError, TformerError
from .train import (Task, TrainConfig, autocast, load_optimizer_tensors, lr_at, make_optimizer,
                    micro_batches, optimizer_tensors, pick_device, progress_of)

OPTIMIZER = "optimizer.safetensors"
RNG = "rng.safetensors"
EMA = "ema.safetensors"
STEP_DIR = re.compile(r"step-\d{7}")


class NonFiniteError(TformerError):
    """A NaN or infinite loss, gradient or weight stopped the run (after --skip-nonfinite skipped steps)."""

    def __init__(self, step: int, what: str, message: str | None = None):
        super().__init__(message or f"step {step}: {what} is not finite")
        self.step, self.what = step, what


class Trainer:
    def __init__(self, task: Task, cfg: TrainConfig, command: list[str] | None = None,
                 args: dict[str, Any] | None = None):
        self.task, self.cfg = task, cfg
        self.command = command if command is not None else list(sys.argv)
        self.args = args or {}
        self.run_dir = Path(cfg.out)
        self.stop_requested = False
        self.nonfinite = 0  # steps skipped for a NaN/inf loss or gradient

    # --- set-up --------------------------------------------------------------------------
    def _build(self, resume: str | None) -> dict[str, Any]:
        cfg, task = self.cfg, self.task
        self.device = pick_device(cfg.device, self.dist.local_rank)
        torch.manual_seed(cfg.seed)
        self.plain = task.build_model()
        state: dict[str, Any] = {"step": 0, "elapsed": 0.0, "warm_elapsed": None, "best_val_loss": None,
                                 "tokens": 0, "best": None}
        opt_saved = None
        if resume:
            ckpt, saved = read_trainer_state(resume)
            load_state(self.plain, read_safetensors(ckpt / "model.safetensors"), str(ckpt))
            opt_saved = (read_safetensors(ckpt / OPTIMIZER), saved["optimizer_groups"], str(ckpt / OPTIMIZER))
            state.update({k: saved.get(k, state[k]) for k in state})
            # best/ on disk is what later evaluations must beat (it may come from after this checkpoint)
            state["best"] = _best_record(self.run_dir) if cfg.keep_best else None
        self.plain.to(self.device)
        self.ema = None  # --ema: {name: running average} of the parameters
        if cfg.ema:
            self.ema = {n: p.detach().clone() for n, p in self.plain.named_parameters()}
            if resume and (ckpt / EMA).is_file():
                self.ema = {n: t.to(self.device) for n, t in read_safetensors(ckpt / EMA).items()}
        self.model = self._wrap(self.plain)
        self.opt, self.names = make_optimizer(self.model, cfg)
        if opt_saved is not None:
            tensors, groups, source = opt_saved
            if cfg.fsdp:
                tensors = self._shard_like_params(tensors)
            load_optimizer_tensors(self.opt, self.names, tensors, groups, source)
        self.train_model = torch.compile(self.model) if cfg.compile else self.model
        return state

    def _wrap(self, model: nn.Module) -> nn.Module:
        if self.cfg.fsdp:
            from torch.distributed.fsdp import fully_shard

            if self.dist.world == 1 and not torch.distributed.is_initialized():
                raise CheckpointError("--fsdp needs torchrun (e.g. torchrun --nproc_per_node 2 -m tformer train ...)")
            for p in model.parameters():  # FSDP2 shards contiguous tensors only
                p.data = p.data.contiguous()
            for layer in (m for m in model.modules() if type(m).__name__.endswith("Layer")):
                fully_shard(layer)
            return fully_shard(model)
        if self.dist.world > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            return DDP(model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        return model

    def _shard_like_params(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        from torch.distributed.tensor import DTensor, distribute_tensor

        params = dict(self.model.named_parameters())
        out = {}
        for key, t in tensors.items():
            p = params.get(key.rpartition("/")[0])
            if isinstance(p, DTensor) and t.shape == p.shape:
                t = distribute_tensor(t.to(self.device), p.device_mesh, p.placements)
            out[key] = t
        return out

    def _check_out(self, resume: str | None) -> None:
        """Refuse to overwrite another run; fail early (before training) when --out is unwritable.
        Rank 0 decides and tells the others, so they never race with its mkdir."""
        error = None
        if self.dist.main:
            try:
                self._check_out_here(resume)
            except CheckpointError as e:
                error = str(e)
        if self.dist.world > 1:
            box = [error]
            torch.distributed.broadcast_object_list(box, src=0)
            error = box[0]
        if error:
            raise CheckpointError(error)

    def _check_out_here(self, resume: str | None) -> None:
        run = self.run_dir
        if run.exists() and not run.is_dir():
            raise CheckpointError(f"--out {run} is a file, not a directory")
        if not resume and run.is_dir() and ((run / "checkpoints").exists() or (run / "metrics.jsonl").exists()):
            raise CheckpointError(f"--out {run} already holds a run (continue it with --resume {run}, "
                                  "or choose another --out)")
        try:
            run.mkdir(parents=True, exist_ok=True)
            probe = run / f".write-test-{os.getpid()}"
            probe.write_text("")
            probe.unlink()
        except OSError as e:
            raise CheckpointError(f"cannot write to --out {run} ({e.strerror or e})") from None
        # Hidden leftovers of a run killed mid-save or mid-prune (never loaded): free their space.
        for leftover in (run / "checkpoints").glob(".step-*") if (run / "checkpoints").is_dir() else ():
            shutil.rmtree(leftover, ignore_errors=True)
        for leftover in run.glob(f".{BEST}.*"):
            shutil.rmtree(leftover, ignore_errors=True)

    # --- outputs -------------------------------------------------------------------------
    def _metrics(self, record: dict[str, Any] | None = None, keep_until: int | None = None) -> None:
        if not self.dist.main:
            return
        path = self.run_dir / "metrics.jsonl"
        if keep_until is not None:  # on resume: forget what the interrupted run logged after the checkpoint
            lines = path.read_text(encoding="utf-8", errors="replace").splitlines() if path.exists() else []
            records = [r for r in map(_record, lines) if r is not None and r.get("step", 0) <= keep_until]
            tmp = path.with_suffix(".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
            os.replace(tmp, path)
            self.records = records
            return
        self.records.append(record)
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def _plot(self) -> None:
        if not self.dist.main or not self.records:
            return
        try:
            from .viz import plot_loss
        except ImportError:  # matplotlib missing: the metrics file still has everything
            return
        plot_loss(self.records, self.run_dir / "loss.png")

    def _save(self, state: dict[str, Any]) -> Path:
        from safetensors.torch import save as st_save

        tensors, groups = self._optimizer_state()
        model = self._model_to_save()
        path = checkpoint_dir(self.run_dir, state["step"])
        if self.dist.main:
            rng = {"torch": torch.get_rng_state()}
            if torch.cuda.is_available():
                rng |= {f"cuda{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())}
            trainer_state = {**state, "train_config": self.cfg.to_dict(), "args": self.args, "command": self.command,
                             "task": self.task.name, "world_size": self.dist.world, "optimizer_groups": groups,
                             "scheduler": {"kind": "linear warm-up + cosine", "lr": self.cfg.lr,
                                           "min_lr_ratio": self.cfg.min_lr_ratio, "warmup": self.cfg.warmup,
                                           "max_steps": self.cfg.max_steps, "time_budget": self.cfg.time_budget,
                                           "warm_elapsed": state["warm_elapsed"], "last_lr": self.opt.param_groups[0]["lr"]},
                             "data_position": {"seed": self.cfg.seed, "next_step": state["step"]}}
            extra = {OPTIMIZER: st_save(tensors), RNG: st_save(rng),
                     STATE: json.dumps(trainer_state, indent=2).encode()}
            if self.ema is not None:
                extra[EMA] = st_save({n: t.detach().cpu().contiguous() for n, t in self.ema.items()})
            save(model, path, tokenizer=self.task.tokenizer, meta={"task": self.task.name, **self.task.meta(),
                                                                   "step": state["step"]}, extra_files=extra,
                 source_tokenizer=getattr(self.task, "source_tokenizer", None))
            self._prune()
        self.dist.barrier()
        return path

    def _model_to_save(self) -> nn.Module | None:
        """The plain model to write (None on other processes). Under FSDP every process must call
        this: it gathers the shards into a plain copy, as the sharded module holds DTensors."""
        if not self.cfg.fsdp:
            return self.plain if self.dist.main else None
        weights = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in self.model.state_dict().items()}
        if not self.dist.main:
            return None
        model = self.task.build_model()
        aliases = _aliases(model)
        load_state(model, {k: v.cpu() for k, v in weights.items() if k not in aliases}, "FSDP state")
        return model

    def _keep_best(self, state: dict[str, Any], metrics: dict[str, float]) -> None:
        """--keep-best: write the model to RUN/best/ when this evaluation beats every earlier one on
        the task's `best_metric` (default: lowest val_loss). A tie keeps the earlier model."""
        name, mode = getattr(self.task, "best_metric", ("val_loss", "min"))
        value = metrics.get(name)
        best = state["best"]
        better = value is not None and math.isfinite(value) and (
            best is None or (value > best["value"] if mode == "max" else value < best["value"]))
        if self.dist.world > 1:  # every process must agree (FSDP gathers the weights on all of them)
            better = bool(self.dist.max([float(better)], self.device)[0])
        if not better:
            return
        state["best"] = {"metric": name, "mode": mode, "value": value, "step": state["step"]}
        model = self._model_to_save()
        if self.dist.main:
            save(model, self.run_dir / BEST, tokenizer=self.task.tokenizer,
                 meta={"task": self.task.name, **self.task.meta(), "step": state["step"], "best": state["best"]},
                 source_tokenizer=getattr(self.task, "source_tokenizer", None))
        self.dist.barrier()

    def _optimizer_state(self):
        tensors, groups = optimizer_tensors(self.opt, self.names)
        if self.cfg.fsdp:  # every process must take part in gathering each shard, in the same order
            opt_state = self.opt.state_dict()["state"]
            for idx in sorted(opt_state):
                for field, v in opt_state[idx].items():
                    if hasattr(v, "full_tensor"):
                        tensors[f"{self.names[idx]}/{field}"] = v.full_tensor().cpu()
        return tensors, groups

    def _prune(self) -> None:
        ckpts = sorted(p for p in (self.run_dir / "checkpoints").iterdir() if STEP_DIR.fullmatch(p.name))
        for old in ckpts[:-self.cfg.keep]:
            hidden = old.with_name(f".{old.name}.deleting")  # never leave a half-deleted visible checkpoint
            os.replace(old, hidden)
            shutil.rmtree(hidden, ignore_errors=True)

    def _say(self, text: str) -> None:
        if self.dist.main:
            from tqdm import tqdm
            tqdm.write(text, file=sys.stderr)

    # --- the loop ------------------------------------------------------------------------
    def _update_ema(self, step: int) -> None:
        """ema <- d * ema + (1 - d) * weights, with d growing to --ema over the first steps
        (d = (1 + step) / (10 + step) until then), so the average soon forgets the random start."""
        decay = min(self.cfg.ema, (1 + step) / (10 + step))
        params = dict(self.plain.named_parameters())
        names = list(self.ema)
        torch._foreach_lerp_([self.ema[n] for n in names], [params[n].detach() for n in names], 1.0 - decay)

    def _swap_ema(self) -> None:
        """Exchange the live weights and their moving average (twice = back as before)."""
        with torch.no_grad():
            for name, p in self.plain.named_parameters():
                live = p.detach().clone()
                p.copy_(self.ema[name])
                self.ema[name] = live

    def _evaluate(self, state: dict[str, Any]) -> dict[str, float]:
        if self.ema is None:
            return self._evaluate_now(state)
        self._swap_ema()  # score (and keep as best) the averaged weights
        try:
            return self._evaluate_now(state)
        finally:
            self._swap_ema()

    def _evaluate_now(self, state: dict[str, Any]) -> dict[str, float]:
        eval_model = self.model if self.cfg.fsdp else self.plain
        eval_model.eval()
        with torch.no_grad():
            metrics = self.task.evaluate(eval_model)
            if not math.isfinite(metrics["val_loss"]):  # NaN outputs: sampling from them would fail
                sample = "(none: the model's outputs are not finite)"
            else:
                sample = self.task.sample(eval_model) if (self.dist.main or self.cfg.fsdp) else ""
        eval_model.train()
        if state["best_val_loss"] is None or metrics["val_loss"] < state["best_val_loss"]:
            state["best_val_loss"] = metrics["val_loss"]
        if self.cfg.keep_best:
            self._keep_best(state, metrics)
        shown = "  ".join(f"{k} {v:.4f}" for k, v in metrics.items())
        self._say(f"step {state['step']}: {shown}\n--- sample ---\n{sample}\n--------------")
        return metrics

    def _on_sigint(self, signum, frame) -> None:
        if self.stop_requested:  # a second Ctrl-C: stop now, without saving
            raise KeyboardInterrupt
        self.stop_requested = True
        self._say("interrupted: finishing this step and saving a checkpoint (Ctrl-C again to quit at once)")

    def _done(self, state: dict[str, Any]) -> str | None:
        cfg = self.cfg
        if self.stop_requested:
            return "interrupted"
        if cfg.max_steps is not None and state["step"] >= cfg.max_steps:
            return "max_steps"
        if cfg.time_budget is not None and state["elapsed"] >= cfg.time_budget:
            return "time_budget"
        if cfg.stop_at is not None and state["step"] >= cfg.stop_at:
            return "stop_at"
        return None

    def run(self, resume: str | None = None) -> dict[str, Any]:
        self.dist = None
        try:
            return self._run(resume)
        except NonFiniteError as e:
            raise self._stop_nonfinite(e) from None
        finally:
            if self.dist is not None:
                self.dist.close()

    def _run(self, resume: str | None) -> dict[str, Any]:
        from tqdm import tqdm

        cfg, task = self.cfg, self.task
        self.dist = Dist(cfg.device)
        self._check_out(resume)
        state = self.state = self._build(resume)
        self.records: list[dict[str, Any]] = []
        self._metrics(keep_until=state["step"] if resume else 0)
        handler = None
        if threading.current_thread() is threading.main_thread():
            handler = signal.signal(signal.SIGINT, self._on_sigint)
        bar = tqdm(total=cfg.max_steps, initial=state["step"], unit="step", file=sys.stderr, dynamic_ncols=True,
                   disable=not (cfg.progress and self.dist.main), desc="train")
        start = time.perf_counter() - state["elapsed"]
        train_time, tokens_since, losses, last_eval, last_save = 0.0, 0, [], None, None
        try:
            while (reason := self._done(state)) is None:
                step = state["step"]
                lr = lr_at(cfg, step, progress_of(cfg, step, state["elapsed"], state["warm_elapsed"]))
                for g in self.opt.param_groups:
                    g["lr"] = lr
                t_step = time.perf_counter()
                torch.manual_seed((cfg.seed * 1_000_003 + step) * 131 + self.dist.rank)  # dropout = f(seed, step, rank)
                batch = task.batch(step, "train")
                micros = micro_batches(batch, self.dist.rank, self.dist.world, cfg.grad_accum)
                loss_sum = 0.0
                for i, micro in enumerate(micros):
                    last = i == len(micros) - 1
                    with self._sync(last):
                        with autocast(self.device, cfg.precision):
                            micro = {k: v.to(self.device, non_blocking=True) for k, v in micro.items()}
                            loss = task.loss(self.train_model, micro) / len(micros)
                        loss.backward()
                    loss_sum += loss.item()
                if self._healthy(loss_sum, self._grad_norm(), step + 1):
                    self.opt.step()
                    if self.ema is not None:
                        self._update_ema(step)
                    losses.append(loss_sum)
                self.opt.zero_grad(set_to_none=True)
                train_time += time.perf_counter() - t_step
                tokens_since += task.tokens(batch)
                state["step"] = step = step + 1
                state["tokens"] += task.tokens(batch)
                state["elapsed"], stop = self.dist.max([time.perf_counter() - start, float(self.stop_requested)],
                                                       self.device)
                self.stop_requested = bool(stop)
                if state["warm_elapsed"] is None and step >= cfg.warmup:
                    state["warm_elapsed"] = state["elapsed"]
                record = None
                if step % cfg.log_every == 0 or self._done(state):
                    mean_loss = sum(losses) / len(losses) if losses else math.nan  # nan: every step skipped
                    record = {"step": step, "train_loss": self.dist.mean(mean_loss, self.device),
                              "lr": lr, "tokens_per_s": tokens_since / max(train_time, 1e-9),
                              "elapsed": round(state["elapsed"], 3)}
                    bar.set_postfix(loss=f"{record['train_loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
                    if cfg.max_steps is None and cfg.time_budget:  # ETA from the clock: estimate the total steps
                        bar.total = max(step, int(step * cfg.time_budget / max(state["elapsed"], 1e-9)))
                    train_time, tokens_since, losses = 0.0, 0, []
                if step % cfg.eval_every == 0 or (self._done(state) and self._done(state) != "interrupted"
                                                  and self._done(state) != "stop_at"):
                    record = (record or {"step": step}) | self._evaluate(state)
                    last_eval = step
                if record is not None:
                    self._metrics(record)
                    if last_eval == step:
                        self._plot()
                bar.update(1)
                if step % cfg.save_every == 0 and not self._done(state):
                    self._check_weights(step)
                    self._save(state)
                    last_save = step
        finally:
            bar.close()
            if handler is not None:
                signal.signal(signal.SIGINT, handler)
        path = checkpoint_dir(self.run_dir, state["step"])
        if last_save != state["step"]:
            self._check_weights(state["step"])
            path = self._save(state)
        self._plot()
        if reason == "interrupted":
            self._say(f"stopped at step {state['step']}; checkpoint {path}; continue with "
                      f"`tformer train --resume {self.run_dir}`")
        return {"reason": reason, "step": state["step"], "best_val_loss": state["best_val_loss"],
                "checkpoint": str(path), "best": state["best"],
                "best_checkpoint": str(self.run_dir / BEST) if state["best"] is not None else None, "run_dir": str(self.run_dir), "elapsed": state["elapsed"],
                "tokens": state["tokens"], "records": self.records}

    # --- numeric health --------------------------------------------------------------------
    def _grad_norm(self) -> torch.Tensor:
        """The global gradient norm, after clipping to --grad-clip when set."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.cfg.grad_clip:
            norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def _healthy(self, loss: float, norm: torch.Tensor, step: int) -> bool:
        """Whether step `step` may update the weights. A NaN/inf loss or gradient skips the update
        (at most --skip-nonfinite times), then stops the run before the bad step touches anything."""
        bad = not (math.isfinite(loss) and bool(torch.isfinite(norm)))
        if self.dist.world > 1:  # every process must take the same decision
            bad = bool(self.dist.max([float(bad)], self.device)[0])
        if not bad:
            return True
        what = f"the loss ({loss})" if not math.isfinite(loss) else f"the gradient norm ({float(norm)})"
        self.nonfinite += 1
        if self.nonfinite > self.cfg.skip_nonfinite:
            raise NonFiniteError(step, what)
        self._say(f"warning: step {step}: {what} is not finite; update skipped "
                  f"({self.nonfinite} of --skip-nonfinite {self.cfg.skip_nonfinite})")
        return False

    def _weights_finite(self) -> bool:
        local = all(bool(torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all())
                    for p in self.model.parameters())
        return not self.dist.max([float(not local)], self.device)[0]

    def _check_weights(self, step: int) -> None:
        """Never save weights an update made NaN/inf (a finite but huge step can)."""
        if not self._weights_finite():
            raise NonFiniteError(step, "a weight after the update")

    def _stop_nonfinite(self, e: NonFiniteError) -> NonFiniteError:
        """Save the last good weights if they are not on disk yet (never bad ones); say where to go on."""
        state = self.state
        if state["step"] > 0 and not checkpoint_dir(self.run_dir, state["step"]).exists() and self._weights_finite():
            self._save(state)
        ckpts = sorted(p for p in (self.run_dir / "checkpoints").glob("step-*") if STEP_DIR.fullmatch(p.name)) \
            if (self.run_dir / "checkpoints").is_dir() else []
        where = (f"the last good checkpoint is {ckpts[-1]} (continue with `tformer train --resume {self.run_dir} "
                 "--skip-nonfinite N` to skip up to N such steps, or start again with a lower --lr)" if ckpts else
                 "no checkpoint was saved (start again with a lower --lr, or --skip-nonfinite N to skip such steps)")
        return NonFiniteError(e.step, e.what, f"step {e.step}: {e.what} is not finite, training stopped; {where}")

    def _sync(self, last: bool):
        """Gradient accumulation: exchange gradients only in the last micro-batch's backward."""
        if self.dist.world == 1:
            return nullcontext()
        if self.cfg.fsdp:
            self.model.set_requires_gradient_sync(last)
            return nullcontext()
        return nullcontext() if last else self.model.no_sync()

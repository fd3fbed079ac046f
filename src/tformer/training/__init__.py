"""Training: what to optimise (config: TrainConfig, the Task protocol, the task registry), the loop (loop:
Trainer, fit), a run from options as `tformer train` makes it (session: train, prepare), the optimiser and
schedule (optim), the weight average (ema), the NaN/inf guard (guard), torchrun (distributed), the run
directory (rundir) and the flags derived from dataclasses (options)."""

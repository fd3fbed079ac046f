"""Tasks for the training loop (see tformer.training.config.Task): lm, classify, translate."""

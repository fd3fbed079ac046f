"""Tasks for the training loop (see tformer.train.Task): lm, classify, translate."""

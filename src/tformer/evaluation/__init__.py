"""Scores: metrics (accuracy, F1, entity reports, BLEU/chrF helpers) and the prediction functions that the
CLI, `tformer eval`, the server and the tasks' validation share: batching (pad, length_batches), classify,
tag (with words: words and their pieces), translate, lm. Never imports training or tasks."""

"""Scores: metrics (accuracy, F1, entity reports, BLEU/chrF helpers) and the prediction functions that the
CLI, `tformer eval` and the server share."""

"""Metric functions against hand computations and sacrebleu itself."""

import pytest
import sacrebleu

from tformer.evaluation import metrics


def test_classification_metrics_by_hand():
    refs = [0, 0, 0, 1, 1, 2]
    preds = [0, 1, 0, 1, 2, 2]
    assert metrics.accuracy(preds, refs) == pytest.approx(4 / 6)
    assert metrics.confusion_matrix(preds, refs, 3) == [[2, 1, 0], [0, 1, 1], [0, 0, 1]]
    # per label: P, R -> F1.  0: 2/2, 2/3 -> 0.8   1: 1/2, 1/2 -> 0.5   2: 1/2, 1/1 -> 2/3
    assert metrics.macro_f1(preds, refs, 3) == pytest.approx((0.8 + 0.5 + 2 / 3) / 3)


def test_macro_f1_edge_cases():
    assert metrics.macro_f1([0, 0], [0, 0], 3) == 1.0          # labels never seen nor predicted are skipped
    assert metrics.macro_f1([1, 1], [0, 0], 2) == 0.0          # predicted-only and reference-only labels count 0
    with pytest.raises(ValueError, match="2 predictions but 3 references"):
        metrics.accuracy([0, 1], [0, 1, 1])


def test_translation_metrics_match_sacrebleu():
    hyps = ["the cat sat on the mat", "ninety-seven", "one hundred and one"]
    refs = ["the cat sat on a mat", "ninety-seven", "one hundred one"]
    assert metrics.bleu(hyps, refs) == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score)
    assert metrics.chrf(hyps, refs) == pytest.approx(sacrebleu.corpus_chrf(hyps, [refs]).score)
    assert metrics.bleu(refs, refs) == pytest.approx(100.0)
    assert metrics.exact_match(hyps, refs) == pytest.approx(1 / 3)
    assert metrics.exact_match([" ninety-seven "], ["ninety-seven"]) == 1.0

"""Evaluation metrics for the tasks: accuracy, macro-F1 and the confusion matrix for classification;
BLEU and chrF (sacrebleu, the standard implementation, so numbers compare with papers) and exact
match for translation; entity-level precision / recall / F1 for tagging (seqeval, the conlleval
rules, so numbers compare with papers). Plain lists in, plain numbers out."""

from __future__ import annotations

from collections.abc import Sequence


def accuracy(predictions: Sequence, references: Sequence) -> float:
    _same_length(predictions, references)
    return sum(p == r for p, r in zip(predictions, references)) / len(references)


def confusion_matrix(predictions: Sequence[int], references: Sequence[int], num_labels: int) -> list[list[int]]:
    """matrix[true][predicted] = count (rows: the reference label, columns: the prediction)."""
    _same_length(predictions, references)
    matrix = [[0] * num_labels for _ in range(num_labels)]
    for p, r in zip(predictions, references):
        matrix[r][p] += 1
    return matrix


def macro_f1(predictions: Sequence[int], references: Sequence[int], num_labels: int) -> float:
    """The unweighted mean over labels of F1 = 2·precision·recall / (precision + recall); a label with
    no predictions and no references is skipped (it says nothing), one with either counts as F1 = 0."""
    matrix = confusion_matrix(predictions, references, num_labels)
    scores = []
    for k in range(num_labels):
        tp = matrix[k][k]
        predicted = sum(row[k] for row in matrix)
        actual = sum(matrix[k])
        if predicted == 0 and actual == 0:
            continue
        scores.append(2 * tp / (predicted + actual))  # = 2PR / (P + R), written without 0/0
    return sum(scores) / len(scores)


def exact_match(hypotheses: Sequence[str], references: Sequence[str]) -> float:
    """Fraction of hypotheses equal to their reference after trimming surrounding whitespace."""
    _same_length(hypotheses, references)
    return sum(h.strip() == r.strip() for h, r in zip(hypotheses, references)) / len(references)


def bleu(hypotheses: Sequence[str], references: Sequence[str]) -> float:
    """Corpus BLEU (0-100) with sacrebleu's default 13a tokenisation."""
    _same_length(hypotheses, references)
    import sacrebleu

    return sacrebleu.corpus_bleu(list(hypotheses), [list(references)]).score


def chrf(hypotheses: Sequence[str], references: Sequence[str]) -> float:
    """Corpus chrF (0-100): character n-gram F-score, kinder than BLEU to small models and rich morphology."""
    _same_length(hypotheses, references)
    import sacrebleu

    return sacrebleu.corpus_chrf(list(hypotheses), [list(references)]).score


def entity_scores(predictions: Sequence[Sequence[str]], references: Sequence[Sequence[str]]) -> dict[str, float]:
    """Micro-averaged entity precision, recall and F1 over IOB2-tagged sentences: an entity counts
    only when its type and both ends are right (seqeval's default mode, the rules of conlleval)."""
    _same_length(predictions, references)
    from seqeval.metrics import f1_score, precision_score, recall_score

    pred, ref = [list(p) for p in predictions], [list(r) for r in references]
    return {name: float(score(ref, pred, zero_division=0))
            for name, score in (("precision", precision_score), ("recall", recall_score), ("f1", f1_score))}


def entity_report(predictions: Sequence[Sequence[str]], references: Sequence[Sequence[str]]) -> str:
    """seqeval's per-type table (precision, recall, F1, support of each entity type)."""
    from seqeval.metrics import classification_report

    return classification_report([list(r) for r in references], [list(p) for p in predictions], digits=4,
                                 zero_division=0)


def _same_length(a: Sequence, b: Sequence) -> None:
    if len(a) != len(b):
        raise ValueError(f"{len(a)} predictions but {len(b)} references")
    if not b:
        raise ValueError("no examples to score")

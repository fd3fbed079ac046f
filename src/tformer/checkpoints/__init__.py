"""Files a model lives in: one checkpoint (format), a run directory's names and rules (layout), and
Hugging Face import/export (hf)."""

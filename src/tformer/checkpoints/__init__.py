"""Files a model lives in: one checkpoint (format), atomic writes of files and directories (files), a run
directory's names and rules (layout), and Hugging Face import/export (hf)."""

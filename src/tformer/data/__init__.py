"""Text in: files and tables (files), the shipped corpora (corpora, bible) and tokenizers."""

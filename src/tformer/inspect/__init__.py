"""Looking inside a model: the step-by-step trace (trace) and pictures of attention and training (viz)."""

"""Decoding machinery on top of the model: int8 quantisation (quant), a GPT's whole decoding step in one
kernel call (fused), and what fits in memory (limits)."""

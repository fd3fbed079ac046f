"""The model: the Transformer itself, from the formula up.

config (the numbers and choices) -> masks, positional, attention (the formula, multi-head), kv_cache ->
layers (norms, feed-forward, encoder and decoder layers) -> embeddings, pooling -> models (Encoder,
Decoder, EncoderDecoder) -> heads (classifier, tagger). linear holds the linear layer and its decoding
plans. Imports only tformer.kernels, tformer.errors and tformer.devices (and, lazily, the two documented
edges: model.generate -> tformer.generation, the fused decoding step -> tformer.inference.fused).
"""

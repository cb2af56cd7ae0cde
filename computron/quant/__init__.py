"""Quantized weights: their byte formats (``formats``, ``names``), the Linear that computes with them
(``linear``), and turning a shard's Linears into quantized ones (``apply``)."""

"""GEMMs of quantized weights: FP8 (W8A16 GEMV, per-token activation quantization), 4-bit (w4a16) and 8-bit
grouped (w8a16), with the split-K and tile-load helpers they share."""

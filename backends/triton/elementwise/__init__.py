"""Per-token kernels of a decoder layer: RMSNorm (with the residual add), rotary embedding, SiLU-and-mul."""

"""Images in prompts: the record a request carries (`inputs`), the model's processor (`processing`),
the worker's encoder cache (`encoder_cache`) and how a step's embeddings and M-RoPE positions are
built from them (`step`)."""

"""Grammar-constrained decoding (structured outputs): the backend contract, the built-in xgrammar
backend and the engine-side manager. `StructuredOutputsParams` itself lives in `corectl.sampling_params`."""

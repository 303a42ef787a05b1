"""The built-in structured-output backend, registered through the `corectl` entry-point group like any other."""
from __future__ import annotations

from corectl.plugins import StructuredOutputBackendSpec, hookimpl


@hookimpl
def corectl_structured_output_backends():
    yield StructuredOutputBackendSpec("xgrammar", "corectl.structured.xgrammar_backend:XGrammarBackend",
                                      description="xgrammar: JSON schema, regex, choice, EBNF, structural tags")

"""KV connectors: moving KV blocks between engines (disaggregated prefill/decode) and into a
host-memory tier. The contract is `base.py`; `config.py` parses `--kv-transfer-config` and a
request's `kv_transfer_params`; `factory.py` builds a configured engine's two halves."""

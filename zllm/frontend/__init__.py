"""The frontend process: tokenization, validation, incremental detokenization, streaming."""

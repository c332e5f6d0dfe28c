"""Model files: GGUF identity (spec §5) and the synthetic GGUF writer for tests and demos."""

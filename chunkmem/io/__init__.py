"""Files: the disk I/O engine, atomic writes and checksums, checkpoints, state dicts, Hugging Face loading."""

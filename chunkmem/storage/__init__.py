"""Bytes on disk: the disk I/O engine of the disk tier (aligned buffers, direct-I/O files, the private scratch
directory), atomic file writes and content checksums."""

"""The k+m (default 10+2) erasure codec with per-shard checksums."""

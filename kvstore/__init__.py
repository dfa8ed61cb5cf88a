"""kvstore: storage nodes, on-disk format, cluster map and placement, and the CLI."""

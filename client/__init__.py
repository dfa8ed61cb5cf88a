"""The async cluster client: block keys, prefix lookup, hedged erasure-coded reads, swap-in."""

"""Local cluster launcher, multi-host configuration and service files."""

"""Regions on one machine: network namespaces joined by a link with a stated round-trip time."""

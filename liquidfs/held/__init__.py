"""Levels of held bytes behind one interface: memory, memfd, local disk, the memcached cluster."""

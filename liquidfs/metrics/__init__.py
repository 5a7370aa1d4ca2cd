"""A mount's counters, every metric declared once, and the Prometheus endpoint."""

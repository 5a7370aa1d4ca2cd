"""Where an open's bytes come from and how they reach the kernel: the DataPath interface, the daemon path, the
passthrough path, the per-inode records, the notifier and the timed storage calls."""

"""The mount's daemon: spawning it, building its parts, serving the FUSE loop, its watchdog, and the control file's
clients."""

"""The profile: what this machine loads and decodes, the cost model and the share it chooses, measured by timing the
loader through scratch mounts where asked."""

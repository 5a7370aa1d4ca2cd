"""Which representation each open serves: the share (fixed or adaptive), its controller and pressures."""

"""``mount --mix``'s modes and the adaptive mix's pace, in a module that imports nothing: the command line reads
them without loading trio (``datapath.limits`` says why)."""

from __future__ import annotations

#: ``mount --mix``'s named modes: every image with a raw object served raw, or a share steered while the mount
#: runs (a number is a share fixed for the mount).
MIX_MODES = ("prepared", "adaptive")
#: Seconds between two decisions of the adaptive mix. The pressure is measured over exactly that interval
#: (``Stalls``), so it says what the last move did; fewer than 5 s would hold too few of a loader's bursts of opens
#: (DALI's opens per 5 s already swing from 7 to 35 in a steady phase).
STEER_INTERVAL = 5.0

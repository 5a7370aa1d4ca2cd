"""Which files to hold: the next-epoch policy, each job's epochs, the shared budget, and which job an open comes
from."""

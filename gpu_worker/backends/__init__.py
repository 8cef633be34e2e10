"""The worker's device backends: what differs by device or CPU kind sits behind one interface."""

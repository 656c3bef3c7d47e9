"""Steps: the runner that wires a user transform between buffers and sinks,
heartbeats, and the drain protocol."""

"""retrace.runtime."""

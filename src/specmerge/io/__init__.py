"""Reading checkpoints and adapters, and writing outputs."""

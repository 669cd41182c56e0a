"""One module per CLI command (or family of commands)."""
